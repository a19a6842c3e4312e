"""The fused CPU kernels of the pairwise Lorentz distance and exterior angle against the eager
reference they replace.

``lorentz.pairwise_dist(..., fused=False)`` (``_PairwiseAcosh``) and
``lorentz.pairwise_exterior_angle(..., fused=False)`` (``_PairwiseExteriorAngle``) are the
reference; the default path on CPU is ``geometry._fused_lorentz``. Values and gradients (X, Y
and the curvature c, per factor in the factor layout) must agree to the dtype's rounding, on
the edge matrix too. The kernel is compiled once per test session (a few seconds; cached).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from curvalign.geometry import _fused_lorentz as FL
from curvalign.geometry import lorentz as L

f64 = torch.float64

needs_kernel = pytest.mark.skipif(
    not FL.available(torch.zeros(1)), reason="fused Lorentz kernel disabled or not buildable here"
)

FUNCTIONS = {"dist": L.pairwise_dist, "angle": L.pairwise_exterior_angle}
FUSED_NODES = {"dist": "curvalign_lorentz_dist_", "angle": "curvalign_lorentz_exterior_angle_"}


def points(seed: int, shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(*shape, generator=g, dtype=f64) * (scale / shape[-1] ** 0.5)
    return L.expmap0(v, 1.0).to(dtype)


def value_and_grads(fn, X, Y, c, weights, fused: bool):  # noqa: ANN001, ANN201
    X, Y, c = (t.detach().clone().requires_grad_() for t in (X, Y, c))
    out = fn(X, Y, c, fused=fused)
    gx, gy, gc = torch.autograd.grad((out * weights).sum(), (X, Y, c))
    return out, gx, gy, gc


def assert_close(got, ref, dtype, what: str, tol: float | None = None) -> None:  # noqa: ANN001
    # Relative to the largest entry: the kernel and the reference round and sum differently.
    scale = ref.abs().max().clamp_min(1.0)
    tol = tol if tol is not None else (1e-11 if dtype == f64 else 2e-5)
    err = (got - ref).abs().max() / scale
    assert err < tol, f"{what}: max error {err:.3g} (relative to {scale:.3g}) above {tol}"


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
@pytest.mark.parametrize("dtype", [torch.float32, f64])
@pytest.mark.parametrize(("N", "M"), [(1, 1), (5, 3), (13, 8), (16, 17), (37, 21)])
def test_fused_matches_reference(name: str, dtype: torch.dtype, N: int, M: int) -> None:
    fn = FUNCTIONS[name]
    X, Y = points(N, (N, 7), dtype), points(100 + M, (M, 7), dtype, scale=2.0)
    c = torch.tensor(0.6, dtype=dtype)
    w = torch.randn(N, M, generator=torch.Generator().manual_seed(1), dtype=f64).to(dtype)
    fused = value_and_grads(fn, X, Y, c, w, fused=True)
    ref = value_and_grads(fn, X, Y, c, w, fused=False)
    assert fused[0].dtype == dtype and fused[0].shape == (N, M)
    assert FUSED_NODES[name] in type(fused[0].grad_fn).__name__
    for what, a, b in zip(("value", "dX", "dY", "dc"), fused, ref, strict=True):
        assert_close(a, b, dtype, f"{name} {what}")


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_fused_factor_layout_with_per_factor_curvature(name: str, dtype: torch.dtype) -> None:
    fn = FUNCTIONS[name]
    k, N, M = 5, 11, 9
    X, Y = points(3, (N, k, 4), dtype), points(4, (M, k, 4), dtype, scale=2.0)
    c = torch.tensor([0.1, 0.5, 1.0, 3.0, 10.0], dtype=dtype)
    w = torch.randn(k, N, M, generator=torch.Generator().manual_seed(5), dtype=f64).to(dtype)
    fused = value_and_grads(fn, X, Y, c, w, fused=True)
    ref = value_and_grads(fn, X, Y, c, w, fused=False)
    assert fused[0].shape == (k, N, M)
    assert FUSED_NODES[name] in type(fused[0].grad_fn).__name__
    for what, a, b in zip(("value", "dX", "dY", "dc"), fused, ref, strict=True):
        assert_close(a, b, dtype, f"{name} {what}")


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
def test_fused_gradcheck_float64(name: str) -> None:
    fn = FUNCTIONS[name]
    X, Y = points(5, (4, 3), f64).requires_grad_(), points(6, (3, 3), f64).requires_grad_()
    c = torch.tensor(0.8, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, cc: fn(a, b, cc), (X, Y, c))
    Xk, Yk = points(7, (3, 2, 3), f64).requires_grad_(), points(8, (4, 2, 3), f64).requires_grad_()
    ck = torch.tensor([0.4, 3.0], dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, cc: fn(a, b, cc), (Xk, Yk, ck))


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
def test_fused_accepts_non_contiguous_inputs(name: str) -> None:
    fn = FUNCTIONS[name]
    X = points(7, (9, 6), f64)[::2]  # [5, 6], row stride 12
    Y = points(8, (6, 12), f64)[:, ::2]  # [6, 6], column stride 2
    assert not X.is_contiguous() and not Y.is_contiguous()
    w = torch.ones(5, 6, dtype=f64)
    c = torch.tensor(0.7, dtype=f64)
    fused, ref = value_and_grads(fn, X, Y, c, w, True), value_and_grads(fn, X, Y, c, w, False)
    for a, b in zip(fused, ref, strict=True):
        assert_close(a, b, f64, f"{name} non-contiguous")
    # an expanded (stride-0) incoming gradient, as out.sum().backward() gives
    Xg = X.clone().requires_grad_()
    fn(Xg, Y, c).sum().backward()
    Xr = X.clone().requires_grad_()
    fn(Xr, Y, c, fused=False).sum().backward()
    assert_close(Xg.grad, Xr.grad, f64, f"{name} expanded grad")


EDGE_SCALES = [0.0, 1e-6, 1.0, 1e2, 1e4]


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
@pytest.mark.parametrize("c", [0.1, 1.0, 10.0])
@pytest.mark.parametrize("scale", EDGE_SCALES)
def test_fused_edge_matrix(name: str, scale: float, c: float) -> None:
    """x = y, x = 0, huge norms, c at 0.1 and 10: finite, bounded, and equal to the reference
    wherever the reference's value is determined (not rounding noise)."""
    fn = FUNCTIONS[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    x = x / x.norm(dim=-1, keepdim=True) * scale
    other = torch.randn(6, 5, generator=g) * max(scale, 1.0)
    cc = torch.tensor(c)
    w = torch.linspace(0.5, 1.5, 36).view(6, 6)
    off = ~torch.eye(6, dtype=torch.bool)
    for case, (a, b) in {"x=y": (x, x.clone()), "x=0": (torch.zeros_like(x), other)}.items():
        fused = value_and_grads(fn, a, b, cc, w, True)
        ref = value_and_grads(fn, a, b, cc, w, False)
        where = f"{name}, {case}, |x|={scale}, c={c}"
        for what, u in zip(("value", "dX", "dY", "dc"), fused, strict=True):
            assert torch.isfinite(u).all(), f"{where}: non-finite {what}"
        if name == "angle":
            assert ((fused[0] >= 0) & (fused[0] <= math.pi)).all(), (
                f"{where}: angle outside [0, pi]"
            )
        if case == "x=y":
            # On the diagonal (every pair at |x| <= 1e-6) the Gram matrix's rounding decides
            # w (distance: which side of 0; angle: the sign of the clamped cosine), so the
            # paths agree in bound only: the distance within the noise, the gradients bounded.
            t2 = 1.0 / c + scale**2
            noise = 4 * float(torch.acosh(torch.tensor(1.0 + 16 * 1.2e-7 * max(c, 1) * t2)))
            if name == "dist":
                atol = 2 * noise * max(1.0, c**-0.5)
                assert fused[0].diagonal().abs().max() <= atol, f"{where}: diagonal not ~0"
            bound = 2e4 * (1.0 + scale) ** 2 * max(c, 1.0 / c)
            for what, u in zip(("dX", "dY", "dc"), fused[1:], strict=True):
                assert u.abs().max() <= bound, f"{where}: {what} unbounded"
            if scale >= 1.0:  # distinct points off the diagonal: determined values
                # (the angle through its cosine: acos amplifies the Gram matrix's rounding
                # by 1 / sin, large for the near-collinear pairs of points far out)
                u, v = (torch.cos(t) if name == "angle" else t for t in (fused[0], ref[0]))
                err = (u - v)[off].abs().max() / v.abs().max().clamp_min(1.0)
                assert err < 2e-5, f"{where}: off-diagonal values differ by {err:.3g}"
            continue
        for what, u, v in zip(("value", "dX", "dY", "dc"), fused, ref, strict=True):
            # dc sums N M terms that largely cancel (t depends on c on both sides).
            assert_close(u, v, torch.float32, f"{where}: {what}", 2e-5 if what == "value" else 1e-4)


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
def test_fused_passes_nan_and_inf_through_like_the_reference(name: str) -> None:
    fn = FUNCTIONS[name]
    X, Y = points(1, (4, 3), f64), points(2, (5, 3), f64)
    X[1, 0] = float("nan")
    Y[2, 1] = float("inf")
    got, ref = fn(X, Y, 1.0), fn(X, Y, 1.0, fused=False)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin) and fin.any()
    assert torch.allclose(got[fin], ref[fin], rtol=1e-12, atol=1e-12)


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
def test_fused_bf16_autocast_computes_in_float32(name: str) -> None:
    fn = FUNCTIONS[name]
    X, Y = points(3, (7, 6), torch.float32), points(4, (9, 6), torch.float32)
    c = torch.tensor(0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fn(X.bfloat16(), Y.bfloat16(), c)
    assert got.dtype == torch.float32
    ref = fn(X.bfloat16().float(), Y.bfloat16().float(), c, fused=False)
    assert_close(got, ref, torch.float32, f"{name} bf16 autocast")


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
def test_fused_second_backward_recomputes_the_gram_matrix(name: str) -> None:
    """The first backward writes over the saved Gram matrix; retain_graph must still work."""
    fn = FUNCTIONS[name]
    X = points(9, (8, 4), f64).requires_grad_()
    Y = points(10, (6, 4), f64)
    out = fn(X, Y, 0.9)
    first = torch.autograd.grad(out.square().sum(), X, retain_graph=True)[0]
    second = torch.autograd.grad(out.square().sum(), X)[0]
    assert_close(second, first, f64, f"{name} second backward")
    with torch.no_grad():  # inference: no graph, the same values
        assert torch.equal(fn(X, Y, 0.9), out.detach())


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
def test_fused_backward_releases_the_gram_matrix(name: str) -> None:
    """The kept Gram matrix is let go by the backward that consumes it, not when the output
    (which holds the graph) is freed: a training loop's next forward must not find it alive."""
    X = points(11, (8, 4), f64).requires_grad_()
    out = FUNCTIONS[name](X, points(12, (6, 4), f64), 0.9)
    assert out.grad_fn.gram is not None  # the autograd node is the ops' context
    out.sum().backward()
    assert out.grad_fn.gram is None


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
def test_env_switch_turns_the_kernel_off(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fn = FUNCTIONS[name]
    X = points(0, (6, 3), f64).requires_grad_()
    monkeypatch.setenv("CURVALIGN_FUSED", "0")
    assert FUSED_NODES[name] not in type(fn(X, X, 1.0).grad_fn).__name__
    monkeypatch.setenv("CURVALIGN_FUSED", "1")
    assert FUSED_NODES[name] in type(fn(X, X, 1.0).grad_fn).__name__


def test_failed_build_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(FL.KERNEL, "build", broken)
    monkeypatch.setattr(FL.KERNEL, "library", None)
    monkeypatch.setattr(FL.KERNEL, "failed", None)
    X, Y = points(0, (6, 3), f64), points(1, (5, 3), f64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = L.pairwise_dist(X, Y, 1.0)
        angle = L.pairwise_exterior_angle(X, Y, 1.0)
        second = L.pairwise_dist(X, Y, 1.0)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "simulated compiler failure" in messages[0]
    ref = L.pairwise_dist(X, Y, 1.0, fused=False)
    assert torch.equal(first, ref) and torch.equal(second, ref)
    assert torch.equal(angle, L.pairwise_exterior_angle(X, Y, 1.0, fused=False))


def test_compile_error_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(FL.KERNEL, "library", None)
    monkeypatch.setattr(FL.KERNEL, "failed", None)
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert FL.load_kernel() is None
    assert not FL.available(torch.zeros(1))


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
def test_fused_with_several_threads_equals_one(name: str) -> None:
    """The backward sums per-thread column sums: the split must not change the result."""
    fn = FUNCTIONS[name]
    X, Y = points(11, (3, 29, 4), f64).transpose(0, 1), points(12, (3, 19, 4), f64).transpose(0, 1)
    c = torch.tensor([0.3, 1.0, 4.0], dtype=f64)
    w = torch.randn(3, 29, 19, generator=torch.Generator().manual_seed(2), dtype=f64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = value_and_grads(fn, X, Y, c, w, True)
        torch.set_num_threads(3)
        three = value_and_grads(fn, X, Y, c, w, True)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, three, strict=True):
        assert_close(a, b, f64, f"{name} threads")


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
@pytest.mark.parametrize("factors", [None, 3])
def test_fused_reads_a_transposed_incoming_gradient(name: str, factors: int | None) -> None:
    """A symmetric InfoNCE hands the backward a transposed gradient, read in tiles of 16 rows x
    256 columns: sizes across both tile edges, one and several threads, equal to the reference."""
    fn = FUNCTIONS[name]
    N, M = 37, 300
    shape = (N, 4) if factors is None else (N, factors, 4)
    X, Y = points(20, shape, f64), points(21, (M, *shape[1:]), f64, scale=2.0)
    c = (
        torch.tensor(0.8, dtype=f64)
        if factors is None
        else torch.tensor([0.5, 1.0, 2.0], dtype=f64)
    )
    W = torch.randn(*(() if factors is None else (factors,)), M, N, dtype=f64)

    def run(fused: bool):  # noqa: ANN202
        Xg, Yg, cg = (t.clone().requires_grad_() for t in (X, Y, c))
        out = fn(Xg, Yg, cg, fused=fused)
        (out.transpose(-1, -2) * W).sum().backward()  # d loss / d out = W^T: not contiguous
        return out.detach(), Xg.grad, Yg.grad, cg.grad

    ref = run(False)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for what, a, b in zip(("value", "dX", "dY", "dc"), run(True), ref, strict=True):
                assert_close(a, b, f64, f"{name} transposed grad, {threads} thread(s): {what}")
    finally:
        torch.set_num_threads(before)


class _NewStorages(TorchDispatchMode):
    """Counts the distinct new storages of at least ``numel`` elements that ops return."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.seen = numel, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.seen.add(t.untyped_storage().data_ptr())
        return out


@needs_kernel
@pytest.mark.parametrize("name", ["dist", "angle"])
def test_fused_allocates_two_pair_matrices_in_all(name: str) -> None:
    """The point of the kernel: forward and backward together allocate the Gram matrix and the
    output, nothing else of size N x M (the reference allocates several more)."""
    fn = FUNCTIONS[name]
    N, M = 48, 40
    X = points(30, (N, 8), f64).requires_grad_()
    Y = points(31, (M, 8), f64).requires_grad_()
    c = torch.tensor(0.9, dtype=f64, requires_grad=True)
    W = torch.randn(M, N, dtype=f64).t()  # a transposed incoming gradient, as in InfoNCE

    def count(fused: bool) -> int:
        with _NewStorages(N * M) as mode:
            out = fn(X, Y, c, fused=fused)
            torch.autograd.backward(out, W)
        return len(mode.seen - {W.untyped_storage().data_ptr()})

    assert count(True) == 2
    assert count(False) > 3  # the test can fail: the eager reference makes more
