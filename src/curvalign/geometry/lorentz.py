"""The Lorentz (hyperboloid) model of hyperbolic space with sectional curvature ``-c``.

Conventions (DESIGN.md, "Public API"):

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

from curvalign.geometry._numerics import (
    Curvature,
    acos_safe,
    as_positive,
    check_points,
    eps,
    no_autocast,
    safe_norm,
    sqrt_lin,
    work_dtype,
)

__all__ = [
    "time",
    "expmap0",
    "logmap0",
    "inner",
    "dist",
    "pairwise_inner",
    "pairwise_dist",
    "dist0",
    "half_aperture",
    "exterior_angle",
    "pairwise_exterior_angle",
    "einstein_midpoint",
]

# sinh(asinh(2^15)) = 2^15: the largest hyperbolic radius sqrt(c)|v| the exponential map lets
# through, so that sinh (and later cosh-sized products of two such points) cannot overflow.
MAX_SQRT_C_RADIUS = math.asinh(2.0**15)


def _prep(x: Tensor, c: Curvature, *others: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
    dtype = work_dtype(x, c, *others)
    cc = as_positive(c, "c", dtype, x.device)
    return x.to(dtype), cc, [o.to(dtype) for o in others]


def _sqnorm(x: Tensor) -> Tensor:
    return (x * x).sum(-1)


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


@no_autocast
def expmap0(v: Tensor, c: Curvature) -> Tensor:
    """Space part of the exponential map at the origin, ``sinh(sqrt(c)|v|) / (sqrt(c)|v|) * v``.

    ``v: [..., d]`` tangent vectors at the origin (their time component is 0) -> ``[..., d]``.
    ``sqrt(c)|v|`` is clamped to ``asinh(2^15)`` so ``sinh`` cannot overflow; below the
    dtype's series threshold ``sinh(r)/r`` is its Taylor series (no 0/0 at ``v = 0``).
    """
    check_points(v, "v")
    v, c, _ = _prep(v, c)
    cb = c.unsqueeze(-1) if c.dim() else c
    r2 = cb * _sqnorm(v).unsqueeze(-1)
    # Taylor series 1 + r^2/6 + r^4/120 is exact to the dtype below r^6/5040 < eps.
    r_small = (5040.0 * eps(v.dtype)) ** (1.0 / 6.0)
    series = 1.0 + r2 / 6.0 + r2 * r2 / 120.0
    r = torch.sqrt(r2.clamp_min(r_small * r_small))
    ratio = torch.sinh(r.clamp_max(MAX_SQRT_C_RADIUS)) / r
    return torch.where(r2 < r_small * r_small, series, ratio) * v


@no_autocast
def logmap0(x: Tensor, c: Curvature) -> Tensor:
    """Inverse of :func:`expmap0`: ``asinh(sqrt(c)|x|) / (sqrt(c)|x|) * x``. ``[..., d]``."""
    check_points(x, "x")
    x, c, _ = _prep(x, c)
    cb = c.unsqueeze(-1) if c.dim() else c
    r2 = cb * _sqnorm(x).unsqueeze(-1)
    # asinh(r)/r = 1 - r^2/6 + 3 r^4/40 - ...; next term 15 r^6/336 below eps.
    r_small = (336.0 / 15.0 * eps(x.dtype)) ** (1.0 / 6.0)
    series = 1.0 - r2 / 6.0 + 3.0 * r2 * r2 / 40.0
    r = torch.sqrt(r2.clamp_min(r_small * r_small))
    ratio = torch.asinh(r) / r
    return torch.where(r2 < r_small * r_small, series, ratio) * x


@no_autocast
def inner(x: Tensor, y: Tensor, c: Curvature) -> Tensor:
    """Row-wise Minkowski inner product ``x.y - time(x) time(y)``. ``[..., d]`` -> ``[...]``."""
    check_points(x, "x")
    check_points(y, "y")
    x, c, (y,) = _prep(x, c, y)
    return (x * y).sum(-1) - _time(x, c) * _time(y, c)


def _rowwise_w(x: Tensor, y: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``w = (-c<x,y>_L - 1) / 2`` row-wise without cancellation, plus ``time(x), time(y)``.

    ``-c<x,y>_L - 1 = (c/2) (|x - y|^2 - (t_x - t_y)^2)`` and
    ``t_x - t_y = (x - y).(x + y) / (t_x + t_y)``: both differences are formed from ``x - y``
    directly, so nearby points keep their small distance instead of rounding it away.
    """
    tx, ty = _time(x, c), _time(y, c)
    delta = x - y
    dt = (delta * (x + y)).sum(-1) / (tx + ty)
    w = 0.25 * c * (_sqnorm(delta) - dt * dt)
    return w, tx, ty


@no_autocast
def dist(x: Tensor, y: Tensor, c: Curvature) -> Tensor:
    """Row-wise geodesic distance ``acosh(-c<x,y>_L) / sqrt(c)`` (AtMG Eq. 4). -> ``[...]``."""
    check_points(x, "x")
    check_points(y, "y")
    x, c, (y,) = _prep(x, c, y)
    w, _, _ = _rowwise_w(x, y, c)
    return _asinh_dist(w, c, eps(x.dtype))


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


def _exterior_cos(
    xy: Tensor, nx: Tensor, tx: Tensor, ty: Tensor, w: Tensor, c: Tensor, w0: float
) -> Tensor:
    """Cosine of the exterior angle from ``x.y``, ``|x|``, times and ``w = (z-1)/2``.

    AtMG Eq. (9): ``(t_y + t_x c<x,y>_L) / (|x| sqrt((c<x,y>_L)^2 - 1))``. Since
    ``c t_x^2 = 1 + c|x|^2`` the numerator over ``|x|`` is ``c (t_x (x.y)/|x| - |x| t_y)``,
    which has no ``1 - c t_x^2`` cancellation and no 0/0 at ``x = 0``; the denominator is
    ``sqrt(z^2 - 1) = 2 sqrt(w (1 + w))`` with ``w >= w0``.
    """
    numer = c * (tx * (xy / nx) - nx * ty)
    wc = w.clamp_min(w0)
    return 0.5 * numer * torch.rsqrt(wc * (1.0 + wc))


@no_autocast
def exterior_angle(x: Tensor, y: Tensor, c: Curvature) -> Tensor:
    """Row-wise exterior angle at ``x`` towards ``y`` (AtMG Eq. 9, MERU ``oxy_angle``).

    The angle at ``x`` between the geodesic from the origin through ``x`` (continued beyond
    ``x``) and the geodesic from ``x`` to ``y``; in ``[0, pi]``, 0 when ``y`` lies on the ray
    from the origin beyond ``x``. ``x, y: [..., d]`` -> ``[...]``. At ``x = 0`` (no ray) the
    value is ``pi/2``; at ``x = y`` it is finite (``pi/2`` up to rounding).
    """
    check_points(x, "x")
    check_points(y, "y")
    x, c, (y,) = _prep(x, c, y)
    e = eps(x.dtype)
    w, tx, ty = _rowwise_w(x, y, c)
    cos = _exterior_cos((x * y).sum(-1), safe_norm(x, e), tx, ty, w, c, e)
    return acos_safe(cos, e)


# ----------------------------------------------------------------------------------------
# Pairwise functions
# ----------------------------------------------------------------------------------------


def _pairwise_prep(
    X: Tensor, Y: Tensor, c: Curvature
) -> tuple[Tensor, Tensor, Tensor]:
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


def _pairwise_w(G: Tensor, tx: Tensor, ty: Tensor, c: Tensor) -> Tensor:
    """``w = (c (t_x t_y - x.y) - 1) / 2`` for all pairs; ``G`` the Gram matrix."""
    return 0.5 * (c * (tx.unsqueeze(-1) * ty.unsqueeze(-2) - G) - 1.0)


@no_autocast
def pairwise_inner(X: Tensor, Y: Tensor, c: Curvature) -> Tensor:
    """All Minkowski inner products ``x_i.y_j - time(x_i) time(y_j)``.

    ``X: [N, d]``, ``Y: [M, d]`` -> ``[N, M]`` (factor layout ``[N, k, d]`` -> ``[k, N, M]``).
    """
    X, Y, c = _pairwise_prep(X, Y, c)
    return _gram(X, Y) - _time(X, c.squeeze(-1)).unsqueeze(-1) * _time(Y, c.squeeze(-1)).unsqueeze(-2)


def _augment(X: Tensor, c: Tensor, time_sign: float, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``[x, time_sign * time(x)]`` (times ``scale``) for ``X: [k, n, d]``, ``c: [k]``; and times.

    With ``P = (c/2) [x, t_x]`` and ``Q = [y, -t_y]``, ``-P.Q - 1/2 = (-c<x,y>_L - 1) / 2``:
    the Minkowski Gram matrix is a single batched matrix product, no separate outer product.
    """
    t = torch.sqrt(c.reciprocal().unsqueeze(-1) + _sqnorm(X))
    aug = torch.cat([X, (time_sign * t).unsqueeze(-1)], -1)
    if scale is not None:
        aug = aug * scale
    return aug, t


def _factor_w(X: Tensor, Y: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``w = (-c<x_i,y_j>_L - 1) / 2`` per factor: ``[k, N, d], [k, M, d], [k]`` -> ``[k, N, M]``.

    Also returns the augmented ``[x, -t_x]``, ``[y, -t_y]`` and the times, for the backward.
    """
    half_c = 0.5 * c.view(-1, 1, 1)
    P, tx = _augment(X, c, 1.0, half_c)
    Q, ty = _augment(Y, c, -1.0)
    w = torch.baddbmm(P.new_full((1, 1, 1), -0.5), P, Q.transpose(1, 2), alpha=-1.0)
    return w, tx, ty, Q, P


def _dist_from_w(w: Tensor, c: Tensor, w0: float) -> Tensor:
    """``2 asinh(sqrt_lin(w)) / sqrt(c)`` with ``c: [k]`` against ``w: [k, N, M]``, fresh memory."""
    r = w.clamp_min(w0).rsqrt_()
    return w.clamp_min(0.0).mul_(r).asinh_().mul_((2.0 * torch.rsqrt(c)).view(-1, 1, 1))


def _ddist_dw(w: Tensor, c: Tensor, w0: float) -> Tensor:
    """Derivative of :func:`_dist_from_w` in ``w``.

    ``1 / (sqrt(c) sqrt(w (1 + w)))`` for ``w >= w0``; on the chord ``0 < w < w0`` it is
    ``2 / (sqrt(c) sqrt(w0 + w^2))`` (= twice the value at ``w0`` to rounding); 0 for ``w <= 0``.
    """
    wc = w.clamp_min(w0)
    fac = wc.mul(wc.add(1.0)).rsqrt_()
    chord = (w > 0.0).to(w.dtype).mul_(2.0 / math.sqrt(w0 * (1.0 + w0)))
    fac = torch.where(w >= w0, fac, chord)
    return fac.mul_(torch.rsqrt(c).view(-1, 1, 1))


class _FactorPairwiseDist(torch.autograd.Function):
    """Pairwise Lorentz distances per factor, optionally summed over factors.

    ``X: [k, N, d]``, ``Y: [k, M, d]``, ``c: [k]``. With ``reduce_sum`` the result is the
    ``[N, M]`` sum over factors, built ``chunk`` factors at a time; only the inputs are saved
    and the backward recomputes each chunk, so no ``[k, N, M]`` tensor exists in either pass
    (peak extra memory about ``5 * chunk * N * M`` elements). Without it the result is
    ``[k, N, M]`` and ``w`` is saved for the backward (no second Gram matrix).

    Backward for one factor, ``w = -(c/2)(x.y - t_x t_y) - 1/2``, ``G = dL/dd * dd/dw``:
    ``dL/dx_i = -(c/2) (sum_j G_ij y_j - (sum_j G_ij t_yj) x_i / t_xi)`` (two matrix products
    with the augmented ``[y, -t_y]``), symmetrically for ``y``, and
    ``dL/dc = sum (G (2w + 1) - dL/dd * d) / (2c) - sum G (t_y/t_x + t_x/t_y) / (4c)``
    (``d`` depends on ``c`` through ``1/sqrt(c)``, ``w`` through ``c`` and both times).
    """

    @staticmethod
    def forward(ctx, X: Tensor, Y: Tensor, c: Tensor, reduce_sum: bool, chunk: int) -> Tensor:  # type: ignore[override]
        k, N, _ = X.shape
        M = Y.shape[1]
        w0 = eps(X.dtype)
        ctx.reduce_sum, ctx.chunk, ctx.w0 = reduce_sum, chunk, w0
        if not reduce_sum:
            w = _factor_w(X, Y, c)[0]
            ctx.save_for_backward(X, Y, c, w)
            return _dist_from_w(w, c, w0)
        out = X.new_zeros(N, M)
        for j0 in range(0, k, chunk):
            j1 = min(k, j0 + chunk)
            w = _factor_w(X[j0:j1], Y[j0:j1], c[j0:j1])[0]
            out += _dist_from_w(w, c[j0:j1], w0).sum(0)
            del w
        ctx.save_for_backward(X, Y, c)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        need_x, need_y, need_c = ctx.needs_input_grad[:3]
        if ctx.reduce_sum:
            X, Y, c = ctx.saved_tensors
            saved_w = None
        else:
            X, Y, c, saved_w = ctx.saved_tensors
        k = X.shape[0]
        w0 = ctx.w0
        gX = torch.zeros_like(X) if need_x else None
        gY = torch.zeros_like(Y) if need_y else None
        gc = torch.zeros_like(c) if need_c else None
        step = ctx.chunk if ctx.reduce_sum else k
        for j0 in range(0, k, step):
            j1 = min(k, j0 + step)
            Xc, Yc, cc = X[j0:j1], Y[j0:j1], c[j0:j1]
            half_c = 0.5 * cc.view(-1, 1, 1)
            if saved_w is None:
                # Recompute exactly as the forward did, so the gradient matches its rounding.
                w, tx, ty, Q, _ = _factor_w(Xc, Yc, cc)
                g = grad.unsqueeze(0)
            else:
                Q, ty = _augment(Yc, cc, -1.0)
                tx = torch.sqrt(cc.reciprocal().unsqueeze(-1) + _sqnorm(Xc))
                w = saved_w[j0:j1]
                g = grad[j0:j1]
            Pun = torch.cat([Xc, -tx.unsqueeze(-1)], -1)  # [x, -t_x]
            G = _ddist_dw(w, cc, w0).mul_(g)
            A = torch.bmm(G, Q)  # [kc, N, d+1]
            B = torch.bmm(G.transpose(1, 2), Pun)  # [kc, M, d+1]
            if need_x:
                gX[j0:j1] = -half_c * (A[..., :-1] + A[..., -1:] * Xc / tx.unsqueeze(-1))
            if need_y:
                gY[j0:j1] = -half_c * (B[..., :-1] + B[..., -1:] * Yc / ty.unsqueeze(-1))
            if need_c:
                d = _dist_from_w(w, cc, w0)
                gw_term = (G * (2.0 * w + 1.0)).sum((1, 2)) - (g * d).sum((1, 2))
                # -A[..., -1] = sum_j G_ij t_yj and -B[..., -1] = sum_i G_ij t_xi
                time_term = -(A[..., -1] / tx).sum(1) - (B[..., -1] / ty).sum(1)
                gc[j0:j1] = gw_term / (2.0 * cc) - time_term / (4.0 * cc)
        return gX, gY, gc, None, None


def factor_pairwise_dist(
    X: Tensor, Y: Tensor, c: Tensor, reduce_sum: bool = False, chunk: int | None = None
) -> Tensor:
    """Per-factor pairwise distances in factor-major layout (internal building block).

    ``X: [k, N, d]``, ``Y: [k, M, d]`` (working dtype), ``c: [k]`` -> ``[k, N, M]``, or the
    ``[N, M]`` sum over factors with ``reduce_sum`` (``chunk`` factors at a time).
    """
    k, N, _ = X.shape
    if chunk is None:
        # About 2^22 elements per chunk: 16 MiB per temporary in float32.
        chunk = max(1, min(k, (1 << 22) // max(1, N * Y.shape[1])))
    return _FactorPairwiseDist.apply(X, Y, c.expand(k).contiguous(), reduce_sum, int(chunk))


@no_autocast
def pairwise_dist(X: Tensor, Y: Tensor, c: Curvature) -> Tensor:
    """All geodesic distances ``acosh(-c<x_i,y_j>_L) / sqrt(c)`` (AtMG Eq. 4).

    ``X: [N, d]``, ``Y: [M, d]`` -> ``[N, M]`` (factor layout ``[N, k, d]`` -> ``[k, N, M]``).
    One matrix product of the time-augmented points, elementwise maps, a hand-written backward
    (two matrix products). Accuracy floor: the Gram matrix carries an absolute error of about
    ``eps |x||y|``, so for nearby points with large norms use the row-wise :func:`dist`, which
    forms ``x - y`` directly.
    """
    X, Y, c = _pairwise_prep(X, Y, c)
    if X.dim() == 2:
        return factor_pairwise_dist(X.unsqueeze(0), Y.unsqueeze(0), c.reshape(1))[0]
    return factor_pairwise_dist(X, Y, c.reshape(-1))


@no_autocast
def pairwise_exterior_angle(X: Tensor, Y: Tensor, c: Curvature) -> Tensor:
    """Exterior angle at every ``x_i`` towards every ``y_j`` (AtMG Eq. 9), in ``[0, pi]``.

    ``X: [N, d]``, ``Y: [M, d]`` -> ``[N, M]`` (factor layout ``[N, k, d]`` -> ``[k, N, M]``).
    """
    X, Y, c = _pairwise_prep(X, Y, c)
    e = eps(X.dtype)
    cv = c.squeeze(-1)
    G = _gram(X, Y)
    tx, ty = _time(X, cv), _time(Y, cv)
    w = _pairwise_w(G, tx, ty, c)
    nx = safe_norm(X, e).unsqueeze(-1)
    cos = _exterior_cos(G, nx, tx.unsqueeze(-1), ty.unsqueeze(-2), w, c, e)
    return acos_safe(cos, e)


# ----------------------------------------------------------------------------------------
# Einstein midpoint
# ----------------------------------------------------------------------------------------


@no_autocast
def einstein_midpoint(
    X: Tensor, c: Curvature, weights: Tensor | None = None, dim: int = -2
) -> Tensor:
    """Weighted Einstein midpoint (hyperbolic centroid) of the points along axis ``dim``.

    AtMG Eq. (5)-(6) with Klein coordinates ``k = x / time(x)`` and Lorentz factors
    ``gamma = 1 / sqrt(1 - |k|^2) = sqrt(c) time(x)`` (DESIGN.md: ``1 - |k|^2``, the Klein ball
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
    norm = torch.sqrt(_sqnorm(x))
    t = torch.sqrt(cb.reciprocal() + norm * norm)
    S = (wts.unsqueeze(-1) * x).sum(dim)
    T_minus_absx = (wts / (cb * (t + norm))).sum(dim)
    absS = torch.sqrt(_sqnorm(S))
    gap = T_minus_absx + ((wts * norm).sum(dim) - absS).clamp_min(0.0)
    T = (wts * t).sum(dim)
    c_set = cb.mean(dim)  # c is constant along the set axis; the mean keeps its gradient
    lower = wts.sum(dim) ** 2 / c_set
    denom2 = (gap * (T + absS)).clamp_min(lower)
    return (S / torch.sqrt(c_set * denom2).unsqueeze(-1)).to(out_dtype)
