"""The synthetic world: structure, determinism, and that it is learnable the way docs/design.md says.

The learnability checks fit a closed-form linear map from text to image features (least
squares on the train split) and measure on the test split: a world where this fails far
above chance could not rank methods, and one where general captions sit as close to their
image as specific ones would have no hierarchy to find.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from curvalign.data import DataSpecError, FeatureStore, FeatureStoreError, load_data
from curvalign.data.features import GROUPS, TENSOR_FIELDS
from curvalign.data.synthetic import (
    NEGATIVE_KINDS,
    SyntheticConfig,
    SyntheticWorld,
    build_world,
    make_world,
)

SMALL = SyntheticConfig(images=240, text_pairs=120)


@pytest.fixture(scope="module")
def world() -> SyntheticWorld:
    return build_world()  # the default world, as the demo sees it


@pytest.fixture(scope="module")
def linear_map(world: SyntheticWorld):
    """Least-squares map from standardised train text features to their images' features."""
    s = world.store
    train_texts = s.texts_of_split("train")
    train_images = s.split_image_ids("train")
    t_mean, t_std = s.text_features[train_texts].mean(0), s.text_features[train_texts].std(0)
    i_mean, i_std = s.image_features[train_images].mean(0), s.image_features[train_images].std(0)

    def text_in(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([(t - t_mean) / t_std, torch.ones(len(t), 1)], dim=1)

    targets = (s.image_features[s.text_to_image[train_texts]] - i_mean) / i_std
    weights = torch.linalg.lstsq(text_in(s.text_features[train_texts]), targets).solution

    def to_image_space(texts: torch.Tensor) -> torch.Tensor:
        return F.normalize(text_in(texts) @ weights, dim=1)

    def images(features: torch.Tensor) -> torch.Tensor:
        return F.normalize((features - i_mean) / i_std, dim=1)

    return to_image_space, images


def test_default_world_is_valid_with_every_group(world: SyntheticWorld):
    s = world.store
    s.validate()
    # every group but token sequences: the world's features are pooled vectors
    assert s.groups == [g for g in GROUPS if not g.endswith("tokens")]
    assert (s.num_images, s.image_dim, s.text_dim) == (3000, 128, 96)
    assert s.meta["source"] == "synthetic" and s.meta["config"]["seed"] == 0


def test_structure_matches_the_config(world: SyntheticWorld):
    s, c = world.store, world.config
    captions = torch.bincount(s.text_to_image, minlength=s.num_images)
    assert int(captions.min()) == c.captions_min and int(captions.max()) == c.captions_max
    boxes = torch.bincount(s.box_to_image, minlength=s.num_images)
    assert int(boxes.min()) == 1 and int(boxes.max()) == c.max_objects  # one box per object
    assert torch.equal(boxes, torch.bincount(world.object_image, minlength=s.num_images))
    n_classes = c.families * c.branching**c.depth
    assert len(s.class_names) == n_classes and s.prompt_features.shape[0] == n_classes * c.templates
    assert torch.equal(torch.bincount(s.prompt_to_class), torch.full((n_classes,), c.templates))
    assert int((s.image_split == 1).sum()) == round(c.images * c.test_fraction)
    assert s.split_names == ["train", "test", "val"]


def test_taxonomy_is_one_tree_whose_leaves_are_the_classes(world: SyntheticWorld):
    s, c = world.store, world.config
    parents = s.taxonomy_parents
    assert int((parents == -1).sum()) == 1 and s.taxonomy_names[0] == s.meta["taxonomy_root"]
    depth = torch.zeros(len(parents), dtype=torch.long)
    for node in range(len(parents)):  # breadth-first order: a parent precedes its children
        if parents[node] >= 0:
            assert parents[node] < node
            depth[node] = depth[parents[node]] + 1
    has_child = torch.zeros(len(parents), dtype=torch.bool)
    has_child[parents[parents >= 0]] = True
    assert set(s.class_to_node.tolist()) == set(torch.nonzero(~has_child).flatten().tolist())
    assert bool((depth[s.class_to_node] == c.depth + 1).all())  # root -> family -> ... -> leaf
    assert [s.taxonomy_names[i] for i in range(1, c.families + 1)] == s.meta["families"]
    # image labels are the leaves of the main objects
    assert torch.equal(s.class_to_node[s.image_labels], world.object_leaf[world.main_objects])


def test_negatives_cover_test_captions_with_every_kind(world: SyntheticWorld):
    s = world.store
    assert s.negative_kind_names == list(NEGATIVE_KINDS)
    assert set(s.negative_to_text.tolist()) <= set(s.texts_of_split("test").tolist())
    assert torch.bincount(s.negative_kind, minlength=len(NEGATIVE_KINDS)).min() > 500
    # at most one negative of each kind per caption
    pairs = s.negative_to_text * len(NEGATIVE_KINDS) + s.negative_kind
    assert torch.unique(pairs).numel() == pairs.numel()
    distance = (s.negative_features - s.text_features[s.negative_to_text]).norm(dim=1)
    assert bool((distance > 1e-4).all())


def test_swapped_negatives_differ_only_through_binding():
    # Without the binding term, swapping attributes between objects leaves the sum unchanged.
    unbound = build_world(replace(SMALL, binding=0.0)).store
    bound = build_world(SMALL).store
    for s, same in ((unbound, True), (bound, False)):
        swapped = s.negative_kind == NEGATIVE_KINDS.index("swapped")
        assert int(swapped.sum()) > 10
        gap = (
            (s.negative_features[swapped] - s.text_features[s.negative_to_text[swapped]])
            .abs()
            .amax(dim=1)
        )
        assert bool((gap < 1e-4).all()) == same


def test_chains_end_with_a_test_caption(world: SyntheticWorld):
    s = world.store
    assert s.chain_features.shape[1:] == (3, s.text_dim) and s.chain_features.shape[0] > 0.9 * len(
        s.split_image_ids("test")
    )
    test_texts = s.text_features[s.texts_of_split("test")]
    nearest = torch.cdist(
        s.chain_features[:, 2], test_texts, compute_mode="donot_use_mm_for_euclid_dist"
    ).amin(dim=1)
    assert bool((nearest == 0).all())


def test_pair_scores_follow_the_structure(world: SyntheticWorld):
    scores = world.store.pair_scores
    assert float(scores.min()) >= 0 and float(scores.max()) <= 1
    same_image, related, random = (float(scores[k::3].mean()) for k in range(3))
    assert same_image > 0.7 > related > 0.3 > random


def test_same_seed_same_world_other_seed_other_world():
    a, b, c = make_world(SMALL), make_world(SMALL), make_world(replace(SMALL, seed=1))
    for name in TENSOR_FIELDS:
        x, y = a.field(name), b.field(name)
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
    assert a.meta == b.meta
    assert not torch.allclose(a.image_features, c.image_features)
    assert not torch.allclose(a.prompt_features, c.prompt_features)


def test_sizes_do_not_change_the_concepts():
    # Each part has its own generator: prompts depend only on the seed and the dimensions.
    small, smaller = make_world(SMALL), make_world(replace(SMALL, images=100, text_pairs=7))
    assert torch.equal(small.prompt_features, smaller.prompt_features)


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="max_objects"):
        build_world(SyntheticConfig(families=2, max_objects=3))
    with pytest.raises(ValueError, match="captions_max"):
        build_world(SyntheticConfig(captions_min=4, captions_max=3))
    with pytest.raises(ValueError, match="generality"):
        build_world(SyntheticConfig(generality=1.0))


# --- learnability ------------------------------------------------------------------------------


def test_linear_map_retrieves_far_above_chance(world: SyntheticWorld, linear_map):
    to_image_space, images = linear_map
    s = world.store
    test_images, test_texts = s.split_image_ids("test"), s.texts_of_split("test")
    position = torch.full((s.num_images,), -1)
    position[test_images] = torch.arange(len(test_images))
    scores = to_image_space(s.text_features[test_texts]) @ images(s.image_features[test_images]).T
    target = position[s.text_to_image[test_texts]]
    rank = (scores > scores[torch.arange(len(target)), target][:, None]).sum(dim=1)
    recall1, recall10 = float((rank < 1).float().mean()), float((rank < 10).float().mean())
    chance = 1 / len(test_images)
    assert recall1 > 100 * chance and recall10 > 0.6
    assert recall1 < 0.9  # and far from solved: methods have room to differ


def test_linear_map_classifies_zero_shot(world: SyntheticWorld, linear_map):
    to_image_space, images = linear_map
    s = world.store
    test_images = s.split_image_ids("test")
    prompts = to_image_space(s.prompt_features)
    classes = F.normalize(
        torch.zeros(len(s.class_names), prompts.shape[1]).index_add_(0, s.prompt_to_class, prompts),
        dim=1,
    )
    accuracy = float(
        (
            (images(s.image_features[test_images]) @ classes.T).argmax(1)
            == s.image_labels[test_images]
        )
        .float()
        .mean()
    )
    assert accuracy > 30 / len(s.class_names)


def test_specific_captions_sit_closer_to_their_image(world: SyntheticWorld, linear_map):
    to_image_space, images = linear_map
    test_images = world.store.split_image_ids("test")
    image_points = images(world.store.image_features[test_images])
    closeness = [
        float(
            (to_image_space(world.render_texts(test_images, levels_up=up)) * image_points)
            .sum(1)
            .mean()
        )
        for up in range(world.config.depth + 1)
    ]
    assert all(a > b + 0.02 for a, b in zip(closeness, closeness[1:], strict=False)), closeness


def test_true_captions_beat_their_hard_negatives(world: SyntheticWorld, linear_map):
    to_image_space, images = linear_map
    s = world.store
    image = images(s.image_features[s.text_to_image[s.negative_to_text]])
    true = (to_image_space(s.text_features[s.negative_to_text]) * image).sum(1)
    fake = (to_image_space(s.negative_features) * image).sum(1)
    for kind, name in enumerate(s.negative_kind_names):
        won = float((true > fake)[s.negative_kind == kind].float().mean())
        assert 0.6 < won < 0.99, (name, won)  # learnable, not trivial


# --- data specs -------------------------------------------------------------------------------


def test_synthetic_spec_with_overrides():
    store = load_data("synthetic:images=240, text_pairs=120,seed=0")
    assert torch.equal(store.image_features, make_world(SMALL).image_features)
    assert store.meta["spec"] == "synthetic:images=240, text_pairs=120,seed=0"


def test_features_spec_round_trip(tmp_path: Path):
    store = make_world(SMALL)
    store.save(tmp_path / "world")
    loaded = load_data(f"features:{tmp_path / 'world'}")
    for name in TENSOR_FIELDS:
        x, y = store.field(name), loaded.field(name)
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
    assert loaded.meta["config"] == store.meta["config"]


@pytest.mark.parametrize(
    "spec, error, pattern",
    [
        (
            "cifar",
            DataSpecError,
            r"unknown data spec 'cifar'; accepted forms: synthetic, synthetic:key=value,..., features:PATH",
        ),
        ("synthetic:imgs=5", DataSpecError, r"no option 'imgs'; options: images"),
        ("synthetic:images=many", DataSpecError, r"images='many': expected int"),
        ("synthetic:images", DataSpecError, r"'images' is not key=value"),
        ("synthetic:images=0", DataSpecError, r"images must be >= 1"),
        ("features:", DataSpecError, r"needs a path"),
        ("features:/no/such/store", FeatureStoreError, r"/no/such/store: no such directory"),
    ],
)
def test_bad_specs(spec: str, error: type, pattern: str):
    with pytest.raises(error, match=pattern):
        load_data(spec)


def test_spec_registry_has_an_extension_point():
    from curvalign.data import _SOURCES, register_data_source

    store = FeatureStore(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, dtype=torch.long))
    register_data_source("probe", lambda argument: store if argument == "x" else None, ("probe:x",))
    try:
        assert load_data("probe:x") is store and "probe:x" in str(
            pytest.raises(DataSpecError, load_data, "nope").value
        )
    finally:
        _SOURCES.pop("probe")
