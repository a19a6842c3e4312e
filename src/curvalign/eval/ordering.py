"""Hierarchy ordering (seed 001, Tables 3-4): are more specific items further from the origin?

A chain lists items from general to specific (text: attribute -> noun phrase -> caption; image:
object crop -> full image). Each item gets its distance to the origin in the recipe's geometry
(``diagnostics.distance_to_origin``); a chain is correctly ordered when the distances increase
strictly along it. Equal distances count as wrong (pessimistic). Geometries without an origin
(cosine, Euclidean-only) have no such ordering and report no number.
"""

from __future__ import annotations

import torch
from torch import Tensor

from curvalign.errors import InputError


def ordering_accuracy(distances: Tensor) -> dict[str, float]:
    """{"chain": share of chains ordered along their whole length, "pairs": share of adjacent
    (general, specific) pairs ordered}.

    distances: [n_chains, L] distance to the origin, columns from general to specific, L >= 2.
    """
    if distances.ndim != 2 or distances.shape[1] < 2:
        raise InputError(
            f"distances must be [n_chains, L] with L >= 2, got {tuple(distances.shape)}"
        )
    if distances.shape[0] == 0:
        raise InputError("no chains: ordering accuracy is undefined")
    if not bool(torch.isfinite(distances).all()):
        raise InputError("distances to the origin contain NaN or infinite values")
    steps = distances[:, 1:] > distances[:, :-1]  # [n, L-1]
    return {"chain": float(steps.all(dim=1).float().mean()), "pairs": float(steps.float().mean())}
