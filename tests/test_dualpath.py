"""DualPath: gate, gradient isolation of the paths, path copy, curriculum, losses, a short fit."""

from __future__ import annotations

import math

import pytest
import torch

from curvalign.data.synthetic import SyntheticConfig, make_world
from curvalign.losses.contrastive import info_nce
from curvalign.losses.multiloss import (
    hardest_negative_triplet,
    pair_ranking,
    score_mse,
    score_weighted_info_nce,
)
from curvalign.nn.dualpath import DualPathHead
from curvalign.recipes import get_recipe
from curvalign.recipes.base import Batch, Progress
from curvalign.recipes.dualpath import DualPath, DualPathConfig
from recipe_harness import heldout_recall_at_1

DI, DT = 20, 24
TOTAL = 300  # default fractions: switch at step 40, gate warm-up 20.5 steps


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(**kw) -> DualPath:
    torch.manual_seed(0)
    return DualPath(DualPathConfig(model_dim=16, hidden_dim=32, embed_dim=8, **kw), DI, DT)


def _batch(n: int = 10, pairs: int = 12, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(
        image=torch.randn(n, DI, generator=g),
        text=torch.randn(n, DT, generator=g),
        pair_a=torch.randn(pairs, DT, generator=g),
        pair_b=torch.randn(pairs, DT, generator=g),
        pair_score=torch.rand(pairs, generator=g),
    )


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_registered_and_requires_text_pairs():
    assert get_recipe("dualpath") is DualPath
    assert DualPath.requires == frozenset({"text_pairs"})
    with pytest.raises(ValueError, match="pair_a"):
        _model().loss(Batch(image=torch.randn(4, DI), text=torch.randn(4, DT)), Progress(0, TOTAL))


def test_gate_starts_at_sigmoid_minus_five():
    model = _model()
    g = model.head.gate().item()
    assert g == pytest.approx(1 / (1 + math.exp(5)), rel=1e-6)
    assert round(g, 4) == 0.0067
    assert model.log_values()["dualpath_gate"] == pytest.approx(g)
    assert model.gate_value() == pytest.approx(g)  # the contract the study reads
    assert model.head.mix.item() == 0.5


def test_text_inputs_never_touch_the_multimodal_path():
    head = DualPathHead({"image": DI, "text": DT}, 16, 32, 8)
    head(torch.randn(5, DT), "text", "text_pair").square().sum().backward()
    untouched = {n for n, p in head.named_parameters() if p.grad is None}
    assert untouched == {
        "multi_path.weight",
        "multi_path.bias",
        "gate_logit",
        "adapters.image.weight",
        "adapters.image.bias",
    }


def test_text_only_step_leaves_multimodal_parameters_bit_identical():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # one Phase-2 step first, so the optimizer holds state (momentum, decay) for every parameter
    for step in (60, 0):  # then a Phase-1 step: text pairs only
        before = _snapshot(model)
        progress = Progress(step, TOTAL)
        model.on_step_start(progress)
        out = model.loss(_batch(seed=step), progress)
        optimizer.zero_grad(set_to_none=True)
        out.total.backward()
        optimizer.step()
        after = _snapshot(model)
        changed = {n for n in before if not torch.equal(before[n], after[n])}
        if step == 60:
            assert {
                "head.multi_path.weight",
                "head.gate_logit",
                "head.adapters.image.weight",
            } <= changed
    assert not changed & {
        "head.multi_path.weight",
        "head.multi_path.bias",
        "head.gate_logit",
        "head.adapters.image.weight",
        "head.adapters.image.bias",
    }
    assert {"head.text_path.weight", "head.adapters.text.weight"} <= changed


def test_path_copy_at_the_switch_happens_once():
    model = _model()
    assert not torch.equal(model.head.multi_path.weight, model.head.text_path.weight)
    model.on_step_start(Progress(39, TOTAL))
    assert not bool(model.switched)
    model.on_step_start(Progress(40, TOTAL))
    assert bool(model.switched)
    assert torch.equal(model.head.multi_path.weight, model.head.text_path.weight)
    assert torch.equal(model.head.multi_path.bias, model.head.text_path.bias)
    with torch.no_grad():  # the text path moves on; a later step must not copy again
        model.head.text_path.weight.add_(1.0)
    model.on_step_start(Progress(41, TOTAL))
    assert not torch.equal(model.head.multi_path.weight, model.head.text_path.weight)
    # a checkpoint remembers the switch
    clone = _model()
    clone.load_state_dict(model.state_dict())
    assert bool(clone.switched)


def test_copied_paths_give_identical_embeddings_whatever_the_gate():
    model = _model(dropout=0.0)
    model.on_step_start(Progress(40, TOTAL))
    x = torch.randn(4, DI)
    with torch.no_grad():
        model.head.gate_logit.fill_(3.0)
        model.head.gate_warmup.fill_(1.0)
        z_high = model.embed_images(x)["point"]
        model.head.gate_logit.fill_(-3.0)
        z_low = model.embed_images(x)["point"]
    torch.testing.assert_close(z_high, z_low)


def test_gate_warmup_ramps_the_effective_gate():
    model = _model()
    with torch.no_grad():
        model.head.gate_logit.fill_(0.0)  # as if training had moved theta from -5 to 0
    model.on_step_start(Progress(40, TOTAL))
    assert model.head.gate().item() == pytest.approx(1 / (1 + math.exp(5)), rel=1e-6)
    model.on_step_start(Progress(50, TOTAL))  # about half-way through the 20.5-step warm-up
    r = (50 - 40) / (TOTAL * 1000 * 512 / 7_500_000)
    assert model.head.gate_warmup.item() == pytest.approx(r)
    assert model.head.gate().item() == pytest.approx(1 / (1 + math.exp(5 * (1 - r))), rel=1e-5)
    model.on_step_start(Progress(80, TOTAL))
    assert model.head.gate().item() == pytest.approx(0.5)


def test_phases_and_curriculum_in_the_loss():
    model = _model()
    first = model.loss(_batch(), Progress(0, TOTAL))
    assert set(first.terms) == {"text_info_nce", "score_mse", "rank"}
    assert first.logs["dualpath_phase"] == 1.0
    curriculum = ("temperature", "score_weight", "rank_weight")
    assert tuple(first.logs[k] for k in curriculum) == pytest.approx((0.1, 0.5, 0.1))
    later = model.loss(_batch(), Progress(100, TOTAL))
    assert set(later.terms) == {"text_info_nce", "score_mse", "rank", "image_info_nce", "triplet"}
    assert tuple(later.logs[k] for k in curriculum) == pytest.approx((0.07, 3.0, 1.0))
    assert later.total.item() == pytest.approx(
        sum(t.item() for t in later.terms.values()), rel=1e-6
    )
    assert later.terms["score_mse"].item() == pytest.approx(
        3.0 * later.logs["score_mse_unweighted"], rel=1e-5
    )


def test_task_prefixes_and_token_inputs():
    model = _model()
    x = torch.randn(3, DT)
    with torch.no_grad():
        model.head.task_prefix.normal_()
    model.eval()
    a = model.embed_texts(x, task="text_pair")["point"]
    b = model.embed_texts(x)["point"]
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="task"):
        model.embed_texts(x, task="vqa")
    with pytest.raises(ValueError, match="pool_tokens"):
        model.embed_texts(torch.randn(3, 5, DT))
    pooled = _model(pool_tokens=True)
    tokens, mask = torch.randn(3, 5, DT), torch.tensor([[1, 1, 0, 0, 0]] * 3)
    out = pooled.embed_texts(tokens, mask)["point"]
    assert out.shape == (3, 8)
    tokens[:, 2:] = 1e3  # masked positions do not matter
    pooled.eval()
    torch.testing.assert_close(
        pooled.embed_texts(tokens, mask)["point"], pooled.embed_texts(tokens[:, :2])["point"]
    )


def test_multiloss_readings():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 5, generator=g)
    # all scores 1: the plain InfoNCE; a zero-score row is no positive
    plain = info_nce(scores, 0.1).item()
    assert score_weighted_info_nce(scores, torch.ones(5), 0.1).item() == pytest.approx(
        plain, rel=1e-6
    )
    w = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    keep = [0, 1, 3, 4]
    ce = torch.nn.functional.cross_entropy(scores[keep] / 0.1, torch.tensor(keep), reduction="mean")
    assert score_weighted_info_nce(scores, w, 0.1).item() == pytest.approx(ce.item(), rel=1e-6)
    assert score_mse(torch.tensor([0.5, 1.0]), torch.tensor([0.0, 1.0])).item() == pytest.approx(
        0.125
    )
    # ranking: pair 0 scored above pair 1 needs a cosine gap >= 0.5
    assert pair_ranking(torch.tensor([0.2, 0.1]), torch.tensor([0.9, 0.4])).item() == pytest.approx(
        0.4
    )
    assert pair_ranking(torch.tensor([0.9, 0.1]), torch.tensor([0.9, 0.4])).item() == 0.0
    assert pair_ranking(torch.tensor([0.9, 0.1]), torch.tensor([0.5, 0.5])).item() == 0.0
    cos = torch.tensor([[0.9, 0.8, 0.1], [0.0, 0.3, 0.5], [0.2, 0.1, 0.6]])
    # rows: max(0, 0.2 - 0.9 + 0.8), max(0, 0.2 - 0.3 + 0.5), max(0, 0.2 - 0.6 + 0.2)
    assert hardest_negative_triplet(cos, margin=0.2).item() == pytest.approx(
        (0.1 + 0.4 + 0.0) / 3, rel=1e-6
    )
    wide = torch.cat(
        [torch.full((2, 2), -1.0), cos[:2]], dim=1
    )  # 2 local rows, positives at offset 2
    assert hardest_negative_triplet(wide, 0.2, offset=2).item() == pytest.approx(
        (0.1 + 0.4) / 2, rel=1e-6
    )


def test_short_fit_learns_and_keeps_text_similarity():
    torch.manual_seed(0)
    store = make_world(SyntheticConfig(images=300, text_pairs=900, seed=0))
    model = DualPath(
        DualPathConfig(model_dim=64, hidden_dim=128, embed_dim=32),
        store.image_features.shape[1],
        store.text_features.shape[1],
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    train = store.split_image_ids("train")
    first_caption = {}
    for t, i in enumerate(store.text_to_image.tolist()):
        first_caption.setdefault(i, t)
    g = torch.Generator().manual_seed(0)
    close = store.pair_scores > 0.8

    def pair_recall() -> float:
        model.eval()
        with torch.no_grad():
            a = model.embed_texts(store.pair_a_features[close].float(), task="text_pair")["point"]
            b = model.embed_texts(store.pair_b_features[close].float(), task="text_pair")["point"]
        model.train()
        return float(((a @ b.T).argmax(1) == torch.arange(len(a))).float().mean())

    recall_init = pair_recall()
    steps, losses = 120, []
    model.train()
    for step in range(steps):
        images = train[torch.randperm(len(train), generator=g)[:32]]
        texts = torch.tensor([first_caption[i] for i in images.tolist()])
        pairs = torch.randint(len(store.pair_scores), (32,), generator=g)
        batch = Batch(
            image=store.image_features[images].float(),
            text=store.text_features[texts].float(),
            pair_a=store.pair_a_features[pairs].float(),
            pair_b=store.pair_b_features[pairs].float(),
            pair_score=store.pair_scores[pairs].float(),
        )
        progress = Progress(step, steps)
        model.on_step_start(progress)
        out = model.loss(batch, progress)
        optimizer.zero_grad(set_to_none=True)
        out.total.backward()
        optimizer.step()
        losses.append(out.terms.get("image_info_nce", torch.tensor(math.nan)).item())
        if step == 15:  # end of Phase 1 (switch at step 16)
            recall_phase1 = pair_recall()
    image_losses = [v for v in losses if not math.isnan(v)]
    assert sum(image_losses[-10:]) < 0.6 * sum(image_losses[:10])
    n_test = int(store.split_image_ids("test").numel())
    assert heldout_recall_at_1(model, store) > 10.0 / n_test
    chance = 1.0 / int(close.sum())
    recall_end = pair_recall()
    assert recall_phase1 > 10 * chance and recall_end > max(10 * chance, recall_init)
    assert recall_end > recall_phase1 - 0.1  # text similarity survives Phase 2


def test_pair_losses_split_over_processes_equal_the_global_batch():
    g = torch.Generator().manual_seed(1)
    cos, s = torch.rand(8, generator=g) * 2 - 1, torch.rand(8, generator=g)
    scores = torch.randn(8, 8, generator=g)
    whole_rank = pair_ranking(cos, s)
    whole_nce = score_weighted_info_nce(scores, s, 0.1)
    ranks, nces = [], []
    for r in range(2):
        sl = slice(4 * r, 4 * r + 4)
        ranks.append(pair_ranking(cos[sl], s[sl], cos, s, world_size=2))
        nces.append(
            score_weighted_info_nce(scores[sl], s[sl], 0.1, offset=4 * r, weight_mean=s.mean())
        )
    assert (0.5 * (ranks[0] + ranks[1])).item() == pytest.approx(whole_rank.item(), rel=1e-6)
    assert (0.5 * (nces[0] + nces[1])).item() == pytest.approx(whole_nce.item(), rel=1e-6)
