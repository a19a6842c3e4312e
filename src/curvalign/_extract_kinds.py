"""The input kinds of ``curvalign extract``: one subcommand each, and how the one-command form
from before the subcommands (``curvalign extract --encoder E --images DIR ...``) finds its kind.

Torch-free on purpose: the command routes and checks its flags before torch is imported, so that
a wrong flag, like a missing model, fails in milliseconds.

=========== ================================================================ ====================
kind        reads                                                            library function
=========== ================================================================ ====================
images      an image folder, with captions, boxes, class prompts, taxonomy,  ``extract_features``
            scored text pairs, token features
texts       text only: captions, class names and prompts, scored text pairs  ``extract_texts``
wds         a CLIP_benchmark webdataset (images, labels, captions in shards) ``extract_webdataset``
sugarcrepe  SugarCrepe's KIND.json files (with COCO val2017 images, or text) ``extract_sugarcrepe``
=========== ================================================================ ====================
(the functions are in ``curvalign.data.extract``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ExtractKind:
    """One input kind: its subcommand ``name``, what it reads (one line, the subcommand's help)
    and why it does not read the options of the other kinds (for the message naming them)."""

    name: str
    reads: str
    not_read: str


EXTRACT_KINDS: dict[str, ExtractKind] = {
    kind.name: kind
    for kind in (
        ExtractKind(
            "images",
            "An image folder with its captions, boxes, class prompts, taxonomy and text pairs.",
            "a webdataset and SugarCrepe are kinds of their own",
        ),
        ExtractKind(
            "texts",
            "Text only: captions, class names and prompts, scored text pairs (no images).",
            "boxes and a taxonomy need images: `curvalign extract images --images DIR ...`",
        ),
        ExtractKind(
            "wds",
            "A CLIP_benchmark webdataset: images, labels and captions come from its shards.",
            "the shards hold the images, labels and captions; token features are not stored "
            "for webdatasets in this version",
        ),
        ExtractKind(
            "sugarcrepe",
            "SugarCrepe's KIND.json files: with --images (the COCO val2017 folder) an image "
            "store, without it text only.",
            "the KIND.json files hold the captions and their negatives; token features are not "
            "stored for SugarCrepe in this version",
        ),
    )
}

#: the option of the one-command form that selects each kind, in the order they are looked for;
#: a command with none of them is text only
_SELECTING_FLAGS = (("--wds", "wds"), ("--sugarcrepe", "sugarcrepe"), ("--images", "images"))


def kind_of_flags(flags: Iterable[str]) -> str:
    """The kind that the one-command form selects by its ``flags`` (option names such as
    ``--images``): ``--wds``, then ``--sugarcrepe``, then ``--images``; text only without any."""
    given = set(flags)
    return next((kind for flag, kind in _SELECTING_FLAGS if flag in given), "texts")


def not_read_message(kind: str, flags: list[str]) -> str:
    """One line naming the ``flags`` that subcommand ``kind`` does not read, and why."""
    what = EXTRACT_KINDS[kind]
    return (
        f"`curvalign extract {kind}` does not read {', '.join(flags)} ({what.not_read}); "
        f"the kinds are {', '.join(EXTRACT_KINDS)} (`curvalign extract KIND --help`)"
    )


__all__ = ["EXTRACT_KINDS", "ExtractKind", "kind_of_flags", "not_read_message"]
