"""Hierarchy-local, entailment and zero-shot convention metrics, each against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from curvalign.data.features import FeatureStore, FeatureStoreError, TextPart
from curvalign.eval import evaluate
from curvalign.eval.entailment import chain_pairs, taxonomy_pairs
from curvalign.eval.hierarchy import Taxonomy, depth_metrics, relative_classes, relative_recall_at_k
from curvalign.eval.multilabel import label_matrix, multilabel_map
from curvalign.eval.ranking import average_precision, roc_auc, tie_diagnostics
from curvalign.eval.zeroshot import mean_per_class_recall, template_positions
from curvalign.geometry import lorentz
from curvalign.recipes import get_recipe
from curvalign.recipes.base import cone_margin
from test_eval_metrics import _IdentityLorentz, _toy_store

# --- ranking: AP, AUROC, ties -------------------------------------------------------------------


def test_average_precision_and_auroc_with_a_tied_block_by_hand():
    scores = torch.tensor([0.9, 0.8, 0.8, 0.1])
    positive = torch.tensor([True, False, True, False])
    # thresholds 0.9 (P=1, R=1/2) and 0.8 (the tied block enters at once: P=2/3, R=1)
    assert average_precision(scores, positive) == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)
    # pairs (pos, neg): 0.9>0.8, 0.9>0.1, 0.8=0.8 (1/2), 0.8>0.1 -> 3.5 / 4
    assert roc_auc(scores, positive) == pytest.approx(3.5 / 4)
    assert tie_diagnostics(scores) == {"distinct_scores": 3.0, "modal_fraction": 0.5}


def test_constant_scores_give_chance_not_a_lucky_ordering():
    positive = torch.tensor([True, False, False, True, False])
    scores = torch.zeros(5)
    assert average_precision(scores, positive) == pytest.approx(2 / 5)
    assert roc_auc(scores, positive) == pytest.approx(0.5)
    assert tie_diagnostics(scores) == {"distinct_scores": 1.0, "modal_fraction": 1.0}


def test_ranking_metrics_reject_degenerate_input():
    with pytest.raises(ValueError, match="no positive"):
        average_precision(torch.zeros(3), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="positives and negatives"):
        roc_auc(torch.zeros(3), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="NaN"):
        roc_auc(torch.tensor([0.0, math.nan]), torch.tensor([True, False]))


# --- hierarchy: depth, siblings, cousins ----------------------------------------------------------

# 0 root; 1 animal, 2 vehicle; 3 dog, 4 cat (under 1); 5 car (under 2); 6 puppy (under 3)
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def test_depth_metrics_show_a_model_that_predicts_general_nodes():
    # truths at depth 2 (dog, cat, car); predictions: animal (an ancestor), cat (right), root
    out = depth_metrics([1, 4, 0], [3, 4, 5], PARENTS)
    assert out == pytest.approx(
        {"depth_match": 1 / 3, "leaf_rate": 1 / 3, "pred_depth": 1.0, "true_depth": 2.0}
    )


def test_depth_in_a_forest_does_not_count_the_virtual_root():
    out = depth_metrics([0, 2], [1, 2], [-1, 0, -1])
    assert out == pytest.approx(
        {"depth_match": 0.5, "leaf_rate": 0.5, "pred_depth": 0.0, "true_depth": 0.5}
    )


def test_siblings_and_cousins_of_classes():
    tax = Taxonomy(PARENTS)
    # classes: dog, cat, car, puppy, animal
    class_to_node = [3, 4, 5, 6, 1]
    assert relative_classes(class_to_node, tax, "sibling") == [[1], [0], [], [], []]
    # cousins share the grandparent, not the parent: dog/cat (under animal) vs car (under vehicle)
    assert relative_classes(class_to_node, tax, "cousin") == [[2], [2], [0, 1], [], []]


def test_sibling_and_cousin_recall_by_hand_with_ties_against_the_model():
    tax = Taxonomy(PARENTS)
    class_to_node = torch.tensor([3, 4, 5, 6, 1])  # dog, cat, car, puppy, animal
    scores = torch.tensor(
        [
            [9.0, 1.0, 5.0, 4.0, 3.0],  # a dog: cat (its sibling) ranks 4th of the others
            [2.0, 9.0, 2.0, 0.0, 0.0],  # a cat: dog ties car for 1st; ties go against: car first
            [0.0, 5.0, 9.0, 6.0, 0.0],  # a car: cousins dog, cat; cat 2nd, dog tied last
        ]
    )
    labels = torch.tensor([0, 1, 2])
    out = relative_recall_at_k(scores, labels, class_to_node, tax, ks=(1, 2, 4))
    # siblings (images of dog and cat only; car has none): dog finds cat only at k=4,
    # cat finds dog at k=2 (car wins the tie for 1st)
    assert out["sibling@1"] == pytest.approx(0.0)
    assert out["sibling@2"] == pytest.approx(0.5)
    assert out["sibling@4"] == pytest.approx(1.0)
    # cousins: dog -> car is 1st (recall 1 at every k); cat -> car is 2nd (0 at k=1, 1 at k=2);
    # car -> {dog, cat} (min(k, 2) slots): puppy 1st, cat 2nd, dog tied with animal, last ->
    # k=1: 0/1, k=2: 1/2, k=4: 2/2
    assert out["cousin@1"] == pytest.approx((1 + 0 + 0) / 3)
    assert out["cousin@2"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert out["cousin@4"] == pytest.approx(1.0)


# --- zero-shot conventions -------------------------------------------------------------------------


def test_mean_per_class_recall_by_hand():
    # class 0: 3 images, 2 right; class 1: 1 image, right; class 2: no images (not averaged)
    scores = torch.tensor(
        [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [5.0, 5.0, 0.0]]
    )
    labels = torch.tensor([0, 0, 0, 1, -1])
    assert mean_per_class_recall(scores, labels) == pytest.approx((2 / 3 + 1) / 2)
    # a tie with the true class counts against, as top-1 does
    assert mean_per_class_recall(torch.tensor([[1.0, 1.0]]), torch.tensor([0])) == 0.0


def test_template_positions_need_the_same_count_per_class():
    assert template_positions(torch.tensor([0, 0, 1, 1, 2, 2]), 3).tolist() == [0, 1] * 3
    assert template_positions(torch.tensor([1, 0, 1, 0]), 2).tolist() == [0, 0, 1, 1]
    assert template_positions(torch.tensor([0, 1, 2]), 3) is None  # one template
    assert template_positions(torch.tensor([0, 0, 1]), 2) is None  # uneven


def test_multilabel_map_by_hand():
    # three images, two classes: image 0 holds both, image 1 class 0, image 2 class 1
    labels = label_matrix(torch.tensor([0, 0, 1, 2]), torch.tensor([0, 1, 0, 1]), 4, 2)
    assert labels[3].tolist() == [False, False]  # image 3 has no annotation and is left out
    scores = torch.tensor([[0.9, 0.2], [0.8, 0.3], [0.1, 0.5], [10.0, 10.0]])
    # class 0: ranks image 0, 1 (positives), 2 -> AP 1; class 1: image 2 (pos), 1 (neg), 0 (pos)
    # -> AP = (1/1 + 2/3) / 2
    out = multilabel_map(scores, labels)
    assert out == pytest.approx({"mAP": (1 + (1 + 2 / 3) / 2) / 2, "classes": 2.0})


# --- entailment pairs ----------------------------------------------------------------------------


def test_taxonomy_pairs_take_ancestor_classes_and_same_depth_negatives():
    tax = Taxonomy(PARENTS)
    class_to_node = torch.tensor([3, 4, 5, 1, 2])  # dog, cat, car, animal, vehicle
    general, specific, positive = taxonomy_pairs(torch.tensor([0, -1]), class_to_node, tax)
    pairs = sorted(zip(general.tolist(), specific.tolist(), positive.tolist(), strict=True))
    # a dog image is entailed by "dog" and "animal"; negatives at the same depth: cat or car for
    # dog, vehicle for animal; the unlabelled image gives no pair
    positives = [(g, s) for g, s, p in pairs if p]
    negatives = [(g, s) for g, s, p in pairs if not p]
    assert positives == [(0, 0), (3, 0)]
    assert len(negatives) == 2 and (4, 0) in negatives
    assert {g for g, _ in negatives} - {4} <= {1, 2}


def test_chain_pairs_pair_every_level_with_the_same_level_of_another_chain():
    general, specific, positive = chain_pairs(3, 3, seed=1)
    assert int(positive.sum()) == 3 * 3 and int((~positive).sum()) == 3 * 3
    for g, s, p in zip(general.tolist(), specific.tolist(), positive.tolist(), strict=True):
        assert g % 3 < s % 3  # general level before specific level
        assert (g // 3 == s // 3) == p  # positives within a chain, negatives across


# --- the recipes' entailment quantities, through the contract -------------------------------------


def _recipe(name, **config):
    cls = get_recipe(name)
    return cls(cls.Config(**config), 2, 2).eval()


def test_meru_entailment_is_the_cone_margin_by_hand():
    recipe = _recipe("meru", embed_dim=2)
    g = torch.tensor([[1.0, 0.0]])
    inside, outside = torch.tensor([[2.0, 0.0]]), torch.tensor([[-2.0, 0.0]])
    c = 1.0
    aperture = math.asin(min(1.0, 2 * 0.1 / 1.0))  # K = 0.1, |g| = 1
    got = recipe.entailment_scores(
        {"point": g.repeat(2, 1)}, {"point": torch.cat([inside, outside])}
    )
    # on the ray beyond g the exterior angle is 0; straight back through the origin it is pi
    assert got.tolist() == pytest.approx([aperture - 0.0, aperture - math.pi], abs=1e-6)
    assert float(recipe.curvature_value()) == c


def test_atmg_entailment_is_minus_the_exterior_angle():
    recipe = _recipe("atmg", embed_dim=2)
    g, s = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    expected = -lorentz.exterior_angle(g.double(), s.double(), 1.0)
    assert recipe.entailment_scores({"point": g}, {"point": s}).tolist() == pytest.approx(
        expected.tolist()
    )


def test_proclip_entailment_is_the_distance_to_origin_order_and_clip_has_none():
    recipe = _recipe("proclip")
    g = {"hyperbolic": torch.tensor([[0.5, 0.0]]), "euclidean": torch.zeros(1, 2)}
    s = {"hyperbolic": torch.tensor([[0.0, 2.0]]), "euclidean": torch.zeros(1, 2)}
    c = float(recipe.curvature_value())
    expected = (math.asinh(math.sqrt(c) * 2.0) - math.asinh(math.sqrt(c) * 0.5)) / math.sqrt(c)
    assert recipe.entailment_scores(g, s).tolist() == pytest.approx([expected])
    clip = _recipe("clip")
    assert clip.entailment_scores({"point": torch.ones(1, 2)}, {"point": torch.ones(1, 2)}) is None


# --- prompt ensembling in each recipe's own geometry ---------------------------------------------


def test_lorentz_class_embedding_is_expmap0_of_the_tangent_mean_by_hand():
    recipe = _recipe("meru", embed_dim=2)  # c = 1 at initialisation
    # two prompts at distance 1 from the origin along the two axes: tangent vectors (1, 0), (0, 1)
    s1 = math.sinh(1.0)
    prompts = {"point": torch.tensor([[s1, 0.0], [0.0, s1]], dtype=torch.float64)}
    # mean tangent (1/2, 1/2), norm r = 1/sqrt(2); expmap0 = sinh(r) / r * v
    r = 1 / math.sqrt(2)
    expected = math.sinh(r) / r * 0.5
    got = recipe.class_embedding(prompts)["point"]
    assert got.flatten().tolist() == pytest.approx([expected, expected], abs=1e-9)
    # not the Euclidean mean of the points (s1/2 each): the geometry matters
    assert abs(expected - s1 / 2) > 1e-2


def test_phyclip_and_proclip_ensemble_each_hyperbolic_part_by_hand():
    s1 = math.sinh(1.0)
    r = 1 / math.sqrt(2)
    mean = math.sinh(r) / r * 0.5
    phyclip = _recipe("phyclip", num_factors=2, factor_dim=2)  # per-factor c = 1 at init
    points = torch.tensor(
        [[[s1, 0.0], [s1, 0.0]], [[0.0, s1], [s1, 0.0]]], dtype=torch.float64
    )  # [P=2, k=2, d=2]: factor 0 as above, factor 1 the same point twice
    got = phyclip.class_embedding({"point": points})["point"]
    assert got.flatten().tolist() == pytest.approx([mean, mean, s1, 0.0], abs=1e-9)
    proclip = _recipe("proclip")
    c = float(proclip.curvature_value())
    parts = {
        "hyperbolic": torch.tensor([[s1, 0.0], [0.0, s1]], dtype=torch.float64) / math.sqrt(c),
        "euclidean": torch.tensor([[1.0, 3.0], [3.0, 1.0]], dtype=torch.float64),
    }
    out = proclip.class_embedding(parts)
    # at curvature c the tangent vectors are (1, 0)/sqrt(c), (0, 1)/sqrt(c): same hand formula
    assert out["hyperbolic"].flatten().tolist() == pytest.approx(
        [mean / math.sqrt(c), mean / math.sqrt(c)], abs=1e-9
    )
    assert out["euclidean"].flatten().tolist() == pytest.approx([2.0, 2.0])


# --- the pipeline on a tiny hand-made store --------------------------------------------------------


def _multilabel_store():
    """Four images in one split, two classes with two templates each, and multi-labels."""
    return FeatureStore(
        image_features=torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7], [-1.0, 0.0]]),
        text=TextPart(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7], [-1.0, 0.0]])),
        text_to_image=torch.tensor([0, 1, 2, 3]),
        class_names=["a", "b"],
        # template 0 points at each class, template 1 is swapped (a bad template)
        prompt=TextPart(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])),
        prompt_to_class=torch.tensor([0, 0, 1, 1]),
        image_labels=torch.tensor([0, 1, -1, -1]),
        multilabel_to_image=torch.tensor([0, 1, 2, 2]),
        multilabel_class=torch.tensor([0, 1, 0, 1]),
        meta={"templates": ["a photo of a {}", "a swapped {}"]},
    )


def test_evaluate_reports_prompt_sensitivity_and_multilabel_map():
    # built by hand (no warm start): the input-preserving start keeps the features' ranking
    recipe = _recipe("clip", embed_dim=2, head_init="input")
    store = _multilabel_store()
    res = evaluate(recipe, store, split="test", diagnostics=False)
    templates = res.prompt_sensitivity.templates
    assert templates["a photo of a {}"].top1 == 1.0
    assert templates["a swapped {}"].top1 == 0.0  # the swapped template inverts the classes
    assert res.prompt_sensitivity.spread_top1 == 1.0
    assert res.prompt_sensitivity.ensemble == res.zeroshot
    assert res.multilabel["classes"] == 2.0
    assert "mean_per_class" in res.to_json()["zeroshot"]
    # the cosine recipe has no entailment quantity, and there is no taxonomy or chain anyway
    assert res.entailment is None and "entailment" not in res.to_json()


def test_evaluate_multilabel_map_matches_the_hand_ranking_with_the_recipe_score():
    recipe = _recipe("clip", embed_dim=2)
    store = _multilabel_store()
    store.prompt = TextPart(torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]))
    res = evaluate(recipe, store, split="test", diagnostics=False)
    emb_i = recipe.embed_images(store.image_features)["point"]
    classes = recipe.embed_texts(torch.eye(2))["point"]
    scores = emb_i @ classes.T  # the class points: each class's two identical prompts
    labels = label_matrix(store.multilabel_to_image, store.multilabel_class, 4, 2)
    assert res.multilabel["mAP"] == pytest.approx(multilabel_map(scores, labels)["mAP"])


def test_multilabel_group_needs_classes_and_valid_indices():
    store = _multilabel_store()
    store.multilabel_class = torch.tensor([0, 1, 0, 5])
    with pytest.raises(FeatureStoreError, match="multilabel_class"):
        store.validate()
    bare = FeatureStore(
        image_features=torch.zeros(1, 2),
        text=TextPart(torch.zeros(1, 2)),
        text_to_image=torch.tensor([0]),
        multilabel_to_image=torch.tensor([0]),
        multilabel_class=torch.tensor([0]),
    )
    with pytest.raises(FeatureStoreError, match="needs the classes group"):
        bare.validate()


def test_subset_keeps_the_multilabels_of_kept_images():
    sub = _multilabel_store().subset([2, 0])
    assert sub.multilabel_to_image.tolist() == [1, 0, 0]
    assert sub.multilabel_class.tolist() == [0, 0, 1]


def test_chance_relative_recall_is_the_mean_over_every_class_ordering():
    import itertools

    from curvalign.eval.chance import relative_recall_chance

    tax = Taxonomy(PARENTS)
    class_to_node = torch.tensor([3, 4, 5])  # dog, cat, car
    labels = torch.tensor([0, 2])  # a dog, a car
    # by hand at k=1: the dog finds its sibling cat with probability 1/2 and its cousin car with
    # 1/2; the car's two cousins fill its one slot surely
    chance = relative_recall_chance(labels, class_to_node, tax, 3, k=1)
    assert chance == pytest.approx({"sibling@1": 0.5, "cousin@1": (0.5 + 1.0) / 2})
    orders = list(itertools.permutations([0.0, 1.0, 2.0]))
    mean = {"sibling@1": 0.0, "cousin@1": 0.0}
    for a, b in itertools.product(orders, orders):
        got = relative_recall_at_k(torch.tensor([a, b]), labels, class_to_node, tax, ks=(1,))
        for key in mean:
            mean[key] += got[key] / len(orders) ** 2
    assert mean == pytest.approx(chance)


class _ClassPointLorentz(_IdentityLorentz):
    """The identity Lorentz stand-in with a class point (the mean of the prompt points)."""

    def class_embedding(self, prompts):
        return {"point": prompts["point"].mean(0, keepdim=True)}


class _ConeLorentz(_ClassPointLorentz):
    """The same points, entailment read by MERU's cone margin at c = 1 (eta 1, K 0.1)."""

    def entailment_scores(self, general, specific, specific_modality="image"):
        one = torch.tensor(1.0, dtype=torch.float64)
        return cone_margin(general["point"], specific["point"], one, 1.0, 0.1)


def test_taxonomy_entailment_through_evaluate_depth_matched_negatives_tie_a_radius_order():
    # classes a, b are the root's children with prompts (1, 0), (0, 1); images 0 (a) at (2, 0),
    # 1 (b) at (0, 2). Pairs: (a, img0)+, (b, img0)-, (b, img1)+, (a, img1)-. Every class lies
    # at radius 1 and every image at radius 2, so dist0(image) - dist0(class) is one value for
    # all four pairs: AP = 1/2 (the share of positives), AUROC = 1/2, one distinct score
    res = evaluate(_ClassPointLorentz(), _toy_store(), diagnostics=False).entailment
    assert res.taxonomy == pytest.approx(
        {
            "AP": 0.5,
            "AUROC": 0.5,
            "positives": 2,
            "negatives": 2,
            "distinct_scores": 1,
            "modal_fraction": 1.0,
        }
    )
    # the cone sees the relation: each image lies on its own class's ray (exterior angle 0) and
    # at a right angle to the other class's, so the positives come first
    cone = evaluate(_ConeLorentz(), _toy_store(), diagnostics=False).entailment.taxonomy
    assert cone["AP"] == 1.0 and cone["AUROC"] == 1.0 and cone["distinct_scores"] == 2


def test_relative_recall_is_the_same_in_row_chunks(monkeypatch):
    from curvalign.eval import hierarchy

    gen = torch.Generator().manual_seed(0)
    tax = Taxonomy(PARENTS)
    class_to_node = torch.tensor([3, 4, 5, 6, 1])
    scores = torch.randint(0, 3, (50, 5), generator=gen).float()  # many ties
    labels = torch.randint(0, 5, (50,), generator=gen)
    whole = relative_recall_at_k(scores, labels, class_to_node, tax, ks=(1, 2))
    monkeypatch.setattr(hierarchy, "ROW_CHUNK", 7)
    assert relative_recall_at_k(scores, labels, class_to_node, tax, ks=(1, 2)) == pytest.approx(
        whole
    )


def test_synthetic_world_is_multi_label_and_evaluate_ranks_it_with_the_recipe_score():
    from curvalign.data import load_data

    store = load_data("synthetic:images=60,text_pairs=10,captions_max=3")
    labels = label_matrix(
        store.multilabel_to_image, store.multilabel_class, store.num_images, len(store.class_names)
    )
    assert bool(labels[torch.arange(store.num_images), store.image_labels].all())  # main object
    assert int(labels.sum(1).max()) > 1  # some image holds several classes
    torch.manual_seed(0)
    meru = get_recipe("meru")
    recipe = meru(meru.Config(), store.image_dim, store.text_dim).eval()
    res = evaluate(recipe, store, split="test", diagnostics=False)
    test = store.split_image_ids("test")
    with torch.no_grad():
        scores = recipe.zero_shot_scores(
            recipe.embed_images(store.image_features[test]),
            recipe.embed_texts(store.prompt_features),
            store.prompt_to_class,
            len(store.class_names),
        )
    assert res.multilabel == pytest.approx(multilabel_map(scores, labels[test]))


def test_depths_print_in_edges_and_get_no_best_verdict():
    from curvalign.report.tables import column_verdicts, metric_kind

    assert metric_kind("hierarchy/pred_depth") == "num"
    assert metric_kind("hierarchy/leaf_rate") == "pct"
    assert metric_kind("hierarchy/sibling@5") == "pct"
    stat = {"mean": 1.0, "low": 0.9, "high": 1.1, "n": 3, "values": [0.9, 1.0, 1.1]}
    far = {"mean": 5.0, "low": 4.9, "high": 5.1, "n": 3, "values": [4.9, 5.0, 5.1]}
    stats = {
        "a": {p: stat for p in ("hierarchy/pred_depth", "hierarchy/leaf_rate", "hierarchy/J")},
        "b": {p: far for p in ("hierarchy/pred_depth", "hierarchy/leaf_rate", "hierarchy/J")},
    }
    cols = [
        ("PredDepth", "hierarchy/pred_depth", "num"),
        ("Leaf", "hierarchy/leaf_rate", "pct"),
        ("J", "hierarchy/J", "pct"),
    ]
    verdicts = column_verdicts(stats, ["a", "b"], cols)
    assert set(verdicts) == {"hierarchy/J"} and verdicts["hierarchy/J"]["best"] == "b"


def test_hycoclip_and_phyclip_cone_margins_use_their_loss_etas():
    g, s = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    aperture = math.asin(0.2)  # K = 0.1, |g| = 1, c = 1
    angle = float(lorentz.exterior_angle(g.double(), s.double(), 1.0)[0])
    hyco = _recipe("hycoclip", embed_dim=2)
    image = float(hyco.entailment_scores({"point": g}, {"point": s}, "image")[0])
    text = float(hyco.entailment_scores({"point": g}, {"point": s}, "text")[0])
    assert image == pytest.approx(0.7 * aperture - angle)  # eta_inter, T -> I
    assert text == pytest.approx(1.2 * aperture - angle)  # eta_intra, T_box -> T
    phy = _recipe("phyclip", num_factors=2, factor_dim=2)
    # factor 0 as above, factor 1: the specific point on the general point's ray (angle 0)
    gk = torch.stack([g, g], dim=1)  # [1, 2, 2]
    sk = torch.stack([s, 2 * g], dim=1)
    got = float(phy.entailment_scores({"point": gk}, {"point": sk}, "image")[0])
    assert got == pytest.approx(((0.7 * aperture - angle) + (0.7 * aperture - 0.0)) / 2, abs=1e-6)
