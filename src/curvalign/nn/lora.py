"""LoRA linear layer: a frozen base projection plus a trainable low-rank update (Hu et al., 2021).

AGR's Euclidean expert (seed 000, Sec. 4.1.1, Eq. 12) freezes its base projection ``W_0`` and
learns only ``W = W_0 + (alpha / r) B A``. The project follows the usual LoRA convention:

    A  [r, in]   random (Kaiming-uniform, as ``nn.Linear``), trainable
    B  [out, r]  zeros, trainable, so the layer starts exactly as its base
    scaling = alpha / r   (``alpha`` defaults to ``r``: scaling 1)

The paper writes the same product with the factors named the other way round (its
``A_E in R^{d x r}`` is our ``B``).

The frozen base is stored as buffers (``base_weight``, ``base_bias``): it is saved with the model,
moved with ``.to()``, never handed to an optimiser, and cannot receive a gradient.

The forward pass forms the merged weight ``W_0 + scaling B A`` ([out, in], one ``r``-rank matrix
product) and applies one ``F.linear``. The cost is ``r * out * in`` multiply-adds per call,
independent of the batch, and it makes ``merge()`` exact: the merged ``nn.Linear`` computes
bit-for-bit the same outputs as the unmerged layer (the paper's "inference equivalence").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LoRALinear(nn.Module):
    """``y = x (W_0 + scaling B A)^T + b_0`` with ``W_0``, ``b_0`` frozen.

    Args:
        in_features, out_features: shapes of the projection, ``[N, in] -> [N, out]``.
        rank: ``r`` (AGR: 64). A rank >= min(in, out) is allowed (the update is then full rank).
        alpha: LoRA's ``alpha``; ``scaling = alpha / rank``. Default ``rank``.
        bias: whether the (frozen) base has a bias.
        base_weight, base_bias: the frozen base; default a fresh ``nn.Linear`` initialisation
            (a pretrained projection, when one exists, is passed here).
    """

    #: the frozen ``W_0`` [out, in] and ``b_0`` [out] (buffers, registered in ``__init__``)
    base_weight: Tensor
    base_bias: Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int = 64,
        alpha: float | None = None,
        bias: bool = False,
        base_weight: Tensor | None = None,
        base_bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"LoRALinear dimensions must be positive, got {in_features} -> {out_features}"
            )
        if rank <= 0:
            raise ValueError(f"LoRALinear rank must be positive, got {rank}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.alpha = float(rank if alpha is None else alpha)
        if not self.alpha > 0:
            raise ValueError(f"LoRALinear alpha must be positive, got {alpha}")
        self.scaling = self.alpha / rank

        if base_weight is None:
            template = nn.Linear(in_features, out_features, bias=bias)
            base_weight = template.weight.detach()
            if bias and base_bias is None:
                base_bias = template.bias.detach()
        if tuple(base_weight.shape) != (out_features, in_features):
            raise ValueError(
                f"LoRALinear base_weight must have shape [{out_features}, {in_features}], "
                f"got {tuple(base_weight.shape)}"
            )
        if base_bias is not None and tuple(base_bias.shape) != (out_features,):
            raise ValueError(
                f"LoRALinear base_bias must have shape [{out_features}], got {tuple(base_bias.shape)}"
            )
        self.register_buffer("base_weight", base_weight.detach().clone())
        self.register_buffer("base_bias", None if base_bias is None else base_bias.detach().clone())

        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def weight(self) -> Tensor:
        """The effective weight ``W_0 + scaling B A`` [out, in] (differentiable in A and B)."""
        return self.base_weight + self.scaling * (self.lora_B @ self.lora_A)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"LoRALinear expects inputs [..., {self.in_features}], got {tuple(x.shape)}"
            )
        return F.linear(x, self.weight(), self.base_bias)

    @torch.no_grad()
    def merge(self) -> nn.Linear:
        """A plain frozen ``nn.Linear`` with the merged weight, for inference: same outputs, bit for bit."""
        weight = self.weight()
        layer = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.base_bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
        layer.weight.copy_(weight)
        if self.base_bias is not None:
            layer.bias.copy_(self.base_bias)
        layer.requires_grad_(False)
        return layer

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"scaling={self.scaling:g}, bias={self.base_bias is not None}"
        )


__all__ = ["LoRALinear"]
