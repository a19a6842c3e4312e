"""What a fault-injection pass found (issue 16): signals, unwritable outputs, damaged files,
stale indexes and temporaries, file modes. Kills and signals use real subprocesses; damage is
done to real files."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from curvalign._io import staged_directory
from curvalign.cli import app
from curvalign.runs import load_run
from curvalign.train.checkpoint import CheckpointError, read_meta
from curvalign.train.trainer import train

SRC = Path(__file__).resolve().parents[1] / "src"
DATA = "synthetic:images=160,text_pairs=0,seed=3"
SMALL = ["embed_dim=8", "batch_size=32"]
runner = CliRunner()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "COLUMNS": "120"}


def _cli(*args) -> subprocess.CompletedProcess:
    """``curvalign ARGS`` in a subprocess. No timeout: a test bounds the work it asks for (few
    steps, a tiny store), never the time it may take on a loaded machine."""
    return subprocess.run(
        [sys.executable, "-m", "curvalign", *map(str, args)],
        env=_env(),
        capture_output=True,
        text=True,
    )


def _invoke(*args):
    import torch

    threads = torch.get_num_threads()
    try:
        result = runner.invoke(app, [str(a) for a in args])
    finally:
        torch.set_num_threads(threads)  # a run's num_threads= must not outlive it
    return result.exit_code, result.stdout + (
        result.stderr if result.stderr_bytes is not None else ""
    )


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def _wait_for_log(run_dir: Path, step: int, process: subprocess.Popen) -> None:
    """Wait until the run's log.jsonl has reached ``step`` (the training loop is running); fails
    as soon as the process ends first (no deadline: the work is bounded, not the time)."""
    log = run_dir / "log.jsonl"
    while True:
        assert process.poll() is None, process.communicate()
        if log.exists():
            lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
            if lines and lines[-1]["step"] >= step:
                return
        time.sleep(0.1)


def _train(out: Path, steps: int = 4, extra=(), recipe: str = "clip", data: str = DATA) -> Path:
    return train(recipe, data, out, steps=steps, overrides=SMALL + list(extra), show_progress=False)


# --- item 2: an unwritable or full --out ---------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "embed", "benchmark", "index-build"])
def test_an_unwritable_out_fails_first_in_one_line(tmp_path, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = blocker / "out"
    # data and inputs that do not exist either: the output check must come first
    args = {
        "train": ["train", "--recipe", "clip", "--data", "features:/nonexistent", "--out", bad],
        "embed": ["embed", tmp_path / "no-run", "--out", bad],
        "benchmark": ["benchmark", "--recipes", "clip", "--data", "features:/no", "--out", bad],
        "index-build": ["index", "build", tmp_path / "no-emb", "--out", bad],
    }[command]
    code, text = _invoke(*args)
    assert code == 2, text
    assert _error_lines(text) == [
        f"error: --out {bad} cannot be created: {blocker} is not a directory"
    ], text
    assert "Traceback" not in text


def test_a_location_that_refuses_files_is_named(tmp_path):
    from curvalign._io import OutputError, check_output_location

    # root bypasses chmod; /proc refuses new files for everyone
    with pytest.raises(OutputError, match=r"--out /proc/curvalign-x/run is not writable.*/proc"):
        check_output_location("/proc/curvalign-x/run", "--out")
    target = tmp_path / "file-target"
    target.write_text("x")
    with pytest.raises(OutputError, match="exists and is not a directory"):
        check_output_location(target, "--out")
    check_output_location(tmp_path / "new" / "deeper")  # creatable: no error
    assert not list(tmp_path.glob(".curvalign-write-probe-*"))


def test_train_into_proc_is_one_error_line():
    # the output is checked before torch is imported or any data is read: a second of work
    result = _cli("train", "--recipe", "clip", "--data", DATA, "--out", "/proc/cv-x")
    assert result.returncode == 2, result.stderr
    (line,) = _error_lines(result.stderr)
    assert line.startswith("error: --out /proc/cv-x is not writable: cannot create a file in /proc")
    assert "Traceback" not in result.stderr


def test_disk_full_during_a_checkpoint_says_what_was_kept(tmp_path, monkeypatch):
    import curvalign.train.checkpoint as ckpt
    from curvalign.train.config import TrainError

    real = ckpt.save_file
    calls = {"n": 0}

    def disk_full_on_second(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(ckpt, "save_file", disk_full_on_second)
    with pytest.raises(TrainError) as info:
        # val_every=0: one safetensors file per checkpoint (no best.safetensors), so the second
        # save_file call is the second checkpoint's
        _train(tmp_path / "run", steps=4, extra=["checkpoint_every=2", "val_every=0"])
    message = str(info.value)
    assert "checkpoint of step 4 could not be written" in message
    assert "no space left on the device" in message
    assert "last good checkpoint (step 2) is kept" in message
    assert load_run(tmp_path / "run").step == 2


def test_disk_full_in_a_staged_directory_leaves_the_target(tmp_path):
    from curvalign._io import OutputError

    target = tmp_path / "store"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(OutputError, match=rf"no space left on the device; {target} is unchanged"):
        with staged_directory(target) as tmp:
            (tmp / "half.npy").write_text("half")
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "half.npy"))
    assert (target / "old.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    with pytest.raises(OutputError, match="read-only; nothing was written at"):
        with staged_directory(tmp_path / "new"):
            raise OSError(errno.EROFS, "Read-only file system")


# --- item 3: SIGTERM checkpoints like Ctrl-C -----------------------------------------------------


@pytest.mark.slow
def test_sigterm_checkpoints_exactly_and_the_run_resumes(tmp_path):
    # far more steps than can finish before the signal, even on a fast machine
    overrides = [*SMALL, "log_every=1", "checkpoint_every=0", "num_threads=1"]
    run_dir = tmp_path / "run"
    # checkpoint_every=0: only the stop request can write a checkpoint before the end
    process = subprocess.Popen(
        [sys.executable, "-m", "curvalign", "train", "--recipe", "clip", "--data", DATA]
        + ["--steps", "100000", "--out", str(run_dir), "-q", *overrides],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_log(run_dir, 3, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate()
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert _error_lines(stderr) == [], stderr  # a clean stop with a checkpoint (issue 25)
    errors = [line for line in stderr.splitlines() if line.startswith("stopped:")]
    assert len(errors) == 1 and "interrupted (SIGTERM)" in errors[0], stderr
    assert f"curvalign train --out {run_dir} --resume" in errors[0]
    stopped = read_meta(run_dir)["step"]
    assert stopped >= 3
    # the checkpoint is exact: the weights of an unbroken run stopped at the same step
    reference = train(
        "clip", DATA, tmp_path / "ref", steps=100000, overrides=overrides, show_progress=False,
        stop_at=stopped,
    )  # fmt: skip
    assert (run_dir / "model.safetensors").read_bytes() == (
        reference / "model.safetensors"
    ).read_bytes()
    code, text = _invoke("train", "--out", run_dir, "--resume", "--steps", stopped + 3, "-q")
    assert code == 0, text
    assert read_meta(run_dir)["step"] == stopped + 3


@pytest.mark.slow
def test_sigterm_to_a_multi_process_run_checkpoints(tmp_path):
    run_dir = tmp_path / "ddp"
    process = subprocess.Popen(
        [sys.executable, "-m", "curvalign", "train", "--recipe", "clip", "--data", DATA]
        + ["--steps", "100000", "--out", str(run_dir), "--nproc", "2", "-q"]
        + SMALL
        + ["log_every=1", "checkpoint_every=0"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_log(run_dir, 3, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate()
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "--resume" in stderr and "Traceback" not in stderr, stderr
    # item 13: DDP's warning about find_unused_parameters is not shown to the user
    assert "find_unused_parameters" not in stderr
    meta = read_meta(run_dir)
    assert meta["step"] >= 3 and load_run(run_dir, weights="last").step == meta["step"]


# --- item 4: checksums of the files a run writes -------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return _train(root / "run", steps=4)


def _copy_run(run: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(run, dest)
    return dest


def test_meta_records_a_checksum_of_every_file_of_the_checkpoint(trained):
    from curvalign._io import sha256_file

    sums = read_meta(trained)["sha256"]
    assert set(sums) == {
        "config.json",
        "config.yaml",
        "model.safetensors",
        "best.safetensors",
        "state.pt",
    }
    for name, digest in sums.items():
        assert sha256_file(trained / name) == digest


def _overwrite_tail(path: Path, pattern: bytes) -> None:
    """Finite garbage: overwrite bytes inside the tensor data (the header stays valid)."""
    data = bytearray(path.read_bytes())
    data[-600:-100] = (pattern * 500)[:500]
    path.write_bytes(bytes(data))


def test_garbage_in_the_weights_is_named_by_eval_and_embed(trained, tmp_path):
    run = _copy_run(trained, tmp_path / "run")
    # eval and embed load the best validation weights by default: damage those
    _overwrite_tail(run / "best.safetensors", b"\x01\x3f")  # finite floats
    for args in (["eval", run], ["embed", run, "--out", tmp_path / "emb", "-q"]):
        code, text = _invoke(*args)
        assert code == 2, text
        (line,) = _error_lines(text)
        assert f"{run / 'best.safetensors'} is damaged or was changed" in line
    _overwrite_tail(run / "model.safetensors", b"\xff")  # NaN bytes: still the file's fault
    with pytest.raises(CheckpointError, match="model.safetensors is damaged"):
        load_run(run, weights="last")


def test_a_damaged_state_is_named_on_resume(trained, tmp_path):
    run = _copy_run(trained, tmp_path / "run")
    _overwrite_tail(run / "state.pt", b"\x00\x01")
    code, text = _invoke("train", "--out", run, "--resume", "--steps", "6", "-q")
    assert code == 2, text
    (line,) = _error_lines(text)
    assert f"{run / 'state.pt'} is damaged or was changed" in line


def test_a_run_without_checksums_still_loads_with_a_note(trained, tmp_path):
    run = _copy_run(trained, tmp_path / "run")
    meta = json.loads((run / "meta.json").read_text())
    del meta["sha256"]
    (run / "meta.json").write_text(json.dumps(meta))
    code, text = _invoke("eval", run, "--data", DATA)
    assert code == 0, text
    assert "written without a checksum" in text and "not verified" in text


def test_a_checkpoint_interrupted_after_its_state_still_resumes(tmp_path, monkeypatch):
    """kill -9 between state.pt and meta.json: state.pt is newer than the checksums; resume
    takes it, says so, rewrites the checkpoint, and ends bit-equal to an unbroken run."""
    import curvalign.train.checkpoint as ckpt

    full = _train(tmp_path / "full", steps=6, extra=["checkpoint_every=3"])
    real = ckpt.atomic_write_text
    calls = {"meta": 0}

    def dies_before_second_meta(path, text):
        if Path(path).name == "meta.json":
            calls["meta"] += 1
            if calls["meta"] == 2:
                raise KeyboardInterrupt  # the process died here
        return real(path, text)

    monkeypatch.setattr(ckpt, "atomic_write_text", dies_before_second_meta)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "run", steps=6, extra=["checkpoint_every=3"])
    monkeypatch.setattr(ckpt, "atomic_write_text", real)
    run = tmp_path / "run"
    assert read_meta(run)["step"] == 3  # model.safetensors and state.pt are at step 6
    with pytest.raises(CheckpointError, match="holds step 6 but meta.json step 3.*--resume"):
        load_run(run)
    notes: list[str] = []
    train(None, None, run, resume=True, show_progress=False, notify=notes.append)
    assert any("newer than meta.json" in n for n in notes), notes
    assert load_run(run, weights="last").step == 6
    assert (run / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()


# --- item 5: an index tied to its weights ---------------------------------------------------------


@pytest.fixture(scope="module")
def rerank_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("stale")
    # no validation: the weights are the last step's, so a replacement run of the same length
    # has the same step whichever step would have validated best
    run = _train(root / "run", steps=3, recipe="atmg", extra=["val_every=0"])
    code, text = _invoke("embed", run, "--out", root / "emb", "-q")
    assert code == 0, text
    code, text = _invoke("index", "build", root / "emb", "--out", root / "idx")
    assert code == 0, text
    return root


def test_an_index_whose_run_was_replaced_by_the_same_recipe_is_refused(rerank_index):
    root = rerank_index
    code, text = _invoke("index", "search", root / "idx", "--query-text-ids", "0,1")
    assert code == 0, text
    # the same recipe, the same step, other weights (another seed): used silently before
    _train(root / "other", steps=3, recipe="atmg", extra=["seed=7", "val_every=0"])
    backup = root / "run.bak"
    os.replace(root / "run", backup)
    os.replace(root / "other", root / "run")
    try:
        code, text = _invoke("index", "search", root / "idx", "--query-text-ids", "0,1")
        assert code == 2, text
        (line,) = _error_lines(text)
        assert "has changed since" in line and "weights SHA-256" in line
        assert "step" not in line.split("(")[1].split(")")[0]  # the step did not change
    finally:
        os.replace(root / "run", root / "other")
        os.replace(backup, root / "run")


def test_an_index_whose_run_became_another_recipe_says_so(rerank_index, tmp_path):
    root = rerank_index
    _train(root / "clip", steps=3, recipe="clip")
    backup = root / "run.bak2"
    os.replace(root / "run", backup)
    os.replace(root / "clip", root / "run")
    try:
        code, text = _invoke("index", "search", root / "idx", "--query-text-ids", "0")
        assert code == 2, text
        (line,) = _error_lines(text)
        assert "recipe 'atmg' -> 'clip'" in line and "proxy" not in line
    finally:
        os.replace(root / "run", root / "clip")
        os.replace(backup, root / "run")


# --- item 7: index search needs a query ----------------------------------------------------------


def test_index_search_without_a_query_is_refused(rerank_index):
    root = rerank_index
    code, text = _invoke("index", "search", root / "idx")
    assert code == 2, text
    assert _error_lines(text) == [
        "error: give a query: one of --query-text-ids, --query-image-ids, --query-npy, "
        "--all-queries"
    ]
    code, text = _invoke("index", "search", root / "idx", "--all-queries", "--k", "1", "--json")
    assert code == 0, text
    texts = json.loads((root / "emb" / "embedding.json").read_text())["counts"]["texts"]
    assert len(json.loads(text)["results"]) == texts


# --- item 8: temporaries of a killed writer -------------------------------------------------------


def test_stale_temporaries_of_a_dead_writer_are_removed_live_ones_kept(tmp_path):
    from curvalign._io import remove_stale_temporaries

    target = tmp_path / "emb"
    dead = tmp_path / ".emb.tmp-dead"
    dead.mkdir()
    (dead / "images.point.npy").write_bytes(b"0" * 1000)
    process = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], text=True, capture_output=True
    )
    (dead / ".owner-pid").write_text(process.stdout.strip())  # that process has exited
    orphan = tmp_path / ".emb.tmp-nopid"  # written by a version without pid files
    orphan.mkdir()
    live = tmp_path / ".emb.tmp-live"
    live.mkdir()
    (live / ".owner-pid").write_text(str(os.getppid()))  # a running process
    other = tmp_path / ".other.tmp-x"
    other.mkdir()
    removed = remove_stale_temporaries(target)
    assert sorted(p.name for p in removed) == [".emb.tmp-dead", ".emb.tmp-nopid"]
    assert live.exists() and other.exists()


def test_a_killed_embed_leaves_nothing_and_the_next_run_cleans_up(trained, tmp_path):
    """SIGTERM while the embeddings are being written: the temporary directory goes with the
    process; one left by kill -9 is removed by the next embed of the same output."""
    out = tmp_path / "emb"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from curvalign._io import staged_directory, terminate_as_interrupt\n"
        "out = Path(sys.argv[1])\n"
        "with terminate_as_interrupt(), staged_directory(out) as tmp:\n"
        "    (tmp / 'images.point.npy').write_bytes(b'0' * 100000)\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(60)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(out)],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "writing"
    assert list(tmp_path.glob(".emb.tmp-*"))
    process.send_signal(signal.SIGTERM)
    process.communicate()
    assert process.returncode != 0
    assert not list(tmp_path.glob(".emb.tmp-*")) and not out.exists()

    process = subprocess.Popen(
        [sys.executable, "-c", script, str(out)],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "writing"
    process.kill()  # kill -9: nothing can clean up
    process.communicate()
    (left,) = tmp_path.glob(".emb.tmp-*")
    code, text = _invoke("embed", trained, "--out", out, "-q")
    assert code == 0, text
    assert not left.exists() and (out / "embedding.json").is_file()


# --- item 10: file modes follow the umask ---------------------------------------------------------


@pytest.mark.parametrize(
    "umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)]
)
def test_written_files_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    previous = os.umask(umask)
    try:
        run = _train(tmp_path / "run", steps=2)
        code, text = _invoke("embed", run, "--out", tmp_path / "emb", "-q")
        assert code == 0, text
    finally:
        os.umask(previous)
    for path in [*run.iterdir(), *(tmp_path / "emb").iterdir()]:
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == file_mode, path
    assert stat.S_IMODE((tmp_path / "emb").stat().st_mode) == dir_mode


# --- item 11: throughput ---------------------------------------------------------------------------


def test_throughput_watch_warns_once_on_a_collapse():
    from curvalign.train.trainer import _ThroughputWatch

    watch = _ThroughputWatch(reference_windows=3, collapse_ratio=0.2)
    assert [watch.observe(r, 2) for r in (5000, 9000, 8000)] == [None] * 3
    assert watch.observe(3000, 2) is None  # slower, not collapsed
    assert watch.observe(1000, 2) is None  # one slow window: a hiccup
    assert watch.observe(9000, 2) is None
    assert watch.observe(1000, 2) is None
    warning = watch.observe(900, 2)  # the second slow window in a row
    assert warning and "900 pairs/s from 9000" in warning and "num_threads=1" in warning
    assert watch.observe(10, 2) is None and watch.observe(10, 2) is None  # once


def test_a_training_that_slows_down_warns(tmp_path, monkeypatch):
    from curvalign.train.trainer import Trainer

    real = Trainer.train_step

    import curvalign.train.trainer as trainer_module

    # the trainer's clock is virtual: a step "takes" 10 ms, then 1 s from step 12 on, whatever
    # the machine's speed or load (a real sleep failed on a loaded machine, where the reference
    # steps were already slow)
    clock = {"now": 0.0}

    def slow_after_step_12(self, progress):
        clock["now"] += 1.0 if progress.step >= 12 else 0.01
        return real(self, progress)

    monkeypatch.setattr(Trainer, "train_step", slow_after_step_12)
    monkeypatch.setattr(trainer_module.time, "perf_counter", lambda: clock["now"])
    notes: list[str] = []
    train(
        "clip",
        DATA,
        tmp_path / "run",
        steps=16,
        overrides=SMALL + ["log_every=3"],
        show_progress=False,
        notify=notes.append,
    )
    assert sum("throughput fell" in n for n in notes) == 1, notes


# --- item 12: help and docs -----------------------------------------------------------------------


def test_help_shows_brackets_and_no_bool_metavars():
    for args in (["train"], ["benchmark"], ["index", "search"], ["embed"], ["eval"]):
        code, text = _invoke(*args, "--help")
        assert code == 0, text
        assert "<bool>" not in text, args
    _, text = _invoke("index", "search", "--help")
    assert "[n, d]" in text
    for command in ("train", "benchmark"):
        _, text = _invoke(command, "--help")
        assert "wordnet:SYNSET" in text, command


def test_readme_states_install_size_test_time_and_threads():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "num_threads" in readme
    assert "GB" in readme and "test suite" in readme.lower()
    assert "idle" in readme


# --- item 13: smaller ----------------------------------------------------------------------------


def test_an_empty_store_is_refused_when_saved(tmp_path):
    import torch

    from curvalign.data.features import FeatureStore, FeatureStoreError, TextPart

    store = FeatureStore(
        image_features=torch.zeros(0, 4),
        text=TextPart(torch.zeros(0, 3)),
        text_to_image=torch.zeros(0, dtype=torch.long),
    )
    with pytest.raises(FeatureStoreError, match="0 images and 0 captions"):
        store.save(tmp_path / "empty")
    assert not (tmp_path / "empty").exists()


def test_a_garbage_query_npy_is_named(tmp_path):
    from curvalign.index.queries import load_query_points

    garbage = tmp_path / "q.npy"
    garbage.write_bytes(os.urandom(300))
    with pytest.raises(ValueError, match=r"q.npy is not a .npy file of float query points"):
        load_query_points(garbage)
    ints = tmp_path / "ints.npy"
    np.save(ints, np.arange(6).reshape(2, 3))
    with pytest.raises(ValueError, match=r"dtype int64 .*expected a .npy file of float"):
        load_query_points(ints)
    objects = tmp_path / "obj.npy"
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="pickled Python objects") as info:
        load_query_points(objects)
    assert "pickled (object)" not in str(info.value)
    good = tmp_path / "good.npy"
    np.save(good, np.ones((2, 3), dtype=np.float32))
    assert load_query_points(good).shape == (2, 3)


def test_extract_checks_the_model_path_before_scanning_images(tmp_path, monkeypatch):
    import curvalign.data.extract as extract
    from curvalign.data.encoders import EncoderError

    def must_not_plan(*args, **kwargs):
        raise AssertionError("the image folder was scanned before the encoder path was checked")

    monkeypatch.setattr(extract, "_plan", must_not_plan)
    with pytest.raises(EncoderError, match="/nonexistent/model"):
        extract.extract_features(
            "hf-clip:/nonexistent/model", tmp_path, tmp_path / "out", captions=tmp_path / "c.json"
        )


@pytest.mark.slow  # a whole study end to end (shared with test_studies: conftest.short_study)
def test_a_short_study_says_it_is_too_short(short_study):
    # each study checks its own budget (studykit.decide): below its need every claim is
    # "too short to test the claim", whatever the numbers at that length say
    from curvalign_lab import kit as studykit

    root, result = short_study
    assert [c.outcome for c in result.claims] == [studykit.TOO_SHORT]
    assert studykit.TOO_SHORT in (root / "proclip-product" / "study.md").read_text()


def test_disk_full_in_a_benchmark_is_one_line(tmp_path, monkeypatch):
    import curvalign.report.benchmark as benchmark

    out = tmp_path / "bench"

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "results.md"))

    monkeypatch.setattr(benchmark, "run_benchmark", disk_full)
    code, text = _invoke("benchmark", "--recipes", "clip", "--out", out)
    assert code == 2, text
    assert _error_lines(text) == [
        f"error: writing {out / 'results.md'} failed: no space left on the device; what was "
        f"completely written before it is kept in {out} (every file is written whole or not at all)"
    ]


def test_disk_full_during_extract_says_the_shards_are_kept(tmp_path, monkeypatch):
    import curvalign.data.extract as extract

    out = tmp_path / "store"

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(out) + ".partial/s3.npy")

    monkeypatch.setattr(extract, "extract_features", disk_full)
    code, text = _invoke("extract", "--encoder", "minilm", "--images", tmp_path, "--out", out)
    assert code == 2, text
    (line,) = _error_lines(text)
    assert "no space left on the device" in line
    assert f"shards finished before are kept in {out}.partial" in line and "resume" in line


def _mount_tmpfs(tmp_path, options: str):
    """A real tmpfs with ``options`` (needs root and mount permission; skipped elsewhere)."""
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip("mount is not permitted here")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], capture_output=True)


@pytest.fixture
def tiny_filesystem(tmp_path):
    yield from _mount_tmpfs(tmp_path, "size=1m")


@pytest.fixture
def read_only_filesystem(tmp_path):
    yield from _mount_tmpfs(tmp_path, "ro,size=1m")


def test_a_read_only_out_is_refused_before_any_work(read_only_filesystem):
    out = read_only_filesystem / "run"
    code, text = _invoke("train", "--recipe", "clip", "--data", "features:/no", "--out", out)
    assert code == 2, text
    assert _error_lines(text) == [
        f"error: --out {out} is not writable: cannot create a file in {read_only_filesystem} "
        "(Read-only file system)"
    ]


def test_training_onto_a_full_disk_is_one_error_line(tiny_filesystem):
    # the command line's own entry in this process (the error path is the command's, not the
    # interpreter's); a small store: the checkpoint's size is the model's, at its default width
    out = tiny_filesystem / "run"
    code, text = _invoke(
        "train", "--recipe", "clip", "--data", DATA, "--steps", "30", "--out", out,
        "-q", "checkpoint_every=10", "batch_size=32",
    )  # fmt: skip
    assert code == 2, text
    (line,) = _error_lines(text)
    assert "the checkpoint of step 10 could not be written" in line
    assert "no space left on the device" in line and "Traceback" not in text
    assert not list(out.glob(".*.tmp"))  # no half-written temporary left behind


def test_resume_removes_temporaries_of_a_killed_checkpoint_write(trained, tmp_path):
    run = _copy_run(trained, tmp_path / "run")
    stale = [run / ".state.pt.k1l2d3.tmp", run / ".model.safetensors.x9y8.tmp"]
    for path in stale:
        path.write_bytes(b"\0" * 4096)  # what kill -9 during atomic_write leaves
    keep = run / ".notes-of-the-user"
    keep.write_text("mine")
    code, text = _invoke("train", "--out", run, "--resume", "--steps", "5", "-q")
    assert code == 0, text
    assert not any(path.exists() for path in stale) and keep.exists()


def test_queries_from_other_weights_and_garbage_npy_are_refused_by_a_lorentz_index(tmp_path):
    for name, seed in (("a", 0), ("b", 7)):
        run = _train(tmp_path / name, steps=3, recipe="meru", extra=[f"seed={seed}"])
        code, text = _invoke("embed", run, "--out", tmp_path / f"emb_{name}", "-q")
        assert code == 0, text
    code, text = _invoke("index", "build", tmp_path / "emb_a", "--out", tmp_path / "idx")
    assert code == 0, text
    search = ["index", "search", tmp_path / "idx", "--query-text-ids", "0"]
    code, text = _invoke(*search, "--queries", tmp_path / "emb_a")
    assert code == 0, text
    code, text = _invoke(*search, "--queries", tmp_path / "emb_b")
    assert code == 2, text
    (line,) = _error_lines(text)
    assert "embedded with other weights of 'meru'" in line
    garbage = tmp_path / "q.npy"
    garbage.write_bytes(b"\x93NUMPY" + os.urandom(200))
    code, text = _invoke("index", "search", tmp_path / "idx", "--query-npy", garbage)
    assert code == 2, text
    (line,) = _error_lines(text)
    assert f"--query-npy {garbage} is not a .npy file of float query points" in line
