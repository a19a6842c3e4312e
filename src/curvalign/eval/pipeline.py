"""Evaluation as one typed pipeline: embed a split once, then run every stage over it.

    embed_split                       images, captions (and class prompts) of the split, once
      -> retrieval                    recall@k both ways with ``recipe.scores``
      -> zero-shot -> hierarchy       ``recipe.zero_shot_scores``; taxonomy metrics on its predictions,
                                      their depths, sibling/cousin recall of the ranked classes
      -> prompt sensitivity           each template alone beside the ensemble (several templates)
      -> multi-label                  per-class AP of the class scores (multi-label stores)
      -> entailment                   ``recipe.entailment_scores`` on taxonomy / chain pairs
      -> compositional                hard negatives vs true captions with ``recipe.pair_scores``
      -> ordering                     ``recipe.distance_to_origin`` along general -> specific chains
      -> diagnostics                  distances, spectra (``recipe.tangent_features``), factor
                                      activation per concept family, ``recipe.embedding_diagnostics``

Each stage reads the ``SplitEmbeddings`` and the store and returns its part of the metrics (or
None when the store lacks what it needs). ``run_evaluation`` returns the metrics (an
``EvaluationResult``, ``eval/result.py``; its ``to_json()`` has the keys in docs/evaluation.md)
and, if asked, the raw arrays the plots draw, from the same embeddings. Every question that
depends on the method goes to the recipe (its contract in ``recipes/base.py``); nothing here
knows a method by name. This module never imports the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curvalign.data.features import FeatureStore, present
from curvalign.errors import InputError
from curvalign.eval.compositional import hard_negative_accuracy
from curvalign.eval.diagnostics import (
    effective_rank,
    eigen_spectrum,
    factor_family_activation,
    factor_specialisation,
    summary,
)
from curvalign.eval.entailment import chain_pairs, entailment_metrics, taxonomy_pairs
from curvalign.eval.hierarchy import (
    Taxonomy,
    depth_metrics,
    hierarchical_metrics,
    relative_recall_at_k,
)
from curvalign.eval.multilabel import label_matrix, multilabel_map
from curvalign.eval.ordering import ordering_accuracy
from curvalign.eval.result import (
    EntailmentMetrics,
    EvaluationMeta,
    EvaluationResult,
    OrderingMetrics,
    PromptSensitivity,
    ZeroShotMetrics,
)
from curvalign.eval.retrieval import RetrievalItems
from curvalign.eval.zeroshot import (
    class_ranks,
    mean_per_class_recall,
    predict,
    template_positions,
    topk_accuracy,
)
from curvalign.readout import (
    PAIR_BUDGET,
    check_input_widths,
    embed_features,
    embed_store_part,
    recall_from_ranks,
    retrieval_ranks,
    score_matrix,
)
from curvalign.recipes.base import (
    Embedding,
    Query,
    Recipe,
    cat_embeddings,
    embedding_size,
    slice_embedding,
)

# --- embedding and scoring helpers (one floor down, in curvalign.readout; names kept here) ------


def embed(recipe: Recipe, features: Tensor, modality: str, batch_size: int = 1024) -> Embedding:
    """Embed ``features`` [N, D] (``modality`` "image" or "text") in batches; returns N items
    (``readout.embed_features``: each batch float32 on the recipe's device)."""
    return embed_features(recipe, features, modality, batch_size)


def embed_text_part(
    recipe: Recipe, store: FeatureStore, part: str, ids: Tensor, batch_size: int = 1024
) -> Embedding:
    """Embed rows ``ids`` of the store's text part ``part`` (a key of ``TEXT_PARTS``: "text",
    "prompt", "negative", ...) as the recipe reads texts: pooled features [n, Dt], or token
    features [n, L, Dk] with their masks when ``recipe.text_tokens`` (each batch cut to its
    longest sequence, so a memory-mapped token array is read one batch at a time)."""
    return embed_store_part(recipe, store, part, ids, batch_size)


#: one clear error when ``store``'s features do not fit ``recipe``'s input widths, naming the
#: cause (``readout.check_input_widths``)
check_inputs = check_input_widths


@torch.no_grad()
def matched_scores(
    recipe: Recipe, texts: Embedding, images: Embedding, query: Query = "image"
) -> Tensor:
    """[n] score of text i with image i, via ``recipe.pair_scores`` (the diagonal of ``scores``)."""
    try:
        return recipe.pair_scores(texts, images, query=query).float().cpu()
    except NotImplementedError:  # a recipe without pair_scores: the diagonal, one pair at a time
        n = embedding_size(texts)
        return (
            torch.stack(
                [
                    recipe.scores(
                        slice_embedding(texts, slice(i, i + 1)),
                        slice_embedding(images, slice(i, i + 1)),
                        query=query,
                    )[0, 0]
                    for i in range(n)
                ]
            )
            .float()
            .cpu()
        )


# --- the split's embeddings -------------------------------------------------------------------


@dataclass
class SplitEmbeddings:
    """One split of a store, embedded once.

    image_ids      [Ni] store rows of the split's images
    text_ids       [Nt] store rows of their captions
    text_to_image  [Nt] local image index (into ``images``) of each caption
    images, texts  the recipe's embeddings of those rows (Ni and Nt items)
    prompts        embeddings of every class prompt (store order), None without classes
    """

    split: str
    image_ids: Tensor
    text_ids: Tensor
    text_to_image: Tensor
    images: Embedding
    texts: Embedding
    prompts: Embedding | None


def split_rows(store: FeatureStore, split: str) -> tuple[Tensor, Tensor, Tensor]:
    """(image ids, text ids, text -> local image index) of ``split``."""
    image_ids = store.split_image_ids(split)
    if len(image_ids) == 0:
        raise InputError(f"split {split!r} has no images")
    local = torch.full((store.num_images,), -1, dtype=torch.long)
    local[image_ids] = torch.arange(len(image_ids))
    text_ids = torch.nonzero(local[store.text_to_image.long()] >= 0).flatten()
    if len(text_ids) == 0:
        raise InputError(f"split {split!r} has no captions")
    return image_ids, text_ids, local[store.text_to_image.long()[text_ids]]


@torch.no_grad()
def embed_split(
    recipe: Recipe, store: FeatureStore, split: str, batch_size: int = 1024
) -> SplitEmbeddings:
    """Embed the split's images and captions, and the class prompts if the store has classes."""
    check_inputs(recipe, store)
    image_ids, text_ids, t2i = split_rows(store, split)
    images = embed_store_part(recipe, store, "image", image_ids, batch_size)
    texts = embed_text_part(recipe, store, "text", text_ids, batch_size)
    prompts = (
        embed_text_part(
            recipe,
            store,
            "prompt",
            torch.arange(present(store.prompt_features, "prompt features").shape[0]),
            batch_size,
        )
        if store.has_classes and (not recipe.text_tokens or store.has_text_tokens("prompt"))
        else None
    )
    return SplitEmbeddings(split, image_ids, text_ids, t2i, images, texts, prompts)


def token_skips(recipe: Recipe, store: FeatureStore) -> list[str]:
    """Stages left out because the recipe reads text tokens and a text part the store has
    carries none (its pooled features cannot stand in)."""
    if not recipe.text_tokens:
        return []
    parts = (
        ("zeroshot", "prompt", store.has_classes),
        ("compositional", "negative", store.has_negatives),
        ("ordering (text chains)", "chain", store.has_chains),
    )
    return [
        f"{stage}: the store's {part} texts have no token features and {recipe.name} reads "
        "text tokens (extract with --tokens)"
        for stage, part, present in parts
        if present and (part == "chain" or not store.has_text_tokens(part))
    ]


# --- stages -----------------------------------------------------------------------------------


def retrieval_stage(recipe: Recipe, emb: SplitEmbeddings) -> dict[str, float]:
    """Recall@1/5/10 text->image and image->text, each direction with its own query side; the
    ranks come in tiles of at most ``PAIR_BUDGET`` pairs (no dense matrix at any split size)."""
    items = retrieval_items(recipe, emb)
    return recall_from_ranks(items.t2i_rank, items.i2t_rank, ks=(1, 5, 10))


def retrieval_items(recipe: Recipe, emb: SplitEmbeddings) -> RetrievalItems:
    """The per-item ranks behind ``retrieval_stage``'s recalls (``RetrievalItems``)."""
    t_ranks, i_ranks = retrieval_ranks(recipe, emb.texts, emb.images, emb.text_to_image)
    return RetrievalItems(t_ranks.cpu(), i_ranks.cpu(), emb.text_to_image.cpu())


def _num_classes(store: FeatureStore) -> int:
    if store.class_names:
        return len(store.class_names)
    return int(present(store.prompt_to_class, "prompt_to_class").max()) + 1


def class_scores_stage(recipe: Recipe, store: FeatureStore, emb: SplitEmbeddings) -> Tensor | None:
    """[Ni, C] ``recipe.zero_shot_scores`` of every image of the split (its class protocol and
    prompt ensemble), float32 on the CPU; None without classes. Zero-shot, the hierarchy-local
    recalls and multi-label mAP all read these; None as well when no image of the split has a
    label or a multi-label (nothing would read them)."""
    if emb.prompts is None:
        return None
    labelled = store.image_labels is not None and bool(
        (store.image_labels[emb.image_ids] >= 0).any()
    )
    if not (labelled or store.has_multilabels):
        return None
    return (
        recipe.zero_shot_scores(
            emb.images,
            emb.prompts,
            present(store.prompt_to_class, "prompt_to_class").long(),
            _num_classes(store),
        )
        .float()
        .cpu()
    )


def _zero_shot_metrics(class_scores: Tensor, labels: Tensor) -> ZeroShotMetrics:
    """Top-1/5 accuracy and mean per-class recall of ``class_scores`` [n, C] for ``labels`` [n]."""
    top = topk_accuracy(class_scores, labels, ks=(1, 5))
    return ZeroShotMetrics(top["top1"], top["top5"], mean_per_class_recall(class_scores, labels))


def zero_shot_stage(
    recipe: Recipe,
    store: FeatureStore,
    emb: SplitEmbeddings,
    tax: Taxonomy | None,
    all_scores: Tensor | None = None,
) -> tuple[ZeroShotMetrics | None, dict[str, float] | None]:
    """(zero-shot top-1/5 and mean per-class recall, hierarchical metrics of its predictions
    with their depths and the sibling/cousin recall of the ranked classes); None where not
    supported. ``all_scores``: ``class_scores_stage``'s matrix (computed here when absent)."""
    if emb.prompts is None or store.image_labels is None:
        return None, None
    labels = store.image_labels[emb.image_ids].long()
    if not bool((labels >= 0).any()):
        return None, None
    if all_scores is None:
        all_scores = class_scores_stage(recipe, store, emb)
    assert all_scores is not None
    keep = torch.nonzero(labels >= 0).flatten()
    class_scores = all_scores[keep]
    zeroshot = _zero_shot_metrics(class_scores, labels[keep])
    hierarchy = None
    if tax is not None and store.class_to_node is not None:
        class_to_node = store.class_to_node.long()
        pred, true = class_to_node[predict(class_scores)], class_to_node[labels[keep]]
        hierarchy = {
            **hierarchical_metrics(pred, true, tax),
            **depth_metrics(pred, true, tax),
            **relative_recall_at_k(class_scores, labels[keep], class_to_node, tax, ks=(5,)),
        }
    return zeroshot, hierarchy


def prompt_sensitivity_stage(
    recipe: Recipe, store: FeatureStore, emb: SplitEmbeddings, ensemble: ZeroShotMetrics | None
) -> PromptSensitivity | None:
    """Zero-shot with each template alone beside the prompt ensemble, when the store has several
    templates (``template_positions``) and labelled images: each template's metrics by name, the
    ensemble's, and the top-1 spread (best minus worst template).
    Template names come from ``store.meta["templates"]`` when it lists them, else "template j"."""
    if emb.prompts is None or store.image_labels is None or ensemble is None:
        return None
    num_classes = _num_classes(store)
    p2c = present(store.prompt_to_class, "prompt_to_class").long()
    position = template_positions(p2c, num_classes)
    if position is None:
        return None
    labels = store.image_labels[emb.image_ids].long()
    keep = torch.nonzero(labels >= 0).flatten()
    images = slice_embedding(emb.images, keep)
    count = int(position.max()) + 1
    names = store.meta.get("templates")
    if not (isinstance(names, list) and len(names) == count):
        names = [f"template {j}" for j in range(count)]
    per_template: dict[str, ZeroShotMetrics] = {}
    for j in range(count):
        rows = torch.nonzero(position == j).flatten()
        scores = (
            recipe.zero_shot_scores(
                images, slice_embedding(emb.prompts, rows), p2c[rows], num_classes
            )
            .float()
            .cpu()
        )
        per_template[str(names[j])] = _zero_shot_metrics(scores, labels[keep])
    top1 = [r.top1 for r in per_template.values()]
    return PromptSensitivity(per_template, ensemble, max(top1) - min(top1))


def multilabel_stage(
    store: FeatureStore, emb: SplitEmbeddings, all_scores: Tensor | None
) -> dict[str, float] | None:
    """Multi-label mAP of the split's annotated images, ranked per class by the recipe's class
    scores (``eval/multilabel.py``); None without multi-labels or classes."""
    if all_scores is None or not store.has_multilabels:
        return None
    assert store.multilabel_to_image is not None and store.multilabel_class is not None
    local = torch.full((store.num_images,), -1, dtype=torch.long)
    local[emb.image_ids] = torch.arange(len(emb.image_ids))
    owner = local[store.multilabel_to_image.long()]
    keep = owner >= 0
    if not bool(keep.any()):
        return None
    labels = label_matrix(
        owner[keep], store.multilabel_class.long()[keep], len(emb.image_ids), all_scores.shape[1]
    )
    return multilabel_map(all_scores, labels)


def entailment_stage(
    recipe: Recipe,
    store: FeatureStore,
    emb: SplitEmbeddings,
    tax: Taxonomy | None,
    batch_size: int,
    seed: int = 0,
) -> EntailmentMetrics | None:
    """Entailment AP/AUROC with ``recipe.entailment_scores`` on the taxonomy's (class text,
    image) pairs and the chains' (general text, specific text) pairs (``eval/entailment.py``);
    n/a with the reason when the recipe has no entailment-capable quantity."""
    has_taxonomy = (
        tax is not None
        and emb.prompts is not None
        and store.image_labels is not None
        and store.class_to_node is not None
    )
    has_chains = store.has_chains and not recipe.text_tokens  # chains hold pooled features only
    if not (has_taxonomy or has_chains):
        return None
    probe = slice_embedding(emb.images, slice(0, 1))
    if recipe.entailment_scores(probe, probe) is None:
        return EntailmentMetrics(
            measure=None,
            note=f"{recipe.name} has no entailment-capable quantity (its geometry has no "
            "origin and no cones): entailment does not apply (n/a)",
        )
    note = taxonomy_metrics = chains_metrics = None
    if has_taxonomy:
        assert tax is not None and emb.prompts is not None and store.class_to_node is not None
        labels = present(store.image_labels, "image_labels")[emb.image_ids].long()
        general, specific, positive = taxonomy_pairs(labels, store.class_to_node.long(), tax, seed)
        if len(positive):
            p2c = present(store.prompt_to_class, "prompt_to_class").long()
            try:
                classes = cat_embeddings(
                    [
                        recipe.class_embedding(
                            slice_embedding(emb.prompts, torch.nonzero(p2c == c).flatten())
                        )
                        for c in range(_num_classes(store))
                    ]
                )
            except NotImplementedError:  # a recipe that scores classes without a class point
                note = f"taxonomy pairs n/a: {recipe.name} has no class_embedding"
            else:
                scores = recipe.entailment_scores(
                    slice_embedding(classes, general),
                    slice_embedding(emb.images, specific),
                    "image",
                )
                assert scores is not None  # the probe above found an entailment quantity
                taxonomy_metrics = entailment_metrics(scores.double().cpu(), positive)
    if has_chains:
        chains = present(store.chain_features, "chain features").float()
        n, length, dim = chains.shape
        general, specific, positive = chain_pairs(n, length, seed)
        if len(positive):
            chain_emb = embed(recipe, chains.reshape(n * length, dim), "text", batch_size)
            scores = recipe.entailment_scores(
                slice_embedding(chain_emb, general), slice_embedding(chain_emb, specific), "text"
            )
            assert scores is not None  # the probe above found an entailment quantity
            chains_metrics = entailment_metrics(scores.double().cpu(), positive)
    return EntailmentMetrics(recipe.entailment_measure, note, taxonomy_metrics, chains_metrics)


def compositional_stage(
    recipe: Recipe, store: FeatureStore, emb: SplitEmbeddings, batch_size: int
) -> dict[str, float] | None:
    """Share of hard negatives scored below their true caption, overall and per kind."""
    return compositional_items(recipe, store, emb, batch_size)[0]


def compositional_items(
    recipe: Recipe, store: FeatureStore, emb: SplitEmbeddings, batch_size: int
) -> tuple[dict[str, float] | None, Tensor | None]:
    """(``compositional_stage``'s metrics, [Nn] 0/1 per hard negative of the split: won by its
    true caption); (None, None) where the stage does not apply."""
    if not store.has_negatives:
        return None, None
    text_local = torch.full((store.num_texts,), -1, dtype=torch.long)
    text_local[emb.text_ids] = torch.arange(len(emb.text_ids))
    owner = text_local[present(store.negative_to_text, "negative_to_text").long()]
    keep = torch.nonzero(owner >= 0).flatten()
    if not len(keep):
        return None, None
    if recipe.text_tokens and not store.has_text_tokens("negative"):
        return None, None  # listed in meta.skipped (token_skips)
    negatives = embed_text_part(recipe, store, "negative", keep, batch_size)
    paired_images = slice_embedding(emb.images, emb.text_to_image[owner[keep]])
    true = matched_scores(
        recipe, slice_embedding(emb.texts, owner[keep]), paired_images, query="image"
    )
    negative = matched_scores(recipe, negatives, paired_images, query="image")
    kinds = store.negative_kind[keep].long() if store.negative_kind is not None else None
    metrics = hard_negative_accuracy(true, negative, kinds, store.negative_kind_names)
    return metrics, (true > negative).float()  # the "overall" rate's items


def ordering_stage(
    recipe: Recipe, store: FeatureStore, emb: SplitEmbeddings, batch_size: int
) -> OrderingMetrics | None:
    """Hierarchy ordering along text chains and crop -> image pairs, by distance to the origin."""
    if not (store.has_chains or store.has_boxes):
        return None
    if recipe.distance_to_origin(slice_embedding(emb.images, slice(0, 1))) is None:
        return OrderingMetrics(
            text=None,
            image=None,
            note=f"{recipe.name} has no origin in its geometry (no hyperbolic part): "
            "hierarchy ordering does not apply (n/a)",
        )
    text = image = None
    if store.has_chains and not recipe.text_tokens:  # chains hold pooled features only
        chains = present(store.chain_features, "chain features")
        n, length, dim = chains.shape
        chain_emb = embed(recipe, chains.reshape(n * length, dim), "text", batch_size)
        d_chain = recipe.distance_to_origin(chain_emb)
        assert d_chain is not None  # the geometry has an origin (checked above)
        text = ordering_accuracy(d_chain.reshape(n, length))
    if store.has_boxes:
        local = torch.full((store.num_images,), -1, dtype=torch.long)
        local[emb.image_ids] = torch.arange(len(emb.image_ids))
        owner = local[present(store.box_to_image, "box_to_image").long()]
        keep = torch.nonzero(owner >= 0).flatten()
        if len(keep):
            crops = embed_store_part(recipe, store, "box_image", keep, batch_size)
            d_crop = recipe.distance_to_origin(crops)
            d_full = recipe.distance_to_origin(slice_embedding(emb.images, owner[keep]))
            assert d_crop is not None and d_full is not None  # an origin (checked above)
            image = ordering_accuracy(torch.stack([d_crop, d_full], dim=1))
    return OrderingMetrics(
        text, image, "distance to the origin of the hyperbolic part, chains general -> specific"
    )


def _node_families(tax: Taxonomy) -> list[int]:
    """Concept family of every node: the root of its tree in a forest; under a single root (the
    synthetic world's "entity", WordNet's "entity") the root's child on the node's path."""
    out = []
    for node, chain in enumerate(tax.ancestors):
        line = [node] + [a for a in chain if a < tax.num_nodes]  # node up to its real root
        out.append(line[-1] if tax.virtual_root or len(line) < 2 else line[-2])
    return out


@dataclass
class DiagnosticArrays:
    """Raw arrays behind the diagnostics plots (numpy): ``distance`` {"image": [Ni], "text":
    [Nt]} or None without an origin; ``spectrum`` {"image": [D], "text": [D]} descending
    eigenvalues; ``factor_activation`` {"image": [Ni, k], "text": [Nt, k]} or None."""

    distance: dict[str, np.ndarray] | None
    spectrum: dict[str, np.ndarray]
    factor_activation: dict[str, np.ndarray] | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "distance": self.distance,
            "spectrum": self.spectrum,
            "factor_activation": self.factor_activation,
        }


def diagnostics_stage(
    recipe: Recipe, store: FeatureStore, emb: SplitEmbeddings, tax: Taxonomy | None
) -> tuple[dict[str, Any], DiagnosticArrays]:
    """Distance-to-origin summaries, spectra, the recipe's own diagnostics and factor activation
    per concept family; with the raw arrays behind them."""
    out: dict[str, Any] = {"distance_to_origin": None, "spectrum": {}}
    d_img = recipe.distance_to_origin(emb.images)
    d_txt = recipe.distance_to_origin(emb.texts)
    if d_img is not None and d_txt is not None:
        out["distance_to_origin"] = {"image": summary(d_img), "text": summary(d_txt)}
    spectra = {}
    for modality, e in (("image", emb.images), ("text", emb.texts)):
        spectrum = eigen_spectrum(recipe.tangent_features(e))
        spectra[modality] = spectrum.numpy()
        out["spectrum"][modality] = {
            "effective_rank": effective_rank(spectrum),
            "top_eigenvalues": [float(v) for v in spectrum[:10]],
        }
    for name, samples in recipe.embedding_diagnostics(emb.images, emb.texts).items():
        out[name] = {modality: summary(values) for modality, values in samples.items()}
    if emb.prompts is not None and tax is not None and store.class_to_node is not None:
        activation = recipe.factor_activation(emb.prompts)
        if activation is not None:
            families = torch.tensor(_node_families(tax))
            class_family = families[present(store.class_to_node, "class_to_node").long()]
            roots = sorted(set(class_family.tolist()))  # families that have classes
            family_of_class = torch.tensor([roots.index(int(f)) for f in class_family])
            prompt_family = family_of_class[
                present(store.prompt_to_class, "prompt_to_class").long()
            ]
            per_family = factor_family_activation(activation, prompt_family, len(roots))
            out["factors"] = {
                "family_names": [
                    store.taxonomy_names[r] if store.taxonomy_names else str(r) for r in roots
                ],
                "activation": per_family.tolist(),
                **factor_specialisation(per_family),
            }
    a_img = recipe.factor_activation(emb.images)
    a_txt = recipe.factor_activation(emb.texts)
    arrays = DiagnosticArrays(
        distance=None
        if d_img is None or d_txt is None
        else {"image": d_img.numpy(), "text": d_txt.numpy()},
        spectrum=spectra,
        factor_activation=None
        if a_img is None or a_txt is None
        else {"image": a_img.numpy(), "text": a_txt.numpy()},
    )
    return out, arrays


# --- the pipeline -----------------------------------------------------------------------------


@dataclass
class Evaluation:
    """``metrics``: the result record (``to_json()``: docs/evaluation.md); ``arrays``: what the
    plots draw (None unless diagnostics ran); ``embeddings``: the split, embedded once;
    ``items``: the per-item retrieval ranks behind ``metrics.retrieval`` (``RetrievalItems``:
    per-query hits, for intervals that count the test items)."""

    metrics: EvaluationResult
    arrays: DiagnosticArrays | None
    embeddings: SplitEmbeddings
    items: RetrievalItems | None = None
    #: {metric path: [n] 0/1 per item} behind a rate: "zeroshot/top1" (per labelled image of
    #: the split) and "compositional/overall" (per hard negative), where the stage ran
    hits: dict[str, Tensor] = field(default_factory=dict)


@torch.no_grad()
def run_evaluation(
    recipe: Recipe,
    store: FeatureStore,
    split: str = "test",
    batch_size: int = 1024,
    diagnostics: bool = True,
) -> Evaluation:
    """Every metric ``store`` supports on ``split`` (every image when it has no splits), from one
    embedding of the split. The recipe is put in eval mode and restored afterwards."""
    was_training = recipe.training
    recipe.eval()
    try:
        emb = embed_split(recipe, store, split, batch_size)
        meta = EvaluationMeta(
            recipe=recipe.name,
            split=split,
            num_images=len(emb.image_ids),
            num_texts=len(emb.text_ids),
            skipped=tuple(token_skips(recipe, store)),
        )
        items = retrieval_items(recipe, emb)
        retrieval = recall_from_ranks(items.t2i_rank, items.i2t_rank, ks=(1, 5, 10))
        tax = (
            Taxonomy(present(store.taxonomy_parents, "taxonomy_parents"))
            if store.has_taxonomy
            else None
        )
        class_scores = class_scores_stage(recipe, store, emb)
        zeroshot, hierarchy = zero_shot_stage(recipe, store, emb, tax, class_scores)
        hits: dict[str, Tensor] = {}
        if zeroshot is not None and class_scores is not None and store.image_labels is not None:
            labels = store.image_labels[emb.image_ids].long()
            keep = labels >= 0
            hits["zeroshot/top1"] = (class_ranks(class_scores[keep], labels[keep]) < 1).float()
        compositional, won = compositional_items(recipe, store, emb, batch_size)
        if won is not None:
            hits["compositional/overall"] = won
        stages = EvaluationResult(
            meta=meta,
            retrieval=retrieval,
            zeroshot=zeroshot,
            hierarchy=hierarchy,
            prompt_sensitivity=prompt_sensitivity_stage(recipe, store, emb, zeroshot),
            multilabel=multilabel_stage(store, emb, class_scores),
            entailment=entailment_stage(recipe, store, emb, tax, batch_size),
            compositional=compositional,
            ordering=ordering_stage(recipe, store, emb, batch_size),
        )
        if not diagnostics:
            return Evaluation(stages, None, emb, items, hits)
        diagnostic_metrics, arrays = diagnostics_stage(recipe, store, emb, tax)
        metrics = replace(stages, diagnostics=diagnostic_metrics)
        return Evaluation(metrics, arrays, emb, items, hits)
    finally:
        if was_training:
            recipe.train()


__all__ = [
    "PAIR_BUDGET",
    "DiagnosticArrays",
    "RetrievalItems",
    "Evaluation",
    "EvaluationResult",
    "SplitEmbeddings",
    "embed",
    "embed_split",
    "embed_text_part",
    "check_inputs",
    "matched_scores",
    "retrieval_items",
    "run_evaluation",
    "score_matrix",
    "split_rows",
]
