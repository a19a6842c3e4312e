"""The examples run as documented (a short run: they must not rot)."""

from __future__ import annotations

import re
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
        timeout=1800,  # only a hang reaches it: the work is bounded by --steps 3
    )
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(x for x in result.stdout.splitlines() if "retrieval on the test split" in x)
    # rates in %, as everywhere: "t2i@1 12.3, ..." (a fraction such as 0.123 would fail)
    assert "(%)" in line, line
    rates = dict(re.findall(r"(\w2\w@\d+) (\d+\.\d)\b", line))
    assert {"t2i@1", "i2t@1"} <= rates.keys(), line
    assert all(0 <= float(v) <= 100 for v in rates.values()), line
    assert any(float(v) >= 1 for v in rates.values()), line  # a fraction never reaches 1.0 here
    assert result.stdout.count("caption ") == 3
    assert (tmp_path / "run" / "model.safetensors").is_file()
