"""Training pairs streamed from webdataset shards (``TowersConfig.shards``), resumable.

A shard is a ``.tar`` whose members group into samples by key (``curvalign.data.webdataset``:
the same reader the webdataset evaluation uses): ``KEY.jpg`` (or ``png``, ``webp``, ``jpeg``)
plus ``KEY.txt``, its caption (one per line when there are several: one is drawn per visit).
``shards`` is a folder (its ``*.tar``, or ``0.tar .. N-1.tar`` when it holds ``nshards.txt``) or
one ``.tar`` file.

Streaming: one shard is open at a time and read member by member; nothing is unpacked or held
beyond the step being drawn (and the DataLoader's prefetch). Each epoch visits the shards in an
order drawn from (seed, epoch) and the samples of a shard in their stored order. A sample
without an image or a caption is skipped and counted. The global batch is read on every rank;
each rank keeps its share, so N processes train on the rows one process trains on.

Position: ``state_dict()`` is (epoch, shard in the epoch's order, samples read from it, skipped
so far); ``load_state_dict`` reopens that shard and skips as many samples (without decoding
them), so a resumed run continues at the same sample.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from curvalign.data.webdataset import IMAGE_EXTENSIONS, WdsSample, iter_wds_shard
from curvalign.towers.base import TowerError
from curvalign.towers.loader import StepRows, row_generator


def list_shards(path: str | Path) -> list[Path]:
    """The shards of ``path`` (a ``.tar`` file, or a folder of them), in a stable order."""
    base = Path(path)
    if base.is_file():
        return [base]
    if not base.is_dir():
        raise TowerError(f"towers shards {base}: no such file or folder")
    count = base / "nshards.txt"
    if count.is_file():
        n = int(count.read_text().strip() or 0)
        shards = [base / f"{k}.tar" for k in range(n)]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise TowerError(f"towers shards {base}: nshards.txt says {n}, missing {missing[:3]}")
    else:

        def natural(p: Path) -> list[Any]:
            return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]

        shards = sorted(base.glob("*.tar"), key=natural)
    if not shards:
        raise TowerError(f"towers shards {base}: no .tar shard in it")
    return shards


def _pair(sample: WdsSample) -> tuple[bytes, list[str]] | None:
    """(image bytes, captions) of a sample, or None when it has no image or no caption."""
    image = next((sample.members[e] for e in IMAGE_EXTENSIONS if e in sample.members), None)
    text = sample.members.get("txt")
    if image is None or text is None:
        return None
    captions = [c.strip() for c in text.decode("utf-8", "replace").splitlines() if c.strip()]
    return (image, captions) if captions else None


class WebDatasetRows:
    """``(image, caption)`` training rows streamed from webdataset shards, ``batch_size`` per
    step (the global batch), this rank's share handed out (see the module docstring)."""

    def __init__(
        self,
        shards: str | Path,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.shards = list_shards(shards)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.epoch = self.shard = self.sample = self.skipped = 0
        self._samples: Iterator[WdsSample] | None = None

    def _order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.shards), generator=generator).tolist()

    def _open(self) -> None:
        path = self.shards[self._order(self.epoch)[self.shard]]
        self._samples = iter_wds_shard(path)
        for _ in range(self.sample):  # a resumed position: skip what was read
            if next(self._samples, None) is None:
                raise TowerError(
                    f"shard {path} has fewer than the {self.sample} samples the checkpoint "
                    "read from it: resume with the shards the run was trained on"
                )

    def _next_pair(self) -> tuple[bytes, list[str]]:
        for _ in range(len(self.shards) + 1):  # at most one pass over every shard finds nothing
            if self._samples is None:
                self._open()
            assert self._samples is not None
            for sample in self._samples:
                self.sample += 1
                pair = _pair(sample)
                if pair is not None:
                    return pair
                self.skipped += 1
            self._samples, self.sample = None, 0
            self.shard += 1
            if self.shard == len(self.shards):
                self.epoch, self.shard = self.epoch + 1, 0
        raise TowerError(
            f"towers shards: no sample with an image and a .txt caption in {self.shards[0].parent}"
        )

    def next_rows(self, step: int) -> StepRows:
        pairs = [self._next_pair() for _ in range(self.batch_size)]
        size = self.batch_size // self.world_size
        offset = self.rank * size
        images, texts = [], []
        for k, (image, captions) in enumerate(pairs[offset : offset + size]):
            pick = row_generator(self.seed, step, "caption", offset + k)
            images.append(image)
            texts.append(captions[int(torch.randint(len(captions), (), generator=pick))])
        return StepRows(step, images=images, texts=texts, offset=offset)

    def state_dict(self) -> dict[str, Any]:
        return {
            "shards": len(self.shards),
            "epoch": self.epoch,
            "shard": self.shard,
            "sample": self.sample,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["shards"]) != len(self.shards):
            raise TowerError(
                f"the stream position is for {state['shards']} shards, these are "
                f"{len(self.shards)}: resume with the shards the run was trained on"
            )
        self.epoch, self.shard = int(state["epoch"]), int(state["shard"])
        self.sample, self.skipped = int(state["sample"]), int(state["skipped"])
        self._samples = None


__all__ = ["WebDatasetRows", "list_shards"]
