"""benchmarks/data_scale.py's layout: distinct pairs at any N and shard size, data a linear map
does not already rank perfectly, and the cache-dropping and disk-read helpers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyarrow")
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "data_scale.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("data_scale_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layout_has_distinct_pairs_with_a_short_last_shard(bench, tmp_path: Path):
    # N smaller than the default shard size, and N not a multiple of it: both are fine
    bench.write_layout(tmp_path / "a", 300, 16, 500_000)
    bench.write_layout(tmp_path / "b", 700, 16, 256)
    files = sorted((tmp_path / "b" / "img_emb").glob("*.npy"))
    assert [len(np.load(f)) for f in files] == [256, 256, 188]
    assert len({f.stat().st_ino for f in files}) == 3  # written, not linked
    assert all(f.stat().st_nlink == 1 for f in (tmp_path / "b").rglob("*.npy"))
    images = np.concatenate([np.load(f) for f in files])
    assert len(np.unique(images, axis=0)) == len(images)
    assert np.load(tmp_path / "a" / "img_emb" / "img_emb_0.npy").shape == (300, 16)


def test_a_linear_map_does_not_rank_the_pairs_perfectly(bench, tmp_path: Path):
    bench.write_layout(tmp_path, 2000, 64, 1000)
    x = np.concatenate([np.load(tmp_path / "img_emb" / f"img_emb_{k}.npy") for k in (0, 1)])
    t = np.concatenate([np.load(tmp_path / "text_emb" / f"text_emb_{k}.npy") for k in (0, 1)])
    x, t = x.astype(np.float64), t.astype(np.float64)
    fit, held = slice(0, 1500), slice(1500, 2000)
    ridge = np.linalg.solve(x[fit].T @ x[fit] + np.eye(64), x[fit].T @ t[fit])
    mapped = x[held] @ ridge
    mapped /= np.linalg.norm(mapped, axis=1, keepdims=True)
    top1 = float(((t[held] @ mapped.T).argmax(axis=1) == np.arange(500)).mean())
    assert 5 / 500 < top1 < 0.9  # far above chance, far from perfect
    raw = float(((t[held] @ x[held].T).argmax(axis=1) == np.arange(500)).mean())
    assert raw < 0.1  # the sides differ by more than noise: the raw features do not align


def test_cache_drop_and_read_bytes(bench, tmp_path: Path):
    bench.write_layout(tmp_path, 50, 8, 20)
    assert bench.drop_cache(tmp_path) is True
    assert bench.read_bytes() >= 0


def test_a_bad_shard_size_names_its_flag(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--pairs", "10", "--shard-rows", "0", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--shard-rows must be positive" in proc.stderr


@pytest.mark.parametrize("steps", ["ten", "0", "-5"])
def test_steps_is_a_positive_count_or_default(steps: str, tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--pairs", "10", "--steps", steps, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--steps must be a positive integer or 'default'" in proc.stderr


def test_shards_written_apart_make_the_layout_and_only_a_whole_one_is_reused(bench, tmp_path):
    bench.write_layout(tmp_path / "whole", 700, 16, 256)
    assert bench._written(tmp_path / "whole") == {
        "pairs": 700,
        "dim": 16,
        "shard_rows": 256,
        "seed": 0,
    }
    for k in (2, 0, 1):  # any order, any process: each shard from its own seeded stream
        bench.write_layout(tmp_path / "parts", 700, 16, 256, shards=[k])
    assert bench._written(tmp_path / "parts") is None  # no marker: never taken as complete
    for k in range(3):
        name = f"img_emb/img_emb_{k}.npy"
        assert np.array_equal(
            np.load(tmp_path / "whole" / name), np.load(tmp_path / "parts" / name)
        )
