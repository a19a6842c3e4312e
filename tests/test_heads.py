"""Heads return points on their manifolds; learnable scalars stay in range with sensible gradients."""

from __future__ import annotations

import math

import pytest
import torch

from curvalign.geometry import lorentz
from curvalign.nn.heads import (
    CosineHead,
    FactorizedLorentzHead,
    LorentzHead,
    MixedCurvatureHead,
    clip_tangent_norm,
)
from curvalign.nn.scalars import LearnableScalar, scalar_parameter_names


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_cosine_head_gives_unit_vectors():
    head = CosineHead(12, 7)
    x = head(torch.randn(5, 12) * 30)
    assert x.shape == (5, 7)
    torch.testing.assert_close(x.norm(dim=-1), torch.ones(5))


def test_lorentz_head_point_is_expmap_of_its_tangent():
    head = LorentzHead(10, 6)
    f = torch.randn(8, 10, dtype=torch.float32)
    c = torch.tensor(0.7)
    x = head(f, c)
    v = head.tangent(f)
    assert x.shape == (8, 6)
    # On the hyperboloid the distance to the origin is the tangent norm, and logmap0 inverts.
    torch.testing.assert_close(lorentz.dist0(x, c), v.norm(dim=-1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lorentz.logmap0(x, c), v, rtol=1e-4, atol=1e-5)
    # Full point satisfies -t^2 + |x|^2 = -1/c.
    t = lorentz.time(x, c).double()
    torch.testing.assert_close(
        -(t**2) + x.double().square().sum(-1),
        torch.full((8,), -1 / 0.7, dtype=torch.float64),
        rtol=1e-5,
        atol=1e-5,
    )


def test_lorentz_head_scale_starts_at_inverse_sqrt_dim_and_is_capped():
    head = LorentzHead(10, 16)
    assert float(head.scale.value) == pytest.approx(16**-0.5)
    with torch.no_grad():
        head.scale.log_value.fill_(3.0)
    assert float(head.scale.value) == pytest.approx(1.0)


def test_lorentz_head_clip_norm_bounds_the_tangent():
    head = LorentzHead(10, 6, scale_init=1.0, clip_norm=1.0)
    f = torch.randn(20, 10) * 50
    v = head.tangent(f)
    assert torch.all(v.norm(dim=-1) <= 1.0 + 1e-5)
    assert torch.all(lorentz.dist0(head(f, 1.0), 1.0) <= 1.0 + 1e-4)
    small = torch.tensor([[0.1, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(
        clip_tangent_norm(small, 1.0), small
    )  # inside the ball, and zero, unchanged


def test_factorized_head_maps_each_factor_with_its_curvature():
    k, d = 5, 3
    head = FactorizedLorentzHead(12, k, d)
    assert float(head.scale.value) == pytest.approx((k * d) ** -0.5)
    c = torch.tensor([0.1, 0.5, 1.0, 3.0, 10.0])
    f = torch.randn(4, 12)
    x = head(f, c)
    assert x.shape == (4, k, d)
    v = head.tangent(f)
    for i in range(k):
        torch.testing.assert_close(lorentz.logmap0(x[:, i], c[i]), v[:, i], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="one per factor"):
        head(f, torch.ones(k + 1))


def test_factorized_head_per_factor_scale():
    head = FactorizedLorentzHead(12, 4, 2, per_factor_scale=True)
    assert head.scale().shape == (4,)
    torch.testing.assert_close(head.scale(), torch.full((4,), 2**-0.5))


def test_mixed_head_parts_lie_on_their_manifolds():
    head = MixedCurvatureHead(9, hyperbolic_dim=4, euclidean_dim=3, sphere_dim=5, hidden_dim=16)
    f = torch.randn(6, 9)
    parts = head(f, 0.5, 2.0)
    assert set(parts) == {"hyperbolic", "euclidean", "sphere"}
    assert parts["hyperbolic"].shape == (6, 4) and parts["euclidean"].shape == (6, 3)
    torch.testing.assert_close(parts["sphere"].norm(dim=-1), torch.full((6,), 2.0))
    tangent = head.mlps["hyperbolic"](f)
    torch.testing.assert_close(
        lorentz.logmap0(parts["hyperbolic"], 0.5), tangent, rtol=1e-4, atol=1e-5
    )
    only_sphere = MixedCurvatureHead(9, 0, 0, 4, hidden_dim=8)
    assert set(only_sphere(f, 1.0, 1.0)) == {"sphere"}


def test_heads_reject_bad_input():
    with pytest.raises(ValueError, match=r"\[N, 10\]"):
        LorentzHead(10, 4)(torch.randn(3, 11), 1.0)
    with pytest.raises(ValueError):
        MixedCurvatureHead(4, 0, 0, 0)


# --- learnable scalars -----------------------------------------------------------------------------
def test_scalar_clamps_each_entry_and_passes_only_inward_gradients():
    s = LearnableScalar(1.0, min=0.1, max=10.0, shape=(4,))
    with torch.no_grad():
        s.log_value.copy_(torch.tensor([math.log(100.0), math.log(1e-3), 0.0, 0.5]))
    value = s()
    torch.testing.assert_close(value, torch.tensor([10.0, 0.1, 1.0, math.exp(0.5)]))
    value.sum().backward()  # d/dv > 0: descent lowers every value
    grad = s.log_value.grad
    assert grad[0] > 0  # at the top: lowering is inwards, passes
    assert grad[1] == 0  # at the bottom: lowering would push out, blocked
    assert grad[2] > 0 and grad[3] > 0
    s.log_value.grad = None
    (-s()).sum().backward()  # descent raises every value
    assert s.log_value.grad[0] == 0 and s.log_value.grad[1] < 0


def test_scalar_decides_the_bound_on_the_summed_gradient_of_every_use():
    # two uses whose gradients point opposite ways at the floor: the parameter must move as
    # their sum says (per use, the outward part was blocked and the inward part kept)
    for weights, expected_sign in (((2.0, -1.0), 0), ((-2.0, 1.0), -1)):
        s = LearnableScalar(0.5, min=0.5)
        (weights[0] * s() + weights[1] * s()).backward()
        grad = float(s.log_value.grad)
        if expected_sign == 0:
            assert grad == 0.0  # total pushes the value below its floor: blocked
        else:
            assert grad == pytest.approx(-0.5)  # total (-1 x value 0.5) points inwards: all of it
    # inside the range the sum passes untouched
    s = LearnableScalar(1.0, min=0.5)
    (2.0 * s() - 1.0 * s()).backward()
    assert float(s.log_value.grad) == pytest.approx(1.0)


def test_scalar_copy_keeps_the_bound_rule():
    import copy

    s = copy.deepcopy(LearnableScalar(0.5, min=0.5))
    (2.0 * s() - 1.0 * s()).backward()
    assert float(s.log_value.grad) == 0.0


def test_scalar_frozen_is_a_buffer_and_validates_its_range():
    s = LearnableScalar(0.5, min=0.1, max=2.0, learnable=False)
    assert list(s.parameters()) == [] and "log_value" in dict(s.named_buffers())
    assert float(s()) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="outside its range"):
        LearnableScalar(20.0, min=0.1, max=10.0)
    with pytest.raises(ValueError, match="positive"):
        LearnableScalar(-1.0)


def test_scalar_summary_and_parameter_names():
    vec = LearnableScalar([0.2, 0.4, 0.9])
    summary = vec.summary("curvature")
    assert summary["curvature/min"] == pytest.approx(0.2) and summary[
        "curvature/max"
    ] == pytest.approx(0.9)
    head = LorentzHead(4, 3)
    assert scalar_parameter_names(head) == {"scale.log_value"}
