"""Towers through the one seam: a ``RunSpec`` with towers trained by ``fit`` (with a hook, kept
in memory), and ``curvalign benchmark --towers --tune`` on the tiny open_clip world of
test_towers."""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None
    or importlib.util.find_spec("peft") is None
    or importlib.util.find_spec("optuna") is None,
    reason="optional extras not installed: pip install 'curvalign[towers,tune]'",
)

from curvalign.train.hooks import TrainerHook  # noqa: E402
from test_towers import TRAIN, towers_config, world  # noqa: E402, F401  (fixture)


class _Seen(TrainerHook):
    """Records the validations and whether the trainer had towers in front of the recipe."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.towers_training: list[bool] = []

    def on_validation(self, trainer, event):
        self.steps.append(int(event.step))
        return None

    def on_step_end(self, trainer, step, record):
        self.towers_training.append(bool(trainer.towers.training))


def test_fit_trains_a_towers_spec_with_hooks_in_memory(world, tmp_path, monkeypatch):  # noqa: F811
    from curvalign.train.fitting import RunSpec, fit

    monkeypatch.chdir(tmp_path)  # a stray write would land here
    towers = towers_config(world, image="lora", text="lora")
    spec = RunSpec.parse("clip", world["store"], overrides=TRAIN, steps=4, towers=towers)
    seen = _Seen()
    result = fit(spec, None, hooks=[seen], show_progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert result.towers is not None and not result.towers.training
    # the hook saw the validations the run made (step 0, every 3 steps, the last step)
    assert seen.steps == [s for s, _ in result.val_history] == [0, 3, 4]
    assert seen.towers_training == [True] * 4  # the towers trained at every step
    trained = result.towers.trainable_state()
    assert trained and all("lora" in name for name in trained)  # the adapters trained


@pytest.mark.slow  # tuning 2 trials then both benchmark arms, every run with towers
def test_benchmark_towers_tune_runs_on_tiny_towers(world, tmp_path) -> None:  # noqa: F811
    from typer.testing import CliRunner

    from curvalign.cli import app

    out = tmp_path / "bench"
    towers = f"{world['spec']};image=lora;text=lora;lora_rank=2"
    args = ["benchmark", "--recipes", "clip", "--data", world["store"], "--steps", "3"]
    args += ["--seeds", "1", "--tune", "2", "--out", str(out), "-q", "--towers", towers]
    result = CliRunner().invoke(app, [*args, "--", *TRAIN])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((out / "tuning" / "trials.csv").open()))
    assert len(rows) == 2 and rows[0]["defaults"] == "yes"
    assert all(r["outcome"] == "ok" or r["outcome"].startswith("pruned") for r in rows), rows
    payload = json.loads((out / "results.json").read_text())
    assert {"clip (paper)", "clip (tuned)"} <= set(payload["results"])
    for arm in ("paper", "tuned"):  # both arms trained the towers
        assert (out / arm / "runs" / "clip" / "seed-0" / "towers.json").exists()
    assert not (out / "tuning" / "runs").exists()  # the trials wrote no run
