"""Projection heads: features -> manifold points. A head never returns scores.

Every head owns its projection and its learnable scale; the curvature belongs to the recipe
(shared by the image and the text head, logged once) and is passed to ``forward``. The maps
onto the manifolds are ``curvalign.geometry`` functions; nothing here re-derives them.

    CosineHead               [N, D] -> [N, d]     unit vectors (CLIP)
    LorentzHead              [N, D] -> [N, d]     Lorentz space components (MERU, HyCoCLIP, AtMG, AGR)
    FactorizedLorentzHead    [N, D] -> [N, k, d]  k Lorentz factors, curvature [k] (PHyCLIP)
    MixedCurvatureHead       [N, D] -> {"hyperbolic" [N, dH], "euclidean" [N, dE],
                                        "sphere" [N, dS]}  (ProCLIP)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from curvalign.geometry import lorentz, sphere
from curvalign.nn.scalars import LearnableScalar


def _clip_style_linear(in_dim: int, out_dim: int, bias: bool = False) -> nn.Linear:
    """A linear projection initialised as CLIP/MERU do: N(0, in_dim^-1/2), so that unit-scale
    inputs give outputs whose entries have unit scale."""
    if in_dim <= 0 or out_dim <= 0:
        raise ValueError(
            f"head dimensions must be positive, got in_dim={in_dim}, out_dim={out_dim}"
        )
    layer = nn.Linear(in_dim, out_dim, bias=bias)
    nn.init.normal_(layer.weight, std=in_dim**-0.5)
    return layer


def _check_features(features: Tensor, in_dim: int, head: str) -> None:
    if not isinstance(features, Tensor) or features.ndim != 2 or features.shape[-1] != in_dim:
        shape = tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
        raise ValueError(f"{head} expects features of shape [N, {in_dim}], got {shape}")


def clip_tangent_norm(v: Tensor, max_norm: float) -> Tensor:
    """Rescale each row of ``v`` [..., d] to Euclidean norm at most ``max_norm`` (AGR's kappa).

    Rows already inside the ball are unchanged; the factor is computed in at least float32 and
    the norm is floored at the dtype's tiny so a zero row stays zero (no 0/0)."""
    work = torch.promote_types(v.dtype, torch.float32)
    norm = torch.linalg.vector_norm(v.to(work), dim=-1, keepdim=True)
    factor = (max_norm / norm.clamp_min(torch.finfo(work).tiny)).clamp(max=1.0)
    return (v.to(work) * factor).to(v.dtype)


class CosineHead(nn.Module):
    """CLIP's head: linear projection, then L2 normalisation onto the unit sphere. [N, D] -> [N, d]."""

    def __init__(self, in_dim: int, out_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.proj = _clip_style_linear(in_dim, out_dim, bias)

    def forward(self, features: Tensor) -> Tensor:
        _check_features(features, self.in_dim, type(self).__name__)
        return sphere.project(self.proj(features), 1.0)


class LorentzHead(nn.Module):
    """MERU's head: ``x = expmap0(s * W f, c)`` with a learnable positive scalar ``s`` per modality.

    ``s`` starts at ``scale_init``: the recipes pass the value ``resolve_tangent_scale`` gives
    for their features (tangent norm about 1 at initialisation); None is MERU's
    ``1/sqrt(out_dim)``, the same rule for MERU's features (norm sqrt(D)). It is bounded above by ``scale_max`` (MERU clamps it at 1:
    the scale may shrink the features, never enlarge them). With ``clip_norm`` (AGR's kappa) the
    tangent vector is rescaled to norm <= kappa before the exponential map.

    forward(features [N, D], c) -> [N, d] Lorentz space components.
    ``tangent(features)`` -> [N, d] the tangent vector at the origin (before ``expmap0``).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        scale_init: float | None = None,
        scale_max: float | None = 1.0,
        learn_scale: bool = True,
        clip_norm: float | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be positive or None, got {clip_norm}")
        self.in_dim, self.out_dim = in_dim, out_dim
        self.proj = _clip_style_linear(in_dim, out_dim, bias)
        init = scale_init if scale_init is not None else out_dim**-0.5
        self.scale = LearnableScalar(init, max=scale_max, learnable=learn_scale)
        self.clip_norm = clip_norm

    def tangent(self, features: Tensor) -> Tensor:
        _check_features(features, self.in_dim, type(self).__name__)
        v = self.proj(features) * self.scale()
        if self.clip_norm is not None:
            v = clip_tangent_norm(v, self.clip_norm)
        return v

    def forward(self, features: Tensor, c: float | Tensor) -> Tensor:
        return lorentz.expmap0(self.tangent(features), c)


class FactorizedLorentzHead(nn.Module):
    """PHyCLIP's head: a ``k*d`` projection sliced into ``k`` factors of ``d`` dimensions, scaled
    by a learnable positive scalar per modality (PHyCLIP App. C.3: ``c_img``, ``c_txt``, init
    ``1/sqrt(k d)``), each lifted by ``expmap0`` with its own curvature ``c[i]``.

    ``per_factor_scale=True`` learns one scalar per factor instead (the authors' code does,
    initialised at ``1/sqrt(d)``; pass ``scale_init`` to choose).

    forward(features [N, D], c [k]) -> [N, k, d] Lorentz space components per factor.
    """

    def __init__(
        self,
        in_dim: int,
        num_factors: int,
        factor_dim: int,
        scale_init: float | None = None,
        scale_max: float | None = 1.0,
        per_factor_scale: bool = False,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if num_factors <= 0 or factor_dim <= 0:
            raise ValueError(
                f"num_factors and factor_dim must be positive, got {num_factors}, {factor_dim}"
            )
        self.in_dim, self.num_factors, self.factor_dim = in_dim, num_factors, factor_dim
        self.proj = _clip_style_linear(in_dim, num_factors * factor_dim, bias)
        if scale_init is None:
            scale_init = (factor_dim if per_factor_scale else num_factors * factor_dim) ** -0.5
        shape = (num_factors,) if per_factor_scale else ()
        self.scale = LearnableScalar(scale_init, max=scale_max, shape=shape)

    def tangent(self, features: Tensor) -> Tensor:
        _check_features(features, self.in_dim, type(self).__name__)
        v = self.proj(features).unflatten(-1, (self.num_factors, self.factor_dim))
        scale = self.scale()
        return v * (scale.unsqueeze(-1) if scale.ndim else scale)

    def forward(self, features: Tensor, c: Tensor) -> Tensor:
        if not isinstance(c, Tensor) or c.shape not in ((self.num_factors,), ()):
            raise ValueError(
                f"FactorizedLorentzHead expects a curvature of shape [{self.num_factors}] "
                f"(one per factor) or a scalar, got {getattr(c, 'shape', c)}"
            )
        return lorentz.expmap0(self.tangent(features), c)


def _mlp(in_dim: int, hidden: int, out_dim: int) -> nn.Sequential:
    if min(in_dim, hidden, out_dim) <= 0:
        raise ValueError(f"MLP dimensions must be positive, got {in_dim}-{hidden}-{out_dim}")
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, out_dim))


class MixedCurvatureHead(nn.Module):
    """ProCLIP's factorised head (Sec. 2.2, 3.3): one 2-layer MLP (hidden 512, ReLU) per factor.

    The hyperbolic MLP predicts a tangent vector at the origin mapped by ``expmap0``; the
    spherical MLP's output is projected onto the sphere of radius ``R``; the Euclidean MLP's
    output is used raw. A factor of dimension 0 is left out (single-geometry baselines).

    forward(features [N, D], c, radius) -> {"hyperbolic": [N, dH], "euclidean": [N, dE],
    "sphere": [N, dS]} (only the parts with a positive dimension). ``dS`` is the ambient
    dimension of the sphere's points (the paper's ``r_S + 1``).

    ``skip=True`` (the warm start's architecture) adds a linear path per part, ``skips[part]``
    [d, D] without bias, and starts the MLP's last layer at zero: each part's output is
    ``S f + MLP(f)`` with ``MLP(f) = 0`` at initialisation, so the head starts as the linear
    map ``S`` (which ``warm_start`` sets) and the MLP learns a residual on it. Without it the
    parameters are the paper's (``mlps.<part>.{0,2}.{weight,bias}``), as saved runs hold them.
    """

    PARTS = ("hyperbolic", "euclidean", "sphere")

    def __init__(
        self,
        in_dim: int,
        hyperbolic_dim: int,
        euclidean_dim: int,
        sphere_dim: int,
        hidden_dim: int = 512,
        skip: bool = False,
    ) -> None:
        super().__init__()
        dims = {"hyperbolic": hyperbolic_dim, "euclidean": euclidean_dim, "sphere": sphere_dim}
        if any(d < 0 for d in dims.values()) or not any(d > 0 for d in dims.values()):
            raise ValueError(
                f"MixedCurvatureHead needs non-negative part dimensions, at least one "
                f"positive, got {dims}"
            )
        if sphere_dim == 1:
            raise ValueError("sphere_dim must be 0 (no spherical part) or >= 2 (ambient dimension)")
        self.in_dim = in_dim
        self.dims = dims
        self.mlps = nn.ModuleDict(
            {part: _mlp(in_dim, hidden_dim, d) for part, d in dims.items() if d > 0}
        )
        self.skips: nn.ModuleDict | None = None
        if skip:
            self.skips = nn.ModuleDict(
                {part: _clip_style_linear(in_dim, d) for part, d in dims.items() if d > 0}
            )
            with torch.no_grad():  # the residual branch starts at zero
                for mlp in self.mlps.values():
                    last = mlp[-1] if isinstance(mlp, nn.Sequential) else None
                    assert isinstance(last, nn.Linear)  # _mlp's output layer
                    last.weight.zero_()
                    last.bias.zero_()

    def skip_layer(self, part: str) -> nn.Linear:
        """The linear skip path of ``part`` (a head built with ``skip=True``); ValueError
        otherwise."""
        layer = None if self.skips is None else self.skips[part]
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"this head has no linear skip path for part {part!r} (skip=False)")
        return layer

    def part(self, name: str, features: Tensor) -> Tensor:
        """The raw output [N, d] of one part before its map onto the manifold: the MLP's, plus
        the linear skip path where there is one."""
        out = self.mlps[name](features)
        if self.skips is not None:
            out = out + self.skips[name](features)
        return out

    def forward(
        self, features: Tensor, c: float | Tensor, radius: float | Tensor
    ) -> dict[str, Tensor]:
        _check_features(features, self.in_dim, type(self).__name__)
        out: dict[str, Tensor] = {}
        if "hyperbolic" in self.mlps:
            out["hyperbolic"] = lorentz.expmap0(self.part("hyperbolic", features), c)
        if "euclidean" in self.mlps:
            out["euclidean"] = self.part("euclidean", features)
        if "sphere" in self.mlps:
            out["sphere"] = sphere.project(self.part("sphere", features), radius)
        return out


def projection_gain(in_dim: int, out_dim: int, input_preserving: bool = False) -> float:
    """Expected ``|W f| / |f|`` of a head's initial projection ``W`` [out_dim, in_dim]: the
    CLIP/MERU init N(0, 1/in_dim) gives ``sqrt(out_dim / in_dim)``; the shared orthonormal
    projection (``share_input_preserving_projection``) keeps norms exactly when
    ``out_dim >= in_dim`` (gain 1) and keeps ``out_dim / in_dim`` of the squared norm otherwise."""
    if input_preserving and out_dim >= in_dim:
        return 1.0
    return (out_dim / in_dim) ** 0.5


def resolve_tangent_scale(
    target_norm: float,
    feature_norm: float | None,
    in_dim: int,
    out_dim: int,
    input_preserving: bool = False,
) -> float:
    """The scale ``s`` that puts the step-0 tangent vectors ``s W f`` at mean norm
    ``target_norm``: ``s = target_norm / (feature_norm * projection_gain)``.

    ``feature_norm`` is the mean ``|f|`` of the features the head will receive
    (``data.statistics.FeatureNorms``); None stands for the papers' features, encoder outputs
    after a LayerNorm, of norm about ``sqrt(in_dim)``. For those, with the paper's random
    projection and ``target_norm = 1``, the rule gives MERU's ``1/sqrt(out_dim)``."""
    if not target_norm > 0:
        raise ValueError(f"the target tangent norm must be positive, got {target_norm}")
    if feature_norm is None:
        feature_norm = in_dim**0.5
    if not (feature_norm > 0 and feature_norm < float("inf")):
        raise ValueError(
            f"cannot resolve a head scale from a mean feature norm of {feature_norm} "
            "(the features are all zero or not finite)"
        )
    return target_norm / (feature_norm * projection_gain(in_dim, out_dim, input_preserving))


def linear_proj(head: nn.Module) -> nn.Linear:
    """The linear ``proj`` layer of a head (``LorentzHead``, ``CosineHead``, a plug-in's own);
    TypeError naming the head when it has none."""
    proj = getattr(head, "proj", None)
    if not isinstance(proj, nn.Linear):
        raise TypeError(
            f"a head's linear `proj` was expected; {type(head).__name__} has {type(proj).__name__}"
        )
    return proj


def share_input_preserving_projection(heads: list[nn.Module]) -> bool:
    """Start every head's linear ``proj`` [d, D] at one shared matrix with orthonormal columns
    (d >= D; orthonormal rows when d < D), drawn from the global RNG (seed it first).

    Then an image and a text with the same feature get the same projection, and inner products
    of the input features are preserved exactly (d >= D; approximately otherwise): a cosine head
    starts at the frozen features' own ranking, and a Lorentz head whose inputs have one norm
    ranks like them too (its distance is monotone in the angle at a fixed radius). Needs every
    head to take the same input dimension (the two sides in one space); returns False, changing
    nothing, when they do not."""
    weights = [linear_proj(h).weight for h in heads]
    if len({tuple(w.shape) for w in weights}) != 1:
        return False
    out_dim, in_dim = weights[0].shape
    q, _ = torch.linalg.qr(torch.randn(max(out_dim, in_dim), min(out_dim, in_dim)))
    matrix = q if out_dim >= in_dim else q.T
    with torch.no_grad():
        for w in weights:
            w.copy_(matrix.to(w.dtype))
    return True


__all__ = [
    "CosineHead",
    "FactorizedLorentzHead",
    "LorentzHead",
    "MixedCurvatureHead",
    "clip_tangent_norm",
    "linear_proj",
    "projection_gain",
    "resolve_tangent_scale",
    "share_input_preserving_projection",
]
