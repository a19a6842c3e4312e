"""Encoder specs checked against the disk without importing torch or any model library.

``curvalign extract`` calls :func:`check_encoder_paths` first, so a model path that is not there
fails in milliseconds instead of after the seconds that importing torch, open_clip or
transformers takes. ``curvalign.data.encoders`` uses the same checks when it builds an adapter.
"""

from __future__ import annotations

import os
from pathlib import Path

from curvalign.errors import CurvalignError


class EncoderError(CurvalignError, ValueError):
    """A bad encoder spec, a model that is not on disk, or a missing optional extra."""


def existing_path(path: str | os.PathLike[str], what: str, *, directory: bool) -> Path:
    """The path, or EncoderError at once: nothing is ever fetched in its place."""
    p = Path(path).expanduser()
    ok = p.is_dir() if directory else p.is_file()
    if not ok:
        kind = "directory" if directory else "file"
        found = "" if not p.exists() else f" ({p} exists but is not a {kind})"
        raise EncoderError(
            f"{what}: expected a local {kind} at {p}{found}; curvalign never downloads models, "
            "so put the model there first"
        )
    return p


def check_encoder_paths(spec: str) -> None:
    """Fail with EncoderError if a path the spec names is not on disk (the spec's grammar is
    checked again, fully, by ``curvalign.data.encoders.load_encoder``)."""
    if "+" in spec:  # IMAGE_SPEC+TEXT_SPEC: each part on its own
        for part in spec.split("+"):
            check_encoder_paths(part)
        return
    kind, _, rest = spec.partition(":")
    if kind.startswith("efficientnet-") and rest:
        existing_path(rest, f"{kind} weights", directory=False)
    elif kind in ("torchvision", "timm"):
        arch, sep, checkpoint = rest.partition(":")
        if arch and sep and checkpoint:
            existing_path(checkpoint, f"{kind} checkpoint for {arch}", directory=False)
    if kind == "open_clip":
        arch, sep, checkpoint = rest.partition(":")
        if arch and sep and checkpoint:
            existing_path(checkpoint, f"open_clip checkpoint for {arch}", directory=False)
            if arch.endswith(".json"):
                existing_path(arch, "open_clip model config", directory=False)
    elif kind == "hf-clip" and rest:
        existing_path(rest, "Hugging Face model directory", directory=True)
    elif kind == "sentence-transformers" and rest:
        existing_path(rest, "sentence-transformers model directory", directory=True)
