"""The norm statistics' sample (``data.statistics``): every train row of a small store, runs of
the warm start's fit rows on a large one, and what that does to the mean norm."""

from __future__ import annotations

import pytest
import torch

from curvalign.data.alignment import MAX_FIT_PAIRS, SAMPLE_RUN_ROWS, spread_runs
from curvalign.data.features import FeatureStore, TextPart
from curvalign.data.statistics import MAX_ROWS, feature_norms, norm_sample

DIM = 4


def _store(norms: torch.Tensor, test_rows: int = 0) -> FeatureStore:
    """Rows of norm ``norms`` [N] (random directions, one caption per image, the text its
    image at half the norm); the last ``test_rows`` rows are a "test" split at 1000x the norm,
    which the statistics must not read."""
    g = torch.Generator().manual_seed(1)
    n = len(norms)
    rows = torch.nn.functional.normalize(torch.randn(n, DIM, generator=g), dim=-1) * norms[:, None]
    split = (torch.arange(n) >= n - test_rows).long()
    rows[split == 1] *= 1000.0
    return FeatureStore(
        image_features=rows,
        text=TextPart(rows * 0.5),
        text_to_image=torch.arange(n),
        image_split=split,
        split_names=["train", "test"],
    )


def _full_mean(features: torch.Tensor, ids: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(features[ids].double(), dim=-1).mean())


def test_a_store_of_at_most_max_rows_train_rows_reads_every_one() -> None:
    g = torch.Generator().manual_seed(0)
    store = _store(1.0 + 0.3 * torch.rand(MAX_ROWS + 50, generator=g), test_rows=50)
    train = store.split_image_ids("train")
    assert len(train) == MAX_ROWS
    assert torch.equal(norm_sample(train), train)
    norms = feature_norms(store)
    assert (norms.image_rows, norms.text_rows) == (MAX_ROWS, MAX_ROWS)
    # the same rows in the same order as the whole-split mean: identical by construction
    assert norms.image_norm == _full_mean(store.image_features, train)
    assert norms.text_norm == _full_mean(store.text_features, train)


@pytest.mark.parametrize(
    "layout",
    ["independent rows, 20% spread", "runs of 64 alike rows, 4% spread", "a trend in row order"],
)
def test_norm_runs_estimate_the_mean_norm_of_a_large_store(layout: str) -> None:
    n = 3 * MAX_FIT_PAIRS + 1_234
    g = torch.Generator().manual_seed(2)
    if layout.startswith("independent"):
        norms = 10.0 * (1 + 0.2 * torch.randn(n, generator=g)).abs()
    elif layout.startswith("runs"):  # a dump in crawl order: neighbours alike, blocks not
        blocks = 1 + 0.04 * torch.randn(-(-n // SAMPLE_RUN_ROWS), generator=g)
        norms = 10.0 * blocks.repeat_interleave(SAMPLE_RUN_ROWS)[:n]
    else:  # norms sorted along the rows: the even spread of the runs covers the trend
        norms = torch.linspace(5.0, 15.0, n)
    store = _store(norms, test_rows=1_000)
    train = store.split_image_ids("train")
    stats = feature_norms(store)
    assert stats.image_rows == stats.text_rows == MAX_ROWS
    full = _full_mean(store.image_features, train)
    assert stats.image_norm == pytest.approx(full, rel=0.01)  # the docstring's bound
    assert stats.text_norm == pytest.approx(0.5 * full, rel=0.01)


def test_the_norm_sample_is_runs_of_the_warm_start_fit_rows() -> None:
    """Above MAX_ROWS the statistics read only rows the warm start's fit reads (their pages are
    in the page cache by then) in runs of neighbours, spread over the whole split."""
    ids = torch.arange(0, 4 * MAX_FIT_PAIRS, 1) + 7
    sample = norm_sample(ids)
    assert len(sample) == MAX_ROWS and len(sample.unique()) == MAX_ROWS
    assert torch.all(sample[1:] > sample[:-1])  # in order
    assert torch.isin(sample, spread_runs(ids, MAX_FIT_PAIRS)).all()
    # runs: few breaks between consecutive ids (a strided sample breaks at every row)
    breaks = int((sample.diff() != 1).sum())
    assert breaks < 2 * MAX_ROWS / SAMPLE_RUN_ROWS
    # spread over the whole split: from its first row to its last hundredth
    assert int(sample[0]) == int(ids[0]) and int(sample[-1]) > int(ids[-1]) - len(ids) // 100
