"""Data-aware head initialisation (issue 21 item 1) and the step-0 health check (item 2).

Stores: one whose features are unit-norm (MiniLM-like, one space for both sides) and the same
store unnormalised (images at norm ~37, texts at ~5): the resolved scales must put the step-0
points at the same radii on both."""

from __future__ import annotations

import math

import pytest
import torch

from curvalign.config import describe_config, resolve_config
from curvalign.data.features import FeatureStore, TextPart
from curvalign.data.sampling import BatchSampler
from curvalign.data.statistics import feature_norms
from curvalign.errors import ConfigError
from curvalign.eval.health import RunHealth, curvature_bounds, health_of_run
from curvalign.nn.heads import resolve_tangent_scale
from curvalign.recipes.health import (
    Step0Health,
    check_step0,
    step0_codes,
    step0_health,
    warning_line,
)
from curvalign.report.tables import step0_cells
from curvalign.runs import build_started_recipe, load_run
from curvalign.train.trainer import train

DIM = 24
N = 400


def _store(image_norm: float | None = None, text_norm: float | None = None) -> FeatureStore:
    """Matched image/text features in one space (text = image + noise); unit-norm rows unless
    a norm is given (then rows are scaled to about that norm, with a 20% spread)."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(N, DIM, generator=g)
    texts = images + 3.0 * torch.randn(N, DIM, generator=g)
    images = torch.nn.functional.normalize(images, dim=-1)
    texts = torch.nn.functional.normalize(texts, dim=-1)
    if image_norm is not None:
        images = images * image_norm * (1 + 0.2 * torch.rand(N, 1, generator=g))
    if text_norm is not None:
        texts = texts * text_norm * (1 + 0.2 * torch.rand(N, 1, generator=g))
    split = (torch.arange(N) >= int(0.8 * N)).long()
    return FeatureStore(
        image_features=images,
        text=TextPart(texts),
        text_to_image=torch.arange(N),
        image_split=split,
        split_names=["train", "test"],
    )


UNIT = _store()
RAW = _store(image_norm=37.0, text_norm=5.0)


def _built(recipe: str, store: FeatureStore, *overrides: str, seed: int = 0):
    config = resolve_config(recipe, "mem", overrides=[*overrides, f"seed={seed}"])
    started = build_started_recipe(config, store)
    return started.recipe, started.config


def _radii(recipe, store: FeatureStore) -> tuple[float, float]:
    with torch.no_grad():
        images = recipe.embed_images(store.image_features)
        texts = recipe.embed_texts(store.text_features)
        return (
            float(recipe.distance_to_origin(images).mean()),
            float(recipe.distance_to_origin(texts).mean()),
        )


def _check(recipe, store: FeatureStore, batch_size: int = 128) -> Step0Health:
    sampler = BatchSampler(
        store, batch_size, seed=0, requires=recipe.requires, recipe=recipe.name, data="mem"
    )
    return check_step0(recipe, sampler, 100)


# --- the rule ---------------------------------------------------------------------------------


def test_rule_gives_the_papers_value_for_the_papers_features() -> None:
    # MERU: encoder outputs of norm sqrt(D), random N(0, 1/D) projection to d: s = 1/sqrt(d)
    assert resolve_tangent_scale(1.0, None, 768, 512) == pytest.approx(512**-0.5)
    assert resolve_tangent_scale(1.0, 768**0.5, 768, 512) == pytest.approx(512**-0.5)
    # the shared orthonormal projection keeps norms (d >= D): s = target / |f|
    assert resolve_tangent_scale(1.0, 1.0, 384, 512, input_preserving=True) == pytest.approx(1.0)
    assert resolve_tangent_scale(2.0, 4.0, 384, 512, input_preserving=True) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="mean feature norm"):
        resolve_tangent_scale(1.0, 0.0, 8, 8)


def test_feature_norms_read_the_train_rows_only() -> None:
    store = _store()
    store.image_features[store.split_image_ids("test")] *= 1000.0  # test rows must not count
    norms = feature_norms(store)
    assert norms.image_norm == pytest.approx(1.0, rel=1e-6)
    assert norms.image_rows == int(0.8 * N)


@pytest.mark.parametrize("store", [UNIT, RAW], ids=["unit-norm", "unnormalised"])
@pytest.mark.parametrize("recipe", ["meru", "atmg", "agr"])
def test_resolved_scales_put_step0_points_at_the_target_radius(recipe, store) -> None:
    model, config = _built(recipe, store)
    image_r, text_r = _radii(model, store)
    ratio = config.recipe_config.get("text_radius_ratio", 1.0)
    assert image_r == pytest.approx(1.0, rel=0.15)
    assert text_r == pytest.approx(ratio, rel=0.15)


@pytest.mark.parametrize("store", [UNIT, RAW], ids=["unit-norm", "unnormalised"])
def test_phyclip_resolved_scale_puts_each_factor_at_unit_tangent_norm(store) -> None:
    model, _ = _built("phyclip", store, "num_factors=4", "factor_dim=8")
    with torch.no_grad():
        tangent = model.image_head.tangent(store.image_features)  # [N, k, d]
    assert float(tangent.norm(dim=-1).mean()) == pytest.approx(1.0, rel=0.2)


def test_the_old_default_on_unit_norm_features_is_tiny_and_the_new_one_is_not() -> None:
    old, _ = _built("meru", UNIT, f"image_scale_init={512**-0.5}", f"text_scale_init={512**-0.5}")
    new, config = _built("meru", UNIT)
    assert _radii(old, UNIT)[0] == pytest.approx(512**-0.5, rel=0.05)
    assert _radii(new, UNIT)[0] == pytest.approx(1.0, rel=0.05)
    assert config.recipe_config["image_scale_init"] == pytest.approx(1.0, rel=1e-3)


def test_features_that_give_no_scale_are_one_config_error() -> None:
    zero = _store()
    zero.image_features.zero_()
    with pytest.raises(ConfigError, match="mean feature norm of 0.0"):
        _built("meru", zero)


def test_user_values_win_and_resolution_is_recorded_in_config() -> None:
    _, config = _built("meru", RAW, "text_scale_init=0.5")
    assert config.recipe_config["text_scale_init"] == 0.5
    assert config.recipe_config["image_scale_init"] == pytest.approx(1 / 37.0 / 1.1, rel=0.05)


def test_scale_max_is_raised_to_a_resolved_scale_above_it() -> None:
    small = _store(image_norm=0.1, text_norm=0.1)
    model, config = _built("meru", small)
    assert config.recipe_config["scale_max"] >= config.recipe_config["image_scale_init"] > 1.0
    assert _radii(model, small)[0] == pytest.approx(1.0, rel=0.15)


@pytest.mark.parametrize("recipe", ["meru", "atmg"])
@pytest.mark.parametrize("query", ["text", "image"])
def test_input_init_keeps_the_frozen_ranking_on_unit_norm_features(recipe, query) -> None:
    """head_init=input with the resolved scales (and AtMG's radius gap: each side at one
    radius) ranks like the cosine of the frozen features."""
    model, _ = _built(recipe, UNIT)
    with torch.no_grad():
        images = model.embed_images(UNIT.image_features)
        texts = model.embed_texts(UNIT.text_features)
        scores = model.scores(texts, images, query).double()
    cosine = UNIT.text_features.double() @ UNIT.image_features.double().T
    if query == "image":
        scores, cosine = scores.T, cosine.T
    # along each row in the cosine's order the score never falls (float32 noise aside)
    along = scores.gather(1, cosine.argsort(dim=1))
    assert float(along.diff(dim=1).min()) > -1e-5
    assert torch.equal(scores.argmax(dim=1), cosine.argmax(dim=1))


# --- the step-0 check ---------------------------------------------------------------------------


def test_step0_check_is_silent_on_the_new_defaults() -> None:
    for recipe in ("clip", "meru", "atmg"):
        for store in (UNIT, RAW):
            model, _ = _built(recipe, store)
            report = _check(model, store)
            assert report.ok, (recipe, report.codes)


def test_step0_check_fires_on_the_papers_scale_on_unit_norm_features() -> None:
    model, _ = _built("meru", UNIT, f"image_scale_init={512**-0.5}", f"text_scale_init={512**-0.5}")
    report = _check(model, UNIT)
    assert {"loss_at_chance", "flat_logits", "flat_geometry", "inert_curvature"} <= set(
        report.codes
    )
    flat = next(w for w in report.warnings if w.code == "flat_logits")
    assert flat.knobs[:2] == ("tangent_norm_init", "image_scale_init")
    assert "tangent_norm_init" in flat.message and flat.value < flat.threshold


def test_step0_check_fires_on_equal_radii_for_an_angle_loss() -> None:
    model, _ = _built("atmg", UNIT, "text_radius_ratio=1")
    report = _check(model, UNIT)
    assert "equal_radii" in report.codes
    assert "loss_at_chance" in report.codes  # the two directions cancel: the loss sits at log B
    gap = next(w for w in report.warnings if w.code == "equal_radii")
    assert gap.knob == "text_radius_ratio"
    # MERU's distance loss has no such cancellation: equal radii are fine there
    assert "equal_radii" not in _check(_built("meru", UNIT)[0], UNIT).codes


def test_step0_check_fires_on_points_too_far_out() -> None:
    model, _ = _built("meru", UNIT, "image_scale_init=9", "text_scale_init=9")
    assert "far_out" in _check(model, UNIT).codes


def test_step0_check_fires_on_a_temperature_that_cannot_move_the_loss() -> None:
    same = _store()
    same.image_features[:] = same.image_features[0]  # every item alike: every logit flat
    same.text_features[:] = same.text_features[0]
    model, _ = _built("clip", same)
    report = _check(model, same)
    assert "inert_temperature" in report.codes
    assert "inert_temperature" not in _check(_built("clip", UNIT)[0], UNIT).codes


def test_step0_check_changes_neither_sampling_nor_rng_nor_weights() -> None:
    model, _ = _built("atmg", UNIT)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sampler = BatchSampler(UNIT, 64, seed=3, recipe="atmg", data="mem")
    fresh = BatchSampler(UNIT, 64, seed=3, recipe="atmg", data="mem")
    torch.manual_seed(5)
    check_step0(model, sampler, 100)
    after_check = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_check, torch.rand(3))
    assert torch.equal(sampler.next_batch().image, fresh.next_batch().image)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_report_round_trips_and_its_lines_carry_their_codes() -> None:
    model, _ = _built("atmg", UNIT, "text_radius_ratio=1")
    batch = BatchSampler(UNIT, 64, seed=0, recipe="atmg", data="mem").next_batch()
    report = step0_health(model, batch)
    assert report.log_b == pytest.approx(math.log(64))
    assert Step0Health.from_json(report.to_json()) == report
    assert report.codes == ["loss_at_chance", "equal_radii"]
    chance, equal = report.warnings
    # each warning carries what it measured and the bound that failed
    assert chance.value == pytest.approx(report.loss_ratio) and chance.value >= chance.threshold
    assert equal.knobs == ("text_radius_ratio",) and equal.value <= equal.threshold
    lines = [f"seed 2: {warning_line(w)}" for w in report.warnings]
    assert step0_codes(lines) == report.codes
    assert step0_codes(["seed 1: validation stopped improving early"]) == []


def test_a_report_saved_before_warnings_carried_their_values_still_loads() -> None:
    old = {
        "batch_size": 8,
        "log_b": math.log(8),
        "loss": 2.0,
        "loss_ratio": 2.0 / math.log(8),
        "recall_at_1": 0.5,
        "logit_spread": 0.3,
        "feature_norm": {"image": 1.0, "text": 1.0},
        "radius": {"image": 0.04, "text": 0.04},
        "curvature": 1.0,
        "curvature_radius2": {"image": 0.0016, "text": 0.0016},
        "sensitivity": {"curvature": 0.0},
        "warnings": [
            {"code": "flat_logits", "knob": "scale_init / temperature_init", "message": "m"}
        ],
    }
    report = Step0Health.from_json(old)
    (warning,) = report.warnings
    assert warning.knobs == ("scale_init", "temperature_init") and warning.value is None
    saved = report.to_json()
    assert {k: v for k, v in saved.items() if k != "warnings"} == {
        k: v for k, v in old.items() if k != "warnings"
    }
    assert saved["warnings"][0] == {**old["warnings"][0], "value": None, "threshold": None}


# --- the run records it; the benchmark table marks it ------------------------------------------


def test_training_records_resolved_scales_and_the_report(tmp_path) -> None:
    run = train(
        "atmg",
        RAW,
        tmp_path / "run",
        steps=2,
        overrides=["text_radius_ratio=1", "batch_size=32", "val_every=1", "num_threads=1"],
        show_progress=False,
    )
    loaded = load_run(run)
    assert loaded.config.recipe_config["image_scale_init"] == pytest.approx(
        1 / (37 * 1.1), rel=0.05
    )
    report = loaded.meta["step0_health"]
    assert [w["code"] for w in report["warnings"]] == ["loss_at_chance", "equal_radii"]
    resumed = train("atmg", RAW, run, steps=3, resume=True, show_progress=False)
    assert load_run(resumed).meta["step0_health"] == report  # a resumed run keeps its report
    health = health_of_run(loaded)
    assert step0_codes(list(health.warnings)) == ["loss_at_chance", "equal_radii"]
    assert health.step0 is not None and health.step0.codes == ["loss_at_chance", "equal_radii"]
    assert RunHealth.from_json(health.to_json()) == health
    rows = {
        "atmg": {
            "kind": "trained",
            "seeds": [0, 1],
            "warnings": [f"seed 0: {health.warnings[0]}"],
        },
        "clip": {"kind": "trained", "seeds": [0, 1], "warnings": []},
        "frozen features": {"kind": "baseline"},
    }
    assert dict(step0_cells(rows)) == {"atmg": "! loss_at_chance (1/2)", "clip": "ok"}


def test_print_config_shows_the_resolved_values(tmp_path) -> None:
    path = RAW.save(tmp_path / "store")
    text = describe_config("meru", f"features:{path}")
    # 1 / 40.85 (the train rows' mean image norm; the warm start keeps norms: gain 1), not null
    assert "image_scale_init: 0.0245" in text
    assert "resolved from the train features' norms" in text
    assert "# warm start: identity (the two sides in one space), val mean R@1" in text
    assert "image_scale_init: null" in describe_config("meru", None)


def test_curvature_bounds_come_from_the_recipe_contract() -> None:
    assert curvature_bounds(_built("meru", UNIT)[0]) == {0.1, 10.0}
    assert curvature_bounds(_built("meru", UNIT, "learn_curvature=false")[0]) == set()
    assert curvature_bounds(_built("clip", UNIT)[0]) == set()
