"""The fused CPU kernel of AGR's router (``nn._fused_router``) against the eager reference.

``PairwiseRouter(fused=False)`` is the reference (the chunked ``_chunk_logits`` path with
``torch.utils.checkpoint``); the default on CPU is the kernel. With dropout off, values and the
gradients of every router parameter must agree to the dtype's rounding. With dropout on, the
kernel's masks are a hash of (seed, row, column, unit): their rate and scale are checked, and
the kernel's values and gradients are compared with an eager MLP that applies the very masks
the kernel reports (``keep_masks``): the backward replays the forward's masks. The kernel is
compiled once per test session (a few seconds; cached across sessions).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from curvalign.nn import _fused_router as FR
from curvalign.nn.router import PairwiseRouter

IMAGE_DIM, TEXT_DIM = 10, 12
f32, f64 = torch.float32, torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")

needs_kernel = pytest.mark.skipif(
    not FR.available(torch.zeros(1)), reason="fused router kernel disabled or not buildable here"
)


def _router(dtype=f64, fused=True, **kw) -> PairwiseRouter:
    torch.manual_seed(0)
    router = PairwiseRouter(IMAGE_DIM, TEXT_DIM, fused=fused, **kw).to(dtype)
    with torch.no_grad():  # a non-trivial LayerNorm gain/bias and output bias
        router.norm.weight.normal_()
        router.norm.bias.normal_()
        router.tail[5].bias.fill_(0.3)
    return router


def _pair(dtype=f64, **kw) -> tuple[PairwiseRouter, PairwiseRouter]:
    fused = _router(dtype, True, **kw)
    reference = _router(dtype, False, **kw)
    reference.load_state_dict(fused.state_dict())
    return fused, reference


def _data(nt: int, ni: int, dtype, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    s_e = 3 * torch.randn(nt, ni, generator=g, dtype=dtype)
    s_h = -5 * torch.rand(nt, ni, generator=g, dtype=dtype)
    h_t = torch.randn(nt, TEXT_DIM, generator=g, dtype=dtype)
    h_i = torch.randn(ni, IMAGE_DIM, generator=g, dtype=dtype)
    weight = torch.randn(nt, ni, generator=g, dtype=dtype)  # an arbitrary downstream loss
    return s_e, s_h, h_t, h_i, weight


def _logits_and_grads(router: PairwiseRouter, data, seed: int = 7):
    s_e, s_h, h_t, h_i, weight = data
    params = [p for p in router.parameters() if p.requires_grad]
    torch.manual_seed(seed)
    logits = router.matrix_logits(s_e, s_h, router.text_context(h_t), router.image_context(h_i))
    grads = torch.autograd.grad((weight * logits).sum(), params)
    return logits.detach(), grads


def _assert_close(got, ref, dtype, what: str) -> None:  # noqa: ANN001
    scale = ref.abs().max().clamp_min(1e-3)
    tol = 1e-11 if dtype == f64 else 3e-5
    err = float((got - ref).abs().max() / scale)
    assert err < tol, f"{what}: max error {err:.3g} (relative to {float(scale):.3g}) above {tol}"


@needs_kernel
@pytest.mark.parametrize("dtype", [f32, f64])
# (3, 150): 19 tiles a row, so the backward's buffered dW2 updates run mid-row and the last
# tile is processed alone (tiles go two at a time)
@pytest.mark.parametrize("nt,ni", [(7, 9), (1, 1), (13, 8), (33, 21), (3, 150)])
def test_fused_matches_reference_values_and_gradients(dtype, nt: int, ni: int) -> None:
    fused, reference = _pair(dtype, dropout=0.0, jitter=0.0)
    fused.train(), reference.train()
    data = _data(nt, ni, dtype)
    got, got_grads = _logits_and_grads(fused, data)
    ref, ref_grads = _logits_and_grads(reference, data)
    _assert_close(got, ref, dtype, "logits")
    names = [n for n, p in fused.named_parameters() if p.requires_grad]
    assert len(names) == len(got_grads) == len(ref_grads)
    for name, a, b in zip(names, got_grads, ref_grads, strict=True):
        _assert_close(a, b, dtype, name)
    # every parameter is reached (T_gate starts at its floor, where its clamp passes none)
    assert all(
        g.abs().sum() > 0 for n, g in zip(names, got_grads, strict=True) if "temperature" not in n
    )


@needs_kernel
def test_fused_is_the_default_on_cpu() -> None:
    router = _router(f32).train()
    s_e, s_h, h_t, h_i, _ = _data(4, 5, f32)
    out = router.matrix_logits(s_e, s_h, router.text_context(h_t), router.image_context(h_i))
    names = []
    node = out.grad_fn
    while node is not None and node.next_functions:
        names.append(type(node).__name__)
        node = node.next_functions[0][0]
    assert any("router_logits" in n for n in names), names


@needs_kernel
@pytest.mark.parametrize("hidden", [(20, 12), (8, 3)])
def test_fused_with_hidden_widths_not_multiples_of_eight(hidden) -> None:  # noqa: ANN001
    fused, reference = _pair(f64, dropout=0.0, jitter=0.0, hidden_dims=hidden, context_dim=5)
    data = _data(6, 11, f64)
    s_e, s_h, h_t, h_i, weight = data
    for router in (fused, reference):
        assert router.in_dim == 12
    got, got_grads = _logits_and_grads(fused, data)
    ref, ref_grads = _logits_and_grads(reference, data)
    _assert_close(got, ref, f64, "logits")
    for a, b in zip(got_grads, ref_grads, strict=True):
        _assert_close(a, b, f64, "grad")


@needs_kernel
def test_fused_evaluation_without_gradients_matches_reference() -> None:
    fused, reference = _pair(f32)  # dropout and jitter configured, but eval mode: inactive
    fused.eval(), reference.eval()
    s_e, s_h, h_t, h_i, _ = _data(9, 17, f32)
    with torch.no_grad():
        got = fused.matrix_logits(s_e, s_h, fused.text_context(h_t), fused.image_context(h_i))
        ref = reference.matrix_logits(
            s_e, s_h, reference.text_context(h_t), reference.image_context(h_i)
        )
    _assert_close(got, ref, f32, "eval logits")


def _kernel_inputs(nt: int, ni: int, h1: int, h2: int, seed: int = 0):
    """Random float64 inputs of ``router_logits_fused`` with a well-conditioned variance."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=f64)  # noqa: E731
    u_t, u_i = rand(nt, 6), rand(ni, 6)
    return dict(
        se=rand(nt, ni),
        sh=rand(nt, ni),
        text_part=rand(nt, h1),
        image_part=rand(ni, h1),
        scalar_map=rand(4, h1),
        sum_t=u_t.sum(-1),
        sq_t=u_t.square().sum(-1) + 1.0,
        sum_i=u_i.sum(-1),
        sq_i=u_i.square().sum(-1) + 1.0,
        w2=rand(h2, h1) / math.sqrt(h1),
        b2=rand(h2),
        w3=rand(1, h2) / math.sqrt(h2),
        b3=rand(1),
    )


@needs_kernel
@pytest.mark.parametrize("thresholds", [(0, 0), (16384, 26214)])
def test_fused_gradcheck_float64(thresholds) -> None:  # noqa: ANN001
    """Every input, the scalars and the statistics included, with dropout off and on: with a
    fixed seed the masks are fixed, so the backward must be the derivative of the forward."""
    inputs = _kernel_inputs(3, 9, 10, 5)
    names = list(inputs)

    def f(*tensors):  # noqa: ANN002, ANN202
        kw = dict(zip(names, tensors, strict=True))
        return FR.router_logits_fused(**kw, in_dim=8, eps=1e-5, thresholds=thresholds, seed=11)

    tensors = [t.requires_grad_() for t in inputs.values()]
    assert torch.autograd.gradcheck(f, tensors)


def _eager_with_masks(kw: dict, thresholds, seed: int, in_dim: int, eps: float):  # noqa: ANN001
    """The router's function written out in torch, with the kernel's own masks applied."""
    nt, ni = kw["se"].shape
    h1, h2 = kw["w2"].shape[1], kw["w2"].shape[0]
    keep = FR.keep_masks(nt, ni, h1, h2, thresholds, seed)
    h1p = -(-h1 // 8) * 8
    scale1, scale2 = (65536.0 / (65536 - t) for t in thresholds)
    m1 = keep[..., :h1].to(f64) * scale1
    m2 = keep[..., h1p : h1p + h2].to(f64) * scale2
    se, sh = kw["se"].double(), kw["sh"].double()
    mean = (se + sh + kw["sum_t"][:, None] + kw["sum_i"][None]) / in_dim
    var = (se**2 + sh**2 + kw["sq_t"][:, None] + kw["sq_i"][None]) / in_dim - mean**2
    rstd = (var.clamp_min(0) + eps).rsqrt()
    wE, wH, k, c = kw["scalar_map"]
    u = (
        se[..., None] * wE
        + sh[..., None] * wH
        - mean[..., None] * k
        + kw["text_part"][:, None]
        + kw["image_part"][None]
    )
    d1 = F.gelu(u * rstd[..., None] + c) * m1
    d2 = F.gelu(d1 @ kw["w2"].double().T + kw["b2"]) * m2  # float64 (the parameters may be float32)
    return (d2 @ kw["w3"].double().reshape(-1, 1)).squeeze(-1) + kw["b3"]


@needs_kernel
def test_kernel_gelu_error_is_bounded() -> None:
    """The float32 kernel's division-free GELU (the backward's value and derivative, and the
    forward's value alone) against the exact (float64) one over [-12, 12] and beyond: within
    2e-7 max(1, |x|) and 2.5e-7 (torch's own float GELU, A&S 7.1.26, is within about 1.6e-7),
    the sign of gelu kept, NaN carried through."""
    x = torch.linspace(-12.0, 12.0, 240_001).to(f32)
    x = torch.cat([x, torch.tensor([-40.0, -6.5, -6.0, -5.0, 5.0, 6.0, 6.5, 40.0])])
    y, dy, value = FR.kernel_gelu(x)
    x64 = x.double()
    cdf = 0.5 * (1.0 + torch.erf(x64 / math.sqrt(2.0)))
    ref, dref = x64 * cdf, cdf + x64 * torch.exp(-0.5 * x64**2) / math.sqrt(2.0 * math.pi)
    for got, what in ((y, "backward's value"), (value, "forward's value")):
        err = ((got.double() - ref).abs() / x64.abs().clamp_min(1.0)).max()
        assert err < 2e-7, (what, float(err))
        assert bool((got[x < 0] <= 0).all()) and bool((got[x > 0] > 0).all()), what
    derr = (dy.double() - dref).abs().max()
    assert derr < 2.5e-7, float(derr)
    nan = FR.kernel_gelu(torch.tensor([float("nan")]))
    assert all(bool(t.isnan().all()) for t in nan)


@needs_kernel
def test_kernel_gelu_vector_and_portable_loops_agree() -> None:
    """The AVX2 loops (where built) do the portable loops' operations in the same order: the
    same bits, NaN and infinities included; a length that is not a multiple of 8 runs the
    portable loops on the tail."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([8 * torch.randn(4099, generator=g), torch.tensor([0.0, -0.0, 5.0, -5.0])])
    x = torch.cat([x, torch.tensor([6.0, -6.0, float("nan"), float("inf"), -float("inf")])])
    fast, plain = FR.kernel_gelu(x), FR.kernel_gelu(x, portable=True)
    for a, b in zip(fast, plain, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
        assert torch.equal(a.isnan(), b.isnan())


@needs_kernel
@pytest.mark.parametrize("dtype", [f64, f32])
def test_dropout_masks_are_replayed_in_backward(dtype) -> None:  # noqa: ANN001
    """Dropout on: the kernel's logits and gradients equal an eager MLP that applies the masks
    the kernel reports, so forward and backward used the same masks with the exact scale (in
    float32 too, whose masks come from the vectorised hash where the build has AVX2)."""
    thresholds, seed = (6554, 6554), 123456789123
    stats = ("sum_t", "sq_t", "sum_i", "sq_i")  # float64 in both dtypes
    inputs = {
        n: t if n in stats else t.to(dtype)
        for n, t in _kernel_inputs(5, 37, 64, 32, seed=4).items()
    }
    weight = torch.randn(5, 37, generator=torch.Generator().manual_seed(5), dtype=dtype)
    outs = []
    for fn in ("fused", "eager"):
        kw = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
        if fn == "fused":
            out = FR.router_logits_fused(
                **kw, in_dim=34, eps=1e-5, thresholds=thresholds, seed=seed
            )
        else:
            out = _eager_with_masks(kw, thresholds, seed, 34, 1e-5)
        grads = torch.autograd.grad((weight * out).sum(), list(kw.values()))
        outs.append((out.detach(), grads))
    (a, ga), (b, gb) = outs
    _assert_close(a, b, dtype, "logits")
    for name, x, y in zip(inputs, ga, gb, strict=True):
        _assert_close(x, y, dtype, name)
    # and the masks matter: without them the values differ
    no_drop = _eager_with_masks(inputs, (0, 0), seed, 34, 1e-5)
    assert (no_drop - a).abs().max() > 1e-3


@needs_kernel
def test_dropout_masks_rate_and_independence() -> None:
    p = 0.1
    thr = round(p * 65536)
    keep = FR.keep_masks(64, 96, 64, 32, (thr, thr), seed=2024)  # 589,824 units
    n = keep.numel()
    rate = 1.0 - float(keep.float().mean())
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - thr / 65536) < 5 * sigma, rate
    # every unit, and every pair position, drops at the same rate (no stuck lanes or units)
    per_unit = 1.0 - keep.float().mean(dim=(0, 1))
    assert (per_unit - p).abs().max() < 6 * math.sqrt(p * (1 - p) / (64 * 96))
    per_lane = 1.0 - keep.float().reshape(64, 12, 8, 96).mean(dim=(0, 1, 3))
    assert (per_lane - p).abs().max() < 6 * math.sqrt(p * (1 - p) / (64 * 12 * 96))
    # the two 16-bit halves of one hash and neighbouring pairs are uncorrelated
    x = keep.float() - keep.float().mean()
    for a, b in ((x[..., 0::2], x[..., 1::2]), (x[:, :-1], x[:, 1:]), (x[:-1], x[1:])):
        corr = float((a * b).mean() / (a.std() * b.std()))
        assert abs(corr) < 0.01, corr
    # another seed, other masks
    other = FR.keep_masks(64, 96, 64, 32, (thr, thr), seed=2025)
    assert float((other != keep).float().mean()) > 0.1


@needs_kernel
def test_dropout_is_seeded_by_torch() -> None:
    """With dropout on in training, torch.manual_seed reproduces the masks and a new call
    draws new ones (the seed comes from torch's default generator)."""
    router = _router(f32, dropout=0.1, jitter=0.0).train()
    s_e, s_h, h_t, h_i, _ = _data(6, 10, f32)
    args = (s_e, s_h, router.text_context(h_t), router.image_context(h_i))
    torch.manual_seed(1)
    a = router.matrix_logits(*args)
    b = router.matrix_logits(*args)
    torch.manual_seed(1)
    c = router.matrix_logits(*args)
    assert torch.equal(a, c) and not torch.equal(a, b)
    router.eval()
    with torch.no_grad():
        clean = router.matrix_logits(*args)
    assert not torch.equal(a.detach(), clean)
    assert (a.detach() - clean).abs().mean() < 0.5 * clean.abs().mean() + 0.5  # same router


@needs_kernel
def test_fused_with_several_threads_equals_one() -> None:
    fused = _router(f64, dropout=0.1, jitter=0.0).train()
    data = _data(29, 19, f64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, one_grads = _logits_and_grads(fused, data)
        torch.set_num_threads(3)
        three, three_grads = _logits_and_grads(fused, data)
    finally:
        torch.set_num_threads(before)
    _assert_close(one, three, f64, "threads")  # the masks do not depend on the threads
    for a, b in zip(one_grads, three_grads, strict=True):
        _assert_close(a, b, f64, "threads")


@needs_kernel
def test_fused_under_bf16_autocast_computes_in_float32() -> None:
    fused, reference = _pair(f32, dropout=0.0, jitter=0.0)
    s_e, s_h, h_t, h_i, _ = _data(7, 9, f32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        u_t, u_i = fused.text_context(h_t).float(), fused.image_context(h_i).float()
        got = fused.matrix_logits(s_e, s_h, u_t, u_i)
    assert got.dtype == f32
    ref = reference.matrix_logits(s_e, s_h, u_t, u_i)
    _assert_close(got.detach(), ref.detach(), f32, "autocast")


@needs_kernel
def test_env_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    router = _router(f64, dropout=0.0, jitter=0.0).train()
    s_e, s_h, h_t, h_i, _ = _data(4, 5, f64)

    def graph(out) -> str:  # noqa: ANN001
        node, names = out.grad_fn, []
        while node is not None and node.next_functions:
            names.append(type(node).__name__)
            node = node.next_functions[0][0]
        return " ".join(names)

    monkeypatch.setenv("CURVALIGN_FUSED", "0")
    off = router.matrix_logits(s_e, s_h, router.text_context(h_t), router.image_context(h_i))
    assert "router_logits" not in graph(off)
    monkeypatch.setenv("CURVALIGN_FUSED", "1")
    on = router.matrix_logits(s_e, s_h, router.text_context(h_t), router.image_context(h_i))
    assert "router_logits" in graph(on)
    _assert_close(on.detach(), off.detach(), f64, "env switch")


def test_failed_build_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(FR.KERNEL, "build", broken)
    monkeypatch.setattr(FR.KERNEL, "library", None)
    monkeypatch.setattr(FR.KERNEL, "failed", None)
    router = _router(f64, dropout=0.0, jitter=0.0).train()
    reference = _router(f64, fused=False, dropout=0.0, jitter=0.0).train()
    s_e, s_h, h_t, h_i, _ = _data(4, 5, f64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = router.matrix_logits(s_e, s_h, router.text_context(h_t), router.image_context(h_i))
        second = router.matrix_logits(s_e, s_h, router.text_context(h_t), router.image_context(h_i))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "simulated compiler failure" in messages[0]
    ref = reference.matrix_logits(
        s_e, s_h, reference.text_context(h_t), reference.image_context(h_i)
    )
    assert torch.equal(first, ref) and torch.equal(second, ref)


# --- the routed score in both directions ------------------------------------------------------


def _routed_inputs(nt: int, ni: int, dtype, scale: float = 1.0, seed: int = 8):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=f64)  # noqa: E731
    return [
        (-20 * scale * torch.rand(nt, ni, generator=g, dtype=f64)).to(dtype),  # s_h
        (14 * scale * rand(nt, ni)).to(dtype),  # s_e
        torch.rand(nt, ni, generator=g, dtype=f64).to(dtype),  # w
        torch.rand(nt, generator=g, dtype=f64).to(dtype),  # row gate
        (2 * torch.rand(nt, 3, generator=g, dtype=f64)).to(dtype),  # row calibration
        torch.rand(ni, generator=g, dtype=f64).to(dtype),  # column gate
        (2 * torch.rand(ni, 3, generator=g, dtype=f64)).to(dtype),  # column calibration
    ]


def _routed_both(inputs, fused: bool, alpha=0.7, beta=0.4, weights=None):  # noqa: ANN001, ANN202
    from curvalign.nn.router import routed_scores_both

    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    rows, cols = routed_scores_both(*leaves, alpha, beta, 5.0, fused=fused)
    w1, w2 = weights
    grads = torch.autograd.grad((w1 * rows).sum() + (w2 * cols).sum(), leaves)
    return rows.detach(), cols.detach(), grads


@needs_kernel
@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize("nt,ni", [(7, 9), (1, 1), (16, 8), (33, 21)])
@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])  # tanh's series, its middle, saturation
def test_routed_both_matches_two_reference_calls(dtype, nt: int, ni: int, scale: float) -> None:
    inputs = _routed_inputs(nt, ni, dtype, scale)
    g = torch.Generator().manual_seed(9)
    weights = (
        torch.randn(nt, ni, generator=g).to(dtype),
        torch.randn(nt, ni, generator=g).to(dtype),
    )
    a_rows, a_cols, a_grads = _routed_both(inputs, True, weights=weights)
    b_rows, b_cols, b_grads = _routed_both(inputs, False, weights=weights)
    _assert_close(a_rows, b_rows, dtype, "row-query scores")
    _assert_close(a_cols, b_cols, dtype, "column-query scores")
    names = ["s_h", "s_e", "w", "row gate", "row calibration", "column gate", "column calibration"]
    for name, x, y in zip(names, a_grads, b_grads, strict=True):
        _assert_close(x, y, dtype, name)


@needs_kernel
def test_routed_both_gradcheck_float64() -> None:
    inputs = [t.requires_grad_() for t in _routed_inputs(3, 9, f64, 0.3)]
    assert torch.autograd.gradcheck(
        lambda *t: FR.routed_scores_both_fused(*t, 0.6, 0.8, 5.0), inputs
    )


@needs_kernel
def test_routed_both_with_alpha_zero_is_the_hyperbolic_score() -> None:
    inputs = _routed_inputs(5, 6, f32)
    rows, cols = FR.routed_scores_both_fused(*inputs, 0.0, 1.0, 5.0)
    assert torch.equal(rows, inputs[0]) and torch.equal(cols, inputs[0])


@needs_kernel
def test_agr_loss_fused_equals_eager_without_dropout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole AGR loss (router kernel + routed-score kernel) against CURVALIGN_FUSED=0, with
    dropout and jitter off: the same loss terms and gradients to float rounding."""
    from curvalign.recipes.agr import AGR, AGRConfig
    from curvalign.recipes.base import Batch, Progress

    torch.manual_seed(0)
    model = AGR(AGRConfig(embed_dim=16, lora_rank=8, router_dropout=0.0, score_jitter=0.0), 20, 24)
    with torch.no_grad():
        for name, p in model.named_parameters():  # move the zero-initialised parts
            if "lora_B" in name or "calibration" in name:
                p.add_(0.1 * torch.randn(p.shape))
    g = torch.Generator().manual_seed(1)
    batch = Batch(image=torch.randn(13, 20, generator=g), text=torch.randn(13, 24, generator=g))
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("CURVALIGN_FUSED", flag)
        out = model.loss(batch, Progress(800, 1000))  # alpha = beta = 1: every path active
        grads = torch.autograd.grad(out.total, params, allow_unused=True)
        results.append((out, grads))
    (a, ga), (b, gb) = results
    for key in a.terms:
        _assert_close(a.terms[key].detach(), b.terms[key].detach(), f32, key)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    largest = max(float(y.abs().max()) for y in gb if y is not None)
    for name, x, y in zip(names, ga, gb, strict=True):
        assert (x is None) == (y is None), name
        if x is not None:  # float32 rounding, relative to the parameter's or the largest gradient
            err = float((x - y).abs().max())
            assert err < 3e-5 * max(float(y.abs().max()), 1e-2 * largest), (name, err)
