"""Towers: the image and text encoders in front of the heads, trained locked, with LoRA or fully.

``Towers`` (``curvalign.towers.base``) is the protocol, ``build_towers`` builds one from a
``TowersConfig``; ``curvalign.train.towers.TowerTrainer`` trains ``towers + recipe`` through the
trainer's loop and hooks. See docs/training.md, "Train the towers".

This package sits on the floor of ``data`` (it reads stores and builds Batches, and reuses the
frozen encoder adapters of ``data.encoders``); recipes below it never see a tower, and ``train``
above it drives it.
"""

from curvalign.towers.adapters import (
    EfficientNetTowers,
    HFClipTowers,
    OpenClipTowers,
    PairedTowers,
    SentenceTransformerTowers,
    build_towers,
    describe,
)
from curvalign.towers.base import (
    MODES,
    SIDES,
    InputPreparer,
    TowerError,
    Towers,
    TowersConfig,
    switch_off_dropout,
)
from curvalign.towers.data import StoreItems, check_recipe_parts, tower_batch
from curvalign.towers.loader import Augment, RawBatchLoader, StepRows, StoreRows
from curvalign.towers.stream import WebDatasetRows

__all__ = [
    "MODES",
    "SIDES",
    "Augment",
    "InputPreparer",
    "RawBatchLoader",
    "StepRows",
    "StoreRows",
    "WebDatasetRows",
    "EfficientNetTowers",
    "HFClipTowers",
    "OpenClipTowers",
    "PairedTowers",
    "SentenceTransformerTowers",
    "StoreItems",
    "TowerError",
    "Towers",
    "TowersConfig",
    "build_towers",
    "check_recipe_parts",
    "describe",
    "switch_off_dropout",
    "tower_batch",
]
