"""The Lorentz (hyperboloid) model of hyperbolic space with sectional curvature ``-c``.

Conventions (docs/design.md, "Public API"):

- A point is stored by its **space components** ``x`` of shape ``[..., d]``; its time
  component is derived, ``time(x) = sqrt(1/c + |x|^2)``, so the full point ``(time(x), x)``
  lies on ``-t^2 + |x|^2 = -1/c``.
- ``c > 0`` is a float or a tensor broadcasting against ``x.shape[:-1]`` (per-factor ``[k]``
  for points ``[B, k, d]``); every function is differentiable in ``c``.
- Pairwise functions take ``X: [N, d]``, ``Y: [M, d]`` and return ``[N, M]``; they also accept
  the factor layout ``X: [N, k, d]``, ``Y: [M, k, d]`` with ``c`` of shape ``[k]`` (or scalar)
  and then return ``[k, N, M]``. They are one matrix product plus outer products and
  elementwise maps; no ``[N, M, d]`` tensor is ever formed.
- Everything computes in at least float32 with autocast disabled and returns that dtype.

Equation references: AtMG (seed 001) Eq. (3) time, Eq. (4) distance, Eq. (5)-(6) Einstein
midpoint, Eq. (9) exterior angle, Eq. (10) aperture; MERU for the exponential map at the origin.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from curvalign.geometry import _fused_lorentz
from curvalign.geometry._numerics import (
    Curvature,
    as_positive,
    bounded_atan2,
    check_points,
    eps,
    no_autocast,
    safe_norm,
    sqrt_lin,
    tiny_floor,
    work_dtype,
)

__all__ = [
    "time",
    "expmap0",
    "logmap0",
    "inner",
    "dist",
    "excess",
    "dist_from_excess",
    "poincare",
    "pairwise_inner",
    "pairwise_dist",
    "minkowski_operands",
    "dist0",
    "half_aperture",
    "exterior_angle",
    "pairwise_exterior_angle",
    "pairwise_exterior_angles",
    "einstein_midpoint",
    "tangent_mean",
]

# sinh(asinh(2^15)) = 2^15: the largest hyperbolic radius sqrt(c)|v| the exponential map lets
# through, so that sinh (and later cosh-sized products of two such points) cannot overflow.
MAX_SQRT_C_RADIUS = math.asinh(2.0**15)


def _prep(x: Tensor, c: Curvature, *others: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
    dtype = work_dtype(x, c, *others)
    cc = as_positive(c, "c", dtype, x.device)
    return x.to(dtype), cc, [o.to(dtype) for o in others]


def _sqnorm(x: Tensor) -> Tensor:
    return torch.linalg.vecdot(x, x)  # one pass, no [..., d] temporary


def _robust_norm(v: Tensor) -> Tensor:
    """``|v|`` over the last axis as ``[..., 1]``, scaled by the largest entry first so that
    norms up to the dtype's maximum do not overflow in the squares; finite gradient at 0."""
    m = v.detach().abs().amax(-1, keepdim=True).clamp_min(torch.finfo(v.dtype).tiny)
    return m * torch.sqrt(((v / m) ** 2).sum(-1, keepdim=True).clamp_min(torch.finfo(v.dtype).tiny))


def _time(x: Tensor, c: Tensor) -> Tensor:
    return torch.sqrt(c.reciprocal() + _sqnorm(x))


def _asinh_dist(w: Tensor, c: Tensor, w0: float) -> Tensor:
    """Distance from ``w = (z - 1) / 2`` with ``z = -c <x,y>_L``.

    ``acosh(z) = 2 asinh(sqrt((z - 1) / 2))``: the same value, but the square root goes
    through :func:`sqrt_lin`, so the distance is exactly 0 at ``x = y`` and its gradient stays
    bounded there (acosh has an infinite derivative at 1).
    """
    return 2.0 * torch.asinh(sqrt_lin(w, w0)) * torch.rsqrt(c)


@no_autocast
def time(x: Tensor, c: Curvature) -> Tensor:
    """Time component ``sqrt(1/c + |x|^2)`` (AtMG Eq. 3). ``x: [..., d]`` -> ``[...]``."""
    check_points(x, "x")
    x, c, _ = _prep(x, c)
    return _time(x, c)


def _sinhc_terms(r: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``f(r) = sinh(min(r, R)) / r`` and ``f'(r) / r`` for radii ``r >= 0`` (``R`` =
    :data:`MAX_SQRT_C_RADIUS`), both finite at ``r = 0``: below the dtype's series threshold
    ``f = 1 + r^2/6 + r^4/120`` and ``f'/r = 1/3 + r^2/30``; above ``R``, where the value is
    clamped, ``f' = -f / r`` (the slope of ``sinh(R) / r``)."""
    r_small = (5040.0 * eps(dtype)) ** (1.0 / 6.0)
    r2 = r.clamp_max(r_small).square()
    r_big = r.clamp_min(r_small)
    rc = r_big.clamp_max(MAX_SQRT_C_RADIUS)
    sh = torch.sinh(rc)
    f_big = sh / r_big
    # f'(r) = (cosh r - f) / r below R; -f / r above (sinh is clamped there)
    df_big = torch.where(r_big > MAX_SQRT_C_RADIUS, -f_big, torch.cosh(rc) - f_big) / r_big
    small = r < r_small
    f = torch.where(small, 1.0 + r2 / 6.0 + r2 * r2 / 120.0, f_big)
    df_over_r = torch.where(small, 1.0 / 3.0 + r2 / 30.0, df_big / r_big)
    return f, df_over_r


class _Expmap0(torch.autograd.Function):
    """``x = f(r) v`` with ``r = sqrt(c) |v|`` (one row norm and one scaling pass), and its
    backward in two passes: ``dv = f g + c (f'(r)/r) (g.v) v``, ``dc = sum (g.v) (f'(r)/r) |v|^2 / 2``
    (``dr/dv = c v / r``, ``dr/dc = r / (2c)``). The row terms are ``[..., 1]`` tensors, so
    the eager composition's dozen ``[..., d]`` temporaries (robust norm, series, where) are not
    formed. ``v: [..., d]``, ``c`` broadcast to ``[..., 1]`` (working dtype)."""

    @staticmethod
    def forward(ctx, v: Tensor, c: Tensor, sq: Tensor) -> Tensor:
        r = torch.sqrt(c * sq)
        f, df_over_r = _sinhc_terms(r, v.dtype)
        ctx.save_for_backward(v, c, sq, f, df_over_r)
        return v * f

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        v, c, sq, f, df_over_r = ctx.saved_tensors
        gv_dot = torch.linalg.vecdot(g, v).unsqueeze(-1)  # [..., 1]
        kappa = gv_dot * df_over_r
        dv = None
        if ctx.needs_input_grad[0]:
            dv = torch.addcmul(g * f, v, kappa * c)
        dc = None
        if ctx.needs_input_grad[1]:
            dc = (0.5 * kappa * sq).sum_to_size(c.shape)
        return dv, dc, None


def _expmap0_reference(v: Tensor, c: Tensor) -> Tensor:
    """The eager composition :class:`_Expmap0` is tested against (robust to norms whose square
    overflows). ``v: [..., d]`` and ``c`` in the working dtype."""
    cb = c.unsqueeze(-1) if c.dim() else c
    r = torch.sqrt(cb) * _robust_norm(v)
    # Taylor series 1 + r^2/6 + r^4/120 is exact to the dtype below r^6/5040 < eps.
    r_small = (5040.0 * eps(v.dtype)) ** (1.0 / 6.0)
    r2 = r.clamp_max(r_small) ** 2  # clamped so the unselected branch has finite gradients
    series = 1.0 + r2 / 6.0 + r2 * r2 / 120.0
    r_big = r.clamp_min(r_small)
    ratio = torch.sinh(r_big.clamp_max(MAX_SQRT_C_RADIUS)) / r_big
    return torch.where(r < r_small, series, ratio) * v


@no_autocast
def expmap0(v: Tensor, c: Curvature, fused: bool | None = None) -> Tensor:
    """Space part of the exponential map at the origin, ``sinh(sqrt(c)|v|) / (sqrt(c)|v|) * v``.

    ``v: [..., d]`` tangent vectors at the origin (their time component is 0) -> ``[..., d]``.
    ``sqrt(c)|v|`` is clamped to ``asinh(2^15)`` so ``sinh`` cannot overflow; below the
    dtype's series threshold ``sinh(r)/r`` is its Taylor series (no 0/0 at ``v = 0``).

    On CPU the default path is one hand-differentiated function (:class:`_Expmap0`: a row
    norm and a scaling pass forward, two passes backward); where a row's squared norm
    overflows the dtype, on other devices, or with ``fused=False``, the eager reference
    (norms scaled by the row's largest entry first).
    """
    check_points(v, "v")
    v, c, _ = _prep(v, c)
    if fused is not False and v.device.type == "cpu":
        sq = torch.linalg.vecdot(v.detach(), v.detach()).unsqueeze(-1)
        if bool(torch.isfinite(sq).all()):
            cb = c.unsqueeze(-1) if c.dim() else c
            return _Expmap0.apply(v, cb, sq)
    return _expmap0_reference(v, c)


@no_autocast
def logmap0(x: Tensor, c: Curvature) -> Tensor:
    """Inverse of :func:`expmap0`: ``asinh(sqrt(c)|x|) / (sqrt(c)|x|) * x``. ``[..., d]``."""
    check_points(x, "x")
    x, c, _ = _prep(x, c)
    cb = c.unsqueeze(-1) if c.dim() else c
    r = torch.sqrt(cb) * _robust_norm(x)
    # asinh(r)/r = 1 - r^2/6 + 3 r^4/40 - ...; next term 15 r^6/336 below eps.
    r_small = (336.0 / 15.0 * eps(x.dtype)) ** (1.0 / 6.0)
    r2 = r.clamp_max(r_small) ** 2
    series = 1.0 - r2 / 6.0 + 3.0 * r2 * r2 / 40.0
    r_big = r.clamp_min(r_small)
    ratio = torch.asinh(r_big) / r_big
    return torch.where(r < r_small, series, ratio) * x


@no_autocast
def inner(x: Tensor, y: Tensor, c: Curvature) -> Tensor:
    """Row-wise Minkowski inner product ``x.y - time(x) time(y)``. ``[..., d]`` -> ``[...]``."""
    check_points(x, "x")
    check_points(y, "y")
    x, c, (y,) = _prep(x, c, y)
    return (x * y).sum(-1) - _time(x, c) * _time(y, c)


def _rowwise_w(x: Tensor, y: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``w = (-c<x,y>_L - 1) / 2`` row-wise without cancellation.

    ``-c<x,y>_L - 1 = (c/2) (|x - y|^2 - (t_y - t_x)^2)`` and
    ``t_y - t_x = (y - x).(x + y) / (t_x + t_y)``: both differences are formed from
    ``delta = y - x`` directly, so nearby points keep their small distance to relative
    precision instead of losing it to ``t_x t_y - x.y``. Also returns ``t_x, t_y, delta`` and
    ``t_y - t_x``.
    """
    tx, ty = _time(x, c), _time(y, c)
    delta = y - x
    dt = torch.linalg.vecdot(delta, x + y) / (tx + ty)
    w = 0.25 * c * (_sqnorm(delta) - dt * dt)
    return w, tx, ty, delta, dt


@no_autocast
def dist(x: Tensor, y: Tensor, c: Curvature) -> Tensor:
    """Row-wise geodesic distance ``acosh(-c<x,y>_L) / sqrt(c)`` (AtMG Eq. 4). -> ``[...]``.

    Formed from ``y - x`` (see :func:`_rowwise_w`): relative precision even for nearby points,
    exactly 0 at ``x = y`` with a finite gradient.
    """
    check_points(x, "x")
    check_points(y, "y")
    x, c, (y,) = _prep(x, c, y)
    w = _rowwise_w(x, y, c)[0]
    # w carries relative (not absolute) error here, so the chord below sqrt(tiny) is harmless.
    return _asinh_dist(w, c, tiny_floor(x.dtype))


@no_autocast
def excess(x: Tensor, y: Tensor, c: Curvature) -> Tensor:
    """Row-wise ``z = -c<x,y>_L - 1 >= 0`` without cancellation (see :func:`_rowwise_w`; ``z = 2w``),
    over broadcast ``[..., d]`` inputs -> ``[...]``. ``dist(x, y) = acosh(1 + z) / sqrt(c)``
    (:func:`dist_from_excess`); an index certifies its float32 candidates in float64 with it."""
    check_points(x, "x")
    check_points(y, "y")
    x, c, (y,) = _prep(x, c, y)
    return (2.0 * _rowwise_w(x, y, c)[0]).clamp_min(0.0)


@no_autocast
def dist_from_excess(z: Tensor, c: Curvature) -> Tensor:
    """``acosh(1 + z) / sqrt(c)`` from the excess ``z`` of :func:`excess` (``[...]``), as
    ``log1p(z + sqrt(z (z + 2)))``: exact near ``z = 0``, exactly 0 there."""
    check_points(z, "z", min_dim=0)
    z, c, _ = _prep(z, c)
    return _acosh_1p2w(0.5 * z) * torch.rsqrt(c)


@no_autocast
def poincare(x: Tensor, c: Curvature) -> Tensor:
    """Poincare-ball coordinates ``x / (1 + sqrt(c) time(x))`` of Lorentz points ``[..., d]``
    (the ball of radius ``1/sqrt(c)``; conformal, so Euclidean neighbours there are hyperbolic
    neighbours to first order: an approximate index builds its graph on them)."""
    check_points(x, "x")
    x, c, _ = _prep(x, c)
    return x / (1.0 + torch.sqrt(c) * _time(x, c)).unsqueeze(-1)


@no_autocast
def dist0(x: Tensor, c: Curvature) -> Tensor:
    """Distance to the origin ``acosh(sqrt(c) time(x)) / sqrt(c) = asinh(sqrt(c)|x|) / sqrt(c)``.

    The asinh form avoids acosh's infinite derivative at the origin. ``[..., d]`` -> ``[...]``.
    """
    check_points(x, "x")
    x, c, _ = _prep(x, c)
    sc = torch.sqrt(c)
    return torch.asinh(sc * safe_norm(x, eps(x.dtype) ** 2)) / sc


@no_autocast
def half_aperture(x: Tensor, c: Curvature, K: float = 0.1) -> Tensor:
    """Half-aperture of the entailment cone at ``x``: ``asin(min(1, 2K / (sqrt(c)|x|)))``.

    AtMG Eq. (10) / MERU. The argument is clamped to ``1 - eps`` so asin's derivative stays
    finite; ``|x| >= eps``. ``[..., d]`` -> ``[...]``.
    """
    check_points(x, "x")
    if not K > 0:
        raise ValueError(f"K: expected a number > 0, got {K}")
    x, c, _ = _prep(x, c)
    e = eps(x.dtype)
    arg = 2.0 * K / (torch.sqrt(c) * safe_norm(x, e))
    return torch.asin(arg.clamp_max(1.0 - e))


@no_autocast
def exterior_angle(x: Tensor, y: Tensor, c: Curvature) -> Tensor:
    """Row-wise exterior angle at ``x`` towards ``y`` (AtMG Eq. 9, MERU ``oxy_angle``).

    The angle at ``x`` between the geodesic from the origin through ``x`` (continued beyond
    ``x``) and the geodesic from ``x`` to ``y``; in ``[0, pi]``, 0 when ``y`` lies on the ray
    from the origin beyond ``x``. ``x, y: [..., d]`` -> ``[...]``.

    Computed as ``atan2(sin, cos)`` with the common factor ``1 / sqrt(z^2 - 1)`` dropped:
    ``cos`` is Eq. (9), whose numerator over ``|x|`` is ``c (t_x x^.y - |x| t_y)`` (because
    ``c t_x^2 = 1 + c|x|^2``) = ``c (t_x x^.delta - |x| (t_y - t_x))`` with ``delta = y - x``;
    ``sin = sqrt(c) |delta_perp| / sqrt(z^2 - 1)`` by the hyperbolic law of sines in the
    triangle (origin, x, y), ``delta_perp`` the part of ``delta`` orthogonal to ``x``. Both are
    formed from ``delta``, so small angles and nearby points keep relative precision (``acos``
    of a cosine near 1 would lose half the digits). Gradients are bounded (by about
    ``1/sqrt(eps)``) where the angle is undetermined: at ``x = y``, and at ``x = 0`` (no ray;
    the value there is ``pi/2``).
    """
    check_points(x, "x")
    check_points(y, "y")
    x, c, (y,) = _prep(x, c, y)
    e = eps(x.dtype)
    _, tx, _, delta, dt = _rowwise_w(x, y, c)
    nx = safe_norm(x, e)
    xhat = x / nx.unsqueeze(-1)
    along = torch.linalg.vecdot(xhat, delta)
    perp = torch.addcmul(delta, along.unsqueeze(-1), xhat, value=-1.0)
    sin_part = torch.sqrt(c) * safe_norm(perp, tiny_floor(x.dtype))
    cos_part = c * (tx * along - nx * dt)
    return bounded_atan2(sin_part, cos_part, math.sqrt(e))


# ----------------------------------------------------------------------------------------
# Pairwise functions
# ----------------------------------------------------------------------------------------


def _pairwise_prep(X: Tensor, Y: Tensor, c: Curvature) -> tuple[Tensor, Tensor, Tensor]:
    """Bring ``X, Y`` into ``[N, d], [M, d]`` or factor layout ``[k, N, d], [k, M, d]``.

    Returns the working-dtype tensors and ``c`` shaped to broadcast against ``[..., N, M]``.
    """
    check_points(X, "X", 2)
    check_points(Y, "Y", 2)
    if X.dim() != Y.dim() or X.dim() > 3:
        raise ValueError(
            "X, Y: expected [N, d] and [M, d], or factor layout [N, k, d] and [M, k, d]; "
            f"got {tuple(X.shape)} and {tuple(Y.shape)}"
        )
    if X.shape[1:] != Y.shape[1:]:
        raise ValueError(
            f"X, Y: trailing shapes must match, got {tuple(X.shape)} and {tuple(Y.shape)}"
        )
    dtype = work_dtype(X, Y, c)
    cc = as_positive(c, "c", dtype, X.device)
    X, Y = X.to(dtype), Y.to(dtype)
    if X.dim() == 3:
        X, Y = X.transpose(0, 1), Y.transpose(0, 1)
        k = X.shape[0]
        if cc.numel() not in (1, k):
            raise ValueError(f"c: expected a scalar or shape [{k}], got {tuple(cc.shape)}")
        cc = cc.reshape(-1, 1, 1) if cc.numel() == k and cc.dim() else cc.reshape(())
    else:
        if cc.numel() != 1:
            raise ValueError(f"c: expected a scalar for X of shape [N, d], got {tuple(cc.shape)}")
        cc = cc.reshape(())
    return X, Y, cc


def _gram(X: Tensor, Y: Tensor) -> Tensor:
    return X @ Y.transpose(-1, -2)


@no_autocast
def pairwise_inner(X: Tensor, Y: Tensor, c: Curvature) -> Tensor:
    """All Minkowski inner products ``x_i.y_j - time(x_i) time(y_j)``.

    ``X: [N, d]``, ``Y: [M, d]`` -> ``[N, M]`` (factor layout ``[N, k, d]`` -> ``[k, N, M]``).
    """
    X, Y, c = _pairwise_prep(X, Y, c)
    return _gram(X, Y) - _time(X, c.squeeze(-1)).unsqueeze(-1) * _time(Y, c.squeeze(-1)).unsqueeze(
        -2
    )


def minkowski_operands(X: Tensor, Y: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``P = (c/2) [x, t_x]`` and ``Q = [y, -t_y]`` for ``X: [k, N, d]``, ``Y: [k, M, d]``, ``c: [k]``.

    ``-P.Q - 1/2 = (-c<x,y>_L - 1) / 2 = w``: the Minkowski Gram matrix is one batched matrix
    product of the time-augmented points, no separate outer product of times. Built with
    autograd (they are small, ``[k, n, d+1]``), so the dependence of the times on ``x`` and
    ``c`` is differentiated for free.
    """
    cv = c.view(-1, 1)
    tx = torch.sqrt(cv.reciprocal() + _sqnorm(X))
    ty = torch.sqrt(cv.reciprocal() + _sqnorm(Y))
    # Wide operands are zero-padded to a multiple of 8 columns: 513 is a slow GEMM shape on CPU
    # (about +19% against 520), and the padded columns add exact zeros to every product.
    width = X.shape[-1] + 1
    pad = (-width) % 8 if width > _PAD_FROM else 0
    P = torch.cat([X, tx.unsqueeze(-1), X.new_zeros(*X.shape[:-1], pad)], -1)
    P = P * (0.5 * c.view(-1, 1, 1))
    Q = torch.cat([Y, -ty.unsqueeze(-1), Y.new_zeros(*Y.shape[:-1], pad)], -1)
    return P, Q


#: Time-augmented operands wider than this are padded to a multiple of 8 columns (narrow
#: factors, e.g. PHyCLIP's d + 1 = 9, would almost double their work instead).
_PAD_FROM = 64


def _w_block(P: Tensor, Q: Tensor) -> Tensor:
    """``w = -P Q^T - 1/2``: ``[k, n, d+1], [k, M, d+1]`` -> ``[k, n, M]``."""
    return torch.baddbmm(P.new_full((1, 1, 1), -0.5), P, Q.transpose(1, 2), alpha=-1.0)


def _acosh_1p2w(w: Tensor) -> Tensor:
    """``acosh(1 + 2u)`` with ``u = max(w, 0)``, as ``log1p(2 (u + sqrt(u + u^2)))``.

    Same value as ``2 asinh(sqrt(u))``, without cancellation near 0 (log1p), exactly 0 at
    ``u = 0``; and log1p/sqrt are vectorised on CPU where asinh/acosh are not (about 10x).
    """
    u = w.clamp_min(0.0)
    return torch.addcmul(u, u, u).sqrt_().add_(u).mul_(2.0).log1p_()


def _dacosh_dw(w: Tensor, w0: float) -> Tensor:
    """``d acosh(1 + 2w) / dw = 1 / sqrt(w (1 + w))`` with ``w`` floored at ``w0``; 0 for ``w <= 0``.

    The floor bounds the gradient by ``1 / sqrt(w0)`` where the true one grows without bound
    (``x -> y``); below ``w0`` (the Gram matrix's rounding floor) the value is noise anyway.
    """
    wc = w.clamp_min(w0)
    return torch.addcmul(wc, wc, wc).rsqrt_().masked_fill_(w <= 0.0, 0.0)


def _row_blocks(k: int, n: int, m: int, budget: int) -> tuple[int, int]:
    """Factors and rows per block so that a ``[kc, nb, m]`` block holds about ``budget`` elements."""
    if k * n * m <= budget:
        return k, n
    if n * m <= budget:
        return max(1, budget // (n * m)), n
    return 1, max(1, budget // m)


class _PairwiseAcosh(torch.autograd.Function):
    """``d = acosh(1 + 2w) * s`` with ``w = -P Q^T - 1/2`` per factor, ``s = 1/sqrt(c)``.

    ``P: [k, N, d+1]``, ``Q: [k, M, d+1]``, ``s: [k]``. Without ``reduce_sum`` returns
    ``[k, N, M]`` and saves ``w`` (no second Gram matrix in the backward). With it returns the
    ``[N, M]`` sum over factors, computed block by block (``[kc, nb, M]``, about ``block``
    elements, small enough to stay in cache); only the inputs are saved and the backward
    recomputes each block, so no ``[k, N, M]`` tensor exists in either pass.

    Backward per factor with ``G = dL/dd * s * dacosh/dw``: ``dL/dP = -G Q``,
    ``dL/dQ = -G^T P``, ``dL/ds = sum dL/dd * acosh(1 + 2w)``.
    """

    @staticmethod
    def forward(ctx, P: Tensor, Q: Tensor, s: Tensor, reduce_sum: bool, block: int) -> Tensor:
        k, N, _ = P.shape
        M = Q.shape[1]
        ctx.reduce_sum, ctx.block, ctx.w0 = reduce_sum, block, eps(P.dtype)
        s3 = s.view(-1, 1, 1)
        if not reduce_sum:
            w = _w_block(P, Q)
            out = _acosh_1p2w(w).mul_(s3)
            ctx.save_for_backward(P, Q, s, w, out)
            return out
        out = P.new_zeros(N, M)
        kc, nb = _row_blocks(k, N, M, block)
        for j0 in range(0, k, kc):
            j1 = min(k, j0 + kc)
            for i0 in range(0, N, nb):
                i1 = min(N, i0 + nb)
                d = _acosh_1p2w(_w_block(P[j0:j1, i0:i1], Q[j0:j1]))
                # Scale by 1/sqrt(c_k) and sum over factors in one pass: [kc] x [kc, nb*M].
                out[i0:i1] += torch.tensordot(s[j0:j1], d, dims=1)
        ctx.save_for_backward(P, Q, s)
        return out

    @staticmethod
    @no_autocast  # the backward runs outside the forward's context: keep float32 here too
    def backward(ctx, grad: Tensor):
        need_p, need_q, need_s = ctx.needs_input_grad[:3]
        w0 = ctx.w0
        if not ctx.reduce_sum:
            P, Q, s, w, out = ctx.saved_tensors
            G = _dacosh_dw(w, w0).mul_(grad)
            minus_s = -s.view(-1, 1, 1)  # applied to the small [k, n, d+1] products
            gP = torch.bmm(G, Q).mul_(minus_s) if need_p else None
            gQ = torch.bmm(G.transpose(1, 2), P).mul_(minus_s) if need_q else None
            gs = (grad * out).sum((1, 2)) / s if need_s else None
            return gP, gQ, gs, None, None
        P, Q, s = ctx.saved_tensors
        k, N, _ = P.shape
        M = Q.shape[1]
        gP = torch.zeros_like(P) if need_p else None
        gQ = None
        gs = torch.zeros_like(s) if need_s else None
        s3 = s.view(-1, 1, 1)
        # The two products below have only d + 1 output columns (9 for PHyCLIP): as
        # ``[d+1, M] @ G^T`` and ``P^T @ G`` (wide outputs, transposed afterwards) they run
        # 3-6x faster on CPU than ``G @ Q`` and ``G^T @ P`` (the same sums).
        r_floor = math.sqrt(w0 * (1.0 + w0))  # _dacosh_dw's floor: 1 / r <= 1 / r_floor
        Qt = Q.transpose(1, 2).contiguous() if need_p else None
        Pt = P.transpose(1, 2).contiguous() if need_q else None
        gQt = torch.zeros_like(Q.transpose(1, 2)) if need_q else None
        kc, nb = _row_blocks(k, N, M, ctx.block)
        for j0 in range(0, k, kc):
            j1 = min(k, j0 + kc)
            for i0 in range(0, N, nb):
                i1 = min(N, i0 + nb)
                Pb, Qb = P[j0:j1, i0:i1], Q[j0:j1]
                w = _w_block(Pb, Qb)
                g = grad[i0:i1].unsqueeze(0)
                # acosh(1 + 2u) = log1p(2 (u + r)) and its derivative 1 / r share
                # r = sqrt(u + u^2), u = max(w, 0): one square root for both
                u = w.clamp_min_(0.0)
                r = torch.addcmul(u, u, u).sqrt_()
                if need_s:  # sum over the block of grad * acosh, as a matrix-vector product
                    acosh = torch.add(r, u).mul_(2.0).log1p_()
                    assert gs is not None
                    gs[j0:j1] += acosh.flatten(1) @ g.reshape(-1)
                    del acosh
                G = r.clamp_min_(r_floor).reciprocal_().masked_fill_(u == 0.0, 0.0).mul_(g)
                del w, u, r
                s3b = s3[j0:j1]
                if need_p:
                    assert gP is not None and Qt is not None
                    gP[j0:j1, i0:i1] = torch.bmm(Qt[j0:j1], G.transpose(1, 2)).transpose(1, 2)
                    gP[j0:j1, i0:i1] *= -s3b
                if need_q:
                    assert gQt is not None and Pt is not None
                    gQt[j0:j1] -= torch.bmm(Pt[j0:j1, :, i0:i1], G).mul_(s3b)
        if gQt is not None:
            gQ = gQt.transpose(1, 2)
        return gP, gQ, gs, None, None


def factor_pairwise_dist(
    X: Tensor, Y: Tensor, c: Tensor, reduce_sum: bool = False, block: int = 1 << 18
) -> Tensor:
    """Per-factor pairwise distances in factor-major layout (building block of the public API).

    ``X: [k, N, d]``, ``Y: [k, M, d]`` (working dtype), ``c: [k]`` or ``[1]`` -> ``[k, N, M]``,
    or with ``reduce_sum`` the ``[N, M]`` sum over factors, built in blocks of about ``block``
    pair-factor elements (peak extra memory about ``4 * block`` elements beyond the output).
    """
    k = X.shape[0]
    c = c.reshape(-1).expand(k)
    P, Q = minkowski_operands(X, Y, c)
    return _PairwiseAcosh.apply(P, Q, torch.rsqrt(c), reduce_sum, int(block))


@no_autocast
def pairwise_dist(
    X: Tensor, Y: Tensor, c: Curvature, fused: bool | None = None, scale: float = 1.0
) -> Tensor:
    """All geodesic distances ``acosh(-c<x_i,y_j>_L) / sqrt(c)`` (AtMG Eq. 4).

    ``X: [N, d]``, ``Y: [M, d]`` -> ``[N, M]`` (factor layout ``[N, k, d]`` -> ``[k, N, M]``).
    One matrix product, vectorised elementwise maps and a hand-written backward (two matrix
    products). Exactly 0 where ``-c<x,y>_L <= 1`` (x = y up to rounding); the gradient is
    bounded by flooring ``(z - 1)/2`` at ``eps`` inside the derivative. Accuracy floor: the
    Gram matrix carries an absolute error of about ``eps c t_x t_y`` in ``z``, so for nearby
    points with large norms use the row-wise :func:`dist`, which forms ``y - x`` directly.

    On CPU (float32/float64 working dtype) the default path is the fused C++ kernel of
    :mod:`curvalign.geometry._fused_lorentz` (the space Gram matrix in torch, every elementwise
    map one pass forward and one backward; compiled once on first use and cached).
    ``fused=False`` or ``CURVALIGN_FUSED=0`` selects the eager reference it is tested against
    (also used for CUDA tensors and, after one warning, when the kernel cannot be built).

    ``scale`` (a constant) multiplies the result: the fused kernel folds it into its
    ``1/sqrt(c)`` factor, so a score ``-d`` (``scale=-1``) costs no extra pass over the matrix.
    """
    X, Y, c = _pairwise_prep(X, Y, c)
    squeeze = X.dim() == 2
    if squeeze:
        X, Y = X.unsqueeze(0), Y.unsqueeze(0)
    if fused is not False and _fused_lorentz.available(X, Y, c):
        return _fused_lorentz.pairwise_dist_fused(X, Y, c.reshape(-1), squeeze, scale)
    out = factor_pairwise_dist(X, Y, c.reshape(-1))
    out = out[0] if squeeze else out
    return out if scale == 1.0 else out * scale


class _PairwiseExteriorAngle(torch.autograd.Function):
    """Exterior angles for all pairs from one Gram matrix, with a hand-written backward.

    Inputs (made by autograd outside, so their dependence on ``x``, ``y`` and ``c`` needs no
    code here): ``Xs = (c/2) X: [k, N, d]``, ``Y: [k, M, d]``, ``txs = (c/2) time(x)``,
    ``u = time(x) / |x|``, ``a = (c/2) |x|^2 / time(x)`` (``[k, N]``) and ``ty = time(y)``
    (``[k, M]``). With ``Gs = Xs Y^T``:
    ``h = txs ty - Gs = w + 1/2`` (``w = (z - 1)/2``), ``w (1 + w) = h^2 - 1/4``,
    numerator ``n = u (Gs - a ty) = (c/2)(t_x (x.y)/|x| - |x| t_y)`` (AtMG Eq. 9 over ``|x|``),
    ``cos = n / sqrt(h^2 - 1/4)`` with ``h^2 - 1/4`` floored at ``eps (1 + eps)``,
    ``alpha = acos(clamp(cos, -1 + eps, 1 - eps))``. At the clamp the backward uses the slope at
    the boundary (bounded by ``1/sqrt(2 eps)``); at the floor the ``h`` path is cut.
    """

    @staticmethod
    def forward(ctx, Xs, Y, txs, u, a, ty):
        e = eps(Xs.dtype)
        q_min = e * (1.0 + e)
        Gs = torch.bmm(Xs, Y.transpose(1, 2))
        ty_row = ty.unsqueeze(1)
        h = torch.baddbmm(Gs, txs.unsqueeze(-1), ty_row, beta=-1.0)
        q = torch.addcmul(h.new_full((1, 1, 1), -0.25), h, h)
        floored = q <= q_min
        den = q.clamp_min_(q_min).rsqrt_()
        cos = torch.baddbmm(Gs, a.unsqueeze(-1), ty_row, alpha=-1.0)
        del Gs
        cos.mul_(den).mul_(u.unsqueeze(-1))
        bound = 1.0 - e
        cos.clamp_(-bound, bound)
        ctx.save_for_backward(Xs, Y, txs, u, a, ty, h, den, cos, floored)
        return torch.acos(cos)

    @staticmethod
    @no_autocast  # the backward runs outside the forward's context: keep float32 here too
    def backward(ctx, grad):
        Xs, Y, txs, u, a, ty, h, den, cos, floored = ctx.saved_tensors
        r = torch.addcmul(torch.ones_like(cos), cos, cos, value=-1.0).rsqrt_().mul_(grad)
        p = r * den  # -dL/dn
        rc = r.mul_(cos)  # r consumed
        g_u = -rc.sum(-1) / u  # dL/du = sum_j dL/dn * n / u = -sum_j r cos / u
        g_h = rc.mul_(h).mul_(den).mul_(den).masked_fill_(floored, 0.0)  # dL/dh
        g_txs = torch.bmm(g_h, ty.unsqueeze(-1)).squeeze(-1)
        g_ty = torch.bmm(g_h.transpose(1, 2), txs.unsqueeze(-1)).squeeze(-1)
        g_ty += torch.bmm(p.transpose(1, 2), (u * a).unsqueeze(-1)).squeeze(-1)
        g_a = u * torch.bmm(p, ty.unsqueeze(-1)).squeeze(-1)
        minus_gGs = p.mul_(u.unsqueeze(-1)).add_(g_h)  # -dL/dGs
        del g_h
        gXs = torch.bmm(minus_gGs, Y).neg_()
        gY = torch.bmm(minus_gGs.transpose(1, 2), Xs).neg_()
        return gXs, gY, g_txs, g_u, g_a, g_ty


@no_autocast
def pairwise_exterior_angle(
    X: Tensor, Y: Tensor, c: Curvature, fused: bool | None = None
) -> Tensor:
    """Exterior angle at every ``x_i`` towards every ``y_j`` (AtMG Eq. 9), in ``[0, pi]``.

    ``X: [N, d]``, ``Y: [M, d]`` -> ``[N, M]`` (factor layout ``[N, k, d]`` -> ``[k, N, M]``).
    One Gram matrix, elementwise maps, a hand-written backward (two matrix products). The
    cosine is clamped into ``[-1 + eps, 1 - eps]`` (so the angle has a ``sqrt(2 eps)`` floor:
    the Gram matrix's rounding puts the same floor on its accuracy anyway); use the row-wise
    :func:`exterior_angle` where small angles must be exact.

    On CPU (float32/float64) the elementwise maps run as one fused C++ pass forward and one
    backward (:mod:`curvalign.geometry._fused_lorentz`, same operands and formulas);
    ``fused=False`` or ``CURVALIGN_FUSED=0`` selects the eager reference (also used for CUDA
    tensors and, after one warning, when the kernel cannot be built).
    """
    X, Y, c = _pairwise_prep(X, Y, c)
    squeeze = X.dim() == 2
    if squeeze:
        X, Y = X.unsqueeze(0), Y.unsqueeze(0)
    if fused is not False and _fused_lorentz.available(X, Y, c):
        return _fused_lorentz.pairwise_angle_fused(X, Y, c.reshape(-1), squeeze)
    k = X.shape[0]
    cv = c.reshape(-1).expand(k).view(-1, 1)
    e = eps(X.dtype)
    tx = torch.sqrt(cv.reciprocal() + _sqnorm(X))
    ty = torch.sqrt(cv.reciprocal() + _sqnorm(Y))
    nx = safe_norm(X, e)
    half_c = 0.5 * cv
    out = _PairwiseExteriorAngle.apply(
        X * half_c.unsqueeze(-1), Y, half_c * tx, tx / nx, half_c * nx * nx / tx, ty
    )
    return out[0] if squeeze else out


@no_autocast
def pairwise_exterior_angles(
    X: Tensor, Y: Tensor, c: Curvature, fused: bool | None = None
) -> tuple[Tensor, Tensor]:
    """Both ways at once: ``(pairwise_exterior_angle(X, Y, c), pairwise_exterior_angle(Y, X, c))``,
    the angles at every ``x_i`` towards every ``y_j`` ``[N, M]`` and at every ``y_j`` towards
    every ``x_i`` ``[M, N]`` (AtMG Eq. 9; its loss, Eq. 11, takes one at the text and one at the
    image).

    ``X: [N, d]``, ``Y: [M, d]``, scalar ``c``. The two Gram matrices are one matrix and its
    transpose, and the two angles' gradients with respect to it add: on the fused CPU path
    (:mod:`curvalign.geometry._fused_lorentz`) one GEMM forward and two backward, where two
    calls take three each. Otherwise (``fused=False``, CUDA, the factor layout) the two calls.
    """
    Xp, Yp, cc = _pairwise_prep(X, Y, c)
    if fused is not False and Xp.dim() == 2 and _fused_lorentz.available(Xp, Yp, cc):
        return _fused_lorentz.pairwise_angles_both_fused(Xp, Yp, cc.reshape(1))
    return (
        pairwise_exterior_angle(X, Y, c, fused=fused),
        pairwise_exterior_angle(Y, X, c, fused=fused),
    )


# ----------------------------------------------------------------------------------------
# Einstein midpoint
# ----------------------------------------------------------------------------------------


@no_autocast
def einstein_midpoint(
    X: Tensor, c: Curvature, weights: Tensor | None = None, dim: int = -2
) -> Tensor:
    """Weighted Einstein midpoint (hyperbolic centroid) of the points along axis ``dim``.

    AtMG Eq. (5)-(6) with Klein coordinates ``k = x / time(x)`` and Lorentz factors
    ``gamma = 1 / sqrt(1 - |k|^2) = sqrt(c) time(x)`` (docs/design.md: ``1 - |k|^2``, the Klein ball
    of space/time coordinates has radius 1). Then ``sum_j w_j gamma_j k_j / sum_j w_j gamma_j
    = S / T`` with ``S = sum_j w_j x_j`` and ``T = sum_j w_j time(x_j)``, and mapping back,
    ``(1, m) / sqrt(c (1 - |m|^2))``, gives the space part ``S / sqrt(c (T^2 - |S|^2))``.

    ``T^2 - |S|^2 = (T - |S|)(T + |S|)`` is formed as
    ``T - |S| = sum_j w_j (t_j - |x_j|) + (sum_j w_j |x_j| - |S|)`` in float64: the first sum
    is ``sum_j w_j / (c (t_j + |x_j|))`` (no cancellation), the second is >= 0 by the triangle
    inequality. ``T^2 - |S|^2 >= (sum_j w_j)^2 / c`` holds exactly, and is used as the clamp.

    ``X: [..., n, ..., d]`` with the set axis ``dim`` (any axis but the last; for PHyCLIP points
    ``[B, k, d]`` with ``c: [k]`` use ``dim=0``);
    ``c`` and ``weights`` (non-negative, not all zero) broadcast against ``X.shape[:-1]``.
    Returns ``X.shape`` without axis ``dim``. The midpoint of one point is that point.
    """
    check_points(X, "X", 2)
    out_dtype = work_dtype(X, c, *([weights] if weights is not None else []))
    if not -X.dim() <= dim < X.dim() or dim % X.dim() == X.dim() - 1:
        raise ValueError(
            f"dim: expected an axis of X other than the last (coordinates), got {dim} for shape {tuple(X.shape)}"
        )
    dim = dim % X.dim()
    dtype = torch.float64
    x = X.to(dtype)
    cc = as_positive(c, "c", dtype, X.device)
    try:
        cb = torch.broadcast_to(cc, X.shape[:-1])
    except RuntimeError:
        raise ValueError(
            f"c: shape {tuple(cc.shape)} does not broadcast against X.shape[:-1] = {tuple(X.shape[:-1])}"
        ) from None
    if weights is None:
        wts = torch.ones(X.shape[:-1], dtype=dtype, device=X.device)
    else:
        if not isinstance(weights, Tensor):
            raise TypeError(f"weights: expected a tensor, got {type(weights).__name__}")
        try:
            wts = torch.broadcast_to(weights.to(dtype), X.shape[:-1])
        except RuntimeError:
            raise ValueError(
                f"weights: shape {tuple(weights.shape)} does not broadcast against "
                f"X.shape[:-1] = {tuple(X.shape[:-1])}"
            ) from None
        if bool((wts < 0).any()) or bool((wts.sum(dim) <= 0).any()):
            raise ValueError("weights: expected non-negative weights with a positive sum per set")
    tiny = torch.finfo(dtype).tiny
    sq = _sqnorm(x)
    norm = torch.sqrt(sq.clamp_min(tiny))  # finite gradient at x = 0
    t = torch.sqrt(cb.reciprocal() + sq)
    S = (wts.unsqueeze(-1) * x).sum(dim)
    T_minus_absx = (wts / (cb * (t + norm))).sum(dim)
    absS = torch.sqrt(_sqnorm(S).clamp_min(tiny))
    gap = T_minus_absx + ((wts * norm).sum(dim) - absS).clamp_min(0.0)
    T = (wts * t).sum(dim)
    c_set = cb.mean(dim)  # c is constant along the set axis; the mean keeps its gradient
    lower = wts.sum(dim) ** 2 / c_set
    denom2 = (gap * (T + absS)).clamp_min(lower)
    return (S / torch.sqrt(c_set * denom2).unsqueeze(-1)).to(out_dtype)


def tangent_mean(x: Tensor, c: Curvature, dim: int = 0) -> Tensor:
    """Centroid through the tangent space at the origin: ``expmap0(mean(logmap0(x)))`` over ``dim``
    (kept, with size 1). MERU's class embedding from prompt embeddings; with ``x: [P, k, d]``
    and ``c: [k]`` it is taken per factor (PHyCLIP). Exact for points on one geodesic through the
    origin on the same side of it (their tangent vectors are parallel)."""
    return expmap0(logmap0(x, c).mean(dim=dim, keepdim=True), c)
