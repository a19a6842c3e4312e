"""curvalign: geometry-aware contrastive alignment of images and texts."""

__version__ = "0.1.0"
