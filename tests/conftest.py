"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread avoids oversubscribing a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: the tiny synthetic world of the shared short study: a small taxonomy (16 classes, 2 prompt
#: templates), since every validation scores zero-shot per class and template
SHORT_STUDY_DATA = (
    "synthetic:images=160,text_pairs=60,captions_max=3,depth=2,branching=2,templates=2"
)


@pytest.fixture(scope="session")
def short_study(tmp_path_factory):
    """``(root, result)``: the proclip-product study run once, far too short (2 steps, 2 seeds,
    a two-rate grid, a narrow MLP), written to ``root / "proclip-product"``. Read by the tests
    of its budget verdict and the results page; none of them writes into ``root``."""
    from curvalign_lab.runner import run_study

    root = tmp_path_factory.mktemp("short-study")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run_study(
            "proclip-product",
            root / "proclip-product",
            steps=2,
            seeds=2,
            data=SHORT_STUDY_DATA,
            overrides=["batch_size=16", "pair_batch_size=16", "hidden_dim=16"],
            lr_grid=(1e-3, 3e-3),
        )
    finally:
        torch.set_num_threads(before)
    return root, result
