"""The one rule that sets a curved head's scale (``recipes.base.head_scales``, docs/methods.md
"The rule"): explicit per-side scales win; otherwise images at ``tangent_norm_init``, texts at
``text_radius_ratio`` times it. ``scale_init`` is deprecated and folded into the per-side keys."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from curvalign.config import RunConfig, resolve_config
from curvalign.recipes.atmg import AtmgConfig
from curvalign.recipes.base import HEAD_SCALE_KNOBS, head_scales
from curvalign.recipes.meru import MeruConfig
from curvalign.recipes.phyclip import Phyclip, PhyclipConfig

ROOT = Path(__file__).resolve().parents[1]


def test_explicit_sides_win_and_unset_sides_follow_the_two_inputs() -> None:
    asked: list[tuple[str, float]] = []

    def resolve(side: str, target: float) -> float:
        asked.append((side, target))
        return 10 * target

    config = AtmgConfig(tangent_norm_init=2.0, text_radius_ratio=0.25)
    assert head_scales(config, resolve) == (20.0, 5.0)
    assert asked == [("image", 2.0), ("text", 0.5)]
    asked.clear()
    config = AtmgConfig(tangent_norm_init=2.0, image_scale_init=0.3)
    assert head_scales(config, resolve) == (0.3, 5.0) and asked == [("text", 0.5)]


def test_scale_init_is_deprecated_and_means_what_it_meant() -> None:
    with pytest.warns(DeprecationWarning, match="image_scale_init=0.2, text_scale_init=0.05"):
        config = AtmgConfig(scale_init=0.2)  # AtMG's text_radius_ratio 0.25
    assert (config.image_scale_init, config.text_scale_init, config.scale_init) == (0.2, 0.05, None)
    with pytest.warns(DeprecationWarning):
        old = resolve_config("meru", "mem", overrides=["scale_init=0.1"])
    new = resolve_config("meru", "mem", overrides=["image_scale_init=0.1", "text_scale_init=0.1"])
    assert old == new  # one saved form: the per-side scales
    with pytest.warns(DeprecationWarning):  # a side set by the user keeps its value
        assert MeruConfig(scale_init=0.1, text_scale_init=0.7).text_scale_init == 0.7


@pytest.mark.parametrize(
    "path", sorted((ROOT / "docs" / "results").glob("*/best/*.yaml")), ids=lambda p: p.name
)
def test_saved_best_configs_load_without_a_warning(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        config = resolve_config(None, None, config_file=path)
    saved = yaml.safe_load(path.read_text())["recipe_config"]
    start = [k for k in saved if "scale" in k or k.endswith("_init") or "radius" in k]
    assert start and all(config.recipe_config[k] == saved[k] for k in start)  # as saved


def test_an_old_run_config_with_scale_init_and_resolved_sides_loads_silently() -> None:
    raw = {
        "recipe": "meru",
        "data": "mem",
        "recipe_config": {"scale_init": 0.04, "image_scale_init": 0.04, "text_scale_init": 0.04},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        config = RunConfig.from_dict(raw)
    assert config.recipe_config["scale_init"] is None
    assert config.recipe_config["image_scale_init"] == 0.04


def test_phyclip_app_c3_scale_stays_reachable() -> None:
    k, d, width = 4, 8, 64
    c3 = PhyclipConfig(num_factors=k, factor_dim=d, per_factor_scale=False, head_init="paper")
    image, text = Phyclip.head_scales_for(c3, width, width)  # the papers' features
    assert image == pytest.approx((k * d) ** -0.5) and text == pytest.approx(image)
    authors = PhyclipConfig(num_factors=k, factor_dim=d, head_init="paper")
    assert Phyclip.head_scales_for(authors, width, width)[0] == pytest.approx(d**-0.5)
    half = PhyclipConfig(num_factors=k, factor_dim=d, head_init="paper", text_radius_ratio=0.5)
    image, text = Phyclip.head_scales_for(half, width, width)
    assert text == pytest.approx(0.5 * image)


def test_the_step0_check_and_tuning_name_the_rules_knobs() -> None:
    space = Phyclip.search_space()
    assert set(space["tangent_norm_init"].covers) == set(HEAD_SCALE_KNOBS) - {"tangent_norm_init"}
    assert Phyclip.scale_knobs == HEAD_SCALE_KNOBS


def test_the_old_phyclip_head_scale_warns_and_gives_the_image_side():
    from curvalign.recipes.phyclip import Phyclip, PhyclipConfig

    config = PhyclipConfig(num_factors=4, factor_dim=8)
    with pytest.warns(DeprecationWarning, match="head_scales_for"):
        old = Phyclip.head_scale(config, 16, 3.0)
    assert old == Phyclip.head_scales_for(config, 16, 16, 3.0, 3.0)[0]
