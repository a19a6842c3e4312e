"""AGR's router, query conditioning, routed score and routing losses."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from curvalign.losses.routing import binary_entropy_from_logits, load_balance, routing_entropy
from curvalign.nn.router import PairwiseRouter, QueryConditioner, routed_scores

IMAGE_DIM, TEXT_DIM = 10, 12


pytestmark = pytest.mark.usefixtures("one_thread")


def _router(dtype=torch.float64, **kw) -> PairwiseRouter:
    torch.manual_seed(0)
    router = PairwiseRouter(IMAGE_DIM, TEXT_DIM, **kw).to(dtype).eval()
    with torch.no_grad():  # a non-trivial LayerNorm gain/bias, so folding them is tested
        router.norm.weight.normal_()
        router.norm.bias.normal_()
    return router


def _inputs(router: PairwiseRouter, nt=7, ni=9, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    s_e = 3 * torch.randn(nt, ni, generator=g, dtype=dtype)
    s_h = -20 * torch.rand(nt, ni, generator=g, dtype=dtype)
    u_t = router.text_context(torch.randn(nt, TEXT_DIM, generator=g, dtype=dtype))
    u_i = router.image_context(torch.randn(ni, IMAGE_DIM, generator=g, dtype=dtype))
    return s_e, s_h, u_t, u_i


def test_matrix_equals_pair_mode_on_every_pair():
    router = _router()
    s_e, s_h, u_t, u_i = _inputs(router)
    matrix = router.matrix_logits(s_e, s_h, u_t, u_i)
    # [n, K] candidate lists: each text against every image
    lists = router.pair_logits(s_e, s_h, u_t[:, None, :], u_i[None, :, :])
    torch.testing.assert_close(matrix, lists, rtol=1e-12, atol=1e-12)
    # matched rows [n]: the flattened pairs
    t_idx = torch.arange(7).repeat_interleave(9)
    i_idx = torch.arange(9).repeat(7)
    rows = router.pair_logits(s_e.flatten(), s_h.flatten(), u_t[t_idx], u_i[i_idx])
    torch.testing.assert_close(matrix.flatten(), rows, rtol=1e-12, atol=1e-12)


def test_matrix_mode_in_float32_and_chunked():
    router = _router(torch.float32)
    s_e, s_h, u_t, u_i = (t.float() for t in _inputs(_router()))
    matrix = router.matrix_logits(s_e, s_h, u_t.detach(), u_i.detach())
    torch.testing.assert_close(
        matrix, router.pair_logits(s_e, s_h, u_t[:, None], u_i[None]), rtol=1e-5, atol=1e-5
    )
    router.max_chunk_pairs = 10  # 1 row of 9 pairs per chunk
    with torch.no_grad():
        chunked = router.matrix_logits(s_e, s_h, u_t, u_i)
    torch.testing.assert_close(chunked, matrix.detach(), rtol=1e-6, atol=1e-6)


def test_no_pairwise_feature_tensor_is_kept():
    """The B x B path never saves a [Nt, Ni, 34] tensor for backward (the naive path does)."""
    router = _router(torch.float32)
    router.train()
    s_e, s_h, u_t, u_i = (t.float() for t in _inputs(_router()))
    shapes: list[tuple[int, ...]] = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        router.matrix_logits(s_e, s_h, u_t, u_i)
    assert shapes and (7, 9, 34) not in shapes
    shapes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        router.pair_logits(s_e, s_h, u_t[:, None], u_i[None])
    assert (7, 9, 34) in shapes  # the reference path does hold it: the check can fail


def test_gate_temperature_floor_and_fixed_option():
    router = _router()
    assert router.temperature().item() == pytest.approx(0.5)
    with torch.no_grad():
        router.temperature.log_value.fill_(math.log(0.1))
    assert router.temperature().item() == pytest.approx(0.5)  # clamped at the floor
    s_e, s_h, u_t, u_i = _inputs(router)
    with torch.no_grad():
        router.temperature.log_value.fill_(math.log(2.0))
        at_two = router.matrix_logits(s_e, s_h, u_t, u_i)
        router.temperature.log_value.fill_(math.log(0.5))
        at_half = router.matrix_logits(s_e, s_h, u_t, u_i)
    torch.testing.assert_close(at_two * 4, at_half)  # logits / T_gate
    fixed = PairwiseRouter(IMAGE_DIM, TEXT_DIM, learn_gate_temperature=False)
    assert not any("temperature" in n for n, _ in fixed.named_parameters())
    with pytest.raises(ValueError, match="outside its range"):
        PairwiseRouter(IMAGE_DIM, TEXT_DIM, gate_temperature=0.3)


def test_jitter_only_in_training():
    router = _router(dropout=0.0)
    s_e, s_h, u_t, u_i = _inputs(router)
    with torch.no_grad():
        eval_a = router.matrix_logits(s_e, s_h, u_t, u_i)
        eval_b = router.matrix_logits(s_e, s_h, u_t, u_i)
        router.train()
        train_a = router.matrix_logits(s_e, s_h, u_t, u_i)
        train_b = router.matrix_logits(s_e, s_h, u_t, u_i)
        router.jitter = 0.0
        train_no_jitter = router.matrix_logits(s_e, s_h, u_t, u_i)
    assert torch.equal(eval_a, eval_b)
    assert not torch.equal(train_a, train_b) and not torch.equal(train_a, eval_a)
    assert (train_a - eval_a).abs().max() < 1.0  # small noise, not a different router
    torch.testing.assert_close(train_no_jitter, eval_a, rtol=1e-12, atol=1e-12)


def test_router_reads_everything_detached():
    router = _router()
    router.train()
    s_e = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    s_h = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    h_t = torch.randn(4, TEXT_DIM, dtype=torch.float64, requires_grad=True)
    h_i = torch.randn(5, IMAGE_DIM, dtype=torch.float64, requires_grad=True)
    logits = router.matrix_logits(s_e, s_h, router.text_context(h_t), router.image_context(h_i))
    grads = torch.autograd.grad(
        logits.sum(),
        [s_e, s_h, h_t, h_i, router.fc1.weight, router.context_text.weight],
        allow_unused=True,
    )
    assert all(g is None for g in grads[:4])
    assert all(g is not None and g.abs().sum() > 0 for g in grads[4:])


def test_query_conditioner_starts_as_identity_and_is_detached():
    torch.manual_seed(0)
    cond = QueryConditioner(TEXT_DIM)
    h = torch.randn(6, TEXT_DIM, requires_grad=True)
    gate, calibration = cond(h)
    assert gate.shape == (6,) and torch.all((gate > 0) & (gate < 1))
    assert torch.equal(calibration, torch.ones(6, 3))
    (gate.sum() + calibration.sum()).backward()
    assert h.grad is None and cond.calibration.weight.grad.abs().sum() > 0


def test_routed_score_is_the_hyperbolic_score_while_alpha_is_zero():
    g = torch.Generator().manual_seed(3)
    s_h = -10 * torch.rand(5, 6, generator=g)
    s_e = 8 * torch.randn(5, 6, generator=g)
    w = torch.rand(5, 6, generator=g)
    gate = torch.rand(5, 1, generator=g)
    calibration = 2 * torch.rand(5, 1, 3, generator=g)
    for beta in (0.0, 0.5, 1.0):
        assert torch.equal(routed_scores(s_h, s_e, w, gate, calibration, 0.0, beta), s_h)


def test_routed_score_formula_and_bound():
    g = torch.Generator().manual_seed(4)
    s_h = -30 * torch.rand(5, 6, generator=g, dtype=torch.float64)
    s_e = 14 * torch.randn(5, 6, generator=g, dtype=torch.float64)
    w = torch.rand(5, 6, generator=g, dtype=torch.float64)
    gate = torch.rand(1, 6, generator=g, dtype=torch.float64)  # image side as the query
    calibration = 2 * torch.rand(1, 6, 3, generator=g, dtype=torch.float64)
    alpha, beta = 0.7, 0.4
    out = routed_scores(s_h, s_e, w, gate, calibration, alpha, beta, max_delta=5.0)
    for t in range(5):
        for i in range(6):
            wE, sH, sE = calibration[0, i].tolist()
            delta = 5.0 * math.tanh((sE * beta * s_e[t, i].item() - s_h[t, i].item()) / 5.0)
            expected = (
                s_h[t, i].item()
                + alpha * gate[0, i].item() * w[t, i].item() * wE * delta
                + alpha * gate[0, i].item() * (sH - 1) * s_h[t, i].item()
            )
            assert out[t, i].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # the Euclidean correction is bounded by alpha g w wE Dmax whatever S_E is
    base = s_h * (1 + alpha * gate * (calibration[..., 1] - 1))
    bound = alpha * gate * w * calibration[..., 0] * 5.0
    huge = routed_scores(s_h, 1e6 * s_e, w, gate, calibration, alpha, 1.0)
    assert torch.all((huge - base).abs() <= bound + 1e-9)


def test_routing_losses():
    logits = torch.tensor([-1000.0, 0.0, 3.0, 1000.0], requires_grad=True)
    h = binary_entropy_from_logits(logits)
    w = torch.sigmoid(torch.tensor(3.0)).item()
    expected = [0.0, math.log(2), -(w * math.log(w) + (1 - w) * math.log(1 - w)), 0.0]
    torch.testing.assert_close(h, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    routing_entropy(logits).backward()
    assert torch.all(torch.isfinite(logits.grad))
    assert load_balance(torch.tensor(0.8)).item() == pytest.approx(0.09)
    with pytest.raises(ValueError):
        routing_entropy(torch.zeros(0))


def test_chunk_first_layer_gradients():
    """gradcheck of one chunk (folded first layer + MLP) in its float64 inputs."""
    router = _router()
    g = torch.Generator().manual_seed(5)
    f64 = torch.float64
    args = [
        torch.randn(3, 4, generator=g, dtype=f64),  # se
        torch.randn(3, 4, generator=g, dtype=f64),  # sh
        torch.randn(3, 64, generator=g, dtype=f64),  # text part
        torch.randn(4, 64, generator=g, dtype=f64),  # image part
        torch.randn(4, 64, generator=g, dtype=f64),  # scalar map
    ]
    stats = (
        torch.randn(3, dtype=f64),
        torch.rand(3, dtype=f64) + 2,
        torch.randn(4, dtype=f64),
        torch.rand(4, dtype=f64) + 2,
    )
    assert torch.autograd.gradcheck(
        lambda *a: router._chunk_logits(*a, *stats), [a.requires_grad_() for a in args]
    )


def test_matrix_and_pair_mode_train_the_router_alike():
    router = _router()
    s_e, s_h, _, _ = _inputs(router)
    g = torch.Generator().manual_seed(6)
    h_t = torch.randn(7, TEXT_DIM, generator=g, dtype=torch.float64)
    h_i = torch.randn(9, IMAGE_DIM, generator=g, dtype=torch.float64)
    weight = torch.randn(7, 9, generator=g, dtype=torch.float64)  # an arbitrary downstream loss
    params = [p for p in router.parameters() if p.requires_grad]
    matrix = router.matrix_logits(s_e, s_h, router.text_context(h_t), router.image_context(h_i))
    grads_matrix = torch.autograd.grad((weight * matrix).sum(), params)
    pairs = router.pair_logits(
        s_e, s_h, router.text_context(h_t)[:, None], router.image_context(h_i)[None]
    )
    grads_pairs = torch.autograd.grad((weight * pairs).sum(), params)
    for a, b in zip(grads_matrix, grads_pairs, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _train_router(**kw) -> PairwiseRouter:
    router = _router(torch.float32, **kw)
    return router.train()


def _router_grads(router: PairwiseRouter, nt: int, ni: int, seed: int = 3):
    """Logits and the gradients of an arbitrary loss of them, with dropout and jitter drawn from
    a fixed seed (so two runs draw the same masks when they consume the RNG alike)."""
    g = torch.Generator().manual_seed(seed)
    s_e = 3 * torch.randn(nt, ni, generator=g)
    s_h = -5 * torch.rand(nt, ni, generator=g)
    h_t = torch.randn(nt, TEXT_DIM, generator=g)
    h_i = torch.randn(ni, IMAGE_DIM, generator=g)
    weight = torch.randn(nt, ni, generator=g)
    params = [p for p in router.parameters() if p.requires_grad]
    torch.manual_seed(seed)
    logits = router.matrix_logits(s_e, s_h, router.text_context(h_t), router.image_context(h_i))
    grads = torch.autograd.grad((weight * logits).sum(), params)
    return logits.detach(), grads


def test_recomputed_chunks_give_identical_gradients():
    """The eager path's row chunks recomputed in the backward (checkpoint) against the same
    chunks kept: same dropout masks and jitter (RNG state restored), identical logits and
    gradients."""
    kept = _train_router(train_chunk_pairs=20, recompute=False, fused=False)  # 2 rows of 9
    recomputed = _train_router(train_chunk_pairs=20, recompute=True, fused=False)
    recomputed.load_state_dict(kept.state_dict())
    a_logits, a_grads = _router_grads(kept, 7, 9)
    b_logits, b_grads = _router_grads(recomputed, 7, 9)
    torch.testing.assert_close(a_logits, b_logits, rtol=0, atol=0)
    for a, b in zip(a_grads, b_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(g.abs().sum() > 0 for g in a_grads)


def test_chunked_router_equals_the_plain_path_without_dropout():
    """Without stochastic layers, chunking the rows changes nothing beyond float rounding, and
    the fused kernel (all rows at once, recomputed per tile) agrees with both."""
    kw = dict(dropout=0.0, jitter=0.0)
    plain = _train_router(train_chunk_pairs=1 << 20, recompute=False, fused=False, **kw)
    chunked = _train_router(train_chunk_pairs=10, recompute=True, fused=False, **kw)
    fused = _train_router(**kw)
    chunked.load_state_dict(plain.state_dict())
    fused.load_state_dict(plain.state_dict())
    a_logits, a_grads = _router_grads(plain, 7, 9)
    for other in (chunked, fused):
        b_logits, b_grads = _router_grads(other, 7, 9)
        torch.testing.assert_close(a_logits, b_logits, rtol=1e-6, atol=1e-6)
        for a, b in zip(a_grads, b_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _LiveOutputs(TorchDispatchMode):
    """Remembers (weakly) the storage of every tensor an aten op produces, so that the bytes
    still alive after a forward pass (what autograd keeps for backward) can be summed."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages: dict[int, tuple[weakref.ref, int]] = {}
        self.existing = {t.untyped_storage().data_ptr() for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() not in self.existing:  # not a view of an input or parameter
                    self.storages[id(st)] = (weakref.ref(st), st.nbytes())
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self.storages.values() if ref() is not None)


def _kept_bytes_per_pair(router: PairwiseRouter, nt: int, ni: int) -> float:
    g = torch.Generator().manual_seed(4)
    s_e, s_h = torch.randn(nt, ni, generator=g), -5 * torch.rand(nt, ni, generator=g)
    h_t, h_i = torch.randn(nt, TEXT_DIM, generator=g), torch.randn(ni, IMAGE_DIM, generator=g)
    with _LiveOutputs([s_e, s_h, h_t, h_i, *router.parameters()]) as mode:
        logits = router.matrix_logits(s_e, s_h, router.text_context(h_t), router.image_context(h_i))
        kept = mode.live_bytes()
    logits.sum().backward()  # the graph is intact
    return kept / (nt * ni)


def test_chunked_router_keeps_o_chunk_activations():
    """With recompute, what the forward leaves alive for backward is a few scalars per pair
    (jittered inputs, the logits), not the ~1.2 KB a pair of the hidden layers: on the eager
    path (chunks under checkpoint) and on the fused kernel (which stores nothing per pair and
    recomputes per tile); the eager chunking without recompute keeps them all (so the check
    can fail)."""
    nt, ni = 64, 256  # 16384 pairs, chunks of 1024 (4 rows)
    recomputed = _kept_bytes_per_pair(_train_router(train_chunk_pairs=1024, fused=False), nt, ni)
    fused = _kept_bytes_per_pair(_train_router(), nt, ni)
    kept = _kept_bytes_per_pair(
        _train_router(train_chunk_pairs=1024, recompute=False, fused=False), nt, ni
    )
    assert kept > 500, kept
    # jittered s_E and s_H, the chunks' logits and their concatenation (4 x 4 bytes), plus
    # per-item rows and one chunk's temporaries spread over the pairs
    assert recomputed < 32, recomputed
    assert fused < 32, fused


def test_bit_dropout_rate_scale_and_eval():
    from curvalign.nn.router import BitDropout

    torch.manual_seed(0)
    drop = BitDropout(0.1).train()
    x = torch.ones(200_000)
    y = drop(x)
    assert abs(float((y == 0).float().mean()) - 0.1) < 0.005
    assert abs(float(y.mean()) - 1.0) < 0.01  # inverted dropout keeps the expectation
    values = torch.unique(y).tolist()
    assert values[0] == 0.0 and values[1:] == [pytest.approx(1 / (1 - 6554 / 65536))]
    assert torch.equal(drop.eval()(x), x)
    assert torch.equal(BitDropout(0.0).train()(x), x)
    with pytest.raises(ValueError, match="BitDropout p"):
        BitDropout(1.0)
