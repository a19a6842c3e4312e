"""The warm start (docs/methods.md, "The warm start"): the linear alignment and each recipe's
step 0 from it.

Every recipe that trains on image-text pairs is built as a run starts it
(``runs.build_started_recipe``, no training step) on four tiny synthetic stores (the two sides
of one width or of two, unit-norm or unnormalised features), and the mean R@1 of its own scores
on the validation split is compared with the alignment's ``val_r1`` within the tolerance the
recipe states (``warm_start_tolerance``). ``data.alignment`` is checked against an independent
float64 closed form.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from curvalign.config import RunConfig, resolve_config
from curvalign.data.alignment import (
    cosine_mean_r1,
    fit_alignment,
    mean_r1,
    solve_ridge,
    split_pairs,
)
from curvalign.data.synthetic import SyntheticConfig, make_world
from curvalign.recipes import get_recipe, recipe_names
from curvalign.runs import build_recipe, build_started_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

#: small widths per recipe (every head at least as wide as the text side, except ProCLIP's
#: hyperbolic and Euclidean parts), so that building one costs milliseconds
SMALL = {
    "clip": ["embed_dim=32"],
    "meru": ["embed_dim=32"],
    "atmg": ["embed_dim=32"],
    "hycoclip": ["embed_dim=32"],
    "phyclip": ["num_factors=8", "factor_dim=4"],
    "proclip": ["hyperbolic_dim=16", "euclidean_dim=16", "sphere_dim=32", "hidden_dim=32"],
    "agr": ["embed_dim=32", "lora_rank=4"],
    "dualpath": ["model_dim=32", "hidden_dim=48", "embed_dim=32"],
}
NAMES = sorted(SMALL)
#: (image width, text width)
WIDTHS = {"shared": (32, 32), "different": (32, 24)}
#: a small world whose captions name one object each, little noise: the alignment's val mean
#: R@1 is about 60 at 32/24-d, so the comparison sees a real ranking
WORLD = dict(
    images=400,
    text_pairs=64,
    val_fraction=0.3,
    max_objects=1,
    generality=0.0,
    attribute_mention=1.0,
    image_noise=0.3,
    background=0.3,
    text_noise=0.2,
    seed=0,
)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


def _renormed(store, how: str):
    """The store's features unit-normalised ("unit"), or as the synthetic maps give them times
    10 ("raw": mean norm about 30, each row's norm spread as the world's, within about a factor
    of 2, as unnormalised encoder outputs are)."""

    def fix(x):
        if x is None:
            return None
        return _unit(x.float()) if how == "unit" else 10.0 * x.float()

    text = dataclasses.replace(store.text, features=fix(store.text.features))
    pairs = {
        name: dataclasses.replace(part, features=fix(part.features))
        for name in ("pair_a", "pair_b")
        if (part := getattr(store, name)) is not None
    }
    return dataclasses.replace(
        store,
        image_features=fix(store.image_features),
        text=text,
        box_image_features=fix(store.box_image_features),
        box_text_features=fix(store.box_text_features),
        **pairs,
    )


@pytest.fixture(scope="module")
def stores():
    out = {}
    for width, (di, dt) in WIDTHS.items():
        world = make_world(SyntheticConfig(image_dim=di, text_dim=dt, **WORLD))
        for how in ("unit", "raw"):
            out[(width, how)] = _renormed(world, how)
    return out


def _val_r1(model, store) -> float:
    """Mean of T2I and I2T R@1 (%) of the recipe's own scores on the "val" split (the protocol
    of the alignment's ``val_r1``)."""
    images, texts, owner, _ = split_pairs(store, "val")
    model.eval()
    with torch.no_grad():
        emb_i, emb_t = model.embed_images(images.float()), model.embed_texts(texts.float())
        return mean_r1(
            model.scores(emb_t, emb_i, "text").float(),
            owner,
            model.scores(emb_t, emb_i, "image").float(),
        )


def _started(name: str, store, *overrides: str):
    config = resolve_config(name, "mem", overrides=[*SMALL[name], *overrides])
    return build_started_recipe(config, store)


def test_every_pair_recipe_with_a_warm_start_is_covered():
    """A recipe that starts at the alignment by default states its tolerance and is tested here."""
    for name in recipe_names():
        cls = get_recipe(name)
        if not cls.uses_alignment(cls.Config()):
            continue
        assert name in SMALL, f"recipe {name!r} starts at the alignment but is not tested here"
        assert cls.warm_start_tolerance is not None and cls.warm_start_tolerance >= 0


@pytest.mark.parametrize("width", sorted(WIDTHS))
@pytest.mark.parametrize("how", ["unit", "raw"])
@pytest.mark.parametrize("name", NAMES)
def test_step0_ranks_like_the_alignment(stores, name, width, how):
    store = stores[(width, how)]
    started = _started(name, store)
    info = started.warm_start
    assert info is not None and info["val_r1"] is not None, started.note
    step0 = _val_r1(started.recipe, store)
    tolerance = type(started.recipe).warm_start_tolerance
    print(f"{name} {width} {how}: alignment {info['val_r1']:.2f} step 0 {step0:.2f}")
    assert abs(step0 - info["val_r1"]) <= tolerance + 1e-3, (  # val_r1 is saved to 4 decimals
        f"{name}: step-0 val mean R@1 {step0:.2f}, alignment {info['val_r1']:.2f}, "
        f"tolerance {tolerance}"
    )


@pytest.mark.parametrize("name", ["phyclip", "proclip", "agr", "dualpath"])
def test_paper_init_is_kept_and_starts_elsewhere(stores, name):
    """head_init=paper builds the paper's start (no warm start), and a config.json saved before
    head_init existed loads as "paper" with the same parameter names."""
    store = stores[("different", "unit")]
    paper = _started(name, store, "head_init=paper")
    assert paper.warm_start is None
    config = paper.config.to_dict()
    del config["recipe_config"]["head_init"]
    old = RunConfig.from_dict(config)
    assert old.recipe_config["head_init"] == "paper"
    rebuilt = build_recipe(old, store.image_dim, store.text_dim)
    rebuilt.load_state_dict(paper.recipe.state_dict())  # strict: same names and shapes
    aligned = _started(name, store).recipe.state_dict()
    assert any(not torch.equal(v, aligned[k]) for k, v in paper.recipe.state_dict().items())


def test_proclip_align_is_a_linear_skip_plus_zero_mlp(stores):
    store = stores[("shared", "raw")]
    model = _started("proclip", store).recipe.eval()
    paper = _started("proclip", store, "head_init=paper").recipe
    extra = set(model.state_dict()) - set(paper.state_dict())
    assert extra and all(".skips." in k for k in extra)
    x = model._inputs(store.image_features[:20].float())
    for part in model.parts:
        mlp = model.image_head.mlps[part]
        assert torch.equal(mlp(x), torch.zeros_like(mlp(x)))  # the residual branch at zero
        assert torch.equal(model.image_head.part(part, x), model.image_head.skips[part](x))
    # the spherical part alone is the alignment's cosine ranking (sphere_dim >= text width)
    images, texts, owner, _ = split_pairs(store, "val")
    alignment = fit_alignment(store)
    with torch.no_grad():
        si = model.embed_images(images.float())["sphere"]
        st = model.embed_texts(texts.float())["sphere"]
    expected = _unit(texts) @ _unit(images @ alignment.image_map).T
    assert torch.allclose((st @ si.T).double(), expected, atol=1e-5)


def test_agr_router_neutral_and_euclidean_expert_exact(stores):
    store = stores[("different", "raw")]
    started = _started("agr", store)
    model = started.recipe.eval()
    images, texts, owner, _ = split_pairs(store, "val")
    with torch.no_grad():
        emb_i, emb_t = model.embed_images(images.float()), model.embed_texts(texts.float())
        parts = model.routed(emb_t, emb_i, "text", alpha=1.0, beta=1.0)
    assert torch.equal(torch.sigmoid(parts.route_logits), torch.full_like(parts.s_e, 0.5))
    assert torch.equal(parts.gate, torch.full_like(parts.gate, 0.5))
    euclidean = cosine_mean_r1(emb_i["euclidean"].double(), emb_t["euclidean"].double(), owner)
    assert euclidean == pytest.approx(started.warm_start["val_r1"], abs=1e-3)


def test_dualpath_start_does_not_depend_on_the_gate_and_keeps_text_cosine(stores):
    store = stores[("shared", "raw")]
    model = _started("dualpath", store).recipe.eval()
    x = store.image_features[:30].float()
    with torch.no_grad():
        before = model.embed_images(x)["point"]
        model.head.gate_warmup.fill_(1.0)
        model.head.gate_logit.fill_(5.0)  # the gate wide open: the multimodal path leads
        after = model.embed_images(x)["point"]
        texts = store.text_features[:30].float()
        pairs = model.embed_texts(texts, task="text_pair")["point"]
    assert torch.allclose(before, after, atol=1e-6)
    # text pairs start at the frozen text features' own cosine (an isometry of the text space)
    assert torch.allclose(pairs @ pairs.T, _unit(texts) @ _unit(texts).T, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("meru", ["embed_dim=16"]),  # narrower than the 32-d inputs: gain 1 all the same
        ("meru", []),
        ("agr", []),
        ("phyclip", []),  # per factor
    ],
)
def test_warm_start_tangent_norms_are_the_resolved_target(stores, name, overrides):
    """The alignment's projections keep each side's mean norm (gain 1), so the data-aware
    scales put the step-0 tangent vectors at their target (mean norm 1; PHyCLIP: per factor)."""
    store = stores[("shared", "raw")]
    model = _started(name, store, *overrides).recipe
    head = {"agr": "image_lorentz"}.get(name, "image_head")
    with torch.no_grad():
        tangent = getattr(model, head).tangent(store.image_features.float())
    if tangent.ndim == 3:  # PHyCLIP [N, k, d]: the factors' root mean square norm
        norms = tangent.square().sum(-1).mean(-1).sqrt()
    else:
        norms = torch.linalg.vector_norm(tangent, dim=-1)
    assert float(norms.mean()) == pytest.approx(1.0, rel=0.05)


# --- data.alignment against an independent float64 reference -----------------------------------


def test_ridge_matches_the_float64_closed_form():
    g = np.random.default_rng(0)
    x, y = g.normal(size=(200, 7)), g.normal(size=(200, 5))
    for alpha in (1e-3, 1.0):
        lam = alpha * np.trace(x.T @ x) / 7
        ref = np.linalg.solve(x.T @ x + lam * np.eye(7), x.T @ y)
        w, b = solve_ridge(torch.from_numpy(x), torch.from_numpy(y), alpha, intercept=False)
        np.testing.assert_allclose(w.numpy(), ref, rtol=1e-10, atol=1e-12)
        assert not b.any()
        xc, yc = x - x.mean(0), y - y.mean(0)
        lam = alpha * np.trace(xc.T @ xc) / 7
        ref = np.linalg.solve(xc.T @ xc + lam * np.eye(7), xc.T @ yc)
        w, b = solve_ridge(torch.from_numpy(x), torch.from_numpy(y), alpha, intercept=True)
        np.testing.assert_allclose(w.numpy(), ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(b.numpy(), y.mean(0) - x.mean(0) @ ref, atol=1e-12)


def test_fit_alignment_is_the_best_ridge_on_validation(stores):
    """The chosen map is the float64 closed form at its alpha, fit on the train captions, and
    no candidate scores higher on validation."""
    store = stores[("different", "raw")]
    alignment = fit_alignment(store)
    _, texts, _, x = split_pairs(store, "train")
    xs, ts = x.numpy(), texts.numpy()
    assert alignment.kind == "ridge"
    lam = alignment.alpha * np.trace(xs.T @ xs) / xs.shape[1]
    ref = np.linalg.solve(xs.T @ xs + lam * np.eye(xs.shape[1]), xs.T @ ts)
    np.testing.assert_allclose(alignment.image_map.numpy(), ref, rtol=1e-8, atol=1e-10)
    images, vtexts, owner, _ = split_pairs(store, "val")
    for alpha in (1e-4, 1e-2, 1.0, 10.0):
        lam = alpha * np.trace(xs.T @ xs) / xs.shape[1]
        w = np.linalg.solve(xs.T @ xs + lam * np.eye(xs.shape[1]), xs.T @ ts)
        other = cosine_mean_r1(images @ torch.from_numpy(w), vtexts, owner)
        assert other <= alignment.val_r1 + 1e-9


def test_identity_is_chosen_when_both_sides_are_the_same_features(stores):
    store = stores[("shared", "raw")]
    same = dataclasses.replace(
        store,
        text=dataclasses.replace(
            store.text, features=store.image_features[store.text_to_image].clone()
        ),
    )
    alignment = fit_alignment(same)
    assert alignment.kind == "identity" and alignment.val_r1 == pytest.approx(100.0)


@pytest.mark.parametrize("extra", [0, 5])
def test_projections_keep_the_alignment_cosine_when_wide_enough(stores, extra):
    store = stores[("different", "raw")]
    alignment = fit_alignment(store)
    torch.manual_seed(0)
    width = alignment.text_dim + extra
    a_img, a_txt = alignment.projections(width)
    images, texts, _, _ = split_pairs(store, "val")
    got = _unit(images @ a_img.double()) @ _unit(texts @ a_txt.double()).T
    want = _unit(images @ alignment.image_map) @ _unit(texts).T
    assert torch.allclose(got, want, atol=1e-5)
    # each side keeps its mean train norm (gain 1)
    _, train_texts, _, x = split_pairs(store, "train")
    assert float((x @ a_img.double()).norm(dim=-1).mean()) == pytest.approx(
        alignment.image_norm, rel=0.02
    )
    assert float((train_texts @ a_txt.double()).norm(dim=-1).mean()) == pytest.approx(
        alignment.text_norm, rel=0.02
    )


def test_a_capped_split_is_read_in_runs_of_consecutive_rows():
    # a memory-mapped shard reads whole pages: a cap drawn as runs of neighbouring rows reads
    # each page once, where an evenly strided sample would read one page per row
    from types import SimpleNamespace

    from curvalign.data import alignment

    n = 10 * alignment.SAMPLE_RUN_ROWS * 7
    features = torch.arange(n, dtype=torch.float64)[:, None].repeat(1, 3)
    store = SimpleNamespace(
        split_image_ids=lambda split: torch.arange(n),
        num_images=n,
        text_to_image=torch.arange(n),
        image_features=features,
        text_features=features,
    )
    images, texts, owner, _ = alignment.split_pairs(
        store, "train", max_rows=10 * alignment.SAMPLE_RUN_ROWS
    )
    rows = images[:, 0].long()
    assert len(rows) == 10 * alignment.SAMPLE_RUN_ROWS
    assert torch.equal(texts[owner, 0], images[owner, 0])  # each text beside its own image
    steps = rows.diff()
    assert int((steps != 1).sum()) == 9  # ten runs, nine jumps between them
    assert rows.min() == 0 and rows.max() == n - 1  # the runs span the whole split
