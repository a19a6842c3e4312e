"""Small faults: notes on a clip-retrieval layout, `index search`'s distance format, and what
`curvalign search` says on a run whose features came from an unknown encoder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from curvalign.index.embed import SearchResult
from curvalign.index.queries import QueryResults

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def write_layout(root: Path, rows: int = 60, scale: float = 1.0, caption: bool = True) -> None:
    """One shard of clip-retrieval's layout: float32 rows of norm ``scale``, and metadata with
    (or without) a "caption" column."""
    rng = np.random.default_rng(0)
    for folder in ("img_emb", "text_emb", "metadata"):
        (root / folder).mkdir(parents=True)
    for folder, d in (("img_emb", 12), ("text_emb", 8)):
        x = rng.standard_normal((rows, d)).astype(np.float32)
        x = scale * x / np.linalg.norm(x, axis=1, keepdims=True)
        np.save(root / folder / f"{folder}_0.npy", x)
    columns = {"url": [f"https://example.org/{r}.jpg" for r in range(rows)]}
    if caption:
        columns["caption"] = [f"caption {r}" for r in range(rows)]
    pq.write_table(pa.table(columns), root / "metadata" / "metadata_0.parquet")


def test_unit_norm_layout_with_captions_has_no_note(tmp_path: Path):
    from curvalign.data import load_data

    write_layout(tmp_path / "cr")
    store = load_data(f"clip-retrieval:{tmp_path / 'cr'},val=5,test=5")
    assert "notes" not in store.meta
    assert store.texts[3] == "caption 3"


def test_no_caption_column_is_a_note(tmp_path: Path):
    from curvalign.data import load_data

    write_layout(tmp_path / "cr", caption=False)
    store = load_data(f"clip-retrieval:{tmp_path / 'cr'},val=5,test=5")
    (note,) = store.meta["notes"]
    assert "no 'caption' column" in note and "url" in note  # what was found
    assert "search shows item ids" in note  # what it means


def test_rows_not_unit_norm_are_a_note(tmp_path: Path):
    from curvalign.data import load_data

    write_layout(tmp_path / "cr", scale=3.0)
    store = load_data(f"clip-retrieval:{tmp_path / 'cr'},val=5,test=5")
    (note,) = store.meta["notes"]  # one note for both sides
    assert note.startswith("image and text rows are not unit-norm")
    means = [float(m) for m in re.findall(r"mean norm ([0-9.]+)", note)]
    assert means == [pytest.approx(3.0), pytest.approx(3.0)]
    assert "over 60 sampled rows" in note  # every row of this small store: fewer than NORM_SAMPLE


def test_norm_check_reads_a_strided_sample_not_every_row(tmp_path: Path, monkeypatch):
    from curvalign.data import clip_retrieval, load_data

    monkeypatch.setattr(clip_retrieval, "NORM_SAMPLE", 7)
    write_layout(tmp_path / "cr", scale=0.5)
    store = load_data(f"clip-retrieval:{tmp_path / 'cr'},val=5,test=5")
    assert "over 7 sampled rows" in store.meta["notes"][0]


def test_index_search_prints_every_distance_with_one_format():
    scores = np.array([[0.5, 1.0, 0.123456789, 12.5, 1e-05]])
    found = QueryResults("idx", {}, [0], SearchResult(scores, np.arange(5)[None], "distance"))
    printed = [row[3] for row in found.table_rows()]
    assert printed == ["0.5000", "1.0000", "0.1235", "12.5000", "0.0000"]


def test_search_on_a_clip_retrieval_run_says_why_it_needs_an_encoder(tmp_path: Path):
    # the README's clip-retrieval route: train, embed, index; a text query then cannot be
    # encoded (the layout records no encoder), and the message says so, and what else works
    from curvalign.index.embed import build_from_embeddings, embed_run, load_embeddings
    from curvalign.index.searcher import Searcher, SearchError
    from curvalign.train import train

    write_layout(tmp_path / "cr", caption=False)
    spec = f"clip-retrieval:{tmp_path / 'cr'},val=10,test=10"
    train(
        "meru",
        spec,
        tmp_path / "run",
        steps=2,
        overrides=["embed_dim=8", "batch_size=16"],
        show_progress=False,
    )
    emb = embed_run(tmp_path / "run", tmp_path / "emb")
    index = build_from_embeddings(load_embeddings(emb.path), tmp_path / "idx")
    searcher = Searcher.open(tmp_path / "run", index)
    with pytest.raises(SearchError) as caught:
        searcher.search_texts(["a dog"])
    message = str(caught.value)
    assert "an encoder curvalign does not know" in message
    assert "--encoder SPEC" in message and "--query-text-ids" in message
    assert "parquet" in message  # the captions shown are the layout's, not an encoder's
    assert "synthetic" not in message and "before encoders were recorded" not in message
    saved = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert any(
        "no 'caption' column" in note for note in saved["notes"]
    )  # the note, kept in the run
