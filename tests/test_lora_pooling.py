"""LoRA linear (AGR's Euclidean expert) and attention pooling (DualPath)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from curvalign.nn.lora import LoRALinear
from curvalign.nn.pooling import AttentionPooling

pytestmark = pytest.mark.usefixtures("one_thread")


def _trained_lora(dtype=torch.float32, bias=True) -> LoRALinear:
    torch.manual_seed(0)
    layer = LoRALinear(12, 7, rank=4, alpha=8.0, bias=bias).to(dtype)
    with torch.no_grad():
        layer.lora_B.normal_()
    return layer


def test_lora_starts_as_its_base_and_trains_only_the_update():
    torch.manual_seed(0)
    layer = LoRALinear(12, 7, rank=64, bias=True)
    x = torch.randn(5, 12)
    assert torch.equal(layer(x), F.linear(x, layer.base_weight, layer.base_bias))
    assert {n for n, _ in layer.named_parameters()} == {"lora_A", "lora_B"}
    assert not layer.base_weight.requires_grad
    assert set(layer.state_dict()) == {"base_weight", "base_bias", "lora_A", "lora_B"}
    layer(x).square().sum().backward()
    assert layer.lora_B.grad is not None and layer.lora_B.grad.abs().sum() > 0
    assert layer.base_weight.grad is None
    assert layer.scaling == 1.0


def test_lora_merge_is_exact():
    layer = _trained_lora()
    x = torch.randn(9, 12)
    merged = layer.merge()
    assert isinstance(merged, torch.nn.Linear) and not merged.weight.requires_grad
    assert torch.equal(merged(x), layer(x))  # bit for bit
    assert not torch.equal(merged.weight, layer.base_weight)  # the update is in it


def test_lora_matches_the_factored_formula():
    layer = _trained_lora(torch.float64)
    x = torch.randn(9, 12, dtype=torch.float64)
    factored = (
        x @ layer.base_weight.T
        + layer.scaling * (x @ layer.lora_A.T) @ layer.lora_B.T
        + layer.base_bias
    )
    torch.testing.assert_close(layer(x), factored, rtol=1e-12, atol=1e-12)
    assert layer.scaling == 2.0


def test_lora_rejects_bad_shapes():
    with pytest.raises(ValueError, match="rank"):
        LoRALinear(4, 4, rank=0)
    with pytest.raises(ValueError, match="base_weight"):
        LoRALinear(4, 3, rank=2, base_weight=torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"\[\.\.\., 4\]"):
        LoRALinear(4, 3, rank=2)(torch.zeros(2, 5))


def _reference_pool(
    pool: AttentionPooling, tokens: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The paper's formula, written out: exp(h.v/tau) M / sum exp(h.v/tau) M, concatenated heads."""
    tau = pool.temperature().double()
    out = []
    for n in range(tokens.shape[0]):
        heads = []
        for k in range(pool.num_queries):
            e = torch.exp(tokens[n].double() @ pool.queries[k].double() / tau[k]) * mask[n].double()
            heads.append((e / e.sum()) @ tokens[n].double())
        out.append(torch.cat(heads))
    return torch.stack(out)


def test_pooling_matches_the_formula_and_respects_the_mask():
    torch.manual_seed(1)
    pool = AttentionPooling(6, num_queries=4)
    tokens = torch.randn(3, 5, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 1, 0]])
    pooled = pool(tokens, mask)
    assert pooled.shape == (3, 24)
    torch.testing.assert_close(
        pooled.double(), _reference_pool(pool, tokens, mask), rtol=1e-5, atol=1e-6
    )
    weights = pool.attention(tokens, mask)
    assert torch.all(weights[mask.unsqueeze(1).expand_as(weights) == 0] == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4))
    # whatever sits in the padding (even NaN) changes nothing
    garbage = tokens.clone()
    garbage[mask == 0] = float("nan")
    assert torch.equal(pool(garbage, mask), pooled)
    # no mask = everything kept
    assert torch.allclose(pool(tokens), pool(tokens, torch.ones(3, 5)))


def test_pooling_trains_queries_and_temperatures():
    torch.manual_seed(2)
    pool = AttentionPooling(4, num_queries=2, temperature_init=0.5)
    pool(torch.randn(2, 3, 4), torch.ones(2, 3)).square().sum().backward()
    assert pool.queries.grad is not None and pool.queries.grad.abs().sum() > 0
    assert pool.temperature.log_value.grad is not None
    assert pool.temperature().shape == (2,)
    assert AttentionPooling(16).temperature()[0].item() == pytest.approx(math.sqrt(16))


def test_pooling_rejects_empty_sequences_and_bad_shapes():
    pool = AttentionPooling(4)
    with pytest.raises(ValueError, match="sequence 1 has no unmasked token"):
        pool(torch.randn(2, 3, 4), torch.tensor([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="tokens"):
        pool(torch.randn(2, 4))
    with pytest.raises(ValueError, match="mask"):
        pool(torch.randn(2, 3, 4), torch.ones(2, 4))
