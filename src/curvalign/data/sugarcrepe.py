"""SugarCrepe (Hsieh et al., 2023): hard-negative captions over COCO val2017 images.

Layout: one JSON file per kind of perturbation, each an object of entries::

    {"0": {"filename": "000000397133.jpg", "caption": "A man is in a kitchen making pizzas.",
           "negative_caption": "A man is in a kitchen making sandwiches."}, ...}

The seven kinds of the benchmark are the file stems ``add_att``, ``add_obj``, ``replace_att``,
``replace_obj``, ``replace_rel``, ``swap_att``, ``swap_obj``; ``filename`` is relative to the
COCO ``val2017`` image folder. ``curvalign extract --sugarcrepe DIR --images val2017`` writes a
store whose hard-negative group holds one negative per entry (``negative_kind`` = its file), so
``curvalign eval`` reports the accuracy per kind exactly as SugarCrepe does: the share of
entries whose image scores its caption above the negative caption, with the model's own score.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from curvalign.data.readers import Location, ReaderError, get_key, read_json

#: the benchmark's kinds, in the order of its paper's table
SUGARCREPE_KINDS = (
    "replace_obj",
    "replace_att",
    "replace_rel",
    "swap_obj",
    "swap_att",
    "add_obj",
    "add_att",
)


@dataclass
class SugarCrepeEntry:
    kind: str
    entry_id: str
    image_file: str
    caption: str
    negative: str


def sugarcrepe_files(path: str | os.PathLike[str]) -> list[Path]:
    """The kind files under ``path`` (a folder of ``KIND.json`` files, or one such file).

    Files named after the benchmark's kinds come first in the paper's order; any other
    ``*.json`` in the folder is read as a kind of its own (a user's extra perturbation set).
    """
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ReaderError(f"SugarCrepe folder {root}: no such file or directory")
    found = {p.stem: p for p in sorted(root.glob("*.json"))}
    if not found:
        raise ReaderError(
            f"SugarCrepe folder {root}: no KIND.json files (expected {', '.join(SUGARCREPE_KINDS)})"
        )
    known = [found[k] for k in SUGARCREPE_KINDS if k in found]
    return known + [p for k, p in found.items() if k not in SUGARCREPE_KINDS]


def read_sugarcrepe(path: str | os.PathLike[str]) -> tuple[list[SugarCrepeEntry], list[str]]:
    """(every entry of every kind file, the kind names in file order)."""
    entries: list[SugarCrepeEntry] = []
    kinds: list[str] = []
    for file in sugarcrepe_files(path):
        data = read_json(file, "SugarCrepe file")
        if not isinstance(data, dict) or not data:
            raise ReaderError(
                f"SugarCrepe file {file}: expected a non-empty object {{id: {{filename, caption, "
                f"negative_caption}}}}, got {type(data).__name__}"
            )
        kinds.append(file.stem)
        for entry_id, item in data.items():
            where = Location(file, keys=[str(entry_id)])
            entries.append(
                SugarCrepeEntry(
                    file.stem,
                    str(entry_id),
                    get_key(item, "filename", str, where),
                    get_key(item, "caption", str, where).strip(),
                    get_key(item, "negative_caption", str, where).strip(),
                )
            )
    return entries, kinds


__all__ = ["SUGARCREPE_KINDS", "SugarCrepeEntry", "read_sugarcrepe", "sugarcrepe_files"]
