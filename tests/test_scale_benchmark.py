"""benchmarks/scale.py's bookkeeping: which cases it predicts too large to run, and a case that
overruns its time budget is stopped and reported (the measured tables are in docs/scale.md)."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCALE = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("scale_benchmark", SCALE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case(step_s: float, train_mib: float, fixed_mib: float = 400.0) -> dict:
    return {"step_s": step_s, "train_mib": train_mib, "peak_mib": fixed_mib + train_mib}


def test_memory_prediction_follows_b_squared_growth(scale) -> None:
    # training memory 50 MiB + 3e-4 MiB per pair^2: the fit through B = 256 and 1024 is exact
    train = {b: 50.0 + 3e-4 * b * b for b in (256, 1024, 4096)}
    step_s, gib = scale.predict_case(
        4096, (1024, _case(1.0, train[1024])), (256, _case(0.1, train[256]))
    )
    assert gib == pytest.approx((400.0 + train[4096]) / 1024)
    # time: the measured growth x10 per x4 is below quadratic, so x16
    assert step_s == pytest.approx(16.0)
    # one size: all of the training memory taken as quadratic (an upper bound)
    _, gib_one = scale.predict_case(1024, (256, _case(0.1, train[256])))
    assert gib_one == pytest.approx((400.0 + 16 * train[256]) / 1024)


def test_defaults_run_agr_at_4096_and_tight_limits_skip_it_saying_why(scale) -> None:
    # AGR's measured rows at B = 256 and 1024 (docs/scale.md, cost table under load)
    rows = (256, _case(1.399, 181.0, 340.0)), (1024, _case(13.857, 470.0, 339.0))
    defaults = argparse.Namespace(max_step_seconds=600.0, max_gib=12.0)
    assert scale._predict_skip(4096, rows[1], rows[0], defaults) is None
    tight = argparse.Namespace(max_step_seconds=150.0, max_gib=4.0)
    reason = scale._predict_skip(4096, rows[1], rows[0], tight)
    assert reason is not None and "predicted" in reason and "GiB" in reason
    failed = (1024, {"error": "x"})
    assert "smaller batch" in scale._predict_skip(4096, failed, rows[0], defaults)


def test_a_case_past_its_time_budget_is_stopped_and_reported(scale, monkeypatch) -> None:
    real_popen = subprocess.Popen

    def sleeper(command, **kwargs):  # noqa: ANN001, ANN003, ANN202
        return real_popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)

    monkeypatch.setattr(scale.subprocess, "Popen", sleeper)
    result = scale._case_in_subprocess({"threads": 1}, timeout=1)
    assert "timed out after 1 s" in result["error"]
    assert scale._case_timeout({"warmup": 1, "steps": 1, "parts": True}, 600.0) >= 3 * 600.0
