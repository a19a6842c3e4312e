"""What a new user and a second fault-injection pass found (issue 25): a resume that would
overwrite trained weights, a full disk under `embed`, a busy port under `serve`, damaged
embeddings and indexes, pickles and planted libraries, refused recipes in a benchmark, silent
skips, and README commands. Each check uses the real thing it is about (a subprocess, a full
tmpfs, a bound socket, a planted file)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from curvalign._io import sha256_file
from test_faults import _cli, _error_lines, _invoke, _train, tiny_filesystem  # noqa: F401


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("issue25") / "run", steps=4)


def _copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


# --- item 1: a resume whose checkpoint is gone ---------------------------------------------------


def test_resume_without_the_state_that_meta_records_is_refused(trained, tmp_path):
    run = _copy_run(trained, tmp_path / "run")
    (run / "state.pt").unlink()
    before = {name: sha256_file(run / name) for name in ("model.safetensors", "best.safetensors")}
    result = _cli("train", "--out", run, "--resume", "--steps", "8", "-q")
    assert result.returncode == 2, result.stderr
    (line,) = _error_lines(result.stderr)
    assert "meta.json records step 4" in line and str(run / "state.pt") in line, line
    assert "nothing was overwritten" in line
    assert {name: sha256_file(run / name) for name in before} == before
    assert not (run / "state.pt").exists()


# --- item 5: no pickle of a run folder is executed -----------------------------------------------


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("checksum", ["stale", "forged"])
def test_a_planted_pickle_in_state_pt_is_never_executed(trained, tmp_path, checksum):
    run = _copy_run(trained, tmp_path / "run")
    marker = tmp_path / "pwned"
    torch.save({"step": 99, "model": {}, "x": _Planted(marker)}, run / "state.pt")
    if checksum == "forged":  # whoever planted it also rewrote the checksum
        meta = json.loads((run / "meta.json").read_text())
        meta["sha256"]["state.pt"] = sha256_file(run / "state.pt")
        (run / "meta.json").write_text(json.dumps(meta))
    else:  # meta.json written after state.pt, as a complete checkpoint has it
        os.utime(run / "meta.json")
    result = _cli("train", "--out", run, "--resume", "--steps", "8", "-q")
    assert result.returncode == 2, result.stderr
    (line,) = _error_lines(result.stderr)
    assert str(run / "state.pt") in line, line
    assert not marker.exists()
