"""The fused CPU kernel of the l1-product distance against the eager reference it replaces.

``product.l1_pairwise_dist(..., fused=False)`` is the reference (lorentz._PairwiseAcosh with
``reduce_sum``); the default path on CPU is ``geometry._fused_l1``. Values and gradients (X, Y
and the per-factor curvature c) must agree to the dtype's rounding, on the edge matrix too.
The kernel is compiled once per test session (a few seconds; cached across sessions).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from _l1_edge import assert_edge_agrees
from curvalign.geometry import _fused_l1 as FL
from curvalign.geometry import lorentz as L
from curvalign.geometry import product as P

f64 = torch.float64

# The comparisons need the kernel (built once per session, cached); the fallback tests do not.
needs_kernel = pytest.mark.skipif(
    not FL.available(torch.zeros(1)), reason="fused l1 kernel disabled or not buildable here"
)


def points(seed: int, n: int, k: int, d: int, dtype: torch.dtype, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, k, d, generator=g, dtype=f64) * (scale / d**0.5)
    return L.expmap0(v, 1.0).to(dtype)


def value_and_grads(X, Y, c, weights, fused: bool):  # noqa: ANN001, ANN201
    X, Y, c = (t.detach().clone().requires_grad_() for t in (X, Y, c))
    out = P.l1_pairwise_dist(X, Y, c, fused=fused)
    gx, gy, gc = torch.autograd.grad((out * weights).sum(), (X, Y, c))
    return out, gx, gy, gc


def assert_close(got, ref, dtype, what: str) -> None:  # noqa: ANN001
    # Relative to the largest entry: the kernel and the reference sum in different orders.
    scale = ref.abs().max().clamp_min(1.0)
    tol = 1e-11 if dtype == f64 else 2e-5
    err = (got - ref).abs().max() / scale
    assert err < tol, f"{what}: max error {err:.3g} (relative to {scale:.3g}) above {tol}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, f64])
@pytest.mark.parametrize(("N", "M"), [(1, 1), (5, 3), (13, 8), (16, 17), (37, 21)])
def test_fused_matches_reference_values_and_gradients(dtype: torch.dtype, N: int, M: int) -> None:
    k, d = 5, 4
    X, Y = points(N, N, k, d, dtype), points(100 + M, M, k, d, dtype, scale=2.0)
    c = torch.tensor([0.1, 0.5, 1.0, 3.0, 10.0], dtype=dtype)
    w = torch.randn(N, M, generator=torch.Generator().manual_seed(1), dtype=f64).to(dtype)
    fused = value_and_grads(X, Y, c, w, fused=True)
    ref = value_and_grads(X, Y, c, w, fused=False)
    assert fused[0].dtype == dtype and fused[0].shape == (N, M)
    for name, a, b in zip(("value", "dX", "dY", "dc"), fused, ref, strict=True):
        assert_close(a, b, dtype, name)


@needs_kernel
def test_fused_is_the_default_on_cpu() -> None:
    X, Y = points(0, 6, 3, 2, f64), points(1, 5, 3, 2, f64)
    out = P.l1_pairwise_dist(X.requires_grad_(), Y, 1.0)
    assert out.grad_fn is not None and "curvalign_l1_forward" in type(out.grad_fn).__name__


@needs_kernel
def test_fused_gradcheck_float64() -> None:
    X = points(5, 4, 3, 2, f64).requires_grad_()
    Y = points(6, 3, 3, 2, f64).requires_grad_()
    c = torch.tensor([0.4, 1.0, 3.0], dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, cc: P.l1_pairwise_dist(a, b, cc), (X, Y, c))


@needs_kernel
def test_fused_accepts_non_contiguous_inputs_and_scalar_curvature() -> None:
    base = points(7, 9, 6, 3, f64)
    X = base[::2].transpose(0, 1).contiguous().transpose(0, 1)  # [5, 6, 3], non-contiguous
    Y = points(8, 6, 12, 3, f64)[:, ::2]  # [6, 6, 3], strided factors
    assert not X.is_contiguous() and not Y.is_contiguous()
    w = torch.ones(5, 6, dtype=f64)
    for c in (torch.tensor(0.7, dtype=f64), torch.full((6,), 0.7, dtype=f64)):
        fused, ref = value_and_grads(X, Y, c, w, True), value_and_grads(X, Y, c, w, False)
        for a, b in zip(fused, ref, strict=True):
            assert_close(a, b, f64, "non-contiguous")


EDGE_SCALES = [0.0, 1e-6, 1.0, 1e2, 1e4]


@needs_kernel
@pytest.mark.parametrize("c", [0.1, 1.0, 10.0])
@pytest.mark.parametrize("scale", EDGE_SCALES)
def test_fused_edge_matrix(scale: float, c: float) -> None:
    """x = y, x = 0, huge norms, c at 0.1 and 10: finite, and equal to the reference."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 3, generator=g)
    x = x / x.norm(dim=-1, keepdim=True) * scale
    other = torch.randn(6, 4, 3, generator=g) * max(scale, 1.0)
    cc = torch.tensor([c, c, 1.0, c])
    w = torch.linspace(0.5, 1.5, 36).view(6, 6)
    for name, (a, b) in {"x=y": (x, x.clone()), "x=0": (torch.zeros_like(x), other)}.items():
        fused = value_and_grads(a, b, cc, w, True)
        ref = value_and_grads(a, b, cc, w, False)
        for what, u, v in zip(("value", "dX", "dY", "dc"), fused, ref, strict=True):
            assert_edge_agrees(name, scale, c, what, u, v)


@needs_kernel
def test_fused_bf16_autocast_computes_in_float32() -> None:
    X, Y = points(3, 7, 4, 3, torch.float32), points(4, 9, 4, 3, torch.float32)
    c = torch.tensor([0.5, 1.0, 2.0, 4.0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = P.l1_pairwise_dist(X.bfloat16(), Y.bfloat16(), c)
    assert got.dtype == torch.float32
    ref = P.l1_pairwise_dist(X.bfloat16().float(), Y.bfloat16().float(), c, fused=False)
    assert_close(got, ref, torch.float32, "bf16 autocast")


@needs_kernel
def test_env_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CURVALIGN_FUSED", "0")
    X = points(0, 6, 3, 2, f64).requires_grad_()
    out = P.l1_pairwise_dist(X, X, 1.0)
    assert "curvalign_l1_forward" not in type(out.grad_fn).__name__
    monkeypatch.setenv("CURVALIGN_FUSED", "1")
    assert "curvalign_l1_forward" in type(P.l1_pairwise_dist(X, X, 1.0).grad_fn).__name__


def test_failed_build_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(FL.KERNEL, "build", broken)
    monkeypatch.setattr(FL.KERNEL, "library", None)
    monkeypatch.setattr(FL.KERNEL, "failed", None)
    X, Y = points(0, 6, 3, 2, f64), points(1, 5, 3, 2, f64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = P.l1_pairwise_dist(X, Y, 1.0)
        second = P.l1_pairwise_dist(X, Y, 1.0)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "simulated compiler failure" in messages[0]
    ref = P.l1_pairwise_dist(X, Y, 1.0, fused=False)
    assert torch.equal(first, ref) and torch.equal(second, ref)


def test_compile_error_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """A real compiler invocation that fails (no such compiler) is a warning, not an error."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(FL.KERNEL, "library", None)
    monkeypatch.setattr(FL.KERNEL, "failed", None)
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert FL.load_kernel() is None
    assert not FL.available(torch.zeros(1))


@needs_kernel
def test_fused_with_several_threads_equals_one() -> None:
    """The backward sums per-thread column gradients: the split must not change the result."""
    X, Y = points(11, 29, 3, 4, f64), points(12, 19, 3, 4, f64)
    c = torch.tensor([0.3, 1.0, 4.0], dtype=f64)
    w = torch.randn(29, 19, generator=torch.Generator().manual_seed(2), dtype=f64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = value_and_grads(X, Y, c, w, True)
        torch.set_num_threads(3)
        three = value_and_grads(X, Y, c, w, True)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, three, strict=True):
        assert_close(a, b, f64, "threads")


# --- the float32 AVX2 loops (the default path for float32 where the build has AVX2 + FMA) ---
# Their tiles are 4 rows (forward) / 8 rows (backward) by chunks of 16 blocks of 8 columns:
# the shapes below cross every boundary (partial row tiles, a partial column block, two column
# chunks) at PHyCLIP's factor width d = 8 (d + 1 = 9) and at an odd narrow one.


def tile_case(N: int, M: int, k: int, d: int, near: bool):  # noqa: ANN201
    X, Y = points(N + M, N, k, d, torch.float32), points(7 * M, M, k, d, torch.float32, 2.0)
    if near:  # pairs at distance about 1e-2 per factor on the diagonal
        n = min(N, M) // 3
        Y[:n] = L.expmap0(L.logmap0(X[:n], 1.0) + 1e-2 / d**0.5, 1.0)
    c = torch.logspace(-1, 1, k)
    w = torch.randn(N, M, generator=torch.Generator().manual_seed(3))
    return X, Y, c, w


TILE_SHAPES = [(45, 150, 7, 8), (9, 131, 3, 3), (8, 8, 64, 8)]


@needs_kernel
@pytest.mark.parametrize(("N", "M", "k", "d"), TILE_SHAPES)
def test_fused_float32_tiles_match_reference(N: int, M: int, k: int, d: int) -> None:
    X, Y, c, w = tile_case(N, M, k, d, near=False)
    fused = value_and_grads(X, Y, c, w, fused=True)
    ref = value_and_grads(X, Y, c, w, fused=False)
    for name, a, b in zip(("value", "dX", "dY", "dc"), fused, ref, strict=True):
        assert_close(a, b, torch.float32, name)


@needs_kernel
@pytest.mark.parametrize(("N", "M", "k", "d"), TILE_SHAPES)
def test_fused_float32_near_pairs_as_accurate_as_reference(N: int, M: int, k: int, d: int) -> None:
    """Near pairs make the gradient ill-conditioned in float32 (1/r amplifies the rounding of
    the inner product): both paths then differ from float64 by up to about 1e-3 of the largest
    entry; the kernel's error must stay within a small factor of the reference's."""
    X, Y, c, w = tile_case(N, M, k, d, near=True)
    fused = value_and_grads(X, Y, c, w, fused=True)
    ref = value_and_grads(X, Y, c, w, fused=False)
    exact = value_and_grads(X.double(), Y.double(), c.double(), w.double(), fused=False)
    for name, a, b, e in zip(("value", "dX", "dY", "dc"), fused, ref, exact, strict=True):
        e = e.detach()
        scale = e.abs().max().clamp_min(1.0)
        err_fused = float((a.detach().double() - e).abs().max() / scale)
        err_ref = float((b.detach().double() - e).abs().max() / scale)
        assert err_fused <= 4 * err_ref + 2e-5, f"{name}: {err_fused:.3g} vs {err_ref:.3g}"


@needs_kernel
def test_fused_float32_takes_the_avx2_loops_where_built_for_them() -> None:
    from curvalign._native import isa_flags

    assert FL.avx2_float32() == ("-mavx2" in isa_flags())


@needs_kernel
def test_fused_float32_with_several_threads_equals_one() -> None:
    X, Y = points(13, 29, 5, 8, torch.float32), points(14, 140, 5, 8, torch.float32)
    c = torch.tensor([0.3, 1.0, 4.0, 0.1, 10.0])
    w = torch.randn(29, 140, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = value_and_grads(X, Y, c, w, True)
        torch.set_num_threads(3)
        three = value_and_grads(X, Y, c, w, True)
    finally:
        torch.set_num_threads(before)
    # Rows are split between threads, each row's sums the same: value and dX bit for bit. dY
    # adds per-thread partial sums, and dc, which sums N M k terms that largely cancel, with it.
    assert torch.equal(one[0], three[0]) and torch.equal(one[1], three[1])
    assert_close(three[2], one[2], torch.float32, "dY")
    err = float((three[3] - one[3]).abs().max() / one[3].abs().max())
    assert err < 1e-4, f"dc: {err:.3g}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_fused_overflowing_distance_is_inf_as_the_reference(dtype: torch.dtype) -> None:
    """u + u^2 past the dtype's range (norms 1e12 in float32, 1e160 in float64, c = 10): the
    distance is +inf and its derivative 0 on both paths; the other pairs are unaffected."""
    big = 1e12 if dtype == torch.float32 else 1e160
    X = points(21, 3, 2, 3, dtype)
    Y = points(22, 4, 2, 3, dtype)
    X[0, 0] = torch.tensor([big, 0.0, 0.0], dtype=dtype)
    Y[1, 0] = torch.tensor([-big, 0.0, 0.0], dtype=dtype)
    c = torch.tensor([10.0, 1.0], dtype=dtype)
    w = torch.ones(3, 4, dtype=dtype)
    fused = value_and_grads(X, Y, c, w, fused=True)
    ref = value_and_grads(X, Y, c, w, fused=False)
    assert torch.isinf(ref[0][0, 1]) and torch.equal(torch.isinf(fused[0]), torch.isinf(ref[0]))
    finite = torch.isfinite(ref[0])
    assert_close(fused[0][finite], ref[0][finite], dtype, "value")
    for name, a, b in zip(("dX", "dY"), fused[1:3], ref[1:3], strict=True):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)), name
        ok = torch.isfinite(b)
        assert_close(a[ok], b[ok], dtype, name)
