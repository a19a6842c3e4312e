"""Score matrices against straightforward float64 references; pair scores equal diagonals."""

from __future__ import annotations

import math

import pytest
import torch

from curvalign import scores as S

torch.set_default_dtype(torch.float32)


def _points(n: int, d: int, scale: float = 0.8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * scale


def _ref_minkowski(x: torch.Tensor, y: torch.Tensor, c: float) -> torch.Tensor:
    """[N, d], [M, d] -> [N, M] <x, y>_L from full (time, space) vectors, float64, by broadcasting."""
    x, y = x.double(), y.double()
    tx = torch.sqrt(1 / c + x.square().sum(-1))
    ty = torch.sqrt(1 / c + y.square().sum(-1))
    return (x[:, None, :] * y[None, :, :]).sum(-1) - tx[:, None] * ty[None, :]


def _ref_dist(x, y, c):
    return torch.acosh((-c * _ref_minkowski(x, y, c)).clamp_min(1.0)) / math.sqrt(c)


def _ref_exterior(x, y, c):
    """AtMG Eq. 9: angle at x, [N, M]."""
    x64, y64 = x.double(), y.double()
    tx = torch.sqrt(1 / c + x64.square().sum(-1))[:, None]
    ty = torch.sqrt(1 / c + y64.square().sum(-1))[None, :]
    cxy = c * _ref_minkowski(x, y, c)
    num = ty + tx * cxy
    den = x64.norm(dim=-1)[:, None] * torch.sqrt(cxy.square() - 1)
    return torch.acos((num / den).clamp(-1, 1))


def test_cosine_scores():
    x, y = _points(5, 4), _points(6, 4, seed=1)
    ref = (x.double() / x.double().norm(dim=-1, keepdim=True)) @ (
        y.double() / y.double().norm(dim=-1, keepdim=True)
    ).T
    torch.testing.assert_close(S.cosine_scores(x, y).double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        S.cosine_pair_scores(x[:5], y[:5]), torch.diagonal(S.cosine_scores(x[:5], y[:5]))
    )


@pytest.mark.parametrize("c", [0.1, 1.0, 4.0])
def test_lorentz_distance_scores(c):
    x, y = _points(5, 3), _points(7, 3, seed=1)
    s = S.lorentz_distance_scores(x, y, c)
    assert s.shape == (5, 7)
    torch.testing.assert_close(s.double(), -_ref_dist(x, y, c), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        S.lorentz_distance_pair_scores(x, y[:5], c),
        torch.diagonal(S.lorentz_distance_scores(x, y[:5], c)),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("c", [0.5, 2.0])
def test_angle_scores_take_the_angle_at_the_right_point(c):
    texts, images = _points(4, 3, 0.5), _points(6, 3, 1.5, seed=1)
    at_text = S.angle_at_text_scores(texts, images, c)  # -alpha, [Nt, Ni]
    at_image = S.angle_at_image_scores(images, texts, c)  # +beta,  [Ni, Nt]
    torch.testing.assert_close(
        at_text.double(), -_ref_exterior(texts, images, c), rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(
        at_image.double(), _ref_exterior(images, texts, c), rtol=1e-4, atol=1e-4
    )
    n = 4
    torch.testing.assert_close(
        S.angle_at_text_pair_scores(texts, images[:n], c),
        torch.diagonal(S.angle_at_text_scores(texts, images[:n], c)),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(
        S.angle_at_image_pair_scores(images[:n], texts, c),
        torch.diagonal(S.angle_at_image_scores(images[:n], texts, c)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_angles_on_one_geodesic_through_the_origin():
    """Text between the origin and the image, all on one ray: alpha = 0 and beta = pi."""
    axis = torch.tensor([[0.6, 0.8, 0.0]])
    text, image = 0.5 * axis, 2.0 * axis
    assert float(-S.angle_at_text_scores(text, image, 1.0)) == pytest.approx(0.0, abs=2e-3)
    assert float(S.angle_at_image_scores(image, text, 1.0)) == pytest.approx(math.pi, abs=2e-3)


def test_product_average_distance_scores():
    k, d, c = 3, 2, torch.tensor([0.2, 1.0, 5.0])
    x = torch.randn(4, k, d) * 0.7
    y = torch.randn(5, k, d) * 0.7
    ref = sum(_ref_dist(x[:, i], y[:, i], float(c[i])) for i in range(k)) / k
    s = S.product_average_distance_scores(x, y, c)
    assert s.shape == (4, 5)
    torch.testing.assert_close(s.double(), -ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        S.product_average_distance_pair_scores(x, y[:4], c),
        torch.diagonal(S.product_average_distance_scores(x, y[:4], c)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_mixed_sqdist_scores():
    c, radius = 0.5, 2.0
    g = torch.Generator().manual_seed(3)

    def parts(n):
        s = torch.randn(n, 4, generator=g)
        return {
            "hyperbolic": torch.randn(n, 3, generator=g) * 0.6,
            "euclidean": torch.randn(n, 2, generator=g),
            "sphere": radius * s / s.norm(dim=-1, keepdim=True),
        }

    x, y = parts(4), parts(5)
    w = {
        "hyperbolic": torch.tensor(0.5),
        "euclidean": torch.tensor(2.0),
        "sphere": torch.tensor(1.5),
    }
    sph = x["sphere"].double() @ y["sphere"].double().T / radius**2
    ref = (
        0.5 * _ref_dist(x["hyperbolic"], y["hyperbolic"], c) ** 2
        + 2.0 * torch.cdist(x["euclidean"].double(), y["euclidean"].double()) ** 2
        + 1.5 * (radius * torch.acos(sph.clamp(-1, 1))) ** 2
    )
    s = S.mixed_sqdist_scores(x, y, w, c, radius)
    torch.testing.assert_close(s.double(), -ref, rtol=1e-4, atol=1e-3)
    y4 = {k: v[:4] for k, v in y.items()}
    torch.testing.assert_close(
        S.mixed_sqdist_pair_scores(x, y4, w, c, radius),
        torch.diagonal(S.mixed_sqdist_scores(x, y4, w, c, radius)),
        rtol=1e-4,
        atol=1e-4,
    )
