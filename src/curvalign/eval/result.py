"""What one evaluation measured, as a frozen record: ``EvaluationResult`` and its parts.

``run_evaluation`` / ``evaluate`` return an ``EvaluationResult``; report/, the command line,
studies and tuning read its fields (``result.zeroshot.top1``, ``result.meta.num_images``,
``result.mean_r1``). ``to_json()`` gives the JSON-ready dict that ``curvalign eval --json`` prints
and results.json holds (keys in docs/evaluation.md: absent parts left out, key order fixed);
``metric("zeroshot/top1")`` reads one numeric leaf by its metric path, the path a table column or
``--tune-metric`` names. Parts whose keys depend on the data (retrieval's "t2i@k", the hierarchy's
metrics, compositional's negative kinds, the recipe's own diagnostics) stay {name: value} maps.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from curvalign.eval.health import RunHealth


@dataclass(frozen=True)
class EvaluationMeta:
    """What was evaluated: the recipe's name, the split and its sizes; ``skipped`` the stages
    left out because a text part has no token features (``pipeline.token_skips``); ``run`` where
    the weights came from (step, weights, run_dir, ...; added by the caller that loaded a run,
    written after the other keys in the order given)."""

    recipe: str
    split: str
    num_images: int
    num_texts: int
    skipped: tuple[str, ...] = ()
    run: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "recipe": self.recipe,
            "split": self.split,
            "num_images": self.num_images,
            "num_texts": self.num_texts,
        }
        if self.skipped:
            out["skipped"] = list(self.skipped)
        out.update(self.run)
        return out


@dataclass(frozen=True)
class ZeroShotMetrics:
    """Zero-shot classification in [0, 1]: top-1 and top-5 accuracy, mean per-class recall."""

    top1: float
    top5: float
    mean_per_class: float

    @classmethod
    def from_json(cls, raw: Mapping[str, float]) -> ZeroShotMetrics:
        return cls(float(raw["top1"]), float(raw["top5"]), float(raw["mean_per_class"]))

    def to_json(self) -> dict[str, float]:
        return {"top1": self.top1, "top5": self.top5, "mean_per_class": self.mean_per_class}


@dataclass(frozen=True)
class PromptSensitivity:
    """Zero-shot with each template alone (``templates``, by template name) beside the prompt
    ensemble; ``spread_top1`` the best template's top-1 minus the worst's."""

    templates: Mapping[str, ZeroShotMetrics]
    ensemble: ZeroShotMetrics
    spread_top1: float

    def to_json(self) -> dict[str, Any]:
        return {
            "templates": {name: m.to_json() for name, m in self.templates.items()},
            "ensemble": self.ensemble.to_json(),
            "spread_top1": self.spread_top1,
        }


@dataclass(frozen=True)
class EntailmentMetrics:
    """Entailment AP/AUROC (``eval/entailment.py``) with the recipe's ``measure``: on the
    taxonomy's (class, image) pairs and the chains' (general, specific) text pairs, each None
    where it does not apply; ``note`` why a part is n/a (``measure`` None: no part applies)."""

    measure: str | None
    note: str | None = None
    taxonomy: Mapping[str, float] | None = None
    chains: Mapping[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"measure": self.measure}
        for key in ("note", "taxonomy", "chains"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value if isinstance(value, str) else dict(value)
        return out


@dataclass(frozen=True)
class OrderingMetrics:
    """Hierarchy ordering by distance to the origin: ``text`` along the general -> specific
    chains, ``image`` crop -> full image, each {"chain", "pairs"} or None; ``note`` what was
    measured (or why it does not apply)."""

    text: Mapping[str, float] | None
    image: Mapping[str, float] | None
    note: str

    def to_json(self) -> dict[str, Any]:
        return {
            "text": None if self.text is None else dict(self.text),
            "image": None if self.image is None else dict(self.image),
            "note": self.note,
        }


def _leaf(node: Any, path: str) -> float | None:
    for part in path.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        return None
    return float(node)


@dataclass(frozen=True)
class EvaluationResult:
    """Every metric one evaluation measured (``pipeline.run_evaluation``); a part is None where
    the store lacks what it needs (``to_json`` leaves it out).

    retrieval            {"t2i@k", "i2t@k"} recall in [0, 1]
    zeroshot, hierarchy  zero-shot metrics; taxonomy metrics of its predictions ({TIE, LCA, J,
                         PH, RH, depth_match, leaf_rate, pred_depth, true_depth, sibling@5, ...})
    multilabel           {"mAP", "classes"}
    compositional        {"overall", <negative kind>...}: hard negatives ranked below the caption
    diagnostics          {distance_to_origin, spectrum, factors, the recipe's own}
    health               the run's training health (``eval.health.health_of_run``), when the
                         caller evaluated a saved run
    """

    meta: EvaluationMeta
    retrieval: Mapping[str, float]
    zeroshot: ZeroShotMetrics | None = None
    hierarchy: Mapping[str, float] | None = None
    prompt_sensitivity: PromptSensitivity | None = None
    multilabel: Mapping[str, float] | None = None
    entailment: EntailmentMetrics | None = None
    compositional: Mapping[str, float] | None = None
    ordering: OrderingMetrics | None = None
    diagnostics: Mapping[str, Any] | None = None
    health: RunHealth | None = None

    @property
    def mean_r1(self) -> float:
        """mean(t2i@1, i2t@1): the retrieval number studies and tuning select on."""
        return 0.5 * (self.retrieval["t2i@1"] + self.retrieval["i2t@1"])

    def with_run(self, health: RunHealth | None = None, **run: Any) -> EvaluationResult:
        """This result with ``run`` added to ``meta.run`` (where the weights came from) and,
        when given, the run's ``health``."""
        meta = replace(self.meta, run={**self.meta.run, **run})
        return replace(self, meta=meta, health=self.health if health is None else health)

    def to_json(self) -> dict[str, Any]:
        """The result as ``curvalign eval --json`` prints it and results.json holds it: parts in
        a fixed order, absent ones left out (docs/evaluation.md)."""
        out: dict[str, Any] = {"meta": self.meta.to_json(), "retrieval": dict(self.retrieval)}
        parts: tuple[tuple[str, Any], ...] = (
            ("zeroshot", self.zeroshot),
            ("hierarchy", self.hierarchy),
            ("prompt_sensitivity", self.prompt_sensitivity),
            ("multilabel", self.multilabel),
            ("entailment", self.entailment),
            ("compositional", self.compositional),
            ("ordering", self.ordering),
            ("diagnostics", self.diagnostics),
            ("health", self.health),
        )
        for key, value in parts:
            if value is None:
                continue
            out[key] = copy.deepcopy(dict(value)) if isinstance(value, Mapping) else value.to_json()
        return out

    def metric(self, path: str, default: float | None = None) -> float | None:
        """The numeric leaf at metric path ``path`` ("zeroshot/top1", "retrieval/t2i@1",
        "entailment/taxonomy/AP"); ``default`` when this result has no number there (a part it
        does not have, a name, a list)."""
        value = _leaf(self.to_json(), path)
        return default if value is None else value


__all__ = [
    "EntailmentMetrics",
    "EvaluationMeta",
    "EvaluationResult",
    "OrderingMetrics",
    "PromptSensitivity",
    "ZeroShotMetrics",
]
