"""Each recipe's paper training defaults: the code against the table in docs/methods.md."""

from __future__ import annotations

import pytest

from curvalign.config import resolve_config


def _methods_md_defaults() -> dict[tuple[str, str], float]:
    """{(recipe, key): value} from the "Training defaults" table of docs/methods.md."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "methods.md").read_text()
    section = text.split("## Training defaults", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `(\w+)` \| `(\w+)` \| ([^|]+) \|", line)
        if m:
            rows[(m.group(1), m.group(2))] = float(m.group(3).strip())
    return rows


def test_resolved_defaults_match_methods_md():
    from curvalign.recipes import recipe_names

    table = _methods_md_defaults()
    keys = ("lr", "weight_decay", "warmup", "min_lr_ratio", "grad_clip", "batch_size")
    names = [r for r in recipe_names() if not r.startswith("_")]
    assert len(names) == 8 and {r for r, _ in table} == set(names)
    for recipe in names:
        resolved = resolve_config(recipe, "synthetic").train
        for key in keys:
            assert (recipe, key) in table, f"docs/methods.md lacks {recipe} {key}"
            assert getattr(resolved, key) == pytest.approx(table[(recipe, key)]), (recipe, key)


def test_paper_defaults_differ_between_recipes_and_overrides_win():
    assert resolve_config("proclip", "synthetic").train.lr == pytest.approx(1e-4)
    assert resolve_config("meru", "synthetic").train.lr == pytest.approx(5e-4)
    assert resolve_config("agr", "synthetic").train.min_lr_ratio == pytest.approx(0.01)
    assert resolve_config("meru", "synthetic", overrides=["lr=2e-3"]).train.lr == pytest.approx(
        2e-3
    )


def test_proclip_normalises_inputs_and_old_runs_keep_raw_features():
    import torch

    from curvalign.config import RunConfig
    from curvalign.recipes import get_recipe

    cls = get_recipe("proclip")
    torch.manual_seed(0)
    recipe = cls(cls.Config(), 8, 8).eval()
    x = torch.randn(5, 8)
    a = recipe.embed_images(x)
    b = recipe.embed_images(7.0 * x)  # scale does not reach the heads once normalised
    for key in a:
        torch.testing.assert_close(a[key], b[key])
    old = RunConfig.from_dict({"recipe": "proclip", "data": "synthetic", "recipe_config": {}})
    assert old.recipe_config["normalize_inputs"] is False
    new = resolve_config("proclip", "synthetic")
    assert new.recipe_config["normalize_inputs"] is True


@pytest.mark.parametrize("recipe", ["clip", "meru", "atmg"])
def test_input_init_starts_at_the_frozen_features_ranking(recipe):
    import torch

    from curvalign.recipes import get_recipe

    cls = get_recipe(recipe)
    torch.manual_seed(0)
    model = cls(cls.Config(head_init="input", embed_dim=16), 12, 12).eval()
    gen = torch.Generator().manual_seed(1)
    images = torch.nn.functional.normalize(torch.randn(9, 12, generator=gen), dim=-1)
    texts = torch.nn.functional.normalize(torch.randn(7, 12, generator=gen), dim=-1)
    with torch.no_grad():
        got = model.scores(model.embed_texts(texts), model.embed_images(images)).argsort(dim=1)
    frozen = (texts @ images.T).argsort(dim=1)
    assert torch.equal(got, frozen)  # the same ranking as cosine on the inputs
    paper = cls(cls.Config(embed_dim=16, head_init="paper"), 12, 12).eval()
    with torch.no_grad():
        other = paper.scores(paper.embed_texts(texts), paper.embed_images(images)).argsort(dim=1)
    assert not torch.equal(other, frozen)  # the paper's random init does not
