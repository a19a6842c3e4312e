"""DualPath's projection head (viPolyQwen, seed 004, Secs. 3.1-3.4, 4.2, 4.3).

    h      = A_m x + p_task                          input adapter of modality m, task prefix
    h'     = Dropout(GELU(W_1 h + b_1))              shared expansion (2048 -> 4096 in the paper)
    z_text = W_2^text h' + b_2^text,  z_multi = W_2^multi h' + b_2^multi
    z      = z_text                                  text-only inputs
             g z_multi + (1 - g) z_text              inputs with an image,  g = sigmoid(theta)
    e      = a z + (1 - a) W_r h                     residual (a learned, init 0.5)

Readings for a feature setting (documented in docs/methods.md):

* Input adapters. The paper's encoder gives one hidden state for every input (text, or image +
  text) in one width. Frozen image and text features differ in size (``image_dim != text_dim``),
  so each modality has its own linear adapter ``A_m`` into a common width ``model_dim``; the
  rest of the head is shared. An image input uses the image adapter, a text input the text
  adapter: a text-only batch touches neither the image adapter nor the multimodal path.
* Task prefixes (Sec. 4.3) are tokens prepended to the encoder input. Without an encoder in the
  loop, a prefix becomes a learned vector ``p_task`` per task type added to ``h`` (zero-init,
  so the head starts prefix-free). Task types here: ``"text_pair"`` (text similarity) and
  ``"image_text"`` (image-caption retrieval, both sides).
* Gate warm-up. After the curriculum switch the gate "warms up" for 1000 steps (Sec. 4.5) while
  the paper's log shows it still learning (0.007 -> 0.01 -> 0.15 -> 0.4). The project reads
  this as a ramp on how far the gate may move: ``theta_eff = theta_0 + r (theta - theta_0)``
  with ``r`` from 0 at the switch to 1 after the warm-up. At ``r = 0`` the gate is exactly its
  initial value; its effective learning rate ramps up with ``r``, independently of the
  optimiser (a gradient scale would be undone by Adam's normalisation).
* Gate speed. ``gate_speed`` k multiplies the learned displacement:
  ``theta_eff = theta_0 + r k (theta - theta_0)``. Under Adam a parameter moves about one
  learning rate per step whatever its gradient's size, so k is the learning-rate multiplier of
  theta: at k = 1 theta moves at most ~lr per step and a short run cannot open the gate (the
  paper's log reaches 0.15 after 5000 steps). Default 1 (the plain reading).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TASKS = ("text_pair", "image_text")


class DualPathHead(nn.Module):
    """Dual-path projection head. forward(x [N, D_m], modality, task) -> e [N, out_dim] (not normalised).

    Args:
        input_dims: feature size per modality, e.g. {"image": 128, "text": 96}.
        model_dim: common width of ``h`` after the adapters.
        hidden_dim: width of the shared expansion ``h'`` (the paper doubles: 2048 -> 4096).
        out_dim: embedding size (the paper: 1024).
        dropout: dropout on ``h'``.
        gate_init: ``theta_0`` (-5: g = 0.0067).
        residual_init: ``a`` at initialisation (0.5).
        tasks: task types with a learned prefix; empty for no prefixes.
    """

    #: gate warm-up factor r (a buffer, registered in ``__init__``)
    gate_warmup: Tensor

    def __init__(
        self,
        input_dims: Mapping[str, int],
        model_dim: int,
        hidden_dim: int,
        out_dim: int,
        dropout: float = 0.1,
        gate_init: float = -5.0,
        residual_init: float = 0.5,
        tasks: Sequence[str] = TASKS,
        gate_speed: float = 1.0,
    ) -> None:
        super().__init__()
        if not gate_speed > 0:
            raise ValueError(f"DualPathHead: gate_speed must be > 0, got {gate_speed}")
        self.gate_speed = float(gate_speed)
        if "text" not in input_dims:
            raise ValueError(
                f"DualPathHead needs a 'text' input, got modalities {sorted(input_dims)}"
            )
        if min(model_dim, hidden_dim, out_dim, *input_dims.values()) <= 0:
            raise ValueError(
                f"DualPathHead dimensions must be positive, got inputs {dict(input_dims)}, "
                f"model_dim={model_dim}, hidden_dim={hidden_dim}, out_dim={out_dim}"
            )
        self.input_dims = dict(input_dims)
        self.adapters = nn.ModuleDict({m: nn.Linear(d, model_dim) for m, d in input_dims.items()})
        self.tasks = tuple(tasks)
        self.task_prefix = (
            nn.Parameter(torch.zeros(len(self.tasks), model_dim)) if self.tasks else None
        )
        self.expand = nn.Linear(model_dim, hidden_dim)  # W_1
        self.dropout = nn.Dropout(dropout)
        self.text_path = nn.Linear(hidden_dim, out_dim)  # W_2^text
        self.multi_path = nn.Linear(hidden_dim, out_dim)  # W_2^multi
        self.residual = nn.Linear(model_dim, out_dim, bias=False)  # W_r
        self.gate_init = float(gate_init)
        self.gate_logit = nn.Parameter(torch.tensor(float(gate_init)))  # theta
        self.mix = nn.Parameter(torch.tensor(float(residual_init)))  # a
        # gate warm-up factor r in [0, 1]; set by the recipe from the curriculum, saved with the model
        self.register_buffer("gate_warmup", torch.zeros(()))

    def adapter(self, modality: str) -> nn.Linear:
        """The input adapter [D_m -> model_dim] of ``modality``."""
        layer = self.adapters[modality]
        assert isinstance(layer, nn.Linear)  # built as one in __init__
        return layer

    def gate(self) -> Tensor:
        """``g = sigmoid(theta_0 + r k (theta - theta_0))``: the effective gate."""
        theta = self.gate_init + self.gate_warmup * self.gate_speed * (
            self.gate_logit - self.gate_init
        )
        return torch.sigmoid(theta)

    def hidden(self, x: Tensor, modality: str, task: str | None) -> Tensor:
        """``h = A_m x + p_task`` [N, model_dim]."""
        if modality not in self.adapters:
            raise ValueError(
                f"DualPathHead: unknown modality {modality!r}; expected one of {sorted(self.adapters)}"
            )
        d = self.input_dims[modality]
        if x.ndim != 2 or x.shape[1] != d:
            raise ValueError(
                f"DualPathHead: {modality} features must have shape [N, {d}], got {tuple(x.shape)}"
            )
        h = self.adapter(modality)(x)
        if task is not None and self.task_prefix is not None:
            if task not in self.tasks:
                raise ValueError(
                    f"DualPathHead: unknown task {task!r}; expected one of {list(self.tasks)}"
                )
            h = h + self.task_prefix[self.tasks.index(task)]
        return h

    def forward(self, x: Tensor, modality: str, task: str | None = None) -> Tensor:
        h = self.hidden(x, modality, task)
        shared = self.dropout(F.gelu(self.expand(h)))
        z = self.text_path(shared)
        if modality != "text":  # an input with an image: soft mixture of the two paths
            g = self.gate()
            z = g * self.multi_path(shared) + (1.0 - g) * z
        return self.mix * z + (1.0 - self.mix) * self.residual(h)

    @torch.no_grad()
    def copy_text_to_multimodal(self) -> None:
        """``W_2^multi <- W_2^text`` (and the bias) at the curriculum switch (Sec. 3.4)."""
        self.multi_path.weight.copy_(self.text_path.weight)
        self.multi_path.bias.copy_(self.text_path.bias)


__all__ = ["DualPathHead", "TASKS"]
