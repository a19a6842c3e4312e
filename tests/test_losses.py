"""Losses at hand-checkable cases: InfoNCE, gather offsets, entailment cones, AtMG's angle loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from curvalign.geometry import lorentz
from curvalign.losses import (
    angle_contrastive_loss,
    centroid_radius_loss,
    entailment_cone_loss,
    info_nce,
    matched_angle_loss,
    symmetric_info_nce,
    target_radius,
)


# --- InfoNCE -------------------------------------------------------------------------------------
def test_info_nce_perfect_diagonal_and_uniform():
    assert float(info_nce(50.0 * torch.eye(6))) == pytest.approx(0.0, abs=1e-6)
    assert float(info_nce(torch.zeros(6, 6))) == pytest.approx(math.log(6))


def test_info_nce_divides_by_temperature():
    s = torch.randn(5, 5)
    tau = torch.tensor(0.07)
    torch.testing.assert_close(
        info_nce(s, temperature=tau), F.cross_entropy(s / 0.07, torch.arange(5))
    )


def test_gathered_rows_equal_the_rows_of_the_full_batch():
    """Local rows vs all columns with targets arange(B) + offset: each rank's loss is the mean of
    its rows of the full-batch loss, and the ranks' mean is the full-batch loss."""
    full = torch.randn(8, 8)
    per_row = F.cross_entropy(full, torch.arange(8), reduction="none")
    ranks = [info_nce(full[r * 4 : (r + 1) * 4], offset=r * 4) for r in range(2)]
    for r in range(2):
        torch.testing.assert_close(ranks[r], per_row[r * 4 : (r + 1) * 4].mean())
    torch.testing.assert_close(sum(ranks) / 2, info_nce(full))


def test_info_nce_rejects_offsets_that_do_not_fit():
    with pytest.raises(ValueError, match="offset"):
        info_nce(torch.zeros(4, 8), offset=5)
    with pytest.raises(ValueError, match="score matrix"):
        info_nce(torch.zeros(4))


def test_symmetric_info_nce_is_the_mean_of_both_directions():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(
        symmetric_info_nce(a, b, 0.5), 0.5 * (info_nce(a, 0.5) + info_nce(b, 0.5))
    )


# --- entailment cones ------------------------------------------------------------------------------
def test_cone_loss_zero_inside_positive_outside():
    parent = torch.tensor([[1.0, 0.0]])
    inside = torch.tensor([[3.0, 0.05]])  # further out along the parent's axis
    outside = torch.tensor([[0.0, 3.0]])  # off at a right angle
    assert float(entailment_cone_loss(parent, inside, 1.0)) == 0.0
    out = entailment_cone_loss(parent, outside, 1.0)
    angle = lorentz.exterior_angle(parent, outside, 1.0)
    aperture = lorentz.half_aperture(parent, 1.0, K=0.1)
    assert float(out) > 0
    torch.testing.assert_close(out, (angle - aperture).mean())


def test_cone_eta_scales_the_aperture():
    parent, child = torch.tensor([[0.3, 0.0]]), torch.tensor([[0.5, 0.6]])
    losses = [float(entailment_cone_loss(parent, child, 1.0, eta=eta)) for eta in (0.7, 1.0, 1.2)]
    assert losses[0] > losses[1] > losses[2]
    angle = float(lorentz.exterior_angle(parent, child, 1.0))
    aperture = float(lorentz.half_aperture(parent, 1.0))
    assert losses[0] == pytest.approx(max(0.0, angle - 0.7 * aperture), abs=1e-5)


def test_cone_loss_per_factor_is_the_mean_over_factors():
    torch.manual_seed(0)
    parent, child = torch.randn(4, 3, 2), torch.randn(4, 3, 2)
    c = torch.tensor([0.2, 1.0, 5.0])
    each = torch.stack(
        [
            entailment_cone_loss(parent[:, i], child[:, i], float(c[i]), eta=0.7, reduction="none")
            for i in range(3)
        ],
        dim=1,
    )
    torch.testing.assert_close(entailment_cone_loss(parent, child, c, eta=0.7), each.mean())


# --- AtMG ----------------------------------------------------------------------------------------
def _ray(direction, radius):
    u = torch.tensor(direction, dtype=torch.float32)
    return lorentz.expmap0((u / u.norm() * radius).unsqueeze(0), 1.0)


def test_angle_loss_uses_alpha_at_the_text_and_beta_at_the_image():
    """Constructed batch where the angle at the text and the angle at the image differ; the loss
    must equal the hand-computed CE(-alpha/tau) and CE(beta/tau), and must not equal the literal
    Eq. 11 (beta = pi - alpha)."""
    texts = torch.cat([_ray([1.0, 0.0], 0.5), _ray([0.0, 1.0], 1.5)])
    images = torch.cat([_ray([1.0, 0.2], 2.0), _ray([0.3, 1.0], 0.8)])
    tau = 0.5
    loss = angle_contrastive_loss(texts, images, texts, images, 1.0, tau)
    alpha = torch.stack(
        [lorentz.exterior_angle(texts[i].expand(2, -1), images, 1.0) for i in range(2)]
    )  # [t, y]
    beta = torch.stack(
        [lorentz.exterior_angle(images[j].expand(2, -1), texts, 1.0) for j in range(2)]
    )  # [y, t]
    expected = 0.5 * (
        F.cross_entropy(-alpha / tau, torch.arange(2))
        + F.cross_entropy(beta / tau, torch.arange(2))
    )
    torch.testing.assert_close(loss, expected)
    literal = (
        F.cross_entropy(-alpha / tau, torch.arange(2)) * 0.5
        + F.cross_entropy((math.pi - alpha.T) / tau, torch.arange(2)) * 0.5
    )
    assert abs(float(loss) - float(literal)) > 1e-3
    assert not torch.allclose(beta, math.pi - alpha.T, atol=1e-2)


def test_angle_loss_prefers_images_out_along_their_text_axis():
    texts = torch.cat([_ray([1.0, 0.0], 0.5), _ray([0.0, 1.0], 0.5)])
    aligned = torch.cat([_ray([1.0, 0.0], 2.0), _ray([0.0, 1.0], 2.0)])
    inverted = torch.cat(
        [_ray([1.0, 0.0], 0.1), _ray([0.0, 1.0], 0.1)]
    )  # images inside their texts
    good = angle_contrastive_loss(texts, aligned, texts, aligned, 1.0, 0.1)
    bad = angle_contrastive_loss(texts, inverted, texts, inverted, 1.0, 0.1)
    assert float(good) < float(bad)
    assert float(matched_angle_loss(texts, aligned, 1.0)) == pytest.approx(-math.pi, abs=5e-3)
    assert float(matched_angle_loss(texts, inverted, 1.0)) == pytest.approx(math.pi, abs=5e-3)


def test_angle_loss_gather_offset():
    torch.manual_seed(1)
    texts, images = torch.randn(6, 3), torch.randn(6, 3) * 2
    full = angle_contrastive_loss(texts, images, texts, images, 1.0, 0.2)
    halves = [
        angle_contrastive_loss(
            texts[r * 3 : (r + 1) * 3],
            images[r * 3 : (r + 1) * 3],
            texts,
            images,
            1.0,
            0.2,
            offset=r * 3,
        )
        for r in range(2)
    ]
    torch.testing.assert_close(sum(halves) / 2, full)


def test_centroid_loss_is_zero_at_the_target_radii_and_checks_p_above_q():
    q, p = math.cosh(0.5), math.cosh(2.0)
    assert float(target_radius(q, 1.0)) == pytest.approx(0.5, abs=1e-5)
    assert float(target_radius(p, 4.0)) == pytest.approx(math.acosh(4 * p) / 2, abs=1e-5)
    texts, images = _ray([1.0, 1.0], 0.5), _ray([1.0, -1.0], 2.0)
    assert float(centroid_radius_loss(texts, images, 1.0, q, p)) == pytest.approx(0.0, abs=1e-4)
    moved = centroid_radius_loss(_ray([1.0, 1.0], 1.0), images, 1.0, q, p)
    assert float(moved) == pytest.approx(0.5, abs=1e-4)
    with pytest.raises(ValueError, match="p > q|must exceed|p >"):
        centroid_radius_loss(texts, images, 1.0, p, q)
