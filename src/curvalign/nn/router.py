"""AGR's pairwise router, query gates and calibration, and the baseline-safe routed score
(seed 000: Sec. 4.2, Eqs. 13-14; Sec. 4.3, Eqs. 15-18; Algorithm 1, lines 22-34).

Per pair (text ``t``, image ``i``) the router reads the 34-dim feature

    x_ti = [S_E^route(t, i), S_H(t, i), phi_I(sg h_i) (16), phi_T(sg h_t) (16)]

and returns ``w_ti = sigmoid(MLP(LN(x_ti)) / T_gate)``, with the MLP ``34-64-32-1`` (GELU, dropout
after each hidden layer) and ``T_gate >= 0.5`` (Eq. 14; Algorithm 1's ``sigmoid(.)/T_gate`` is a
typo, docs/design.md). Gaussian jitter (sigma 0.1) is added to the two scalars in training only.
Everything the router reads is detached: the contexts by the paper's stop-gradient, the two
scalars too, so that the router sends no gradient into the heads or the trunk (Table 1,
"Router MLP: no gradient to the backbone").

The B x B computation without a [B, B, 34] tensor
    ``LN`` then the first ``Linear`` are exact functions of four per-pair sums, because the
    feature is a concatenation of two scalars and two per-item vectors. With ``W' = W diag(gamma)``
    (LayerNorm's gain folded into the first layer), ``k = W' 1``, ``c = W beta + b``:

        fc1(LN(x_ti)) = (w_E s_E + w_H s_H + W'_T u_t + W'_I u_i - mu_ti k) * rstd_ti + c
        mu_ti   = (s_E + s_H + sum(u_t) + sum(u_i)) / 34
        var_ti  = (s_E^2 + s_H^2 + |u_t|^2 + |u_i|^2) / 34 - mu_ti^2,  rstd = (var + eps)^-1/2

    ``W'_T u_t`` is [Nt, 64] and ``W'_I u_i`` [Ni, 64], computed once per item; the statistics are
    [Nt, Ni] scalars (computed in float64, so the one-pass variance cannot cancel). The first
    tensor with a pair *and* a feature axis is the [R, Ni, 64] hidden layer itself, built by
    one batched product ``[R, Ni, 5] @ [R, 5, 64]`` (the two scalars, the mean correction, the
    bias and the text row, all times ``rstd``) plus the image row times ``rstd`` in place.

Memory: rows are processed in chunks of at most ``train_chunk_pairs`` pairs (2^16) with
gradients and ``max_chunk_pairs`` (2^20) without. With gradients each chunk runs under
``torch.utils.checkpoint``: the forward keeps only the chunk's inputs (the jittered scalars, the
per-item rows) and the backward recomputes the chunk's hidden layers with the RNG state
restored (same dropout masks, same gradients). What stays alive for backward is then about
16 bytes a pair (jittered ``s_E``, ``s_H``, the logits and their concatenation) instead of the
~1 KB a pair of the MLP's hidden layers (GELU inputs and outputs, dropout masks), so B = 4096
(16.8 M pairs) trains in one process (tests/test_router.py measures both).

The fused CPU kernel (default on CPU, ``_fused_router``; ``fused=False`` or
``CURVALIGN_FUSED=0`` gives the eager path above, which stays the reference it is tested
against) computes the same function over all rows at once, tile by tile of 8 pairs in L1: the
folded first layer, GELU, dropout, the second layer, GELU, dropout, the output layer, and in the
backward the same tile recomputed and differentiated by hand. Nothing per pair is stored for
backward except the two jittered scalars. Its dropout masks are a hash of (seed, row, column,
unit), the seed drawn from torch's generator: the backward replays the forward's masks exactly,
with ``BitDropout``'s rate and exact scale (a different random stream from the eager path).
Float32 GELU is a division-free approximation within 2e-7 of the exact one
(torch's vectorised float GELU is within about 1.6e-7). Under autocast the
kernel computes in float32 (the eager path runs the two hidden layers in the autocast dtype).

``pair_logits`` is the same router on given (text, image) pairs, matched rows ``[n]`` or
candidate lists ``[n, K]`` (top-K reranking); it builds the 34-dim features explicitly, with the
standard modules, and is the reference the B x B path is tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from curvalign.nn import _fused_router
from curvalign.nn.scalars import LearnableScalar


class BitDropout(nn.Module):
    """Inverted dropout whose mask comes from 16-bit slices of 64-bit random words.

    Same distribution as ``nn.Dropout(p)`` up to ``p``'s rounding to a multiple of 2^-16 (the
    kept values are scaled by ``1 / (1 - p_rounded)``, so the expectation is exact). The router
    draws a mask for every pair and hidden unit (96 a pair, twice with recompute): ``bernoulli_``
    draws one 32-bit number per element and was the largest op of an AGR step; four masks per 64-bit
    draw are several times cheaper than ``nn.Dropout``. A different random stream from ``nn.Dropout``, same seeding.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"BitDropout p must lie in [0, 1), got {p}")
        self.p = p
        self.threshold = round(p * 65536)  # drop where the 16-bit word (0..65535) is below

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.threshold == 0:
            return x
        n = x.numel()
        # full-range 64-bit words, read as four uniform 16-bit words each
        words = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device)
        words.random_(-(2**63), None)
        keep = words.view(torch.int16)[:n].view(x.shape) >= self.threshold - 32768
        mask = keep.to(x.dtype).mul_(1.0 / (1.0 - self.threshold / 65536))  # 0 or 1/(1-p)
        return x * mask

    def extra_repr(self) -> str:
        return f"p={self.p}"


class PairwiseRouter(nn.Module):
    """AGR's router ``R_theta`` with its context projections ``phi_I``, ``phi_T``.

    Args:
        image_dim, text_dim: trunk feature sizes (the contexts' inputs).
        context_dim: size of each context projection (16 -> 2 + 2 x 16 = 34 router inputs).
        hidden_dims: the MLP's hidden widths (64, 32).
        dropout: dropout after each hidden activation.
        gate_temperature: initial ``T_gate`` (0.5, Table 7); ``min_gate_temperature`` its floor (0.5).
        learn_gate_temperature: learn ``T_gate`` (log-stored, clamped at the floor; the paper's
            Table 5 reports a learned value of 2.0) or keep it fixed.
        jitter: std of the Gaussian noise on the two scalar inputs in training (0.1).
        max_chunk_pairs: without gradients, rows are scored in chunks of at most this many pairs.
        train_chunk_pairs: with gradients, rows are scored in chunks of at most this many pairs
            (2^16 by default: one chunk up to B = 256).
        recompute: with gradients, keep only each chunk's inputs and recompute its hidden layers
            in the backward (``torch.utils.checkpoint``, RNG state restored: the same dropout
            masks, the same gradients); memory kept for backward is then ``O(B^2)`` scalars plus
            one chunk's activations at a time, instead of ~1.2 KB for every pair.
        fused: use the fused CPU kernel for the B x B logits where it applies (CPU tensors in
            float32/64, kernel built, ``CURVALIGN_FUSED`` not 0); it always recomputes per tile,
            so ``recompute`` and the chunk sizes only concern the eager path.
    """

    def __init__(
        self,
        image_dim: int,
        text_dim: int,
        context_dim: int = 16,
        hidden_dims: tuple[int, int] = (64, 32),
        dropout: float = 0.1,
        gate_temperature: float = 0.5,
        min_gate_temperature: float = 0.5,
        learn_gate_temperature: bool = True,
        jitter: float = 0.1,
        max_chunk_pairs: int = 1 << 20,
        train_chunk_pairs: int = 1 << 16,
        recompute: bool = True,
        fused: bool = True,
    ) -> None:
        super().__init__()
        if min(image_dim, text_dim, context_dim, *hidden_dims) <= 0:
            raise ValueError(
                f"PairwiseRouter dimensions must be positive, got image_dim={image_dim}, "
                f"text_dim={text_dim}, context_dim={context_dim}, hidden_dims={hidden_dims}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"PairwiseRouter dropout must lie in [0, 1), got {dropout}")
        if jitter < 0:
            raise ValueError(f"PairwiseRouter jitter must be >= 0, got {jitter}")
        if max_chunk_pairs < 1 or train_chunk_pairs < 1:
            raise ValueError(
                f"max_chunk_pairs and train_chunk_pairs must be >= 1, got {max_chunk_pairs} "
                f"and {train_chunk_pairs}"
            )
        self.context_dim = context_dim
        self.in_dim = 2 + 2 * context_dim
        self.context_image = nn.Linear(image_dim, context_dim)  # phi_I
        self.context_text = nn.Linear(text_dim, context_dim)  # phi_T
        self.norm = nn.LayerNorm(self.in_dim)
        self.fc1 = nn.Linear(self.in_dim, hidden_dims[0])
        self.tail = nn.Sequential(
            nn.GELU(),
            BitDropout(dropout),
            nn.Linear(hidden_dims[0], hidden_dims[1]),
            nn.GELU(),
            BitDropout(dropout),
            nn.Linear(hidden_dims[1], 1),
        )
        self.temperature = LearnableScalar(
            gate_temperature, min=min_gate_temperature, learnable=learn_gate_temperature
        )
        self.jitter = jitter
        self.max_chunk_pairs = max_chunk_pairs
        self.train_chunk_pairs = train_chunk_pairs
        self.recompute = recompute
        self.fused = fused

    # --- contexts (per item, stop-gradient) -------------------------------------------------------
    def image_context(self, h: Tensor) -> Tensor:
        """``phi_I(sg h)``: [N, image_dim] -> [N, context_dim]."""
        return self.context_image(h.detach())

    def text_context(self, h: Tensor) -> Tensor:
        """``phi_T(sg h)``: [N, text_dim] -> [N, context_dim]."""
        return self.context_text(h.detach())

    # --- helpers ------------------------------------------------------------------------------
    def _scalars(self, s_e_route: Tensor, s_h: Tensor) -> tuple[Tensor, Tensor]:
        s_e, s_h = s_e_route.detach(), s_h.detach()
        if self.training and self.jitter > 0:
            s_e = s_e + self.jitter * torch.randn_like(s_e)
            s_h = s_h + self.jitter * torch.randn_like(s_h)
        return s_e, s_h

    def _check_contexts(self, text_context: Tensor, image_context: Tensor) -> None:
        for name, u in (("text_context", text_context), ("image_context", image_context)):
            if u.shape[-1] != self.context_dim:
                raise ValueError(
                    f"PairwiseRouter {name} must end in {self.context_dim}, got {tuple(u.shape)}"
                )

    # --- B x B --------------------------------------------------------------------------------
    def matrix_logits(
        self, s_e_route: Tensor, s_h: Tensor, text_context: Tensor, image_context: Tensor
    ) -> Tensor:
        """Routing logits ``MLP(LN(x)) / T_gate`` for every (text, image) pair.

        s_e_route, s_h   [Nt, Ni]  ``beta(t) S_E`` and ``S_H`` (detached here)
        text_context     [Nt, 16]  ``phi_T(sg h_t)``
        image_context    [Ni, 16]  ``phi_I(sg h_i)``
        returns          [Nt, Ni]  logits ``l``; ``w = sigmoid(l)``
        """
        self._check_contexts(text_context, image_context)
        nt, ni = s_h.shape
        if (
            s_e_route.shape != s_h.shape
            or text_context.shape[0] != nt
            or image_context.shape[0] != ni
        ):
            raise ValueError(
                f"PairwiseRouter.matrix_logits: scores {tuple(s_e_route.shape)}, "
                f"{tuple(s_h.shape)} do not match contexts {tuple(text_context.shape)}, "
                f"{tuple(image_context.shape)}"
            )
        s_e, s_h = self._scalars(s_e_route, s_h)
        work = torch.promote_types(s_h.dtype, torch.float32)
        s_e, s_h = s_e.to(work), s_h.to(work)
        u_t, u_i = text_context.to(work), image_context.to(work)

        c = self.context_dim
        # the folded first layer in float32 at least, also under autocast (the MLP after it may
        # run in bf16): its per-pair statistics and sums need the range and precision
        with torch.autocast(device_type=s_h.device.type, enabled=False):
            weight = self.fc1.weight.to(work) * self.norm.weight.to(work)  # W' [H, 34]
            offset = self.fc1.bias.to(work) + self.fc1.weight.to(work) @ self.norm.bias.to(
                work
            )  # [H]
            scalar_map = torch.stack(
                (weight[:, 0], weight[:, 1], weight.sum(dim=1), offset)
            )  # [4, H]
            text_part = u_t @ weight[:, 2 + c :].T  # [Nt, H]
            image_part = u_i @ weight[:, 2 : 2 + c].T  # [Ni, H]

        # per-item sums for the LayerNorm statistics, in float64 (one-pass variance)
        stat = torch.float64 if work != torch.float64 else work
        sum_t, sq_t = u_t.to(stat).sum(-1), u_t.to(stat).square().sum(-1)
        sum_i, sq_i = u_i.to(stat).sum(-1), u_i.to(stat).square().sum(-1)

        if self.fused and _fused_router.available(s_h, text_part, image_part):
            logits = self._fused_logits(
                s_e, s_h, text_part, image_part, scalar_map, sum_t, sq_t, sum_i, sq_i
            )
            return logits / self.temperature().to(work)

        grad = torch.is_grad_enabled()
        budget = self.train_chunk_pairs if grad else self.max_chunk_pairs
        rows = max(1, budget // max(1, ni))
        recompute = grad and self.recompute
        out = []
        for start in range(0, nt, rows):
            sl = slice(start, start + rows)
            args = (s_e[sl], s_h[sl], text_part[sl], image_part, scalar_map)
            stats = (sum_t[sl], sq_t[sl], sum_i, sq_i)
            if recompute:
                # keep only the chunk's inputs; its hidden layers are recomputed in backward
                # (the RNG state is restored, so dropout draws the same masks: same gradients)
                out.append(
                    checkpoint(
                        self._chunk_logits,
                        *args,
                        *stats,
                        use_reentrant=False,
                        preserve_rng_state=True,
                    )
                )
            else:
                out.append(self._chunk_logits(*args, *stats))
        logits = out[0] if len(out) == 1 else torch.cat(out, dim=0)
        return logits / self.temperature().to(work)

    def _fused_logits(
        self,
        se: Tensor,
        sh: Tensor,
        text_part: Tensor,
        image_part: Tensor,
        scalar_map: Tensor,
        sum_t: Tensor,
        sq_t: Tensor,
        sum_i: Tensor,
        sq_i: Tensor,
    ) -> Tensor:
        """All rows at once in the fused kernel (``_fused_router``): the same function as
        ``_chunk_logits``, its hidden layers never stored (recomputed per tile in backward)."""
        work = sh.dtype
        fc2, fc3, drop2, drop3 = self.tail[2], self.tail[5], self.tail[1], self.tail[4]
        assert isinstance(fc2, nn.Linear) and isinstance(fc3, nn.Linear)  # the tail of __init__
        assert isinstance(drop2, BitDropout) and isinstance(drop3, BitDropout)
        thresholds = (
            drop2.threshold if drop2.training else 0,
            drop3.threshold if drop3.training else 0,
        )
        # the masks' seed from torch's generator: torch.manual_seed reproduces them
        # (a tensor, not an int: under torch.compile a Python int would be baked into the graph)
        seed = torch.randint(0, 2**62, (), dtype=torch.int64) if any(thresholds) else 0
        with torch.autocast(device_type=sh.device.type, enabled=False):
            return _fused_router.router_logits_fused(
                se, sh, text_part, image_part, scalar_map, sum_t, sq_t, sum_i, sq_i,
                fc2.weight.to(work), fc2.bias.to(work), fc3.weight.to(work), fc3.bias.to(work),
                self.in_dim, self.norm.eps, thresholds, seed,
            )  # fmt: skip

    def _chunk_logits(
        self,
        se: Tensor,
        sh: Tensor,
        text_part: Tensor,
        image_part: Tensor,
        scalar_map: Tensor,
        sum_t: Tensor,
        sq_t: Tensor,
        sum_i: Tensor,
        sq_i: Tensor,
    ) -> Tensor:
        """Logits times ``T_gate`` of one row chunk: se, sh [R, Ni] -> [R, Ni]."""
        stat, work = sum_t.dtype, sh.dtype
        se64, sh64 = se.to(stat), sh.to(stat)
        mean = (se64 + sh64 + sum_t[:, None] + sum_i[None, :]) / self.in_dim
        var = (
            se64.square() + sh64.square() + sq_t[:, None] + sq_i[None, :]
        ) / self.in_dim - mean.square()
        rstd = (var.clamp_min(0.0) + self.norm.eps).rsqrt().to(work)
        mean = mean.to(work)
        # [R, Ni, 5] @ [R, 5, H]: the scalar inputs, the mean correction, the bias and the text
        # row (all scaled by rstd) in one product; then the image row, scaled by rstd, in place
        r, h = text_part.shape
        coeffs = torch.stack((se * rstd, sh * rstd, -mean * rstd, torch.ones_like(se), rstd), -1)
        maps = torch.cat((scalar_map.expand(r, 4, h), text_part.unsqueeze(1)), dim=1)
        with torch.autocast(device_type=se.device.type, enabled=False):
            hidden = torch.bmm(coeffs, maps)
            hidden.addcmul_(rstd.unsqueeze(-1), image_part.unsqueeze(0))
        return self.tail(hidden).squeeze(-1)

    # --- given pairs (top-K rerank) ------------------------------------------------------------
    def pair_logits(
        self, s_e_route: Tensor, s_h: Tensor, text_context: Tensor, image_context: Tensor
    ) -> Tensor:
        """Routing logits for given pairs: ``s_*`` of shape ``S`` (``[n]`` or ``[n, K]``), contexts
        broadcastable to ``S + (16,)`` (e.g. ``[n, 1, 16]`` for a query against K candidates).
        Returns logits of shape ``S``."""
        self._check_contexts(text_context, image_context)
        s_e, s_h = self._scalars(s_e_route, s_h)
        work = torch.promote_types(s_h.dtype, torch.float32)
        shape = torch.broadcast_shapes(
            s_e.shape, s_h.shape, text_context.shape[:-1], image_context.shape[:-1]
        )
        c = self.context_dim
        x = torch.cat(
            (
                s_e.to(work).expand(shape).unsqueeze(-1),
                s_h.to(work).expand(shape).unsqueeze(-1),
                image_context.to(work).expand(*shape, c),
                text_context.to(work).expand(*shape, c),
            ),
            dim=-1,
        )
        logits = self.tail(self.fc1(self.norm(x))).squeeze(-1)
        return logits / self.temperature().to(work)


class QueryConditioner(nn.Module):
    """Per-item query gate and calibration of one modality (Eq. 15; Algorithm 1, lines 29-30).

    gate        ``g = sigmoid(Gate(sg h))``                       [N]
    calibration ``(wE, sH, sE) = 2 sigmoid(C(sg h))``              [N, 3]

    ``C`` is zero-initialised, so every calibration factor starts at exactly 1 (identity: the
    routed score starts as Eq. 18). The ``2 sigmoid`` map keeps each factor in ``(0, 2)``: ``sH``
    rescales the hyperbolic base by ``1 + alpha g (sH - 1)``, which must stay positive so that a
    calibration can never reverse the base ranking; ``sE`` and ``wE`` scale the Euclidean
    correction and its weight without changing their sign.
    """

    def __init__(self, in_dim: int) -> None:
        super().__init__()
        if in_dim <= 0:
            raise ValueError(f"QueryConditioner in_dim must be positive, got {in_dim}")
        self.gate = nn.Linear(in_dim, 1)
        nn.init.zeros_(self.gate.bias)
        self.calibration = nn.Linear(in_dim, 3)
        nn.init.zeros_(self.calibration.weight)
        nn.init.zeros_(self.calibration.bias)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """[N, D] trunk features -> (gate [N] in (0, 1), calibration [N, 3] = (wE, sH, sE) in (0, 2))."""
        h = h.detach()
        return torch.sigmoid(self.gate(h)).squeeze(-1), 2.0 * torch.sigmoid(self.calibration(h))


def routed_scores(
    s_h: Tensor,
    s_e: Tensor,
    route_weight: Tensor,
    gate: Tensor,
    calibration: Tensor,
    alpha: float,
    beta: float,
    max_delta: float = 5.0,
) -> Tensor:
    """AGR's baseline-safe routed score (Algorithm 1, lines 32-34; Eqs. 16-18):

        Delta = Dmax tanh((sE beta S_E - S_H) / Dmax)
        S_AGR = S_H + alpha g w wE Delta + alpha g (sH - 1) S_H

    s_h, s_e, route_weight   same shape ``S`` (a [Nt, Ni] matrix or given pairs)
    gate                     the query side's gate, broadcastable to ``S`` ([Nt, 1] when texts
                             are the queries of a [Nt, Ni] matrix, [1, Ni] when images are)
    calibration              the query side's (wE, sH, sE), broadcastable to ``S + (3,)``
    With ``alpha = 0`` the result equals ``S_H`` exactly (every correction is multiplied by 0).
    """
    if max_delta <= 0:
        raise ValueError(f"max_delta must be positive, got {max_delta}")
    w_e, s_h_scale, s_e_scale = calibration.unbind(-1)
    delta = max_delta * torch.tanh((s_e_scale * (beta * s_e) - s_h) / max_delta)
    gated = alpha * gate
    return s_h + gated * route_weight * w_e * delta + gated * (s_h_scale - 1.0) * s_h


def routed_scores_both(
    s_h: Tensor,
    s_e: Tensor,
    route_weight: Tensor,
    row_gate: Tensor,
    row_calibration: Tensor,
    column_gate: Tensor,
    column_calibration: Tensor,
    alpha: float,
    beta: float,
    max_delta: float = 5.0,
    fused: bool = True,
) -> tuple[Tensor, Tensor]:
    """:func:`routed_scores` of one ``[Nt, Ni]`` matrix in both directions: with the rows as the
    queries (``row_gate`` [Nt], ``row_calibration`` [Nt, 3]) and with the columns as the queries
    (``column_gate`` [Ni], ``column_calibration`` [Ni, 3]). Returns both ``[Nt, Ni]`` score
    matrices. On CPU one fused pass each way (``_fused_router``: the elementwise glue of about
    thirty passes over ``[Nt, Ni]`` in each direction, forward and backward, in one loop);
    elsewhere, or with ``fused=False``, :func:`routed_scores` twice (the reference)."""
    if max_delta <= 0:
        raise ValueError(f"max_delta must be positive, got {max_delta}")
    tensors = (s_h, s_e, route_weight, row_gate, row_calibration, column_gate, column_calibration)
    dtype = s_h.dtype
    if (
        fused
        and s_h.ndim == 2
        and all(t.dtype == dtype for t in tensors)
        and row_gate.shape == s_h.shape[:1]
        and column_gate.shape == s_h.shape[1:]
        and _fused_router.available(*tensors)
    ):
        return _fused_router.routed_scores_both_fused(*tensors, alpha, beta, max_delta)
    rows = routed_scores(
        s_h, s_e, route_weight, row_gate[:, None], row_calibration[:, None, :], alpha, beta,
        max_delta,
    )  # fmt: skip
    columns = routed_scores(
        s_h, s_e, route_weight, column_gate[None, :], column_calibration[None, :, :], alpha,
        beta, max_delta,
    )  # fmt: skip
    return rows, columns


__all__ = ["PairwiseRouter", "QueryConditioner", "routed_scores", "routed_scores_both"]
