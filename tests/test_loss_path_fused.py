"""The fused pieces of the loss path a user runs, each against the plain composition it replaces.

- ``lorentz.expmap0``: the hand-differentiated ``_Expmap0`` (CPU default) against the eager
  reference (``fused=False``);
- ``lorentz.pairwise_dist(..., scale=s)`` and ``product.l1_pairwise_dist(..., scale=s)``: the
  constant folded into the kernels' ``1/sqrt(c)`` factor against ``s *`` the reference;
- ``lorentz.pairwise_exterior_angles``: both angle matrices from one Gram matrix against two
  reference calls;
- the recipes take these paths (MERU one distance matrix, AtMG the pair op).

Values and gradients (points and curvature) in float64 to rounding and in float32 against the
float64 reference; edges x = y, tiny and huge norms, c at 0.1 and 10; bf16 autocast; gradcheck.
"""

from __future__ import annotations

import math

import pytest
import torch

from curvalign import scores as S
from curvalign.geometry import _fused_lorentz as FL
from curvalign.geometry import lorentz as L
from curvalign.geometry import product as P

f64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")
needs_kernel = pytest.mark.skipif(
    not FL.available(torch.zeros(1)), reason="fused Lorentz kernel disabled or not buildable here"
)


def _grads(fn, inputs, weights):  # noqa: ANN001, ANN202
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o * w).sum() for o, w in zip(outs, weights, strict=True))
    return [o.detach() for o in outs], list(torch.autograd.grad(loss, inputs))


def _close(got, ref, tol: float, what: str) -> None:  # noqa: ANN001
    scale = ref.abs().max().clamp_min(1.0)
    err = float((got.to(f64) - ref.to(f64)).abs().max() / scale)
    assert err < tol, f"{what}: max error {err:.3g} relative to {float(scale):.3g}, above {tol}"


def _check(fused, ref, inputs, weights, dtype, tol=None) -> None:  # noqa: ANN001
    """``fused`` in ``dtype`` against ``ref`` in float64: values and every input's gradient."""
    tol = tol or (1e-11 if dtype == f64 else 5e-5)
    got = _grads(fused, [t.to(dtype) for t in inputs], [w.to(dtype) for w in weights])
    want = _grads(ref, [t.to(f64) for t in inputs], [w.to(f64) for w in weights])
    for part, (gs, ws) in (("value", (got[0], want[0])), ("grad", (got[1], want[1]))):
        for i, (g, w) in enumerate(zip(gs, ws, strict=True)):
            assert torch.isfinite(g).all(), f"{part} {i}: not finite"
            _close(g, w, tol, f"{part} {i}")


# --- expmap0 ---------------------------------------------------------------------------------

NORMS = [0.0, 1e-30, 1e-4, 1.0, 5.0, 1e3, 1e10]


@pytest.mark.parametrize("dtype", [torch.float32, f64])
@pytest.mark.parametrize("c", [0.1, 1.0, 10.0])
def test_expmap0_fused_matches_reference_over_norms(dtype: torch.dtype, c: float) -> None:
    """Rows from 0 through tiny (series) to huge (past the sinh clamp), at both ends of c."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(len(NORMS), 6, generator=g, dtype=f64)
    v = v / v.norm(dim=-1, keepdim=True) * torch.tensor(NORMS, dtype=f64).unsqueeze(-1)
    w = torch.randn(len(NORMS), 6, generator=g, dtype=f64)
    cc = torch.tensor(c, dtype=f64)

    def fused(v, c):  # noqa: ANN001, ANN202
        out = L.expmap0(v, c)
        assert "Expmap0" in type(out.grad_fn).__name__  # the fused function, not the fallback
        return out

    # compare gradients relative per row scale: huge rows have huge (but exact) values
    _check(fused, lambda v, c: L.expmap0(v, c, fused=False), [v, cc], [w], dtype, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_expmap0_fused_per_factor_curvature(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    v = torch.randn(5, 4, 3, generator=g, dtype=f64)
    c = torch.tensor([0.1, 0.5, 2.0, 10.0], dtype=f64)
    w = torch.randn(5, 4, 3, generator=g, dtype=f64)
    _check(L.expmap0, lambda v, c: L.expmap0(v, c, fused=False), [v, c], [w], dtype)


def test_expmap0_gradcheck_tiny_case() -> None:
    g = torch.Generator().manual_seed(2)
    v = torch.randn(4, 3, generator=g, dtype=f64) * torch.tensor([[1e-5], [0.3], [2.0], [20.0]])
    c = torch.tensor([0.3, 1.0, 4.0], dtype=f64)
    v3 = v.unsqueeze(1).expand(4, 3, 3).clone().requires_grad_()
    assert torch.autograd.gradcheck(L.expmap0, (v3, c.requires_grad_()))


def test_expmap0_square_overflow_falls_back_to_the_robust_reference() -> None:
    v = torch.tensor([[3e19, 4e19], [0.3, 0.4]], requires_grad=True)  # |v|^2 overflows float32
    out = L.expmap0(v, 1.0)
    assert "Expmap0" not in type(out.grad_fn).__name__
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, L.expmap0(v, 1.0, fused=False))


def test_expmap0_bf16_autocast_computes_in_float32() -> None:
    v = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = L.expmap0(v.bfloat16(), torch.tensor(0.7))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, L.expmap0(v.bfloat16().float(), 0.7, fused=False))


# --- a constant folded into the distance kernels ---------------------------------------------


def _points(seed: int, shape: tuple[int, ...], norm: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(*shape, generator=g, dtype=f64)
    return L.expmap0(v / v.norm(dim=-1, keepdim=True) * norm, 1.0, fused=False)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, f64])
@pytest.mark.parametrize("c", [0.1, 1.0, 10.0])
@pytest.mark.parametrize("scale", [-1.0, -1 / 64, 3.0])
def test_pairwise_dist_scale_folded_into_the_kernel(
    dtype: torch.dtype, c: float, scale: float
) -> None:
    X, Y = _points(0, (7, 5)), _points(1, (6, 5), 2.0)
    w = torch.randn(7, 6, generator=torch.Generator().manual_seed(4), dtype=f64)
    cc = torch.tensor(c, dtype=f64)

    def ref(X, Y, c):  # noqa: ANN001, ANN202
        return scale * L.pairwise_dist(X, Y, c, fused=False)

    _check(lambda X, Y, c: L.pairwise_dist(X, Y, c, scale=scale), ref, [X, Y, cc], [w], dtype)


@needs_kernel
def test_lorentz_distance_scores_are_minus_the_distance_in_one_node() -> None:
    X, Y = _points(2, (6, 4)), _points(3, (6, 4))
    s = S.lorentz_distance_scores(X.float().requires_grad_(), Y.float(), 1.0)
    assert "lorentz_dist" in type(s.grad_fn).__name__  # no negation node after the kernel
    torch.testing.assert_close(s, -L.pairwise_dist(X.float(), Y.float(), 1.0, fused=False))


@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_l1_scale_folded_into_the_kernel(dtype: torch.dtype) -> None:
    X, Y = _points(5, (7, 4, 3)), _points(6, (6, 4, 3), 2.0)
    c = torch.tensor([0.1, 0.5, 2.0, 10.0], dtype=f64)
    w = torch.randn(7, 6, generator=torch.Generator().manual_seed(7), dtype=f64)

    def ref(X, Y, c):  # noqa: ANN001, ANN202
        return -P.l1_pairwise_dist(X, Y, c, fused=False) / 4

    _check(S.product_average_distance_scores, ref, [X, Y, c], [w], dtype)


@needs_kernel
def test_scaled_distances_gradcheck_tiny_case() -> None:
    X = _points(20, (4, 3)).requires_grad_()
    Y = _points(21, (3, 3), 2.0).requires_grad_()
    c = torch.tensor(0.7, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda X, Y, c: L.pairwise_dist(X, Y, c, scale=-0.5), (X, Y, c))
    Xk = _points(22, (4, 2, 3)).requires_grad_()
    Yk = _points(23, (3, 2, 3), 2.0).requires_grad_()
    ck = torch.tensor([0.3, 3.0], dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(S.product_average_distance_scores, (Xk, Yk, ck))


# --- both exterior angles from one Gram matrix ------------------------------------------------


def _both_ref(X, Y, c):  # noqa: ANN001, ANN202
    return L.pairwise_exterior_angles(X, Y, c, fused=False)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, f64])
@pytest.mark.parametrize(("N", "M"), [(1, 1), (5, 3), (13, 17)])
def test_both_angles_match_two_reference_calls(dtype: torch.dtype, N: int, M: int) -> None:
    X, Y = _points(N, (N, 6)), _points(100 + M, (M, 6), 2.0)
    g = torch.Generator().manual_seed(8)
    w = [torch.randn(N, M, generator=g, dtype=f64), torch.randn(M, N, generator=g, dtype=f64)]
    c = torch.tensor(0.6, dtype=f64)
    out = L.pairwise_exterior_angles(X.to(dtype).requires_grad_(), Y.to(dtype), c.to(dtype))
    assert "exterior_angle_pair" in type(out[0].grad_fn).__name__
    # float32 against float64: acos amplifies the Gram matrix's rounding near collinear pairs
    _check(L.pairwise_exterior_angles, _both_ref, [X, Y, c], w, dtype, 2e-4)


@needs_kernel
@pytest.mark.parametrize("c", [0.1, 10.0])
@pytest.mark.parametrize("norm", [1e-6, 1.0, 1e2])
def test_both_angles_edges(c: float, norm: float) -> None:
    """x = y (shared rows), tiny and huge norms, c at both ends: finite, in [0, pi], and equal
    to the reference (the same kernel passes) off the undetermined diagonal."""
    X = _points(9, (6, 5), norm).float()
    Y = torch.cat([X[:3], _points(10, (3, 5), norm).float()])
    g = torch.Generator().manual_seed(11)
    # the pairs x = y (first three diagonal entries) have no determined angle: weight 0 there
    same = torch.zeros(6, 6, dtype=torch.bool)
    same[range(3), range(3)] = True
    w = [torch.randn(6, 6, generator=g).masked_fill(same, 0.0) for _ in range(2)]
    cc = torch.tensor(c)
    got = _grads(L.pairwise_exterior_angles, [X, Y, cc], w)
    want = _grads(_both_ref, [X, Y, cc], w)
    for t in (*got[0], *got[1]):
        assert torch.isfinite(t).all()
    for a in got[0]:
        assert ((a >= 0) & (a <= torch.pi)).all()
    for a, b in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(a[~same], b[~same], rtol=0, atol=1e-4)
    for a, b in zip(got[1][:2], want[1][:2], strict=True):
        _close(a, b, 1e-3, "gradient")
    # dc sums terms that largely cancel, ill-conditioned in float32 far out: as accurate as the
    # float32 reference against float64, not equal to it
    exact = _grads(_both_ref, [X.double(), Y.double(), cc.double()], [t.double() for t in w])
    err_fused = float((got[1][2].double() - exact[1][2]).abs())
    err_ref = float((want[1][2].double() - exact[1][2]).abs())
    assert err_fused <= 4 * err_ref + 1e-5 * max(1.0, float(exact[1][2].abs()))


@needs_kernel
def test_both_angles_gradcheck_and_second_backward() -> None:
    X = _points(12, (4, 3)).requires_grad_()
    Y = _points(13, (3, 3), 2.0).requires_grad_()
    c = torch.tensor(0.8, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(L.pairwise_exterior_angles, (X, Y, c))
    a, b = L.pairwise_exterior_angles(X, Y, c)
    loss = a.sum() + (b * b).sum()
    first = torch.autograd.grad(loss, (X, Y, c), retain_graph=True)
    second = torch.autograd.grad(loss, (X, Y, c))  # the Gram matrices were consumed: recomputed
    for u, v in zip(first, second, strict=True):
        torch.testing.assert_close(u, v)
    # one output unused: its gradient is zero, not a failure
    (gx,) = torch.autograd.grad(L.pairwise_exterior_angles(X, Y, c)[1].sum(), (X,))
    (rx,) = torch.autograd.grad(L.pairwise_exterior_angle(Y, X, c, fused=False).sum(), (X,))
    torch.testing.assert_close(gx, rx)


@needs_kernel
def test_both_angles_bf16_autocast_computes_in_float32() -> None:
    X, Y = _points(14, (5, 6)).float(), _points(15, (7, 6)).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = L.pairwise_exterior_angles(X.bfloat16(), Y.bfloat16(), torch.tensor(0.5))
    ref = _both_ref(X.bfloat16().float(), Y.bfloat16().float(), torch.tensor(0.5))
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


# --- the recipes take the fused paths ---------------------------------------------------------


def _nodes(terms: list[torch.Tensor]) -> set:
    """Every autograd node the terms' graphs reach (shared nodes once)."""
    seen: set = set()
    stack = [t.grad_fn for t in terms]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    return seen


@needs_kernel
@pytest.mark.parametrize(
    ("name", "node", "count"),
    [
        ("meru", "lorentz_dist", 1),
        ("atmg", "exterior_angle_pair", 1),
        ("hycoclip", "lorentz_dist", 3),
    ],
)
def test_recipes_use_the_fused_loss_path(name: str, node: str, count: int) -> None:
    """One process: MERU scores one distance matrix (its transpose is the other direction),
    HyCoCLIP three for its four directions, AtMG both angle matrices in one pair op; the
    exponential maps are the fused function."""
    from curvalign.recipes import get_recipe
    from curvalign.recipes.base import Batch, Progress

    torch.manual_seed(0)
    cls = get_recipe(name)
    recipe = cls(cls.Config(embed_dim=16), 12, 10)
    g = torch.Generator().manual_seed(0)
    batch = Batch(image=torch.randn(6, 12, generator=g), text=torch.randn(6, 10, generator=g))
    if name == "hycoclip":
        batch.box_image = torch.randn(6, 12, generator=g)
        batch.box_text = torch.randn(6, 10, generator=g)
    out = recipe.loss(batch, Progress(0, 10))
    names = [type(n).__name__ for n in _nodes(list(out.terms.values()))]
    assert sum(node in n for n in names) == count, f"{name}: {sorted(names)}"
    assert any("Expmap0" in n for n in names), f"{name}: no fused exponential map"


def test_benchmark_loss_path_cases_run_and_reach_every_input() -> None:
    """``benchmarks/geometry.py --loss-path``: each case runs forward + backward on fresh
    features (tiny here) through the public functions, the gradients reach the features."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "geometry.py"
    spec = importlib.util.spec_from_file_location("bench_geometry", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.LOSS_CASES == ("cosine-loss", "lorentz-loss", "exterior-loss", "l1-loss")
    for case in bench.LOSS_CASES:
        prepare, step = bench.build_loss_path(case, 6, 16, 4)
        prepare()
        loss, grads_ok = step().tolist()
        assert math.isfinite(loss) and loss > 0, case  # InfoNCE of 6 pairs: positive
        assert grads_ok == 1.0, f"{case}: a feature got no or a non-finite gradient"


def test_benchmark_loss_path_times_in_cpu_seconds() -> None:
    """``--cpu-time``: the same rounds timed by this process's CPU clock (best <= median)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "geometry.py"
    spec = importlib.util.spec_from_file_location("bench_geometry", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    times = bench.time_loss_paths(["cosine-loss", "l1-loss"], 6, 16, 4, 2, cpu_time=True)
    assert set(times) == {"cosine-loss", "l1-loss"}
    for case, t in times.items():
        assert 0.0 < t["best"] <= t["median"], (case, t)
