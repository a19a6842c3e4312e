"""Training logs: ``log.jsonl`` (one JSON object per logged step) and TensorBoard scalars in ``tb/``.

Each record holds ``step`` (optimizer steps done), ``loss``, every loss term as ``loss/<name>``,
``lr``, ``grad_norm``, ``pairs_per_s`` (image-text pairs per second since the last record),
``epoch``, the recipe's ``log_values()`` and its ``LossOutput.logs``. On resume, records after the
checkpoint's step (written by the interrupted process after its last checkpoint) are dropped,
so the log reads like the one of an uninterrupted run. Reading a log: ``curvalign.runs.read_log``
(re-exported here).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from curvalign._io import atomic_write_text
from curvalign.runs import LOG_FILE, TB_DIR, read_log


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as strings so the file stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class RunLogger:
    """Appends records to ``log.jsonl`` and, optionally, TensorBoard scalars under ``tb/``."""

    def __init__(self, run_dir: Path, *, resume_step: int = 0, tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / LOG_FILE
        if resume_step > 0:
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events a killed process wrote past the checkpoint resumed from
            self._tb = SummaryWriter(str(Path(run_dir) / TB_DIR), purge_step=resume_step + 1)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                if int(json.loads(line)["step"]) <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
        atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (must hold ``step``); numbers go to TensorBoard under their key."""
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if (
                    key != "step"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["RunLogger", "read_log"]
