"""A tiny searchable world built offline: real image files, a tiny local open_clip model,
`curvalign extract`, a trained run, its embeddings and indexes (shared by the search tests)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from test_extract import make_collection

needs_open_clip = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None,
    reason="optional extra not installed: pip install 'curvalign[open_clip]'",
)

TINY = {
    "embed_dim": 8,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 16, "head_width": 8, "patch_size": 16},
    "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
}


@dataclass
class World:
    root: Path
    images: Path  # the images root
    files: list[str]  # readable image files, relative to it
    encoder: str  # the local encoder spec
    store: Path
    runs: dict[str, Path]
    embeddings: dict[str, Path]
    indexes: dict[str, Path]  # "meru" exact, "meru-hnsw", "atmg" rerank


def build_world(root: Path) -> World:
    from curvalign.data import encoders, load_data
    from curvalign.data.extract import extract_features
    from curvalign.index.embed import build_from_embeddings, embed_store, load_embeddings
    from curvalign.runs import load_run
    from curvalign.train.trainer import train

    encoders._make_torchvision_importable()
    import open_clip

    root.mkdir(parents=True, exist_ok=True)
    config = root / "tiny-search-test.json"
    config.write_text(json.dumps(TINY))
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    checkpoint = root / "tiny.pt"
    torch.save(open_clip.create_model("tiny-search-test").state_dict(), checkpoint)
    spec = f"open_clip:{config}:{checkpoint}"
    c = make_collection(root)
    store = root / "store"
    extract_features(spec, c["images"], store, captions=c["captions"], batch_size=4, progress=False)
    files = [f for f in c["files"] if f not in ("dog/truncated.jpg", "cat/missing.png")]
    runs, embeddings, indexes = {}, {}, {}
    for recipe in ("meru", "atmg"):
        runs[recipe] = train(
            recipe,
            f"features:{store}",
            root / f"run-{recipe}",
            steps=2,
            overrides=["batch_size=4", "embed_dim=8"],
            show_progress=False,
        )
        run = load_run(runs[recipe])
        data = f"features:{store}"
        embeddings[recipe] = embed_store(
            run.recipe,
            load_data(data),
            root / f"emb-{recipe}",
            info={"run_dir": str(Path(runs[recipe]).resolve()), "step": run.step, "data": data},
        )
        indexes[recipe] = build_from_embeddings(
            load_embeddings(embeddings[recipe]), root / f"idx-{recipe}"
        )
    indexes["meru-hnsw"] = build_from_embeddings(
        load_embeddings(embeddings["meru"]), root / "idx-meru-hnsw", kind="ann", method="hnsw"
    )
    return World(root, c["images"], files, spec, store, runs, embeddings, indexes)
