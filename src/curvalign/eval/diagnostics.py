"""Embedding and training diagnostics: distance to the origin, spectra, PHyCLIP factor activation
and factor-wise max composition (seed 002, Sec. 5 and App. D.2), AGR routing statistics
(seed 000, Definition 5.2), curvature and DualPath gate trajectories from ``log.jsonl``.

Distance to the origin per recipe (the hook the hierarchy-ordering evaluation uses):

========  ===========================  ==================================================
recipe    embedding key(s)             distance to the origin
========  ===========================  ==================================================
meru      ``point`` [N, d] Lorentz      ``dist0(point, c)``
hycoclip  ``point`` [N, d] Lorentz      ``dist0(point, c)``
atmg      ``point`` [N, d] Lorentz      ``dist0(point, c)``
phyclip   ``point`` [N, k, d]           mean over the k factors of ``dist0(point_i, c_i)``
                                        (the same 1/k average as the training distance)
proclip   ``hyperbolic`` [N, d]         ``dist0`` of the hyperbolic factor only
agr       ``lorentz`` [N, d]            ``dist0`` of the Lorentz expert
clip      unit vectors                  none: the sphere has no origin (n/a, not a number)
dualpath  cosine embedding              none (n/a)
========  ===========================  ==================================================

``dist0(x, c) = acosh(sqrt(c) time(x)) / sqrt(c)``, computed here as the equal and better
conditioned ``asinh(sqrt(c) |x|) / sqrt(c)`` in float64.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from curvalign.errors import InputError

Embedding = dict[str, Tensor]

#: recipe name -> (embedding key of the hyperbolic part, curvature source); None = no origin notion
LORENTZ_PART: dict[str, str | None] = {
    "meru": "point",
    "hycoclip": "point",
    "atmg": "point",
    "phyclip": "point",
    "proclip": "hyperbolic",
    "agr": "lorentz",
    "clip": None,
    "dualpath": None,
}


def dist0(x: Tensor, c: Tensor | float) -> Tensor:
    """[...] distance to the origin of Lorentz points given by space components ``x`` [..., d];
    ``c`` broadcasts against ``x.shape[:-1]``."""
    x64 = x.detach().double()
    sqrt_c = torch.as_tensor(c, dtype=torch.float64).sqrt()
    return torch.asinh(sqrt_c * x64.norm(dim=-1)) / sqrt_c


def logmap0(x: Tensor, c: Tensor | float) -> Tensor:
    """[..., d] tangent vector at the origin of Lorentz points ``x`` [..., d] (inverse exp map)."""
    x64 = x.detach().double()
    sqrt_c = torch.as_tensor(c, dtype=torch.float64).sqrt()[..., None]
    norm = x64.norm(dim=-1, keepdim=True)
    scaled = sqrt_c * norm
    # asinh(u)/u -> 1 as u -> 0; evaluate the ratio safely there
    ratio = torch.where(
        scaled > 1e-6, torch.asinh(scaled) / scaled.clamp_min(1e-300), 1.0 - scaled**2 / 6
    )
    return ratio * x64


def curvature(recipe: Any) -> Tensor:
    """The positive curvature ``c`` (manifold curvature ``-c``) of a recipe's hyperbolic part, as a
    tensor (scalar, or ``[k]`` for PHyCLIP). Looks for a ``curvature`` attribute/method first, then
    for ``curvature*`` entries of ``log_values()``."""
    value = getattr(recipe, "curvature", None)
    if callable(value) and not isinstance(value, Tensor):
        value = value()
    if value is not None:
        return torch.as_tensor(
            value.detach() if isinstance(value, Tensor) else value, dtype=torch.float64
        )
    logs = recipe.log_values() if hasattr(recipe, "log_values") else {}
    keys = [
        k for k in logs if k.split("/")[-1].startswith("curvature") or k.startswith("curvature")
    ]
    if len(keys) == 1:
        return torch.tensor(float(logs[keys[0]]), dtype=torch.float64)
    if keys:  # per-factor entries such as curvature/0 ... curvature/k-1
        numbered = sorted(
            (k for k in keys if k.rsplit("/", 1)[-1].isdigit()),
            key=lambda k: int(k.rsplit("/", 1)[-1]),
        )
        if numbered:
            return torch.tensor([float(logs[k]) for k in numbered], dtype=torch.float64)
    raise InputError(
        f"cannot find the curvature of recipe {getattr(recipe, 'name', recipe)!r}: it has no "
        "`curvature` attribute and no `curvature` entry in log_values()"
    )


def has_origin(recipe_name: str) -> bool:
    """Whether the recipe's geometry has an origin (a hyperbolic part) to measure distances from."""
    return LORENTZ_PART.get(recipe_name) is not None


def distance_to_origin(recipe: Any, emb: Embedding) -> Tensor | None:
    """[N] distance of each item to the origin in the recipe's hyperbolic part (see the module
    table), or None when the geometry has no origin (CLIP, DualPath, unknown recipes)."""
    name = getattr(recipe, "name", None)
    key = LORENTZ_PART.get(name) if name is not None else None
    if key is None or key not in emb:
        return None
    points = emb[key]
    c = curvature(recipe)
    d = dist0(points, c)
    return d.mean(dim=-1) if points.ndim == 3 else d  # PHyCLIP: mean over factors


def factor_activation(recipe: Any, emb: Embedding) -> Tensor | None:
    """[N, k] per-factor distance to the origin of PHyCLIP points (seed 002, Fig. 4a "factor-wise
    norms"), or None for recipes without factors."""
    points = emb.get("point")
    if getattr(recipe, "name", None) != "phyclip" or points is None or points.ndim != 3:
        return None
    return dist0(points, curvature(recipe))


def tangent_features(recipe: Any, emb: Embedding) -> Tensor:
    """[N, D] flat vectors whose spectrum describes the embedding: tangent vectors at the origin for
    Lorentz parts (seed 001, Fig. 7), the raw vectors otherwise, parts concatenated."""
    name = getattr(recipe, "name", None)
    key = LORENTZ_PART.get(name)
    parts = []
    for k in sorted(emb):
        v = emb[k].detach().double()
        if v.ndim < 2:
            continue
        if k == key:
            v = logmap0(v, curvature(recipe))
        parts.append(v.reshape(v.shape[0], -1))
    if not parts:
        raise InputError("embedding has no [N, ...] vectors to take a spectrum of")
    return torch.cat(parts, dim=1)


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


def factorwise_max(a: Tensor, b: Tensor, c: Tensor | float) -> Tensor:
    """PHyCLIP's factor-wise "max" composition (seed 002, App. D.2): for each factor keep the point
    of ``a`` or ``b`` [N, k, d] that lies further from the origin. Returns [N, k, d]."""
    take_a = dist0(a, c) >= dist0(b, c)  # [N, k]
    return torch.where(take_a[..., None], a, b)


# --- training logs ------------------------------------------------------------------------------


def series(rows: Iterable[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one logged scalar, rows without it skipped."""
    steps, values = [], []
    for i, row in enumerate(rows):
        if key in row and isinstance(row[key], (int, float)) and row[key] is not None:
            steps.append(int(row.get("step", i)))
            values.append(float(row[key]))
    return steps, values


def find_keys(rows: list[dict[str, Any]], *fragments: str) -> list[str]:
    """Logged keys containing any of ``fragments`` (e.g. "curvature"), in first-seen order."""
    seen: dict[str, None] = {}
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (int, float)) and any(f in k for f in fragments):
                seen.setdefault(k, None)
    return list(seen)


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
    weight_key: str | None = None,
    gate_key: str | None = None,
) -> dict[str, Any]:
    """AGR routing statistics from a training log: mean routing weight over training, at the end of
    the warm-up (with its dominance verdict) and at the end; the same for the query gate.

    ``weight_key``/``gate_key`` default to the first logged key naming a routing weight / gate.
    """
    weight_key = weight_key or next(
        iter(find_keys(rows, "routing_weight", "route_w", "mean_w")), None
    )
    gate_key = gate_key or next(
        iter(k for k in find_keys(rows, "gate") if "dualpath" not in k), None
    )
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
