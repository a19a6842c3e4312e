"""curvalign.eval metrics against hand-computed cases (ties, several captions per image)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvalign.eval.compositional import hard_negative_accuracy
from curvalign.eval.hierarchy import Taxonomy, hierarchical_metrics
from curvalign.eval.ordering import ordering_accuracy
from curvalign.eval.retrieval import image_to_text_ranks, recall_at_k, text_to_image_ranks
from curvalign.eval.zeroshot import predict, topk_accuracy
from curvalign.geometries import Sphere

# 4 captions, 3 images; captions 0 and 1 describe image 0
SCORES = torch.tensor(
    [
        [0.9, 0.1, 0.2],  # own image 0 first                          -> rank 0
        [0.3, 0.5, 0.3],  # own image 0 (0.3) below 0.5 and tied 0.3   -> rank 2
        [0.4, 0.4, 0.0],  # own image 1 (0.4) tied with image 0         -> rank 1
        [0.1, 0.2, 0.05],  # own image 2 last                            -> rank 2
    ]
)
T2I = torch.tensor([0, 0, 1, 2])


def test_text_to_image_ranks_count_ties_against():
    assert text_to_image_ranks(SCORES, T2I).tolist() == [0, 2, 1, 2]


def test_image_to_text_ranks_use_best_caption_and_ties_against():
    # image 0: best caption 0.9, nothing wrong above -> 0; image 1: caption 2 (0.4) below caption 1 (0.5)
    # -> 1; image 2: caption 3 (0.05) below captions 0 (0.2) and 1 (0.3) -> 2
    assert image_to_text_ranks(SCORES, T2I).tolist() == [0, 1, 2]


def test_recall_at_k_hand_computed():
    r = recall_at_k(SCORES, T2I, ks=(1, 2, 3))
    assert r == pytest.approx(
        {"t2i@1": 1 / 4, "t2i@2": 2 / 4, "t2i@3": 1.0, "i2t@1": 1 / 3, "i2t@2": 2 / 3, "i2t@3": 1.0}
    )


def test_constant_scores_give_no_lucky_hits():
    r = recall_at_k(torch.zeros(4, 3), T2I, ks=(1, 3))
    assert r["t2i@1"] == 0.0 and r["i2t@1"] == 0.0
    assert r["t2i@3"] == 1.0
    # image 0 has two tied right captions: only the two wrong ones count against it (rank 2)
    assert image_to_text_ranks(torch.zeros(4, 3), T2I).tolist() == [2, 3, 3]


def test_any_caption_in_top_k_finds_the_image():
    scores = torch.tensor(
        [[0.0, 1.0], [1.0, 0.0], [0.5, 0.9]]
    )  # captions 0,1 of image 0; 2 of image 1
    t2i = torch.tensor([0, 0, 1])
    # image 0: caption 1 is its top text although caption 0 is last
    assert image_to_text_ranks(scores, t2i).tolist() == [0, 1]


def test_i2t_scores_drive_image_to_text_only():
    other = SCORES.flip(0).contiguous()
    r = recall_at_k(SCORES, T2I, ks=(1,), i2t_scores=other)
    assert r["t2i@1"] == recall_at_k(SCORES, T2I, ks=(1,))["t2i@1"]
    assert r["i2t@1"] == recall_at_k(other, T2I, ks=(1,))["i2t@1"]


def test_images_without_captions_are_left_out_of_i2t():
    scores = torch.tensor([[1.0, 0.0, 0.5]])
    assert image_to_text_ranks(scores, torch.tensor([0])).tolist() == [0, -1, -1]
    assert recall_at_k(scores, torch.tensor([0]), ks=(1,))["i2t@1"] == 1.0


def _brute_ranks(scores, t2i):
    n_text, n_image = len(scores), len(scores[0])
    t_ranks = [
        sum(1 for j in range(n_image) if j != t2i[t] and scores[t][j] >= scores[t][t2i[t]])
        for t in range(n_text)
    ]
    i_ranks = []
    for i in range(n_image):
        right = [t for t in range(n_text) if t2i[t] == i]
        if not right:
            i_ranks.append(-1)
            continue
        best = max(scores[t][i] for t in right)
        i_ranks.append(sum(1 for u in range(n_text) if t2i[u] != i and scores[u][i] >= best))
    return t_ranks, i_ranks


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.data())
def test_ranks_match_brute_force_with_many_ties(n_text, n_image, data):
    values = data.draw(
        st.lists(
            st.lists(st.integers(0, 2), min_size=n_image, max_size=n_image),
            min_size=n_text,
            max_size=n_text,
        )
    )
    t2i = data.draw(st.lists(st.integers(0, n_image - 1), min_size=n_text, max_size=n_text))
    scores = torch.tensor(values, dtype=torch.float32)
    t_ranks, i_ranks = _brute_ranks(values, t2i)
    assert text_to_image_ranks(scores, torch.tensor(t2i)).tolist() == t_ranks
    assert image_to_text_ranks(scores, torch.tensor(t2i)).tolist() == i_ranks


def test_retrieval_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        recall_at_k(torch.tensor([[float("nan")]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="text_to_image"):
        recall_at_k(torch.zeros(2, 2), torch.tensor([0]))
    with pytest.raises(ValueError, match="outside"):
        recall_at_k(torch.zeros(1, 2), torch.tensor([5]))


def test_zero_shot_topk_hand_computed():
    scores = torch.tensor([[0.1, 0.5, 0.5], [0.9, 0.2, 0.1], [0.3, 0.3, 0.3], [1.0, 0.0, 0.0]])
    labels = torch.tensor([1, 0, 2, -1])  # the last image has no class and is left out
    assert topk_accuracy(scores, labels, ks=(1, 2, 3)) == pytest.approx(
        {"top1": 1 / 3, "top2": 2 / 3, "top3": 1.0}
    )
    assert predict(scores[:3]).tolist() == [1, 0, 0]  # ties by lowest index


# 0 root; 1 animal, 2 vehicle; 3 dog, 4 cat (under 1); 5 car (under 2); 6 puppy (under 3)
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
# (pred, true) -> TIE, LCA, J, PH, RH by hand with A(n) excluding n
HAND = {
    (4, 3): (2, 1, 1.0, 1.0, 1.0),  # siblings share every ancestor
    (5, 3): (4, 2, 1 / 3, 1 / 2, 1 / 2),  # only the root in common
    (3, 3): (0, 1, 1.0, 1.0, 1.0),  # correct: LCA is 1 under this convention
    (6, 3): (1, 2, 2 / 3, 2 / 3, 1.0),  # over-specialised: RH = 1
    (1, 6): (2, 1, 1 / 3, 1.0, 1 / 3),  # over-generalised: PH = 1
}


@pytest.mark.parametrize("pair", list(HAND))
def test_hierarchical_metrics_single_pairs(pair):
    got = hierarchical_metrics([pair[0]], [pair[1]], PARENTS)
    assert [got[k] for k in ("TIE", "LCA", "J", "PH", "RH")] == pytest.approx(HAND[pair])


def test_hierarchical_metrics_average_over_samples():
    pred, true = zip(*HAND, strict=False)
    got = hierarchical_metrics(torch.tensor(pred), torch.tensor(true), torch.tensor(PARENTS))
    for i, key in enumerate(("TIE", "LCA", "J", "PH", "RH")):
        assert got[key] == pytest.approx(sum(v[i] for v in HAND.values()) / len(HAND))


def test_forest_is_joined_under_a_virtual_root():
    tax = Taxonomy([-1, -1, 0, 1])  # two trees: 0 -> 2 and 1 -> 3
    assert tax.virtual_root and tax.path_length(2, 3) == 4
    got = hierarchical_metrics([2], [3], tax)
    assert got == pytest.approx({"TIE": 4, "LCA": 2, "J": 1 / 3, "PH": 1 / 2, "RH": 1 / 2})


def test_root_prediction_counts_empty_precision_ratio_as_one():
    got = hierarchical_metrics([0], [3], PARENTS)
    assert got == pytest.approx({"TIE": 2, "LCA": 1, "J": 0.0, "PH": 1.0, "RH": 0.0})


def test_taxonomy_rejects_cycles_and_bad_ids():
    with pytest.raises(ValueError, match="cycle"):
        Taxonomy([-1, 2, 1])
    with pytest.raises(ValueError, match="root"):
        Taxonomy([1, 0])
    with pytest.raises(ValueError, match="node ids"):
        hierarchical_metrics([9], [0], PARENTS)


def test_hard_negative_accuracy_per_kind_ties_lose():
    true = torch.tensor([1.0, 1.0, 2.0, 0.5])
    neg = torch.tensor([0.5, 1.0, 3.0, 0.1])  # second is a tie: lost
    got = hard_negative_accuracy(true, neg, torch.tensor([0, 1, 1, 0]), ["object", "attribute"])
    assert got == pytest.approx({"overall": 0.5, "object": 1.0, "attribute": 0.0})


def test_ordering_accuracy_chain_and_pairs():
    d = torch.tensor(
        [[1.0, 2.0, 3.0], [1.0, 3.0, 2.0], [2.0, 2.0, 3.0]]
    )  # equal distances count wrong
    assert ordering_accuracy(d) == pytest.approx({"chain": 1 / 3, "pairs": 4 / 6})
    with pytest.raises(ValueError, match="L >= 2"):
        ordering_accuracy(torch.zeros(3, 1))


# --- evaluate() on a stand-in Lorentz recipe and a hand-built store ------------------------------

from curvalign.data.features import FeatureStore, TextPart  # noqa: E402
from curvalign.eval import evaluate  # noqa: E402
from curvalign.eval.diagnostics import dominance, eigen_spectrum, routing_statistics  # noqa: E402
from curvalign.recipes.base import HyperbolicRecipe, Recipe  # noqa: E402


class _IdentityLorentz(HyperbolicRecipe):
    """Features are the Lorentz points themselves (c = 1); score = -distance. The geometry
    questions (distance to the origin, tangent features) are answered by HyperbolicRecipe."""

    name = "_identity_lorentz"

    def __init__(self):
        super().__init__(None, 2, 2)

    def curvature_value(self):
        return torch.tensor(1.0, dtype=torch.float64)

    def embed_images(self, f):
        return {"point": f}

    def embed_texts(self, f):
        return {"point": f}

    def scores(self, texts, images, query="text"):
        x, y = texts["point"].double(), images["point"].double()
        tx = (1 + (x * x).sum(-1, keepdim=True)).sqrt()
        ty = (1 + (y * y).sum(-1, keepdim=True)).sqrt()
        return -torch.acosh((tx * ty.T - x @ y.T).clamp_min(1.0)).float()

    def pair_scores(self, texts, images, query="text"):
        return torch.stack(
            [
                self.scores({"point": a[None]}, {"point": b[None]})[0, 0]
                for a, b in zip(texts["point"], images["point"], strict=False)
            ]
        )

    def zero_shot_scores(self, images, prompts, prompt_to_class, num_classes):
        classes = torch.stack(
            [prompts["point"][prompt_to_class == c].mean(0) for c in range(num_classes)]
        )
        return self.scores({"point": classes}, images).T


def _toy_store():
    image = torch.tensor([[2.0, 0.0], [0.0, 2.0], [-2.0, 0.0], [0.0, -2.0]])
    text = torch.tensor(
        [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.1], [0.1, 1.0]]
    )  # last caption points to image 1
    return FeatureStore(
        image_features=image,
        text=TextPart(text),
        text_to_image=torch.tensor([0, 1, 2, 3]),
        image_split=torch.tensor([1, 1, 1, 1]),
        split_names=["train", "test"],
        box_image_features=torch.tensor([[1.0, 0.0], [0.0, 3.0]]),
        box_text_features=torch.zeros(2, 2),
        box_to_image=torch.tensor([0, 1]),
        class_names=["a", "b"],
        prompt=TextPart(torch.tensor([[1.0, 0.0], [0.0, 1.0]])),
        prompt_to_class=torch.tensor([0, 1]),
        image_labels=torch.tensor([0, 1, -1, -1]),
        taxonomy_names=["root", "a", "b"],
        taxonomy_parents=torch.tensor([-1, 0, 0]),
        class_to_node=torch.tensor([1, 2]),
        negative=TextPart(torch.tensor([[0.0, 1.0], [1.0, 0.0]])),
        negative_to_text=torch.tensor([0, 1]),
        negative_kind=torch.tensor([0, 1]),
        negative_kind_names=["object", "attribute"],
        chain_features=torch.tensor(
            [[[0.1, 0.0], [0.5, 0.0], [1.0, 0.0]], [[1.0, 0.0], [0.5, 0.0], [2.0, 0.0]]]
        ),
    )


def test_evaluate_runs_every_supported_metric_with_the_recipe_score():
    res = evaluate(_IdentityLorentz(), _toy_store(), split="test")
    assert res.meta.num_images == 4 and res.meta.num_texts == 4
    # caption 3 is nearest image 1, not its own image 3: 3 of 4 captions find their image first
    assert res.retrieval["t2i@1"] == pytest.approx(3 / 4)
    assert res.zeroshot.top1 == 1.0
    assert res.zeroshot.mean_per_class == 1.0
    # a and b are the root's children: correct leaf predictions at depth 1, each other's sibling
    # (the only other class, so found among the 5 best); no cousins, so no cousin recall
    assert res.hierarchy == pytest.approx(
        {"TIE": 0, "LCA": 1, "J": 1, "PH": 1, "RH": 1}
        | {"depth_match": 1, "leaf_rate": 1, "pred_depth": 1, "true_depth": 1, "sibling@5": 1}
    )
    assert res.compositional == pytest.approx({"overall": 1.0, "object": 1.0, "attribute": 1.0})
    assert res.ordering.text == pytest.approx({"chain": 0.5, "pairs": 3 / 4})
    assert res.ordering.image == pytest.approx(
        {"chain": 0.5, "pairs": 0.5}
    )  # crop 2 is beyond its image
    assert res.diagnostics["distance_to_origin"]["image"]["mean"] == pytest.approx(
        float(torch.asinh(torch.tensor(2.0)))
    )


class _IdentityNoOrigin(_IdentityLorentz):
    """The same scores, but a recipe whose geometry has no origin (a sphere), answered by the
    Recipe defaults from ``geometries()``."""

    name = "_identity_no_origin"
    embedding_geometry = {"point": "sphere"}
    distance_to_origin = Recipe.distance_to_origin
    tangent_features = Recipe.tangent_features

    def geometries(self):  # noqa: ANN201
        return {"point": Sphere()}


def test_evaluate_reports_ordering_as_not_applicable_without_an_origin():
    res = evaluate(_IdentityNoOrigin(), _toy_store())
    assert res.ordering.text is None and "n/a" in res.ordering.note
    assert res.diagnostics["distance_to_origin"] is None


def test_hyperbolic_recipe_answers_distance_and_tangent_features_in_closed_form():
    recipe = _IdentityLorentz()
    emb = {"point": torch.tensor([[3.0, 4.0], [0.0, 0.0]])}
    d = recipe.distance_to_origin(emb)
    assert d.dtype == torch.float64
    assert d.tolist() == pytest.approx([float(torch.asinh(torch.tensor(5.0))), 0.0])
    v = recipe.tangent_features(emb)
    assert v.norm(dim=1).tolist() == pytest.approx(d.tolist())  # |log_o(x)| = d(o, x)


def test_phyclip_factor_max_compose_keeps_the_farther_factor():
    from curvalign.recipes import get_recipe

    cls = get_recipe("phyclip")
    recipe = cls(cls.Config(num_factors=2, factor_dim=2), 4, 4)
    a = torch.tensor([[[1.0, 0.0], [0.1, 0.0]]])
    b = torch.tensor([[[0.2, 0.0], [0.0, 2.0]]])
    out = recipe.factor_max_compose({"point": a}, {"point": b})["point"]
    assert out.tolist() == [[[1.0, 0.0], [0.0, 2.0]]]


def test_spectrum_of_a_line_has_one_direction():
    x = torch.tensor([[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]])
    s = eigen_spectrum(x)
    assert s[0].item() == pytest.approx(5.0) and s[1].item() == pytest.approx(0.0, abs=1e-9)


def test_routing_statistics_reads_the_weight_at_warmup_end():
    rows = [
        {"step": s, "routing_weight": w, "query_gate": 0.5}
        for s, w in [(0, 0.5), (10, 0.95), (20, 0.4)]
    ]
    stats = routing_statistics(rows, warmup_end_step=15, weight_key="routing_weight")
    assert stats["weight_at_warmup_end"] == 0.95 and stats["dominance_at_warmup_end"] == "euclidean"
    assert stats["weight_mean_over_training"] == pytest.approx((0.5 + 0.95 + 0.4) / 3)
    assert dominance(0.05) == "hyperbolic" and dominance(0.5) == "balanced"


def test_text_text_recall_excludes_the_query_and_counts_ties_against():
    from curvalign.eval.retrieval import text_text_recall

    scores = torch.tensor(
        [
            [
                9.0,
                1.0,
                2.0,
                0.0,
            ],  # self-score ignored; paraphrase 1 (1.0) below caption 2 (2.0) -> rank 1
            [1.0, 9.0, 0.5, 0.5],  # paraphrase 0 first -> rank 0
            [0.3, 0.3, 9.0, 0.3],  # paraphrase 3 tied with the two others -> rank 2
            [0.0, 0.0, 1.0, 9.0],  # paraphrase 2 first -> rank 0
        ]
    )
    groups = torch.tensor([0, 0, 1, 1])
    assert text_text_recall(scores, groups, ks=(1, 2, 3)) == pytest.approx(
        {"t2t@1": 0.5, "t2t@2": 0.75, "t2t@3": 1.0}
    )


def test_concept_families_are_the_roots_children_under_a_single_root():
    from curvalign.eval.pipeline import _node_families

    tax = Taxonomy([-1, 0, 0, 1, 2])  # entity -> {1, 2}; 3 under 1, 4 under 2
    assert _node_families(tax) == [0, 1, 2, 1, 2]
    assert _node_families(Taxonomy([-1, -1, 0, 1])) == [0, 1, 0, 1]  # a forest: each tree's root
