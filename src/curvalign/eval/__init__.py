"""curvalign.eval: every evaluation a feature store supports, ranked with the recipe's own score.

``evaluate(recipe, store, split="test")`` embeds the split's images and captions in batches and
runs: retrieval (always), zero-shot classification (store has classes), hierarchical metrics
(classes and a taxonomy), compositional hard negatives (negatives), hierarchy ordering (text
chains, and box crops -> full images), and embedding diagnostics. Ranking goes only through
``recipe.scores`` / ``recipe.pair_scores`` / ``recipe.zero_shot_scores``: never a cosine stand-in.

This package reads recipes and stores; it never imports the trainer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from curvalign.errors import InputError
from curvalign.eval.compositional import hard_negative_accuracy
from curvalign.eval.diagnostics import (
    distance_to_origin,
    effective_rank,
    eigen_spectrum,
    factor_activation,
    factor_family_activation,
    factor_specialisation,
    has_origin,
    summary,
    tangent_features,
)
from curvalign.eval.hierarchy import Taxonomy, hierarchical_metrics
from curvalign.eval.ordering import ordering_accuracy
from curvalign.eval.retrieval import recall_at_k
from curvalign.eval.zeroshot import predict, topk_accuracy

Embedding = dict[str, Tensor]

#: pairs scored per call of ``recipe.scores`` (bounds the memory of per-pair routers such as AGR's)
PAIR_BUDGET = 1 << 20


@torch.no_grad()
def embed(recipe: Any, features: Tensor, modality: str, batch_size: int = 1024) -> Embedding:
    """Embed ``features`` [N, D] (``modality`` "image" or "text") in batches; returns N items."""
    fn = recipe.embed_images if modality == "image" else recipe.embed_texts
    parts = [fn(features[i : i + batch_size]) for i in range(0, features.shape[0], batch_size)]
    if not parts:
        raise InputError(f"no {modality} features to embed")
    return {k: torch.cat([p[k] for p in parts], dim=0) for k in parts[0]}


def _rows(emb: Embedding, index: slice | Tensor) -> Embedding:
    return {k: v[index] for k, v in emb.items()}


def _size(emb: Embedding) -> int:
    return int(next(iter(emb.values())).shape[0])


@torch.no_grad()
def score_matrix(recipe: Any, texts: Embedding, images: Embedding, query: str = "text") -> Tensor:
    """[Nt, Ni] ``recipe.scores`` computed over row chunks of texts (at most ``PAIR_BUDGET`` pairs
    per call), float32 on the CPU."""
    n_text, n_image = _size(texts), _size(images)
    rows = max(1, PAIR_BUDGET // max(1, n_image))
    out = torch.empty(n_text, n_image, dtype=torch.float32)
    for start in range(0, n_text, rows):
        out[start : start + rows] = (
            recipe.scores(_rows(texts, slice(start, start + rows)), images, query=query)
            .float()
            .cpu()
        )
    return out


@torch.no_grad()
def matched_scores(
    recipe: Any, texts: Embedding, images: Embedding, query: str = "image"
) -> Tensor:
    """[n] score of text i with image i, via ``recipe.pair_scores`` (the diagonal of ``scores``)."""
    try:
        return recipe.pair_scores(texts, images, query=query).float().cpu()
    except NotImplementedError:  # a recipe without pair_scores: the diagonal, one pair at a time
        n = _size(texts)
        return (
            torch.stack(
                [
                    recipe.scores(
                        _rows(texts, slice(i, i + 1)), _rows(images, slice(i, i + 1)), query=query
                    )[0, 0]
                    for i in range(n)
                ]
            )
            .float()
            .cpu()
        )


def _split_parts(store: Any, split: str) -> tuple[Tensor, Tensor, Tensor]:
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


def _node_families(tax: Taxonomy) -> list[int]:
    """Concept family of every node: the root of its tree in a forest; under a single root (the
    synthetic world's "entity", WordNet's "entity") the root's child on the node's path."""
    out = []
    for node, chain in enumerate(tax.ancestors):
        line = [node] + [a for a in chain if a < tax.num_nodes]  # node up to its real root
        out.append(line[-1] if tax.virtual_root or len(line) < 2 else line[-2])
    return out


@torch.no_grad()
def evaluate(
    recipe: Any, store: Any, split: str = "test", batch_size: int = 1024, diagnostics: bool = True
) -> dict[str, Any]:
    """All metrics the store supports on ``split`` (every image when the store has no splits).

    Returns a JSON-serialisable dict (keys documented in docs/evaluation.md):
    ``meta`` {recipe, split, num_images, num_texts}; ``retrieval`` {t2i@k, i2t@k};
    ``zeroshot`` {top1, top5}; ``hierarchy`` {TIE, LCA, J, PH, RH}; ``compositional``
    {overall, <kind>...}; ``ordering`` {text, image: {chain, pairs} or None, note};
    ``diagnostics`` {distance_to_origin, spectrum, factors}. Absent parts are left out.
    """
    was_training = getattr(recipe, "training", False)
    if hasattr(recipe, "eval"):
        recipe.eval()
    try:
        return _evaluate(recipe, store, split, batch_size, diagnostics)
    finally:
        if was_training:
            recipe.train()


def _evaluate(
    recipe: Any, store: Any, split: str, batch_size: int, diagnostics: bool
) -> dict[str, Any]:
    name = getattr(recipe, "name", type(recipe).__name__)
    image_ids, text_ids, t2i = _split_parts(store, split)
    images = embed(recipe, store.image_features[image_ids].float(), "image", batch_size)
    texts = embed(recipe, store.text_features[text_ids].float(), "text", batch_size)
    result: dict[str, Any] = {
        "meta": {
            "recipe": name,
            "split": split,
            "num_images": len(image_ids),
            "num_texts": len(text_ids),
        }
    }

    t_scores = score_matrix(recipe, texts, images, query="text")
    i_scores = score_matrix(recipe, texts, images, query="image")
    result["retrieval"] = recall_at_k(t_scores, t2i, ks=(1, 5, 10), i2t_scores=i_scores)
    del t_scores, i_scores

    tax = Taxonomy(store.taxonomy_parents) if store.has_taxonomy else None
    prompts = None
    if store.has_classes:
        labels = store.image_labels[image_ids].long() if store.image_labels is not None else None
        prompts = embed(recipe, store.prompt_features.float(), "text", batch_size)
        num_classes = (
            len(store.class_names) if store.class_names else int(store.prompt_to_class.max()) + 1
        )
        if labels is not None and bool((labels >= 0).any()):
            keep = torch.nonzero(labels >= 0).flatten()
            class_scores = (
                recipe.zero_shot_scores(
                    _rows(images, keep), prompts, store.prompt_to_class.long(), num_classes
                )
                .float()
                .cpu()
            )
            result["zeroshot"] = topk_accuracy(class_scores, labels[keep], ks=(1, 5))
            if tax is not None and store.class_to_node is not None:
                class_to_node = store.class_to_node.long()
                result["hierarchy"] = hierarchical_metrics(
                    class_to_node[predict(class_scores)], class_to_node[labels[keep]], tax
                )

    if store.has_negatives:
        text_local = torch.full((store.num_texts,), -1, dtype=torch.long)
        text_local[text_ids] = torch.arange(len(text_ids))
        owner = text_local[store.negative_to_text.long()]
        keep = torch.nonzero(owner >= 0).flatten()
        if len(keep):
            negatives = embed(recipe, store.negative_features[keep].float(), "text", batch_size)
            paired_images = _rows(images, t2i[owner[keep]])
            true = matched_scores(recipe, _rows(texts, owner[keep]), paired_images, query="image")
            negative = matched_scores(recipe, negatives, paired_images, query="image")
            kinds = store.negative_kind[keep].long() if store.negative_kind is not None else None
            result["compositional"] = hard_negative_accuracy(
                true, negative, kinds, store.negative_kind_names
            )

    if store.has_chains or store.has_boxes:
        result["ordering"] = _ordering(recipe, store, image_ids, images, batch_size)

    if diagnostics:
        result["diagnostics"] = _diagnostics(recipe, store, images, texts, prompts, tax)
    return result


def _ordering(
    recipe: Any, store: Any, image_ids: Tensor, images: Embedding, batch_size: int
) -> dict[str, Any]:
    name = getattr(recipe, "name", None)
    if not has_origin(name) or distance_to_origin(recipe, _rows(images, slice(0, 1))) is None:
        return {
            "text": None,
            "image": None,
            "note": f"{name} has no origin in its geometry (no hyperbolic part): hierarchy ordering "
            "does not apply (n/a)",
        }
    out: dict[str, Any] = {
        "text": None,
        "image": None,
        "note": "distance to the origin of the hyperbolic part, chains general -> specific",
    }
    if store.has_chains:
        chains = store.chain_features.float()
        n, length, dim = chains.shape
        emb = embed(recipe, chains.reshape(n * length, dim), "text", batch_size)
        out["text"] = ordering_accuracy(distance_to_origin(recipe, emb).reshape(n, length))
    if store.has_boxes:
        local = torch.full((store.num_images,), -1, dtype=torch.long)
        local[image_ids] = torch.arange(len(image_ids))
        owner = local[store.box_to_image.long()]
        keep = torch.nonzero(owner >= 0).flatten()
        if len(keep):
            crops = embed(recipe, store.box_image_features[keep].float(), "image", batch_size)
            d_crop = distance_to_origin(recipe, crops)
            d_full = distance_to_origin(recipe, _rows(images, owner[keep]))
            out["image"] = ordering_accuracy(torch.stack([d_crop, d_full], dim=1))
    return out


def _diagnostics(
    recipe: Any,
    store: Any,
    images: Embedding,
    texts: Embedding,
    prompts: Embedding | None,
    tax: Taxonomy | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"distance_to_origin": None, "spectrum": {}}
    d_img, d_txt = distance_to_origin(recipe, images), distance_to_origin(recipe, texts)
    if d_img is not None and d_txt is not None:
        out["distance_to_origin"] = {"image": summary(d_img), "text": summary(d_txt)}
    for modality, emb in (("image", images), ("text", texts)):
        spectrum = eigen_spectrum(tangent_features(recipe, emb))
        out["spectrum"][modality] = {
            "effective_rank": effective_rank(spectrum),
            "top_eigenvalues": [float(v) for v in spectrum[:10]],
        }
    if (
        "gate_logit" in images and "gate_logit" in texts
    ):  # AGR's query gate, per query (seed 000, Sec. 4.2)
        out["query_gate"] = {
            m: summary(torch.sigmoid(e["gate_logit"].double().flatten()))
            for m, e in (("image", images), ("text", texts))
        }
    if prompts is not None and tax is not None and store.class_to_node is not None:
        activation = factor_activation(recipe, prompts)
        if activation is not None:
            families = torch.tensor(_node_families(tax))
            roots = sorted(
                set(families[store.class_to_node.long()].tolist())
            )  # families that have classes
            family_of_class = torch.tensor(
                [roots.index(int(f)) for f in families[store.class_to_node.long()]]
            )
            prompt_family = family_of_class[store.prompt_to_class.long()]
            per_family = factor_family_activation(activation, prompt_family, len(roots))
            out["factors"] = {
                "family_names": [
                    store.taxonomy_names[r] if store.taxonomy_names else str(r) for r in roots
                ],
                "activation": per_family.tolist(),
                **factor_specialisation(per_family),
            }
    return out


@torch.no_grad()
def diagnostic_arrays(
    recipe: Any, store: Any, split: str = "test", batch_size: int = 1024
) -> dict[str, Any]:
    """Raw arrays behind the diagnostics plots of one recipe on ``split``:
    ``distance`` {"image": [Ni], "text": [Nt]} (None without an origin), ``spectrum``
    {"image": [D], "text": [D]} descending eigenvalues, ``factor_activation`` {"image": [Ni, k],
    "text": [Nt, k]} for PHyCLIP (else None). numpy arrays."""
    if hasattr(recipe, "eval"):
        recipe.eval()
    image_ids, text_ids, _ = _split_parts(store, split)
    images = embed(recipe, store.image_features[image_ids].float(), "image", batch_size)
    texts = embed(recipe, store.text_features[text_ids].float(), "text", batch_size)
    d_img, d_txt = distance_to_origin(recipe, images), distance_to_origin(recipe, texts)
    a_img, a_txt = factor_activation(recipe, images), factor_activation(recipe, texts)
    return {
        "distance": None if d_img is None else {"image": d_img.numpy(), "text": d_txt.numpy()},
        "spectrum": {
            m: eigen_spectrum(tangent_features(recipe, e)).numpy()
            for m, e in (("image", images), ("text", texts))
        },
        "factor_activation": None
        if a_img is None
        else {"image": a_img.numpy(), "text": a_txt.numpy()},
    }


__all__ = ["diagnostic_arrays", "embed", "evaluate", "matched_scores", "score_matrix"]
