"""Embedding and training diagnostics: spectra, distance distributions, PHyCLIP factor
activation per concept family (seed 002, Sec. 5 and App. D.2), AGR routing statistics from a
training log (seed 000, Definition 5.2).

What a point's distance to the origin, its tangent features or its factor activation are is the
recipe's answer (``Recipe.distance_to_origin``, ``tangent_features``, ``factor_activation`` in
``recipes/base.py``); this module only summarises the tensors it is given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


def eigen_spectrum(features: Tensor) -> Tensor:
    """[D] eigenvalues of the covariance of ``features`` [N, D], descending (seed 001, Fig. 7)."""
    x = features.double()
    x = x - x.mean(dim=0, keepdim=True)
    cov = x.T @ x / max(1, x.shape[0] - 1)
    return torch.linalg.eigvalsh(cov).flip(0).clamp_min(0.0)


def effective_rank(spectrum: Tensor) -> float:
    """exp(entropy) of the normalised spectrum: how many directions carry the variance."""
    p = spectrum / spectrum.sum().clamp_min(1e-300)
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def summary(values: Tensor) -> dict[str, float]:
    """Mean, std and quantiles of a 1-D sample (for distance distributions)."""
    v = values.double().flatten()
    q = torch.quantile(v, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
    return {
        "mean": float(v.mean()),
        "std": float(v.std()) if len(v) > 1 else 0.0,
        "p05": float(q[0]),
        "median": float(q[1]),
        "p95": float(q[2]),
    }


def factor_family_activation(activation: Tensor, family: Tensor, num_families: int) -> Tensor:
    """[F, k] mean factor activation of the items of each concept family.

    activation: [N, k] per-factor distance to the origin; family: [N] family id (-1: none).
    """
    out = torch.zeros(num_families, activation.shape[1], dtype=torch.float64)
    for f in range(num_families):
        mask = family == f
        if bool(mask.any()):
            out[f] = activation[mask].double().mean(dim=0)
    return out


def factor_specialisation(family_activation: Tensor) -> dict[str, Any]:
    """How separately the families use the factors: the top factor of each family, how many
    distinct top factors there are, and the mean contrast (activation of a family's top factor
    minus the other families' mean activation of that factor, relative to the latter)."""
    top = family_activation.argmax(dim=1)
    contrasts = []
    for f in range(family_activation.shape[0]):
        others = torch.cat([family_activation[:f, top[f]], family_activation[f + 1 :, top[f]]])
        if len(others):
            base = float(others.mean())
            contrasts.append((float(family_activation[f, top[f]]) - base) / max(abs(base), 1e-12))
    return {
        "top_factor": top.tolist(),
        "distinct_top_factors": int(len(set(top.tolist()))),
        "num_families": int(family_activation.shape[0]),
        "mean_relative_contrast": float(sum(contrasts) / len(contrasts))
        if contrasts
        else float("nan"),
    }


# --- training logs ------------------------------------------------------------------------------


def series(rows: Iterable[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one logged scalar, rows without it skipped."""
    steps, values = [], []
    for i, row in enumerate(rows):
        if key in row and isinstance(row[key], (int, float)) and row[key] is not None:
            steps.append(int(row.get("step", i)))
            values.append(float(row[key]))
    return steps, values


def value_at(rows: list[dict[str, Any]], key: str, step: int) -> float | None:
    """The logged value of ``key`` at the last logged step <= ``step`` (None if never logged)."""
    steps, values = series(rows, key)
    best = None
    for s, v in zip(steps, values, strict=False):
        if s <= step:
            best = v
    return best if best is not None else (values[0] if values else None)


def dominance(mean_weight: float | None, low: float = 0.1, high: float = 0.9) -> str:
    """Definition 5.2 of seed 000: "euclidean" if mean w > 0.9, "hyperbolic" if < 0.1, else
    "balanced" (w is the Euclidean routing weight)."""
    if mean_weight is None or math.isnan(mean_weight):
        return "unknown"
    if mean_weight > high:
        return "euclidean"
    if mean_weight < low:
        return "hyperbolic"
    return "balanced"


def routing_statistics(
    rows: list[dict[str, Any]],
    warmup_end_step: int | None,
    weight_key: str | None,
    gate_key: str | None = None,
) -> dict[str, Any]:
    """Routing statistics from a training log: mean routing weight over training, at the end of
    the warm-up (with its dominance verdict) and at the end; the same for the query gate.

    ``weight_key``/``gate_key`` name the logged scalars (AGR logs ``routing_weight`` and
    ``gate``); None skips that part.
    """
    out: dict[str, Any] = {"weight_key": weight_key, "gate_key": gate_key}
    for name, key in (("weight", weight_key), ("gate", gate_key)):
        if key is None:
            continue
        steps, values = series(rows, key)
        if not values:
            continue
        out[f"{name}_mean_over_training"] = sum(values) / len(values)
        out[f"{name}_final"] = values[-1]
        if warmup_end_step is not None:
            out[f"{name}_at_warmup_end"] = value_at(rows, key, warmup_end_step)
    if "weight_at_warmup_end" in out:
        out["dominance_at_warmup_end"] = dominance(out["weight_at_warmup_end"])
    return out
