"""curvalign.eval: every evaluation a feature store supports, ranked with the recipe's own score.

``evaluate(recipe, store, split="test")`` runs the pipeline of ``eval/pipeline.py`` (embed the
split once; retrieval, zero-shot, hierarchy, compositional, ordering, diagnostics) and returns
its metrics as an ``EvaluationResult`` (``eval/result.py``: typed fields, ``to_json()``,
``metric(path)``); ``run_evaluation`` returns them together with the arrays the plots draw.
Ranking goes only through ``recipe.scores`` / ``recipe.pair_scores`` /
``recipe.zero_shot_scores``, never a cosine stand-in; every method-specific question (distance to
the origin, tangent features, factors, extra diagnostics) goes to the recipe's contract.

This package reads recipes and stores; it never imports the trainer.
"""

from __future__ import annotations

from typing import Any

from curvalign.data.features import FeatureStore
from curvalign.eval.pipeline import (
    PAIR_BUDGET,
    DiagnosticArrays,
    Evaluation,
    SplitEmbeddings,
    embed,
    embed_split,
    embed_text_part,
    matched_scores,
    run_evaluation,
    score_matrix,
)
from curvalign.eval.result import EvaluationResult
from curvalign.recipes.base import Recipe


def evaluate(
    recipe: Recipe,
    store: FeatureStore,
    split: str = "test",
    batch_size: int = 1024,
    diagnostics: bool = True,
) -> EvaluationResult:
    """All metrics the store supports on ``split`` (every image when the store has no splits).

    Returns an ``EvaluationResult``; its ``to_json()`` (keys documented in docs/evaluation.md):
    ``meta`` {recipe, split, num_images, num_texts}; ``retrieval`` {t2i@k, i2t@k};
    ``zeroshot`` {top1, top5, mean_per_class}; ``hierarchy`` {TIE, LCA, J, PH, RH, depth_match,
    leaf_rate, pred_depth, true_depth, sibling@5, cousin@5}; ``prompt_sensitivity``;
    ``multilabel`` {mAP, classes}; ``entailment`` {measure, taxonomy, chains, note};
    ``compositional`` {overall, <kind>...}; ``ordering`` {text, image: {chain, pairs} or None, note};
    ``diagnostics`` {distance_to_origin, spectrum, factors, the recipe's own}. Absent parts are
    left out.
    """
    return run_evaluation(recipe, store, split, batch_size, diagnostics).metrics


def diagnostic_arrays(
    recipe: Recipe, store: FeatureStore, split: str = "test", batch_size: int = 1024
) -> dict[str, Any]:
    """Raw arrays behind the diagnostics plots of one recipe on ``split`` (``DiagnosticArrays``
    as a dict). Prefer ``run_evaluation(...).arrays``, which shares the embedding with the
    metrics."""
    arrays = run_evaluation(recipe, store, split, batch_size, diagnostics=True).arrays
    assert arrays is not None
    return arrays.as_dict()


__all__ = [
    "PAIR_BUDGET",
    "DiagnosticArrays",
    "Evaluation",
    "EvaluationResult",
    "SplitEmbeddings",
    "diagnostic_arrays",
    "embed",
    "embed_split",
    "embed_text_part",
    "evaluate",
    "matched_scores",
    "run_evaluation",
    "score_matrix",
]
