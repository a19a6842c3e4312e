"""Trainable modules: learnable positive scalars and the projection heads (features -> manifold points).

The AGR router, LoRA and pooling live in their own modules (``curvalign.nn.router`` ...).
"""

from curvalign.nn.heads import (
    CosineHead,
    FactorizedLorentzHead,
    LorentzHead,
    MixedCurvatureHead,
    clip_tangent_norm,
)
from curvalign.nn.scalars import LearnableScalar, inward_clamp, scalar_parameter_names

__all__ = [
    "CosineHead",
    "FactorizedLorentzHead",
    "LearnableScalar",
    "LorentzHead",
    "MixedCurvatureHead",
    "clip_tangent_norm",
    "inward_clamp",
    "scalar_parameter_names",
]
