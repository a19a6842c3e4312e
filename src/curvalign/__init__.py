"""curvalign: geometry-aware contrastive alignment of images and texts."""

__version__ = "0.2.0"
