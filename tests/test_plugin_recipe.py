"""The plug-in test: a recipe defined outside ``src/`` (tests/plugin_recipe.py, Euclidean-distance
InfoNCE), found through the ``curvalign.recipes`` entry-point group, trains, evaluates with every
metric its geometry supports, embeds, builds an index and searches, with no edit in src/."""

from __future__ import annotations

import json
from importlib.metadata import EntryPoint

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import curvalign.plugins
import curvalign.recipes
from curvalign.cli import app
from curvalign.index.embed import load_embeddings
from curvalign.runs import load_run
from plugin_recipe import NAME, EuclideanInfoNCE

DATA = "synthetic:images=120,text_pairs=20,seed=5"
runner = CliRunner()


def _run(*args) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def plugged():
    """The recipe installed as an entry point of the group would be (nothing registered by hand)."""
    point = EntryPoint(
        name=NAME,
        value="plugin_recipe:EuclideanInfoNCE",
        group=curvalign.plugins.RECIPE_ENTRY_POINT_GROUP,
    )
    real = curvalign.plugins.entry_points
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            curvalign.plugins,
            "entry_points",
            lambda group: [point] if group == point.group else real(group=group),
        )
        mp.setattr(curvalign.recipes, "_loaded", False)  # discover again, entry points included
        yield
        curvalign.recipes._REGISTRY.pop(NAME, None)


def test_the_entry_point_recipe_is_discovered(plugged):
    assert NAME in curvalign.plugins.available_recipe_names()  # the CLI's --recipe help
    assert curvalign.recipes.get_recipe(NAME) is EuclideanInfoNCE
    assert {"clip", "meru", "agr"} <= set(curvalign.recipes.recipe_names())


@pytest.fixture(scope="module")
def run_dir(plugged, tmp_path_factory):
    out = tmp_path_factory.mktemp("plugin") / "run"
    _run(
        "train",
        "--recipe",
        NAME,
        "--data",
        DATA,
        "--steps",
        "20",
        "--out",
        out,
        "-q",
        "batch_size=32",
        "tensorboard=false",
        "checkpoint_every=0",
    )
    return out


def test_plugin_recipe_evaluates_with_every_metric_its_geometry_supports(run_dir):
    result = json.loads(_run("eval", run_dir, "--json"))
    assert result["meta"]["recipe"] == NAME
    for part in ("retrieval", "zeroshot", "hierarchy", "compositional", "ordering"):
        assert part in result, part
    # its geometry has an origin: ordering applies to both chain kinds and distances are reported
    assert result["ordering"]["text"] is not None and result["ordering"]["image"] is not None
    assert result["diagnostics"]["distance_to_origin"] is not None
    assert result["diagnostics"]["spectrum"]["image"]["effective_rank"] > 1

    # retrieval ranks with the recipe's own score: recompute t2i@1 by brute force
    from curvalign.data import load_data
    from curvalign.eval.pipeline import split_rows

    store, recipe = load_data(DATA), load_run(run_dir).recipe
    image_ids, text_ids, t2i = split_rows(store, "test")
    with torch.no_grad():
        images = recipe.image_head(store.image_features[image_ids].float())
        texts = recipe.text_head(store.text_features[text_ids].float())
    d = torch.cdist(texts.double(), images.double())
    own = d[torch.arange(len(t2i)), t2i]
    strictly_closer = (d < own[:, None]).sum(1) + ((d == own[:, None]).sum(1) - 1)
    assert result["retrieval"]["t2i@1"] == pytest.approx(
        float((strictly_closer == 0).double().mean())
    )


def test_plugin_recipe_embeds_indexes_and_searches_exactly(run_dir, tmp_path):
    _run("embed", run_dir, "--out", tmp_path / "emb", "-q")
    emb = load_embeddings(tmp_path / "emb")
    assert emb.recipe_name == NAME and emb.geometry("euclidean") == "euclidean"
    assert emb.curvature is None

    _run("index", "build", tmp_path / "emb", "--out", tmp_path / "idx")
    found = json.loads(
        _run(
            "index", "search", tmp_path / "idx", "--query-text-ids", "0,7,42", "--k", "5", "--json"
        )
    )
    images = emb.side("images")["euclidean"].astype(np.float64)
    texts = emb.side("texts")["euclidean"].astype(np.float64)
    for row in found["results"]:
        sq = ((images - texts[row["query"]]) ** 2).sum(1)
        want = np.lexsort((np.arange(len(sq)), sq))[:5]  # ascending distance, ties by id
        assert row["ids"] == want.tolist()
        assert row["scores"] == pytest.approx((-sq[want]).tolist(), rel=1e-4)


def test_a_recipe_that_fails_to_import_is_an_error_not_a_missing_name(monkeypatch):
    broken = EntryPoint(
        name="broken",
        value="no_such_module_xyz:Recipe",
        group=curvalign.plugins.RECIPE_ENTRY_POINT_GROUP,
    )
    monkeypatch.setattr(curvalign.plugins, "entry_points", lambda group: [broken])
    monkeypatch.setattr(curvalign.recipes, "_loaded", False)
    with pytest.raises(curvalign.recipes.RecipeImportError, match="'broken'.*no_such_module_xyz"):
        curvalign.recipes.recipe_names()


def test_one_built_in_recipe_imports_its_own_module_only():
    """A command that reads one run (``index search``) looks its recipe up by name: only that
    recipe's module is imported, not the other recipes and entry points (about 0.14 CPU s of
    imports, half of what a small search costs). Any other name still discovers them all."""
    import subprocess
    import sys

    code = (
        "import sys, curvalign.recipes as r\n"
        "r.get_recipe('clip')\n"
        "loaded = sorted(m.rsplit('.', 1)[1] for m in sys.modules"
        " if m.startswith('curvalign.recipes.') and m.rsplit('.', 1)[1] in r.recipe_module_names())\n"
        "print(','.join(loaded), r._loaded)\n"
        "try:\n"
        "    r.get_recipe('no-such-recipe')\n"
        "except r.UnknownRecipeError as err:\n"
        "    print('agr' in str(err), r._loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0] == "clip False"
    assert out[1] == "True True"  # an unknown name lists every recipe, discovered in full
