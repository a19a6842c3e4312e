"""Trainable modules: learnable positive scalars and the projection heads (features -> manifold points)."""

from curvalign.nn.scalars import LearnableScalar, inward_clamp

__all__ = ["LearnableScalar", "inward_clamp"]
