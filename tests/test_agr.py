"""AGR recipe: gradient flow (Table 1), curriculum, routed ranking scores, gathering, a short fit."""

from __future__ import annotations

import math

import pytest
import torch

from curvalign.data.synthetic import SyntheticConfig, make_world
from curvalign.recipes import get_recipe
from curvalign.recipes.agr import AGR, AGRConfig
from curvalign.recipes.base import Batch, Gather, Progress, cat_embeddings, slice_embedding
from curvalign.scores import lorentz_distance_scores
from recipe_harness import fit, heldout_recall_at_1

DI, DT = 20, 24
TOTAL = 1_200  # curriculum boundaries at 25 / 50 / 50 / 100 steps


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(**kw) -> AGR:
    torch.manual_seed(0)
    return AGR(AGRConfig(embed_dim=16, lora_rank=8, **kw), DI, DT)


def _batch(n: int = 12, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(image=torch.randn(n, DI, generator=g), text=torch.randn(n, DT, generator=g))


def _perturb_(model: AGR) -> None:
    """Move every zero-initialised part (LoRA B, trunk, calibration) off its initial value."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "trunk" in name or "calibration" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def _step(model: AGR, batch: Batch, progress: Progress, gather: Gather | None = None):
    """One training step's recipe calls, as the trainer makes them: the curriculum hook, then
    the loss."""
    model.on_step_start(progress)
    return model.loss(batch, progress, gather)


def _grads(
    output: torch.Tensor, params: dict[str, torch.nn.Parameter]
) -> dict[str, torch.Tensor | None]:
    grads = torch.autograd.grad(output, list(params.values()), allow_unused=True, retain_graph=True)
    return dict(zip(params, grads, strict=False))


def _connected(grads: dict) -> set[str]:
    return {n for n, g in grads.items() if g is not None and g.abs().sum() > 0}


def test_registered_with_its_config():
    assert get_recipe("agr") is AGR and AGR.Config is AGRConfig
    cfg = AGRConfig()
    defaults = (
        cfg.lora_rank,
        cfg.curvature_init,
        cfg.curvature_min,
        cfg.curvature_max,
        cfg.max_delta,
    )
    assert defaults == (64, 0.1, 1e-4, 2.0, 5.0)
    assert cfg.curriculum.alpha_end * 120_000 == pytest.approx(5_000)
    with pytest.raises(ValueError, match="curvature"):
        AGRConfig(curvature_init=5.0)
    with pytest.raises(ValueError, match="start <= end"):
        AGRConfig(beta_start=0.5, beta_end=0.1)


def test_gradient_flow_table():
    """Table 1: only the hyperbolic head reaches the trunk; the Euclidean LoRA, router, contexts,
    gates and calibration reach neither trunk nor heads."""
    model = _model(trunk="residual")
    _perturb_(model)
    model.alpha.fill_(1.0)
    model.beta.fill_(1.0)
    b = _batch()
    texts, images = model.embed_texts(b.text), model.embed_images(b.image)
    parts = model.routed(texts, images, "text")
    params = dict(model.named_parameters())
    trunk = {n for n in params if "trunk" in n}
    lorentz_heads = {n for n in params if "lorentz" in n}
    lora = {n for n in params if "lora_" in n}
    router = {n for n in params if n.startswith(("router.", "image_query.", "text_query."))}
    assert trunk and lorentz_heads and lora and router
    assert not any("base" in n for n in params)  # the Euclidean base is frozen (a buffer)

    s_h = _connected(_grads(parts.s_h.sum(), params))
    assert trunk <= s_h and lorentz_heads <= s_h and not (s_h & (lora | router))

    s_e = _connected(_grads(parts.s_e.sum(), params))
    assert lora <= s_e and not (s_e & (trunk | router | lorentz_heads))

    for name, value in (
        ("route_logits", parts.route_logits),
        ("gate", parts.gate),
        ("calibration", parts.calibration),
    ):
        reached = _connected(_grads(value.sum(), params))
        assert reached and reached <= router, name

    # the routed score trains both experts and the router, and the trunk only through S_H
    s_agr = _grads(parts.s_agr.sum(), params)
    assert trunk <= _connected(s_agr) and lora <= _connected(s_agr)
    trunk_from_agr = torch.cat([s_agr[n].flatten() for n in sorted(trunk)])
    # compare with the trunk gradient of S_AGR where only S_H's own graph reaches the trunk:
    # the same score with every router-side tensor detached
    gate, calibration = model._query_conditioning({k: v.detach() for k, v in texts.items()})
    detached = model._routed_score(
        parts.s_e,
        parts.s_h,
        parts.route_logits.detach(),
        gate[:, None],
        calibration[:, None, :],
        1.0,
        1.0,
    )
    ref = _grads(detached.sum(), params)
    torch.testing.assert_close(trunk_from_agr, torch.cat([ref[n].flatten() for n in sorted(trunk)]))


def test_loss_terms_reach_the_right_parameters():
    model = _model(trunk="residual")
    _perturb_(model)
    out = model.loss(_batch(), Progress(500, TOTAL))  # Adaptive phase
    params = dict(model.named_parameters())
    trunk = {n for n in params if "trunk" in n}
    reg = _connected(_grads(out.terms["entropy"] + out.terms["load_balance"], params))
    assert reg and all(n.startswith("router.") for n in reg)
    expert_e = _connected(_grads(out.terms["expert_euclidean"], params))
    assert not (expert_e & trunk) and any("lora_" in n for n in expert_e)
    total = _connected(_grads(out.total, params))
    assert trunk <= total


def test_isolation_scores_are_exactly_hyperbolic():
    model = _model()
    _perturb_(model)
    b = _batch()
    out = model.loss(b, Progress(10, TOTAL))  # Isolation: alpha = 0
    assert out.logs["alpha"] == 0.0 and out.logs["phase"] == 1.0
    texts, images = model.embed_texts(b.text), model.embed_images(b.image)
    s_h = lorentz_distance_scores(texts["lorentz"], images["lorentz"], model.curvature())
    for query in ("text", "image"):
        assert torch.equal(model.scores(texts, images, query), s_h)
    # the contrastive term is then the hyperbolic expert's own InfoNCE
    assert out.terms["contrastive"].item() == pytest.approx(out.logs["loss_hyperbolic"], rel=1e-6)
    # once alpha > 0 the routed score departs from S_H
    _step(model, b, Progress(400, TOTAL))
    assert not torch.equal(model.scores(texts, images), s_h)


def test_calibration_starts_as_identity():
    model = _model()
    emb = model.embed_texts(_batch().text)
    assert torch.equal(2 * torch.sigmoid(emb["calibration_logit"]), torch.ones(12, 3))
    assert set(emb) == {"euclidean", "lorentz", "context", "gate_logit", "calibration_logit"}


def test_curriculum_logged_through_the_phases():
    model = _model()
    b = _batch()
    seen = {}
    for step in (0, 25, 26, 40, 50, 51, 75, 100, 101, 1199):
        logs = _step(model, b, Progress(step, TOTAL)).logs
        seen[step] = (logs["alpha"], logs["beta"], logs["phase"])
    assert seen[25] == (0.0, 0.0, 1.0)
    assert seen[40] == (pytest.approx(0.6), 0.0, 2.0)
    assert seen[50] == (1.0, 0.0, 2.0)
    assert seen[75] == (1.0, pytest.approx(0.5), 3.0)
    assert seen[101] == (1.0, 1.0, 4.0)
    assert (
        float(model.alpha) == 1.0 and float(model.beta) == 1.0
    )  # the ranking uses the last values
    logs = model.loss(b, Progress(1199, TOTAL)).logs
    assert 0.0 < logs["routing_weight"] < 1.0 and 0.0 < logs["gate"] < 1.0
    assert logs["curvature"] == pytest.approx(0.1, rel=1e-3)
    assert logs["router_temperature"] == pytest.approx(0.5)
    assert logs["entropy_weight"] < 0.01


def test_warmup_dominance_diagnostic():
    model = _model()
    b = _batch()
    assert "routing_weight_at_warmup_end" not in model.loss(b, Progress(49, TOTAL)).logs
    logs = model.loss(b, Progress(50, TOTAL)).logs  # T_w = alpha_end = 50 steps
    assert logs["routing_weight_at_warmup_end"] == pytest.approx(logs["routing_weight"])
    assert logs["dominance_at_warmup_end"] in (-1.0, 0.0, 1.0)
    first = logs["routing_weight_at_warmup_end"]
    with torch.no_grad():  # push the router to near-Euclidean routing: the record must not move
        model.router.tail[-1].bias.fill_(10.0)
    later = model.loss(b, Progress(60, TOTAL)).logs
    assert later["routing_weight"] > 0.9 and later["routing_weight_at_warmup_end"] == first
    fresh = _model()
    with torch.no_grad():
        fresh.router.tail[-1].bias.fill_(10.0)
    assert fresh.loss(b, Progress(50, TOTAL)).logs["dominance_at_warmup_end"] == 1.0
    assert "routing_weight_at_warmup_end" in fresh.state_dict()


def test_single_schedule_shows_euclidean_from_the_start():
    model = _model(single_schedule=True)
    logs = model.loss(_batch(), Progress(10, TOTAL)).logs
    assert logs["alpha"] == logs["beta"] == pytest.approx(10 / 50) and logs["phase"] == 0.0


@pytest.mark.parametrize("query", ["text", "image"])
def test_matrix_scores_equal_pair_scores(query):
    model = _model()
    _perturb_(model)
    _step(model, _batch(), Progress(500, TOTAL))
    model.eval()
    b = _batch(seed=1)
    texts, images = model.embed_texts(b.text[:5]), model.embed_images(b.image[:7])
    matrix = model.scores(texts, images, query)
    assert matrix.shape == (5, 7)
    # top-K rerank shape: each text against K = 7 candidates
    lists = model.pair_scores(
        {k: v.unsqueeze(1) for k, v in texts.items()},
        {k: v.unsqueeze(0).expand(5, *v.shape) for k, v in images.items()},
        query,
    )
    torch.testing.assert_close(lists, matrix, rtol=1e-5, atol=1e-5)
    # matched rows
    n = 5
    rows = model.pair_scores(texts, slice_embedding(images, slice(0, n)), query)
    torch.testing.assert_close(rows, matrix[torch.arange(n), torch.arange(n)], rtol=1e-5, atol=1e-5)


def test_fresh_checkpoint_keeps_the_ranking_state():
    model = _model()
    _perturb_(model)
    _step(model, _batch(), Progress(500, TOTAL))
    model.eval()
    clone = _model()
    clone.load_state_dict(model.state_dict())
    clone.eval()
    b = _batch(seed=2)
    args = lambda m: (m.embed_texts(b.text), m.embed_images(b.image))  # noqa: E731
    assert float(clone.alpha) == 1.0
    torch.testing.assert_close(clone.scores(*args(clone)), model.scores(*args(model)))


class _TwoRankGather(Gather):
    """Rank ``rank`` of 2, with the other rank's embeddings precomputed (no gradient)."""

    world_size = 2

    def __init__(self, rank: int, full_images, full_texts, n: int):
        self.rank, self.full_images, self.full_texts, self.n = rank, full_images, full_texts, n

    def __call__(self, emb):
        sl = slice(self.rank * self.n, (self.rank + 1) * self.n)
        is_image = torch.allclose(emb["lorentz"], self.full_images["lorentz"][sl], atol=1e-5)
        full = self.full_images if is_image else self.full_texts
        parts = [slice_embedding(full, slice(r * self.n, (r + 1) * self.n)) for r in range(2)]
        parts[self.rank] = emb
        return cat_embeddings(parts)


def test_gathered_loss_equals_the_global_batch():
    model = _model()
    _perturb_(model)
    model.eval()  # no dropout or jitter, so the two computations see the same router
    b = _batch(n=12)
    progress = Progress(500, TOTAL)
    single = model.loss(b, progress)
    with torch.no_grad():
        full_images, full_texts = model.embed_images(b.image), model.embed_texts(b.text)
    per_rank = []
    for rank in range(2):
        sl = slice(rank * 6, (rank + 1) * 6)
        gather = _TwoRankGather(rank, full_images, full_texts, 6)
        per_rank.append(model.loss(Batch(image=b.image[sl], text=b.text[sl]), progress, gather))
    for term in ("contrastive", "expert_euclidean", "expert_hyperbolic"):
        mean = 0.5 * (per_rank[0].terms[term] + per_rank[1].terms[term])
        assert mean.item() == pytest.approx(single.terms[term].item(), rel=1e-5), term


def test_short_fit_learns_and_ranks_heldout_pairs():
    torch.manual_seed(0)
    store = make_world(SyntheticConfig(images=300, text_pairs=0, seed=0))
    model = AGR(
        AGRConfig(embed_dim=32, lora_rank=8),
        store.image_features.shape[1],
        store.text_features.shape[1],
    )
    losses = fit(model, store, steps=100, batch_size=32, lr=3e-3)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    n_test = int(store.split_image_ids("test").numel())
    recall = heldout_recall_at_1(model, store)
    assert recall > 10.0 / n_test, (recall, n_test)  # chance is 1 / n_test
    assert float(model.alpha) == 1.0 and float(model.beta) == 1.0


def test_loss_under_bf16_autocast_is_finite():
    model = _model(trunk="residual")
    _perturb_(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.loss(_batch(), Progress(500, TOTAL))
    assert out.total.dtype == torch.float32 and torch.isfinite(out.total)
    out.total.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_curriculum_buffers_are_set_by_the_step_hook_only():
    model = _model()
    model.loss(_batch(), Progress(75, TOTAL))  # the loss reads the curriculum, sets nothing
    assert float(model.alpha) == 0.0 and float(model.beta) == 0.0
    model.on_step_start(Progress(75, TOTAL))
    assert float(model.alpha) == 1.0 and float(model.beta) == pytest.approx(0.5)


class _EagerPathGather(Gather):
    """One process that takes the multi-process code path (each direction routed on its own):
    the gather is the identity, so both paths score the same global batch."""

    world_size = 2

    def offset(self, local_batch: int) -> int:
        return 0


@pytest.mark.parametrize("seed", [7, 11, 23])
def test_single_pass_and_per_direction_paths_give_the_same_gradients(seed):
    """The fused single-process path (one router pass shared by both directions) and the
    per-direction path taken under DDP must agree on every parameter's gradient, the gate
    temperature at its floor included. These seeds put the temperature at its floor with
    opposite gradients from the two directions: deciding its bound per use (once per
    direction) let an inward part through although the total points out of the range."""
    torch.manual_seed(seed)
    model = AGR(
        AGRConfig(embed_dim=16, lora_rank=8, router_dropout=0.0, score_jitter=0.0), DI, DT
    ).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "temperature" not in name:  # T_gate stays at its floor (init = floor = 0.5)
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    b = Batch(
        image=torch.randn(12, DI, generator=g, dtype=torch.float64),
        text=torch.randn(12, DT, generator=g, dtype=torch.float64),
    )
    progress = Progress(1100, TOTAL)  # every correction on: alpha = beta = 1
    grads = []
    for gather in (Gather(), _EagerPathGather()):
        model.zero_grad()
        out = _step(model, b, progress, gather)
        out.total.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    single, per_direction = grads
    assert float(model.router.temperature()) == pytest.approx(0.5)
    for name in single:
        torch.testing.assert_close(
            per_direction[name], single[name], rtol=1e-9, atol=1e-12, msg=name
        )
