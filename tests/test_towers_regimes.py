"""Towers after training and in the papers' regimes (issue 23 items 4 and 5), on the tiny
open_clip world of ``test_towers`` (random weights saved to a temporary directory).

Checked: ``curvalign towers export`` writes an encoder spec ``curvalign extract --encoder``
accepts, whose features are the trained towers' ones (best or last weights).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None or importlib.util.find_spec("peft") is None,
    reason="optional extras not installed: pip install 'curvalign[towers]' (open_clip, peft)",
)

from test_towers import towers_config, train_towers, world  # noqa: E402, F401  (fixture)

# --- curvalign towers export ----------------------------------------------------------------


def test_towers_export_on_the_command_line_gives_a_spec_extract_accepts(world, tmp_path) -> None:  # noqa: F811
    from typer.testing import CliRunner

    from curvalign.cli import app
    from curvalign.data import load_store
    from curvalign.data.encoders import load_encoder
    from curvalign.train.towers import load_towers

    run = train_towers(
        world, tmp_path / "run", towers_config(world, image="lora", text="lora", lr=1e-2)
    )
    runner = CliRunner()

    def export(*extra: str) -> tuple[str, str]:
        out = tmp_path / f"exp{len(extra)}"
        result = runner.invoke(app, ["towers", "export", str(run), "--out", str(out), *extra])
        assert result.exit_code == 0, result.output
        spec = next(
            line.removeprefix("encoder spec: ")
            for line in result.output.splitlines()
            if line.startswith("encoder spec: ")
        )
        return spec, result.output

    best_spec, output = export()  # --weights best: the towers kept with the best validation
    assert output.startswith("exported the best towers")
    best = load_towers(run, weights="best")
    probe = [f"a caption {i}" for i in range(4)]
    with torch.no_grad():
        torch.testing.assert_close(
            load_encoder(best_spec).encode_texts(probe),
            best.encode_texts(probe),
            rtol=1e-4,
            atol=1e-4,
        )
    spec, output = export("--weights", "last")
    assert output.startswith("exported the last towers")
    root = world["root"]
    store_dir = tmp_path / "store"
    args = ["extract", "--encoder", spec, "--images", str(root / "images")]
    args += ["--captions", str(root / "captions.json"), "--out", str(store_dir)]
    extracted = runner.invoke(app, args)
    assert extracted.exit_code == 0, extracted.output
    store, _ = load_store(f"features:{store_dir}")
    towers = load_towers(run, weights="last")
    with torch.no_grad():
        texts = towers.encode_texts(list(store.texts))
    torch.testing.assert_close(store.text_features.float(), texts, rtol=1e-3, atol=1e-3)
    original, _ = load_store(world["store"])  # and they are not the frozen towers' features
    assert not torch.allclose(
        store.text_features.float(), original.text_features.float(), atol=1e-4
    )

    not_a_run = runner.invoke(app, ["towers", "export", str(root), "--out", str(tmp_path / "x")])
    assert not_a_run.exit_code == 2 and "not a tower run" in not_a_run.output
    assert "Traceback" not in not_a_run.output
    bad = runner.invoke(
        app, ["towers", "export", str(run), "--out", str(tmp_path / "y"), "--weights", "first"]
    )
    assert bad.exit_code == 2 and "--weights must be best or last" in bad.output
