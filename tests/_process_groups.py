"""Spawn gloo process groups in tests without letting a stuck teardown hang the suite.

A CI run once stalled for 15 minutes after both ranks had passed their final barrier: rank 0
had written its results and exited, rank 1 sat in a futex wait inside the process group's
teardown. The results are complete once every rank has passed that barrier, so each worker
calls ``mark_done`` there; ``spawn_and_wait`` joins the workers, and once every rank has marked
itself done it gives the teardown ``teardown_grace`` seconds before killing what is left. Any
other stall (before the barrier) still fails the test, after ``timeout`` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp


def mark_done(marker_dir: str | Path, rank: int) -> None:
    """Call after the workers' last barrier: this rank's results are written."""
    (Path(marker_dir) / f"done.{rank}").touch()


def spawn_and_wait(
    fn: Callable[..., None],
    args: tuple,
    nprocs: int,
    marker_dir: str | Path,
    *,
    timeout: float = 900.0,
    teardown_grace: float = 60.0,
) -> None:
    """``mp.spawn(fn, args, nprocs)``; a worker that raises fails the caller as with ``join``."""
    context = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    start, done_at = time.monotonic(), None
    while not context.join(timeout=1.0):
        now = time.monotonic()
        if done_at is None and all(
            (Path(marker_dir) / f"done.{rank}").exists() for rank in range(nprocs)
        ):
            done_at = now
        stuck_in_teardown = done_at is not None and now - done_at > teardown_grace
        if stuck_in_teardown or now - start > timeout:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
            if stuck_in_teardown:
                return
            raise AssertionError(f"{nprocs} gloo workers did not finish within {timeout:.0f} s")
