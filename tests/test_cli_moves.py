"""What moved out of cli.py into the library answers on its own (the commands that call it are
tested end to end in test_index_cli.py and test_search_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from curvalign.errors import InputError
from curvalign.index.embed import index_build_options
from curvalign.index.searcher import SearchError, read_queries


def test_index_build_options_keep_only_the_chosen_methods_options() -> None:
    assert index_build_options(None, M=8) == {"kind": "exact", "method": "hnsw"}
    assert index_build_options("hnsw", M=8, nlist=5) == {
        "kind": "ann",
        "method": "hnsw",
        "M": 8,
        "ef_construction": 80,
        "ef_search": 128,
    }
    assert index_build_options("ivfpq", M=8, nlist=5, nprobe=2) == {
        "kind": "ann",
        "method": "ivfpq",
        "nlist": 5,
        "nprobe": 2,
    }
    with pytest.raises(InputError, match="--exact and --ann exclude each other"):
        index_build_options("hnsw", exact=True)
    with pytest.raises(InputError, match="--ann must be hnsw, ivf or ivfpq, got 'flat'"):
        index_build_options("flat")


def test_read_queries_appends_the_files_non_blank_lines(tmp_path: Path) -> None:
    file = tmp_path / "q.txt"
    file.write_text(" a dog \n\n  \na red car\n", encoding="utf-8")
    assert read_queries(["first"], file) == ["first", "a dog", "a red car"]
    assert read_queries(["only"], None) == ["only"]
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(SearchError, match="--queries-file .*bad.txt: cannot read it"):
        read_queries([], tmp_path / "bad.txt")
