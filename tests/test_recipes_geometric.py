"""The six geometric recipes: contract, loss structure, gather semantics, and that they learn."""

from __future__ import annotations

import math

import pytest
import torch

from curvalign.losses import (
    angle_contrastive_loss,
    centroid_radius_loss,
    entailment_cone_loss,
    info_nce,
    matched_angle_loss,
)
from curvalign.nn.scalars import LearnableScalar, scalar_parameter_names
from curvalign.recipes import get_recipe, recipe_names
from curvalign.recipes.base import Batch, Gather, Progress, cat_embeddings
from curvalign.scores import lorentz_distance_scores, product_average_distance_scores
from recipe_harness import fit, heldout_recall_at_1, small_world, zero_shot_accuracy

#: small Config overrides per recipe, so each trains in a second or two
SMALL = {
    "clip": dict(embed_dim=32),
    "meru": dict(embed_dim=32),
    "hycoclip": dict(embed_dim=32),
    "atmg": dict(embed_dim=32),
    "phyclip": dict(num_factors=8, factor_dim=4),
    "proclip": dict(hyperbolic_dim=16, euclidean_dim=16, sphere_dim=16, hidden_dim=64),
}
NAMES = sorted(SMALL)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world():
    return small_world(seed=0)


def make(name: str, world, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cls = get_recipe(name)
    return cls(cls.Config(**{**SMALL[name], **overrides}), world.image_dim, world.text_dim)


def random_batch(world, n: int = 8, boxes: bool = True, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(world.num_images, generator=g)[:n]
    texts = torch.stack(
        [torch.nonzero(world.text_to_image == i).flatten()[0] for i in ids.tolist()]
    )
    batch = Batch(image=world.image_features[ids].float(), text=world.text_features[texts].float())
    if boxes:
        rows = torch.stack(
            [torch.nonzero(world.box_to_image == i).flatten()[0] for i in ids.tolist()]
        )
        batch.box_image = world.box_image_features[rows].float()
        batch.box_text = world.box_text_features[rows].float()
    return batch


# --- contract ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_pair_scores_equal_the_diagonal_of_scores(name, world):
    recipe = make(name, world)
    batch = random_batch(world, 7)
    with torch.no_grad():
        texts, images = recipe.embed_texts(batch.text), recipe.embed_images(batch.image)
        for query in ("text", "image"):
            full = recipe.scores(texts, images, query=query)
            assert full.shape == (7, 7) and torch.isfinite(full).all()
            torch.testing.assert_close(
                recipe.pair_scores(texts, images, query=query),
                torch.diagonal(full),
                rtol=1e-5,
                atol=1e-5,
            )


def test_atmg_beta_ranking_pair_scores():
    w = small_world(seed=0)
    recipe = make("atmg", w, image_query_score="beta")
    batch = random_batch(w, 6)
    with torch.no_grad():
        t, i = recipe.embed_texts(batch.text), recipe.embed_images(batch.image)
        full = recipe.scores(t, i, query="image")
        torch.testing.assert_close(
            recipe.pair_scores(t, i, query="image"), torch.diagonal(full), rtol=1e-5, atol=1e-5
        )
        assert not torch.allclose(full, recipe.scores(t, i, query="text"))


@pytest.mark.parametrize("name", NAMES)
def test_embedding_keys_and_class_embedding(name, world):
    recipe = make(name, world)
    with torch.no_grad():
        prompts = recipe.embed_texts(world.prompt_features[:6].float())
        one = recipe.class_embedding(prompts)
    assert set(one) == set(prompts)
    for key, value in one.items():
        assert value.shape == (1, *prompts[key].shape[1:]) and torch.isfinite(value).all()
    expected = {"proclip": {"hyperbolic", "euclidean", "sphere"}}.get(name, {"point"})
    assert set(prompts) == expected


@pytest.mark.parametrize("name", NAMES)
def test_no_decay_names_cover_scalars_and_log_values_are_finite(name, world):
    recipe = make(name, world)
    no_decay = recipe.no_decay_parameter_names()
    names = dict(recipe.named_parameters())
    assert no_decay <= set(names)
    assert any("temperature" in n for n in no_decay) or not recipe.temperature.learnable
    assert all(names[n].ndim < 2 or "log_value" in n for n in no_decay)
    logs = recipe.log_values()
    assert "temperature" in logs and all(math.isfinite(v) for v in logs.values())


def test_recipes_declare_box_requirements(world):
    assert get_recipe("hycoclip").requires == frozenset({"boxes"})
    assert get_recipe("phyclip").requires == frozenset({"boxes"})
    recipe = make("hycoclip", world)
    with pytest.raises(ValueError, match="box"):
        recipe.loss(random_batch(world, 4, boxes=False), Progress(0, 1))


# --- distributed semantics ---------------------------------------------------------------------
class _Recording(Gather):
    def __init__(self):
        self.seen = None

    def __call__(self, emb):
        self.seen = {k: v.detach() for k, v in emb.items()}
        return emb


class _TwoRanks(Gather):
    """Rank ``rank`` of 2: the gathered batch is [rank 0's rows, rank 1's rows]."""

    world_size = 2

    def __init__(self, rank, other):
        self.rank, self.other = rank, other

    def __call__(self, emb):
        parts = [emb, self.other] if self.rank == 0 else [self.other, emb]
        return cat_embeddings(parts)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_average_to_the_full_batch_loss(name, world):
    recipe = make(name, world, **({"centroid_weight": 0.5} if name == "atmg" else {}))
    batch = random_batch(world, 8)
    halves = [
        Batch(
            **{
                k: (v[r * 4 : (r + 1) * 4] if v is not None else None)
                for k, v in batch.__dict__.items()
            }
        )
        for r in range(2)
    ]
    progress = Progress(0, 1)
    with torch.no_grad():
        full = recipe.loss(batch, progress).total
        seen = []
        for half in halves:
            rec = _Recording()
            recipe.loss(half, progress, rec)
            seen.append(rec.seen)
        ranks = [
            recipe.loss(halves[r], progress, _TwoRanks(r, seen[1 - r])).total for r in range(2)
        ]
    torch.testing.assert_close((ranks[0] + ranks[1]) / 2, full, rtol=1e-4, atol=1e-5)


# --- loss structure ------------------------------------------------------------------------------
def test_meru_loss_is_distance_infonce_plus_text_entails_image(world):
    recipe = make("meru", world)
    batch = random_batch(world, 6, boxes=False)
    with torch.no_grad():
        out = recipe.loss(batch, Progress(0, 1))
        c, tau = recipe.curvature(), recipe.temperature()
        i, t = recipe.embed_images(batch.image)["point"], recipe.embed_texts(batch.text)["point"]
        contrast = 0.5 * (
            info_nce(lorentz_distance_scores(i, t, c), tau)
            + info_nce(lorentz_distance_scores(t, i, c), tau)
        )
        torch.testing.assert_close(out.terms["contrastive"], contrast)
        torch.testing.assert_close(
            out.terms["entailment"], 0.2 * entailment_cone_loss(t, i, c, eta=1.0)
        )
        torch.testing.assert_close(out.total, sum(out.terms.values()))


def _local_points(recipe, batch):
    return {
        "image": recipe.embed_images(batch.image)["point"],
        "text": recipe.embed_texts(batch.text)["point"],
        "box_image": recipe.embed_images(batch.box_image)["point"],
        "box_text": recipe.embed_texts(batch.box_text)["point"],
    }


def test_hycoclip_four_contrastive_and_four_entailment_terms(world):
    recipe = make("hycoclip", world)
    batch = random_batch(world, 6)
    with torch.no_grad():
        out = recipe.loss(batch, Progress(0, 1))
        p, c, tau = _local_points(recipe, batch), recipe.curvature(), recipe.temperature()
    contrast = {
        "contrast_image_text": ("image", "text"),
        "contrast_text_image": ("text", "image"),
        "contrast_box_image_text": ("box_image", "text"),
        "contrast_box_text_image": ("box_text", "image"),
    }
    entail = {
        "entail_text_image": ("text", "image", 0.7),
        "entail_box_text_box_image": ("box_text", "box_image", 0.7),
        "entail_box_image_image": ("box_image", "image", 1.2),
        "entail_box_text_text": ("box_text", "text", 1.2),
    }
    assert set(out.terms) == set(contrast) | set(entail)
    for name, (rows, cols) in contrast.items():
        torch.testing.assert_close(
            out.terms[name], 0.25 * info_nce(lorentz_distance_scores(p[rows], p[cols], c), tau)
        )
    for name, (parent, child, eta) in entail.items():
        torch.testing.assert_close(
            out.terms[name], 0.2 * 0.5 * entailment_cone_loss(p[parent], p[child], c, eta=eta)
        )
    torch.testing.assert_close(out.total, sum(out.terms.values()))


def test_phyclip_terms_follow_eq4_and_eq6(world):
    recipe = make("phyclip", world)
    batch = random_batch(world, 6)
    with torch.no_grad():
        out = recipe.loss(batch, Progress(0, 1))
        p, c, tau = _local_points(recipe, batch), recipe.curvature(), recipe.temperature()
    contrast = {
        "contrast_image_text": ("image", "text"),
        "contrast_text_image": ("text", "image"),
        "contrast_box_image_box_text": ("box_image", "box_text"),
        "contrast_box_text_box_image": ("box_text", "box_image"),
    }
    entail = {
        "entail_text_image": ("text", "image", 0.7),
        "entail_box_text_box_image": ("box_text", "box_image", 0.7),
        "entail_box_image_image": ("box_image", "image", 1.2),
        "entail_box_text_text": ("box_text", "text", 1.2),
    }
    assert set(out.terms) == set(contrast) | set(entail)
    for name, (rows, cols) in contrast.items():
        torch.testing.assert_close(
            out.terms[name],
            0.25 * info_nce(product_average_distance_scores(p[rows], p[cols], c), tau),
        )
    for name, (parent, child, eta) in entail.items():
        torch.testing.assert_close(
            out.terms[name], 0.2 * entailment_cone_loss(p[parent], p[child], c, eta=eta)
        )


def test_phyclip_curvatures_stay_in_range_per_factor(world):
    recipe = make("phyclip", world)
    with torch.no_grad():
        recipe.curvature.log_value[0] = math.log(500.0)
        recipe.curvature.log_value[1] = math.log(1e-4)
    c = recipe.curvature().detach()
    assert float(c[0]) == pytest.approx(10.0) and float(c[1]) == pytest.approx(0.1)
    fit(recipe, world, steps=3, batch_size=16, lr=0.5)  # huge steps, every factor pushed around
    c = recipe.curvature().detach()
    assert torch.all(c >= 0.1 - 1e-6) and torch.all(c <= 10.0 + 1e-5)
    logs = recipe.log_values()
    assert {"curvature/min", "curvature/mean", "curvature/max"} <= set(logs)
    assert (
        0.1 - 1e-6
        <= logs["curvature/min"]
        <= logs["curvature/mean"]
        <= logs["curvature/max"]
        <= 10.0 + 1e-5
    )


def test_meru_curvature_at_its_lower_bound_is_visible(world):
    recipe = make("meru", world)
    with torch.no_grad():
        recipe.curvature.log_value.fill_(math.log(0.01))
    assert recipe.log_values()["curvature"] == pytest.approx(0.1)


def test_fixed_curvature_is_not_trained(world):
    recipe = make("meru", world, learn_curvature=False, curvature_init=2.0)
    assert not any("curvature" in n for n, _ in recipe.named_parameters())
    fit(recipe, world, steps=2, batch_size=16)
    assert recipe.log_values()["curvature"] == pytest.approx(2.0)


def test_atmg_loss_is_the_angle_loss_on_its_points(world):
    recipe = make("atmg", world, centroid_weight=0.3)
    batch = random_batch(world, 6, boxes=False)
    with torch.no_grad():
        out = recipe.loss(batch, Progress(0, 1))
        c, tau = recipe.curvature(), recipe.temperature()
        i, t = recipe.embed_images(batch.image)["point"], recipe.embed_texts(batch.text)["point"]
        torch.testing.assert_close(out.terms["angle"], angle_contrastive_loss(t, i, t, i, c, tau))
        torch.testing.assert_close(out.terms["pair_angle"], 0.2 * matched_angle_loss(t, i, c))
        torch.testing.assert_close(
            out.terms["centroid"],
            0.3 * centroid_radius_loss(t, i, c, math.cosh(0.5), math.cosh(2.0)),
        )
    assert set(out.terms) == {"angle", "pair_angle", "centroid"}
    assert "centroid" not in make("atmg", world).loss(batch, Progress(0, 1)).terms  # off by default


def test_atmg_zero_shot_averages_alpha_over_prompts(world):
    recipe = make("atmg", world)
    with torch.no_grad():
        images = recipe.embed_images(world.image_features[:5].float())
        prompts = recipe.embed_texts(world.prompt_features[:6].float())
        p2c = torch.tensor([0, 0, 1, 1, 1, 2])
        zs = recipe.zero_shot_scores(images, prompts, p2c, 3)
        alpha = -recipe.scores(prompts, images)  # [6, 5]
    assert zs.shape == (5, 3)
    torch.testing.assert_close(zs[:, 1], -alpha[2:5].mean(0))
    with pytest.raises(ValueError, match="without prompts"):
        recipe.zero_shot_scores(images, prompts, p2c, 4)


def test_configs_reject_bad_values():
    with pytest.raises(ValueError, match="curvature"):
        get_recipe("meru").Config(curvature_init=20.0)
    with pytest.raises(ValueError, match="p must exceed|image_level"):
        get_recipe("atmg").Config(centroid_text_level=3.0, centroid_image_level=2.0)
    with pytest.raises(ValueError, match="sphere_dim"):
        get_recipe("proclip").Config(sphere_dim=1)


# --- learning ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_short_fit_learns_and_ranks_heldout_pairs_with_its_own_score(name, world):
    recipe = make(name, world)
    losses = fit(recipe, world, steps=80, batch_size=64, lr=3e-3)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    n_test = len(world.split_image_ids("test"))
    chance = 1.0 / n_test
    recall = heldout_recall_at_1(recipe, world)
    assert recall >= 5 * chance, f"{name}: held-out R@1 {recall:.3f}, chance {chance:.3f}"
    accuracy = zero_shot_accuracy(recipe, world)
    assert accuracy >= 3.0 / len(world.class_names), f"{name}: zero-shot accuracy {accuracy:.3f}"


#: what a recipe adds to the base no-decay rule, as its file says (DualPath's task prefixes are
#: [tasks, d] embeddings: decay would pull them to "no prefix")
EXTRA_NO_DECAY = {"dualpath": {"head.task_prefix"}}


@pytest.mark.parametrize("name", recipe_names())
def test_no_decay_is_every_vector_and_every_learnable_scalar(name):
    """Each of the eight recipes, at its defaults: no decay on every parameter with fewer than two
    dimensions and on every LearnableScalar's log, decay on every other matrix (the set the
    former per-recipe overrides ``scalar_parameter_names | super()`` gave)."""
    torch.manual_seed(0)
    recipe = get_recipe(name)(get_recipe(name).Config(), 12, 10)
    params = dict(recipe.named_parameters())
    extra = EXTRA_NO_DECAY.get(name, set())
    assert all(params[n].ndim >= 2 for n in extra)  # otherwise the extra would change nothing
    expected = {n for n, p in params.items() if p.ndim < 2} | scalar_parameter_names(recipe)
    assert recipe.no_decay_parameter_names() == expected | extra
    assert any(p.ndim >= 2 and n not in expected for n, p in params.items())  # some get decay


def test_a_learnable_scalar_of_any_shape_gets_no_decay_by_default():
    """A recipe with a matrix of LearnableScalars (here a plug-in recipe given one) needs no
    override: decay would pull the logs towards 0, the values towards 1."""
    from plugin_recipe import EuclideanConfig, EuclideanInfoNCE

    class WithScaleGrid(EuclideanInfoNCE):
        def __init__(self, config: EuclideanConfig, image_dim: int, text_dim: int) -> None:
            super().__init__(config, image_dim, text_dim)
            self.scale_grid = LearnableScalar(1.0, min=0.1, shape=(2, 3))

    recipe = WithScaleGrid(EuclideanConfig(), 12, 10)
    assert recipe.scale_grid.log_value.ndim == 2
    assert recipe.no_decay_parameter_names() == {
        "scale_grid.log_value",
        "image_head.bias",
        "text_head.bias",
    }
