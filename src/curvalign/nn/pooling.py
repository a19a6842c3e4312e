"""Multi-head attention pooling with learned queries (DualPath, seed 004, Sec. 4.1).

For token features ``h_1 .. h_L`` with attention mask ``M``:

    a_i^(k) = exp(h_i . v_k / tau_k) M_i / sum_j exp(h_j . v_k / tau_k) M_j
    pooled  = concat_k sum_i a_i^(k) h_i                      (K = 4 heads)

with learned query vectors ``v_k`` and learned temperatures ``tau_k`` (log-stored, floored).
Used by the DualPath recipe only when an encoder gives token sequences; feature stores usually
hold pooled vectors, which skip this module.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from curvalign.nn.scalars import LearnableScalar


class AttentionPooling(nn.Module):
    """[N, L, D] tokens (+ mask [N, L]) -> [N, K * D].

    Args:
        dim: token feature size ``D``.
        num_queries: ``K`` learned queries (4).
        temperature_init: initial ``tau_k`` (default ``sqrt(D)``, the scaled dot-product scale).
        temperature_min: floor of ``tau_k``.
    """

    def __init__(
        self,
        dim: int,
        num_queries: int = 4,
        temperature_init: float | None = None,
        temperature_min: float = 1e-2,
    ) -> None:
        super().__init__()
        if dim <= 0 or num_queries <= 0:
            raise ValueError(
                f"AttentionPooling needs positive dim and num_queries, got {dim}, {num_queries}"
            )
        self.dim, self.num_queries = dim, num_queries
        self.queries = nn.Parameter(torch.randn(num_queries, dim) / math.sqrt(dim))
        init = math.sqrt(dim) if temperature_init is None else temperature_init
        self.temperature = LearnableScalar(init, min=temperature_min, shape=(num_queries,))

    @property
    def out_dim(self) -> int:
        return self.num_queries * self.dim

    def attention(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        """Attention weights [N, K, L]; zero exactly on masked tokens, each row sums to 1."""
        if tokens.ndim != 3 or tokens.shape[-1] != self.dim:
            raise ValueError(
                f"AttentionPooling expects tokens [N, L, {self.dim}], got {tuple(tokens.shape)}"
            )
        work = torch.promote_types(tokens.dtype, torch.float32)
        logits = torch.einsum("nld,kd->nkl", tokens.to(work), self.queries.to(work))
        logits = logits / self.temperature().to(work).unsqueeze(-1)
        if mask is not None:
            if mask.shape != tokens.shape[:2]:
                raise ValueError(
                    f"AttentionPooling mask must have shape {tuple(tokens.shape[:2])}, "
                    f"got {tuple(mask.shape)}"
                )
            keep = mask.bool()
            empty = ~keep.any(dim=1)
            if bool(empty.any()):
                first = int(torch.nonzero(empty)[0])
                raise ValueError(
                    f"AttentionPooling: sequence {first} has no unmasked token "
                    f"({int(empty.sum())} such sequences)"
                )
            logits = logits.masked_fill(~keep.unsqueeze(1), -math.inf)
        return torch.softmax(logits, dim=-1)

    def forward(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is not None and mask.shape == tokens.shape[:2]:
            # padding may hold anything (even NaN): zero it so 0-weight x padding stays 0
            tokens = tokens.masked_fill(~mask.bool().unsqueeze(-1), 0.0)
        weights = self.attention(tokens, mask)  # [N, K, L]
        pooled = torch.einsum("nkl,nld->nkd", weights, tokens.to(weights.dtype))
        return pooled.flatten(1).to(tokens.dtype)


__all__ = ["AttentionPooling"]
