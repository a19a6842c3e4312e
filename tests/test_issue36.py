"""What a fourth fault-injection pass found (issue 36): binary garbage as a config, NaN rows in
memory-mapped shards, a leak from train into test, two trainers in one folder, SIGTERM outside
the training loop, a refused pickle that forwarded torch's advice. Each check uses the real thing
it is about (a file of random bytes, a damaged shard, a second process, a signal)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from curvalign._io import sha256_file
from test_faults import DATA, _error_lines, _invoke, _train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("issue36") / "run", steps=3)


# --- fault 1: binary garbage as --config ---------------------------------------------------------


def test_binary_garbage_as_a_config_is_one_line(tmp_path):
    garbage = tmp_path / "garbage.yaml"
    garbage.write_bytes(bytes(range(128, 256)) * 8)
    code, text = _invoke(
        "train", "--recipe", "clip", "--data", DATA, "--out", tmp_path / "run",
        "--config", garbage, "--print-config",
    )  # fmt: skip
    assert code == 2, text
    (line,) = _error_lines(text)
    assert str(garbage) in line and "not UTF-8 text" in line, line
    assert "Traceback" not in text and "UnicodeDecodeError" not in text


# --- fault 9: a pickle refused in state.pt --------------------------------------------------------


class _Planted:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_refused_pickle_is_one_line_without_torchs_advice(trained, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    torch.save({"step": 99, "model": {}, "x": _Planted()}, run / "state.pt")
    meta = json.loads((run / "meta.json").read_text())
    meta["sha256"]["state.pt"] = sha256_file(run / "state.pt")  # a forged checksum
    (run / "meta.json").write_text(json.dumps(meta))
    code, text = _invoke("train", "--out", run, "--resume", "--steps", "6", "-q")
    assert code == 2, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), text
    assert str(run / "state.pt") in lines[0] and "system" in lines[0], lines[0]
    assert "weights_only" not in text and "will likely succeed" not in text
