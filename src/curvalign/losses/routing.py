"""AGR's routing regularisers (seed 000, Eqs. 22 and 25; Algorithm 1, lines 37-38).

Both take the router's *logits* ``l`` (``w = sigmoid(l)``), so the entropy is finite even where
``w`` rounds to 0 or 1.

    routing_entropy(l)        mean binary entropy ``E_ij[H(w_ij)]`` (nats); the loss term is
                              ``-lambda_ent * routing_entropy`` (maximising entropy, anti-collapse)
    load_balance(mean_w)      ``(mean_w - 0.5)^2``; weighted by ``lambda_lb`` (0.1)

The load balance is nonlinear in a batch mean: in multi-process training the mean must be the
global one, ``Gather.average(local_mean)``, before it is squared (the recipe does this).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def binary_entropy_from_logits(logits: Tensor) -> Tensor:
    """``H(sigmoid(l))`` in nats, elementwise, finite with finite gradients for any logit:
    ``H = w softplus(-l) + (1 - w) softplus(l)`` with ``w = sigmoid(l)``."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    w = torch.sigmoid(logits)
    return w * F.softplus(-logits) + (1.0 - w) * F.softplus(logits)


def routing_entropy(logits: Tensor) -> Tensor:
    """Mean binary routing entropy over all pairs, in ``[0, log 2]``."""
    if logits.numel() == 0:
        raise ValueError("routing_entropy got an empty logit tensor")
    return binary_entropy_from_logits(logits).mean()


def load_balance(mean_weight: Tensor) -> Tensor:
    """``(mean_w - 0.5)^2`` for the (global) mean routing weight."""
    return (mean_weight - 0.5).square()


__all__ = ["binary_entropy_from_logits", "load_balance", "routing_entropy"]
