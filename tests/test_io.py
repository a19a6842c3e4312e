"""Atomic replacement of result directories: a reader sees the old directory or the new one."""

from __future__ import annotations

from pathlib import Path

import pytest

from curvalign._io import staged_directory


def test_a_finished_block_replaces_the_target(tmp_path: Path):
    target = tmp_path / "store"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with staged_directory(target) as tmp:
        assert tmp.parent == target.parent and tmp != target
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # nothing left beside it


def test_a_failing_block_leaves_the_target_and_no_debris(tmp_path: Path):
    target = tmp_path / "store"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        with staged_directory(target) as tmp:
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("disk full")
    assert (target / "old.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_a_new_target_and_its_parents_are_created(tmp_path: Path):
    target = tmp_path / "a" / "b" / "index"
    with staged_directory(target) as tmp:
        (tmp / "index.json").write_text("{}")
    assert (target / "index.json").is_file()
