"""The test helper that spawns process groups: a teardown that never returns must not hang the
suite, and a worker that fails must still fail its test."""

from __future__ import annotations

import time

import pytest

from _process_groups import mark_done, spawn_and_wait


def _stuck_after_done(rank: int, marker_dir: str) -> None:
    mark_done(marker_dir, rank)
    if rank == 1:
        time.sleep(3600)  # as a rank stuck in the process group's teardown


def _fails(rank: int, marker_dir: str) -> None:
    if rank == 1:
        raise ValueError("rank 1 broke")
    mark_done(marker_dir, rank)


def _never_done(rank: int, marker_dir: str) -> None:
    time.sleep(3600)


def test_a_rank_stuck_after_its_last_barrier_is_killed_after_the_grace(tmp_path) -> None:
    start = time.monotonic()
    spawn_and_wait(_stuck_after_done, (str(tmp_path),), 2, tmp_path, teardown_grace=1.0)
    assert time.monotonic() - start < 60


def test_a_worker_that_raises_fails_the_caller(tmp_path) -> None:
    with pytest.raises(Exception, match="rank 1 broke"):
        spawn_and_wait(_fails, (str(tmp_path),), 2, tmp_path, teardown_grace=1.0)


def test_workers_that_never_reach_their_barrier_fail_after_the_timeout(tmp_path) -> None:
    with pytest.raises(AssertionError, match="did not finish within 2 s"):
        spawn_and_wait(_never_done, (str(tmp_path),), 2, tmp_path, timeout=2.0)
