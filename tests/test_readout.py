"""curvalign.readout, the floor below train | index | eval: ranks counted in tiles against a
brute-force reference and against the dense path, validation that never holds an N x N matrix,
float16 stores everywhere a store is read, the seeded validation subsample, the input-width
check naming its cause, and a matrix too large for memory as one CurvalignError."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from curvalign import readout
from curvalign.data.features import FeatureStore, TextPart
from curvalign.errors import CurvalignError, InputError
from curvalign.eval.retrieval import recall_at_k
from curvalign.readout import (
    MemoryBudgetError,
    check_input_widths,
    image_to_text_ranks,
    image_to_text_ranks_tiled,
    retrieval_ranks,
    score_matrix,
    text_to_image_ranks,
    text_to_image_ranks_tiled,
)
from curvalign.recipes import get_recipe
from curvalign.train.validation import ValidationSet, validation_store


def _brute_t2i(scores: torch.Tensor, t2i: torch.Tensor) -> torch.Tensor:
    """Other images scoring at least as high as the caption's own, one caption at a time."""
    out = []
    for i in range(scores.shape[0]):
        right = scores[i, t2i[i]]
        out.append(sum(int(scores[i, j] >= right) for j in range(scores.shape[1]) if j != t2i[i]))
    return torch.tensor(out, dtype=torch.long)


def _brute_i2t(scores: torch.Tensor, t2i: torch.Tensor) -> torch.Tensor:
    """Other images' captions scoring at least as high as the image's best own caption; -1
    for an image without captions."""
    out = []
    for j in range(scores.shape[1]):
        own = [i for i in range(scores.shape[0]) if t2i[i] == j]
        if not own:
            out.append(-1)
            continue
        best = max(scores[i, j] for i in own)
        out.append(sum(int(scores[i, j] >= best) for i in range(scores.shape[0]) if t2i[i] != j))
    return torch.tensor(out, dtype=torch.long)


def test_tiled_ranks_match_a_brute_force_reference_at_every_budget():
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        n_text = int(torch.randint(1, 25, (1,), generator=g))
        n_image = int(torch.randint(1, 18, (1,), generator=g))
        t2i = torch.randint(0, n_image, (n_text,), generator=g)  # some images without captions
        if trial % 2:  # few distinct values: ties everywhere
            scores = torch.randint(0, 3, (n_text, n_image), generator=g).float()
        else:
            scores = torch.randn(n_text, n_image, generator=g)
        want_t, want_i = _brute_t2i(scores, t2i), _brute_i2t(scores, t2i)
        for budget in (1, 2, 7, n_image, n_text * n_image, 10**6):
            tile = readout._matrix_tile(scores)
            got_t = text_to_image_ranks_tiled(tile, n_text, n_image, t2i, budget)
            got_i = image_to_text_ranks_tiled(tile, n_text, n_image, t2i, budget)
            assert torch.equal(got_t, want_t), (trial, budget)
            assert torch.equal(got_i, want_i), (trial, budget)
        assert torch.equal(text_to_image_ranks(scores, t2i), want_t)
        assert torch.equal(image_to_text_ranks(scores, t2i), want_i)


def test_an_image_with_more_captions_than_a_window_holds():
    # image 0 owns 9 captions; a budget of 4 pairs puts at most 4 rows in a window
    t2i = torch.tensor([0] * 9 + [1, 2, 2])
    scores = torch.randn(12, 3, generator=torch.Generator().manual_seed(1))
    got = image_to_text_ranks_tiled(readout._matrix_tile(scores), 12, 3, t2i, budget=4)
    assert torch.equal(got, _brute_i2t(scores, t2i))


def _recipe(name: str, seed: int = 0):
    torch.manual_seed(seed)
    cls = get_recipe(name)
    config = cls.Config()
    if hasattr(config, "embed_dim"):
        config.embed_dim = 8
    return cls(config, 12, 10).eval()


@pytest.mark.parametrize("name", ["clip", "meru", "atmg", "agr"])
def test_chunked_ranks_equal_the_dense_path(name, monkeypatch):
    """recall@k from tiles of a few pairs equals recall_at_k on the two dense matrices, ties
    included (duplicated images and captions score exactly alike)."""
    recipe = _recipe(name)
    g = torch.Generator().manual_seed(2)
    image_features = torch.randn(30, 12, generator=g) * 3
    image_features[7] = image_features[3]  # an exact duplicate: a tie for every caption
    text_features = torch.randn(45, 10, generator=g) * 3
    text_features[20] = text_features[4]
    t2i = torch.randint(0, 30, (45,), generator=g)
    with torch.no_grad():
        images, texts = recipe.embed_images(image_features), recipe.embed_texts(text_features)
        dense_t = score_matrix(recipe, texts, images, query="text")
        dense_i = score_matrix(recipe, texts, images, query="image")
    want = recall_at_k(dense_t, t2i, ks=(1, 5, 10), i2t_scores=dense_i)
    monkeypatch.setattr(readout, "PAIR_BUDGET", 37)  # tiles of at most 37 pairs
    t_ranks, i_ranks = retrieval_ranks(recipe, texts, images, t2i)
    assert torch.equal(t_ranks, text_to_image_ranks(dense_t, t2i))
    assert torch.equal(i_ranks, image_to_text_ranks(dense_i, t2i))
    assert readout.recall_from_ranks(t_ranks, i_ranks, ks=(1, 5, 10)) == want


def _val_store(
    num_images: int, dtype=torch.float32, captions: int = 1, train_images: int = 4
) -> FeatureStore:
    """``num_images`` "val" images and ``train_images`` train images, ``captions`` each."""
    g = torch.Generator().manual_seed(3)
    n = num_images + train_images
    return FeatureStore(
        image_features=torch.randn(n, 12, generator=g).to(dtype),
        text=TextPart(torch.randn(n * captions, 10, generator=g).to(dtype)),
        text_to_image=torch.arange(n).repeat_interleave(captions),
        image_split=(torch.arange(n) >= train_images).long(),
        split_names=["train", "val"],
    )


def _largest_allocation(fn) -> int:
    """Bytes of the largest single CPU allocation any op made while ``fn`` ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


def test_validation_never_allocates_a_dense_matrix(monkeypatch):
    """A validation split of 600 images and captions under a budget of 4096 pairs: no op
    allocates even a sixteenth of the 600 x 600 float32 matrix the dense path needed; the score
    is the brute-force one."""
    n = 600
    store = _val_store(n)
    recipe = _recipe("clip")
    validation = ValidationSet(store, max_images=0)  # every image: the tiles bound the memory
    monkeypatch.setattr(readout, "PAIR_BUDGET", 4096)
    largest = _largest_allocation(lambda: validation.score(recipe))
    assert largest < n * n * 4 // 16, largest
    with torch.no_grad():
        images = recipe.embed_images(store.image_features[4:])
        texts = recipe.embed_texts(store.text_features[4:])
        dense = recipe.scores(texts, images)
    others = dense.masked_fill(torch.eye(n, dtype=torch.bool), -torch.inf)  # caption i <-> image i
    t2i_at_1 = (dense.diag() > others.max(1).values).float().mean()
    i2t_at_1 = (dense.diag() > others.max(0).values).float().mean()
    want = (t2i_at_1 + i2t_at_1) / 2
    assert validation.score(recipe) == pytest.approx(float(want))


def test_eval_retrieval_never_allocates_a_dense_matrix(monkeypatch):
    from curvalign.eval import evaluate

    n = 500
    store = dataclasses.replace(_val_store(n), split_names=["train", "test"])
    recipe = _recipe("meru")
    want = evaluate(recipe, store, split="test", diagnostics=False).retrieval
    monkeypatch.setattr(readout, "PAIR_BUDGET", 4096)
    got = {}
    largest = _largest_allocation(
        lambda: got.update(evaluate(recipe, store, split="test", diagnostics=False).retrieval)
    )
    assert largest < n * n * 4 // 16, largest
    assert got == want


def test_a_matrix_that_cannot_fit_is_one_curvalign_error():
    recipe = _recipe("clip")
    texts = {"point": torch.zeros(1, 8).expand(10**6, 8)}
    images = {"point": torch.zeros(1, 8).expand(10**7, 8)}  # 4e13 bytes of scores
    with pytest.raises(MemoryBudgetError, match=r"1000000 x 10000000 score matrix .*GiB"):
        score_matrix(recipe, texts, images)


# --- float16 stores ---------------------------------------------------------------------------


def test_float16_store_validates_evaluates_and_embeds(tmp_path: Path):
    """Every reader of a float16 store (validation, eval, embed, the frozen baseline) gives what
    the same values in float32 give (each batch is cast to float32)."""
    from curvalign.eval import evaluate
    from curvalign.eval.frozen import FrozenFeatures
    from curvalign.index.embed import embed_store, load_embeddings

    half = _val_store(40, torch.float16, captions=2)
    full = half.with_fields(
        image_features=half.image_features.float(),
        text_features=half.text_features.float(),
    )
    recipe = _recipe("meru")
    # Validation and eval gather their rows by an id tensor, so both stores hand the recipe a
    # fresh float32 tensor of the same values and shape: the same computation, compared exactly.
    assert ValidationSet(half).score(recipe) == ValidationSet(full).score(recipe)
    as_test = ["train", "test"]
    half_t = dataclasses.replace(half, split_names=as_test)
    full_t = dataclasses.replace(full, split_names=as_test)
    want = evaluate(recipe, full_t, split="test")
    got = evaluate(recipe, half_t, split="test")
    assert got.retrieval == want.retrieval
    assert got.diagnostics["spectrum"] == want.diagnostics["spectrum"]
    shared = FeatureStore(
        image_features=half.image_features[:, :10].contiguous(),
        text=TextPart(half.text_features),
        text_to_image=half.text_to_image,
        image_split=half.image_split,
        split_names=as_test,
    )
    frozen = evaluate(FrozenFeatures(10, 10), shared, split="test", diagnostics=False)
    assert 0.0 <= frozen.retrieval["t2i@1"] <= 1.0
    a = load_embeddings(embed_store(recipe, half, tmp_path / "half", batch_size=7))
    b = load_embeddings(embed_store(recipe, full, tmp_path / "full", batch_size=7))
    # Not bit for bit: a float32 store's batch of 7 rows is a view at an odd offset into the
    # store, a float16 store's is a fresh cast copy, and MKL may sum a GEMM in another order for
    # the two (seen: 1 ulp on about a third of the text coordinates). Reordering a float32 dot
    # product of K <= 12 terms moves it by at most about K * 2**-24 of the sum of |terms|, and
    # expmap0 is smooth at these radii, so 1e-5 of the largest coordinate bounds that with room;
    # float16 arithmetic instead (a missing cast) would be off by about 1e-3.
    for side in ("images", "texts"):
        for key, values in a.side(side).items():
            want = torch.from_numpy(b.side(side)[key].copy())
            got = torch.from_numpy(values.copy())
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_training_on_a_float16_store_validates(tmp_path: Path):
    """The crash of the issue: validation on float16 features ("expected m1 and m2 to have the
    same dtype") during a default training run."""
    from curvalign.train.trainer import train

    store = _val_store(40, torch.float16, captions=2, train_images=24)
    run = train(
        "clip",
        store,
        tmp_path / "run",
        steps=4,
        overrides=["batch_size=8", "val_every=2", "tensorboard=false", "embed_dim=8"],
        show_progress=False,
    )
    meta = json.loads((Path(run) / "meta.json").read_text())
    assert [s for s, _ in meta["val_history"]] == [0, 2, 4]


# --- the validation subsample -----------------------------------------------------------------


def test_validation_subsample_is_seeded_bounded_and_recorded(tmp_path: Path):
    store = _val_store(50)
    a = ValidationSet(store, max_images=12, seed=5)
    assert a.num_images == 12 and a.subsample == {"images": 12, "of": 50, "seed": 5}
    assert torch.equal(a.image_ids, ValidationSet(store, max_images=12, seed=5).image_ids)
    assert not torch.equal(a.image_ids, ValidationSet(store, max_images=12, seed=6).image_ids)
    assert set(a.image_ids.tolist()) <= set(store.split_image_ids("val").tolist())
    assert ValidationSet(store, max_images=50).subsample is None
    _, info = validation_store(store, 0.1, seed=5, max_images=12)
    assert info == {"source": "store", "images": 50, "scored_images": 12, "subsample_seed": 5}
    _, info = validation_store(store, 0.1, seed=5, max_images=0)
    assert "scored_images" not in info

    from curvalign.train.trainer import train

    run = train(
        "clip",
        store,
        tmp_path / "run",
        steps=2,
        overrides=["batch_size=4", "val_every=1", "val_max_images=12", "tensorboard=false"],
        show_progress=False,
    )
    meta = json.loads((Path(run) / "meta.json").read_text())
    assert meta["validation"]["scored_images"] == 12 and meta["validation"]["subsample_seed"] == 0


# --- input widths -----------------------------------------------------------------------------


def test_input_width_mismatch_names_its_cause():
    from test_token_pooling import DI, DK, DT, token_store

    store = token_store()
    cls = get_recipe("dualpath")
    small = dict(model_dim=16, hidden_dim=16, embed_dim=8)
    tokens = cls.Config(**small, pool_tokens=True)
    pooled = cls.Config(**small)
    check_input_widths(cls(tokens, DI, DK), store)  # the widths runs.recipe_input_dims gives
    check_input_widths(cls(pooled, DI, DT), store)
    # a token reader built for the pooled width (what the benchmark's baseline did)
    with pytest.raises(
        InputError,
        match=rf"text tokens, which are {DK}-wide .* built for the "
        rf"{DT}-wide pooled text features .*recipe_input_dims",
    ) as err:
        check_input_widths(cls(tokens, DI, DT), store)
    assert "another" not in str(err.value)
    with pytest.raises(
        InputError,
        match=rf"reads pooled text features, which are {DT}-wide .* "
        rf"built for the {DK}-wide text tokens",
    ):
        check_input_widths(cls(pooled, DI, DK), store)
    with pytest.raises(
        InputError,
        match=rf"image features are {DI}-wide but dualpath takes "
        rf"{DI + 1}: .*another image encoder",
    ) as err:
        check_input_widths(cls(pooled, DI + 1, DT), store)
    assert "text" not in str(err.value).split(":")[-1]
    with pytest.raises(CurvalignError, match="has none"):  # no tokens at all: the store says so
        check_input_widths(
            cls(tokens, DI, DK),
            store.with_fields(text_token_features=None, text_token_mask=None),
        )


def test_token_pooling_dualpath_benchmark_runs_end_to_end(tmp_path: Path):
    """The issue's bug: the untrained baseline was built with the pooled text width and the
    whole benchmark aborted; every baseline now goes through runs.recipe_input_dims."""
    from curvalign.report.benchmark import run_benchmark
    from test_token_pooling import token_store

    overrides = [
        f"dualpath.{o}"
        for o in (
            "model_dim=16",
            "hidden_dim=16",
            "embed_dim=8",
            "pool_tokens=true",
            "batch_size=4",
            "pair_batch_size=4",
            "tensorboard=false",
        )
    ]
    result = run_benchmark(
        ["dualpath"],
        token_store(),
        tmp_path / "bench",
        steps=2,
        overrides=overrides,
        seeds=1,
        show_progress=False,
        plots=False,
    )
    assert result.rows["dualpath"]["status"] == "ok", result.rows["dualpath"]
    assert any(row.get("kind") == "untrained" for row in result.rows.values())


_CAPPED = """
import gc, resource, sys
import torch
sys.path.insert(0, {tests!r})
import test_readout as T
from curvalign.train.validation import ValidationSet
n = {n}
store = T._val_store(n)
recipe = T._recipe("clip")
validation = ValidationSet(store, max_images=0)
validation.score(recipe)  # warm: every lazy allocation of the path made before the cap
gc.collect()
pages = int(open("/proc/self/statm").read().split()[5])  # data + stack, in pages
cap = pages * resource.getpagesize() + {headroom}
resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
try:
    torch.empty(n, n)  # what the dense path allocated first
    print("dense fits")
except RuntimeError:
    print("dense refused")
print("score", validation.score(recipe))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_validation_split_larger_than_a_dense_matrix_could_hold(tmp_path: Path):
    """Under a data-segment cap of 24 MiB above what the process holds, a 4000 x 4000 float32
    matrix (61 MiB) cannot be allocated, and validation over those 4000 images still runs."""
    import subprocess
    import sys

    script = _CAPPED.format(tests=str(Path(__file__).parent), n=4000, headroom=24 * 2**20)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dense refused" in out.stdout
    assert "score " in out.stdout
