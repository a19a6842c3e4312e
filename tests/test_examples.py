"""The examples run as documented (a short run: they must not rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart_trains_evaluates_and_searches(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "quickstart.py"),
            "--steps",
            "3",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "retrieval on the test split" in result.stdout
    assert result.stdout.count("caption ") == 3
    assert (tmp_path / "run" / "model.safetensors").is_file()
