"""The fused CPU kernels under ``torch.compile``: same values and gradients as eager.

Each kernel (Lorentz distance, exterior angle in the ``[N, d]`` and the factor layout, the
l1-product, the router's logits, the routed scores both ways) is a pair of ``torch.library``
custom ops (``curvalign::...``), opaque to Dynamo. Before that they were
``autograd.Function``s filling their output through a ctypes call, which Dynamo traced past:
the compiled graph returned the uninitialised output (the Lorentz distance came back as zeros),
a silently wrong training. These tests compile each through ``fullgraph=True`` (no graph break
allowed) and compare values and gradients with eager to float rounding, at two batch sizes.

Most cases compile with the ``aot_eager`` backend: Dynamo and AOTAutograd, where the boundary
of the custom ops matters, without Inductor's C++ compile (tens of seconds on CPU each); one
case runs Inductor end to end. Shapes are tiny; the whole file takes well under a minute.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from curvalign.geometry import _fused_l1, _fused_lorentz, lorentz, product
from curvalign.nn import _fused_router
from curvalign.nn.router import PairwiseRouter, routed_scores_both

f64 = torch.float64

needs_kernels = pytest.mark.skipif(
    not (
        _fused_lorentz.available(torch.zeros(1))
        and _fused_l1.available(torch.zeros(1))
        and _fused_router.available(torch.zeros(1))
    ),
    reason="fused kernels disabled or not buildable here",
)

pytestmark = [
    needs_kernels,
    pytest.mark.usefixtures("one_thread"),
    # torch's own compile machinery touches torch.jit.script_method and warns about it; not ours
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _lorentz_points(seed: int, shape: tuple[int, ...], dtype: torch.dtype = f64):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(*shape, generator=g, dtype=f64) / shape[-1] ** 0.5
    return lorentz.expmap0(v, 1.0).to(dtype)


def _values_and_grads(fn, inputs, weight):  # noqa: ANN001, ANN202
    """``fn(*inputs)`` (a tensor or a tuple of them) and the gradients of a weighted sum."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o * weight(o)).sum() for o in outs)
    diff = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(loss, diff, allow_unused=True)
    return [o.detach() for o in outs], [torch.zeros(()) if g is None else g for g in grads]


def _weight(o: torch.Tensor) -> torch.Tensor:
    """A fixed non-uniform weight of ``o``'s shape (the same in eager and compiled)."""
    g = torch.Generator().manual_seed(o.numel())
    return torch.randn(o.shape, generator=g, dtype=o.dtype)


def _assert_close(got, ref, what: str, tol: float = 1e-10) -> None:  # noqa: ANN001
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.shape == b.shape, f"{what}[{i}]: shape {tuple(a.shape)} != {tuple(b.shape)}"
        scale = b.abs().max().clamp_min(1.0)
        err = ((a - b).abs().max() / scale).item()
        assert err < tol, f"{what}[{i}]: compiled differs from eager by {err:.3g} (rel.)"


def _check_compiled(fn, make_inputs, sizes, backend="aot_eager", fullgraph=True) -> int:  # noqa: ANN001
    """Compile ``fn`` once, run it at each size in ``sizes`` against eager (values and
    gradients); the number of graphs Dynamo compiled (a restart of one trace counts once)."""
    compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph)
    for n in sizes:
        inputs = make_inputs(n)
        ref_out, ref_grads = _values_and_grads(fn, inputs, _weight)
        out, grads = _values_and_grads(compiled, inputs, _weight)
        assert all(o.abs().sum() > 0 for o in ref_out)  # the test can see an all-zero output
        _assert_close(out, ref_out, f"value at n={n}")
        _assert_close(grads, ref_grads, f"grad at n={n}")
    return counters["stats"]["unique_graphs"]


def _pair_inputs(layout: str):  # noqa: ANN202
    def make(n: int):  # noqa: ANN202
        shape = (n, 5) if layout == "flat" else (n, 3, 4)
        X, Y = _lorentz_points(n, shape), _lorentz_points(100 + n, (n + 2, *shape[1:]))
        c = torch.tensor(0.8 if layout == "flat" else [0.5, 1.0, 2.0], dtype=f64)
        return X, Y, c

    return make


def _l1_inputs(n: int):  # noqa: ANN202
    X = _lorentz_points(n, (n, 4, 3))
    Y = _lorentz_points(50 + n, (n + 3, 4, 3))
    return X, Y, torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=f64)


def _router(dropout: float = 0.0) -> PairwiseRouter:
    torch.manual_seed(0)
    router = PairwiseRouter(6, 5, context_dim=4, hidden_dims=(12, 8), dropout=dropout, jitter=0.0)
    return router.to(f64).train()


def _router_inputs(n: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(n)
    s_e = 3 * torch.randn(n, n + 1, generator=g, dtype=f64)
    s_h = -5 * torch.rand(n, n + 1, generator=g, dtype=f64)
    h_t = torch.randn(n, 5, generator=g, dtype=f64)
    h_i = torch.randn(n + 1, 6, generator=g, dtype=f64)
    return s_e, s_h, h_t, h_i


def _router_logits(router: PairwiseRouter):  # noqa: ANN202
    def logits(s_e, s_h, h_t, h_i):  # noqa: ANN001, ANN202
        return router.matrix_logits(s_e, s_h, router.text_context(h_t), router.image_context(h_i))

    return logits


def _routed_inputs(n: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(n)
    m = n + 2

    def r(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g, dtype=f64)

    s_h, s_e, weight = -3 * r(n, m), 2 * r(n, m) - 1, r(n, m)
    return s_h, s_e, weight, r(n), r(n, 3) - 0.5, r(m), r(m, 3) - 0.5


def _routed_both(*t):  # noqa: ANN002, ANN202
    return routed_scores_both(*t, alpha=0.6, beta=0.8, max_delta=5.0)


# name -> (function, inputs of a batch size n, sizes, the most graphs allowed over those sizes)
CASES = {
    "lorentz-dist": (lorentz.pairwise_dist, _pair_inputs("flat"), (6, 9, 11), 2),
    "lorentz-dist-factors": (lorentz.pairwise_dist, _pair_inputs("factors"), (6, 9, 11), 2),
    "exterior-angle": (lorentz.pairwise_exterior_angle, _pair_inputs("flat"), (6, 9, 11), 2),
    "exterior-angle-factors": (
        lorentz.pairwise_exterior_angle, _pair_inputs("factors"), (6, 9, 11), 2
    ),
    # n + 3 columns: 9 and 13 do not fill the kernel's 8-column blocks; whether they do is a
    # guard of its own (at most one more graph), 12 and 13 then share the dynamic one
    "l1-product": (product.l1_pairwise_dist, _l1_inputs, (6, 9, 10), 3),
    # more than 8 columns: one column block of the kernel is a size-1 dimension, which Dynamo
    # specialises (one more graph); beyond that, batch sizes share one dynamic graph
    "router-logits": (_router_logits(_router()), _router_inputs, (9, 12, 17), 2),
    "routed-scores-both": (_routed_both, _routed_inputs, (4, 6, 9), 2),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_fullgraph_equals_eager_at_several_batch_sizes(name: str) -> None:
    """No graph break through the kernel; after the first change of batch size (automatic
    dynamic shapes: one recompile) further sizes reuse the dynamic graph."""
    fn, make_inputs, sizes, most_graphs = CASES[name]
    graphs = _check_compiled(fn, make_inputs, sizes)
    assert graphs <= most_graphs, f"{name}: {graphs} graphs for batch sizes {sizes}"


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_as_a_user_would_equals_eager(name: str) -> None:
    """``torch.compile(f)`` with its defaults (graph breaks allowed): where the kernels were
    ``autograd.Function``s around a ctypes call, this returned the empty output buffer."""
    fn, make_inputs, sizes, _ = CASES[name]
    _check_compiled(fn, make_inputs, sizes[:1], fullgraph=False)


@pytest.mark.slow  # Inductor compiles C++: 18 s with a cold compile cache (as in CI)
def test_lorentz_distance_under_inductor() -> None:
    """End to end with Inductor (fusing the torch code around the opaque kernel)."""

    def loss(X, Y, c):  # noqa: ANN001, ANN202
        return torch.logsumexp(-lorentz.pairwise_dist(X, Y, c), dim=1)

    graphs = _check_compiled(loss, _pair_inputs("flat"), sizes=(6, 9), backend="inductor")
    assert graphs <= 2


def test_router_dropout_under_compile_draws_fresh_masks() -> None:
    """The masks' seed is a tensor drawn inside the graph, not a constant baked into it."""
    compiled = torch.compile(
        _router_logits(_router(dropout=0.3)), backend="aot_eager", fullgraph=True
    )
    inputs = _router_inputs(9)
    first, second = compiled(*inputs), compiled(*inputs)
    assert torch.isfinite(first).all() and not torch.equal(first, second)


@pytest.mark.parametrize("name", ["lorentz-dist", "exterior-angle"])
def test_compiled_second_backward_recomputes_the_gram_matrix(name: str) -> None:
    """The backward op writes over the Gram matrix the forward kept (declared as a mutation);
    a second backward through the compiled graph must still get the same gradients."""
    fn, make_inputs, _, _ = CASES[name]
    X, Y, c = make_inputs(7)
    X.requires_grad_()
    compiled = torch.compile(
        lambda X, Y, c: fn(X, Y, c).square().sum(), backend="aot_eager", fullgraph=True
    )
    out = compiled(X, Y, c)
    first = torch.autograd.grad(out, X, retain_graph=True)[0]
    second = torch.autograd.grad(out, X)[0]
    ref = torch.autograd.grad(fn(X, Y, c).square().sum(), X)[0]
    _assert_close([first, second], [ref, ref], "retain_graph gradients")
