"""Shared fixtures, and how the suite uses the machine's cores.

``python -m pytest -q`` runs the tests in two worker processes (pytest-xdist; ``addopts`` in
pyproject.toml), whole files to a worker (``--dist loadfile``: a file's module fixtures, such as a
run trained once and read by several tests, are built once). Each worker, and every process a
test starts from it, uses one intra-op thread: two workers on two cores, neither oversubscribed.
``-n 0`` runs everything in this process with torch's default threads; without pytest-xdist (or
with ``-p no:xdist``) the xdist options of ``addopts`` are accepted and ignored.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from curvalign_lab.records import StudyResult

#: set by pytest-xdist in its worker processes
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _XDIST_WORKER is not None:
    # before any test runs: the workers share the cores, so each takes one thread (and so do the
    # processes its tests start, which inherit this environment)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    """Without pytest-xdist (not installed, or ``-p no:xdist``) accept the xdist options of
    pyproject's ``addopts`` and ignore them, so the suite still runs, in one process."""
    if pluginmanager.hasplugin("xdist"):
        return
    group = parser.getgroup("xdist", "pytest-xdist absent: its options are ignored")
    # pytest reserves lowercase short options for plugins' private _addoption (xdist uses it too)
    group._addoption(
        "-n",
        "--numprocesses",
        dest="numprocesses",
        default=None,
        help="ignored: pytest-xdist is not installed or is disabled",
    )
    group.addoption("--dist", dest="dist", default="no", help="ignored, as -n")
    group.addoption(
        "--no-loadscope-reorder", dest="loadscopereorder", action="store_false", help="ignored"
    )


#: the files that take longest apart from those with a ``slow`` test (``--durations``): the
#: studies (about 220 CPU s), the Triton interpreter's worker, the planted files and subprocesses
LONG_FILES = ("test_studies.py", "test_geometry_triton.py", "test_issue25.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In the xdist workers, the long files first (those of :data:`LONG_FILES`, then those with
    a test marked ``slow``), each file's tests in their order; pyproject's addopts hand whole
    files out in this order (``--no-loadscope-reorder``). The longest files then start at once on
    the two workers and the many short ones fill in after them: a long file handed out last runs
    alone at the end. Only the order of files changes, and only under xdist."""
    if _XDIST_WORKER is None:
        return
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}

    def rank(item: pytest.Item) -> int:
        if item.path.name in LONG_FILES:
            return 0
        return 1 if item.path in slow else 2

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def _plots_drawn_not_rasterised() -> Iterator[None]:
    """The plots of benchmarks, studies and the README's commands: every figure is still made,
    laid out and drawn (``draw_without_rendering``: each artist's draw runs, so a plot that fails
    on a pipeline's data still fails), then a 1 x 1 PNG stands for it. Rasterising and encoding
    was a third of the plots' CPU (1.1 of 3.2 CPU s for a benchmark's five); the plot tests
    (tests/test_benchmark_stats.py, tests/test_issue25.py) call the real ``save_figure``."""
    import numpy as np

    from curvalign.report import plots

    def drawn(fig: Any, path: str | Path, layout: bool = True) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if layout:
            fig.tight_layout()
        fig.draw_without_rendering()
        plots.plt.close(fig)
        plots.plt.imsave(path, np.ones((1, 1, 3)))
        return path

    real = plots._save
    plots._save = drawn
    yield
    plots._save = real


@pytest.fixture
def one_thread() -> Iterator[None]:
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


def _run_short_study(root: Path) -> StudyResult:
    from curvalign_lab.runner import run_study

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_study(
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


@pytest.fixture(scope="session")
def short_study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, StudyResult]:
    """``(root, result)``: the proclip-product study run once, far too short (2 steps, 2 seeds,
    a two-rate grid, a narrow MLP), written to ``root / "proclip-product"``. Read by the tests
    of its budget verdict and the results page; none of them writes into ``root``.

    Under xdist it is run once for all workers: the first to need it runs it under a file lock
    in the run's shared temporary folder, writes the result beside it, and the others read that
    (the tests that read it live in different files, so on either worker)."""
    if _XDIST_WORKER is None:
        root = tmp_path_factory.mktemp("short-study")
        return root, _run_short_study(root)
    import pickle

    from filelock import FileLock  # a dependency of torch

    shared = tmp_path_factory.getbasetemp().parent  # pytest-of-user/pytest-N, one per run
    done = shared / "short-study.pickle"
    with FileLock(str(shared / "short-study.lock")):
        if done.is_file():
            shared_result: tuple[Path, StudyResult] = pickle.loads(done.read_bytes())
            return shared_result
        root = tmp_path_factory.mktemp("short-study")  # this worker's (a failed run stays apart)
        made = root, _run_short_study(root)
        done.write_bytes(pickle.dumps(made))
    return made
