"""What a fourth fault-injection pass found (issue 36): binary garbage as a config, NaN rows in
memory-mapped shards, a leak from train into test, two trainers in one folder, SIGTERM outside
the training loop, a refused pickle that forwarded torch's advice. Each check uses the real thing
it is about (a file of random bytes, a damaged shard, a second process, a signal)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from curvalign._io import sha256_file
from test_faults import DATA, SMALL, _cli, _error_lines, _invoke, _train


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


# --- fault 2 and 3: NaN or inf in memory-mapped shards --------------------------------------------


def _layout(root: Path):
    """A clip-retrieval layout of 700 pairs in shards of 300, 300 and 100 rows, and its store."""
    pytest.importorskip("pyarrow")
    from curvalign.data import load_data
    from test_clip_retrieval import write_layout

    write_layout(root, shard_rows=(300, 300, 100))
    return load_data(f"clip-retrieval:{root}")


def _damage(root: Path, rows, value) -> list[tuple[str, int]]:
    """Set global image rows ``rows`` to ``value`` in their shards; (shard file, local row)."""
    where = []
    for row in rows:
        k, local = divmod(int(row), 300)
        path = root / "img_emb" / f"img_emb_{[0, 1, 10][k]}.npy"
        array = np.load(path)
        array[local] = value
        np.save(path, array)
        where.append((str(path), local))
    return where


@pytest.mark.parametrize("fault", ["three-nan-rows", "one-inf", "all-nan-shard"])
def test_nan_in_a_shard_names_the_file_and_row_and_leaves_no_run(tmp_path, fault):
    root = tmp_path / "cr"
    store = _layout(root)
    val = store.split_image_ids("val").tolist()
    rows = {
        "three-nan-rows": [val[0], 310, 650],
        "one-inf": [val[1]],
        "all-nan-shard": list(range(300)),
    }[fault]
    where = _damage(root, rows, np.inf if fault == "one-inf" else np.nan)
    out = tmp_path / "run"
    code, text = _invoke(
        "train", "--recipe", "clip", "--data", f"clip-retrieval:{root}", "--steps", "2",
        "--out", out, "-q", "batch_size=32",
    )  # fmt: skip
    assert code == 2, text
    (line,) = _error_lines(text)
    assert any(f"{path}: row {local} " in line for path, local in where), line
    assert "NaN or inf" in line and "scores" not in line and "copied" not in line, line
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_the_sampler_names_the_shard_of_a_bad_train_row(tmp_path):
    from curvalign.data.sampling import BatchSampler
    from curvalign.data.sharded import ShardError

    root = tmp_path / "cr"
    store = _layout(root)
    train = store.split_image_ids("train").tolist()
    ((path, local),) = _damage(root, [train[-1]], np.nan)
    store = _layout_reopen(root)
    sampler = BatchSampler(store, 64)
    with pytest.raises(ShardError, match=rf"{path}: row {local} "):
        for _ in range(20):  # 20 batches of 64 pass every train image at least once
            sampler.next_batch()


def _layout_reopen(root: Path):
    from curvalign.data import load_data

    return load_data(f"clip-retrieval:{root}")


# --- fault 4: val and test rows copied from train ---------------------------------------------


def test_test_rows_copied_from_train_are_a_warning(tmp_path):
    from curvalign.data import load_data

    store = load_data(DATA)
    train, test = store.split_image_ids("train"), store.split_image_ids("test")
    store.image_features[test[:8]] = store.image_features[train[:8]]  # 8 of 32: a leak
    store.save(tmp_path / "leaky")
    code, text = _invoke(
        "train", "--recipe", "clip", "--data", f"features:{tmp_path / 'leaky'}", "--steps", "2",
        "--out", tmp_path / "run", "-q", *SMALL,
    )  # fmt: skip
    assert code == 0, text
    (line,) = [x for x in text.splitlines() if "identical to train images" in x]
    assert line.startswith("warning:") and "8 of the 32 'test' images" in line, line


def test_a_store_without_copies_gets_no_leak_warning():
    from curvalign.data import load_data
    from curvalign.data.validation_split import copies_of_train, describe_copies

    copies = copies_of_train(load_data(DATA), "d")
    assert copies["test"] == copies["val"] == 0 and copies["train_checked"] == copies["train"]
    assert describe_copies(copies, "d") is None


# --- fault 5: two trainers into one --out -----------------------------------------------------


def test_a_second_train_into_a_locked_out_is_one_line(tmp_path):
    from curvalign.train.trainer import LOCK_FILE, _run_lock

    out = tmp_path / "run"
    with _run_lock(out) as held:  # this process plays the first trainer
        assert held and (out / LOCK_FILE).read_text().strip() == str(os.getpid())
        result = _cli(
            "train", "--recipe", "clip", "--data", DATA, "--steps", "2", "--out", out, "-q",
            *SMALL, "seed=5",
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = _error_lines(result.stderr)
    assert f"{out} is in use by another curvalign train (pid {os.getpid()})" in line, line
    assert sorted(p.name for p in out.iterdir()) == [], "the second trainer wrote nothing"


def test_a_lock_left_by_a_dead_process_is_taken_over_and_released(tmp_path):
    import subprocess
    import sys

    from curvalign.train.trainer import LOCK_FILE

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text(dead.stdout)  # what kill -9 leaves
    run = _train(out, steps=2)
    assert (run / "meta.json").exists() and not (run / LOCK_FILE).exists()


# --- fault 6: SIGTERM is Ctrl-C everywhere a long command runs ------------------------------------


def test_sigterm_in_the_lr_range_phase_of_a_tuned_benchmark_is_a_stopped_line(tmp_path):
    import signal
    import subprocess
    import sys

    from test_faults import _env

    out = tmp_path / "bench"
    process = subprocess.Popen(
        [sys.executable, "-m", "curvalign", "benchmark", "--recipes", "clip", "--data", DATA,
         "--tune", "2", "--lr-range-steps", "1000000", "--steps", "2", "--seeds", "1",
         "--out", str(out), "-q", *SMALL],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    for line in process.stderr:  # the tuning starts with its lr range test (a million steps)
        if line.startswith("tuning clip"):
            break
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate()
    assert process.returncode == 128 + signal.SIGTERM, stderr
    (line,) = [x for x in stderr.splitlines() if x.startswith("stopped:")]
    assert line.startswith("stopped: interrupted (SIGTERM); run the same command again"), line
    assert "Traceback" not in stderr and not _error_lines(stderr), stderr


def test_a_stop_asked_during_the_last_step_stops_the_caller_too(tmp_path):
    """A study or benchmark trains run after run: a SIGTERM that arrives while a run ends (its
    last step, a validation, a hook's stop) must stop the caller, not be dropped with the run."""
    import signal

    import typer

    from curvalign.cli import stoppable
    from curvalign.train.hooks import TrainerHook
    from curvalign.train.trainer import train

    class SignalAtTheEnd(TrainerHook):
        def on_step_end(self, trainer, step, record):
            if step == 2:
                signal.raise_signal(signal.SIGTERM)

    started = []
    with pytest.raises(typer.Exit) as stopped, stoppable("again"):
        for seed in range(2):  # the second run must never start
            started.append(seed)
            train("clip", DATA, tmp_path / f"run-{seed}", steps=2, show_progress=False,
                  overrides=[*SMALL, f"seed={seed}"], hooks=[SignalAtTheEnd()])  # fmt: skip
    assert stopped.value.exit_code == 128 + signal.SIGTERM and started == [0]
    assert (tmp_path / "run-0" / "meta.json").exists()


# --- the smaller findings ---------------------------------------------------------------------


def test_a_config_of_another_recipe_names_the_conflict(tmp_path):
    code, text = _invoke("train", "--recipe", "meru", "--data", DATA, "--print-config")
    assert code == 0, text
    (tmp_path / "meru.yaml").write_text(text)
    code, text = _invoke(
        "train", "--recipe", "clip", "--data", DATA, "--config", tmp_path / "meru.yaml",
        "--print-config",
    )  # fmt: skip
    assert code == 2, text
    (line,) = _error_lines(text)
    assert "is a config of recipe 'meru' but --recipe 'clip' was given" in line, line
    assert "unknown key" not in line


def test_a_garbage_parquet_is_named(tmp_path):
    root = tmp_path / "cr"
    _layout(root)
    bad = root / "metadata" / "metadata_0.parquet"
    bad.write_bytes(np.random.default_rng(0).bytes(3000))
    code, text = _invoke(
        "train", "--recipe", "clip", "--data", f"clip-retrieval:{root}", "--steps", "2",
        "--out", tmp_path / "run", "-q", "batch_size=32",
    )  # fmt: skip
    assert code == 2, text
    (line,) = _error_lines(text)
    assert f"{bad}: not a readable parquet file" in line, line


@pytest.mark.parametrize("lr", ["inf", "nan", "0", "-1e-3"])
def test_a_learning_rate_that_is_not_finite_and_positive_is_refused_at_once(lr):
    code, text = _invoke("train", "--recipe", "clip", "--data", DATA, "--print-config", f"lr={lr}")
    assert code == 2, text
    (line,) = _error_lines(text)
    assert "lr must be" in line and ("finite" in line or "> 0" in line), line


def test_index_build_onto_an_index_needs_overwrite(tmp_path, monkeypatch):
    from curvalign.index import embed

    built = []
    monkeypatch.setattr(embed, "load_embeddings", lambda path: None)
    monkeypatch.setattr(
        embed, "build_from_embeddings", lambda emb, out, **kw: built.append(out) or out
    )
    out = tmp_path / "idx"
    out.mkdir()
    (out / "index.json").write_text("{}")  # an index built before
    code, text = _invoke("index", "build", tmp_path / "emb", "--out", out)
    assert code == 2 and built == [], text
    (line,) = _error_lines(text)
    assert f"--out {out} already holds an index; pass --overwrite" in line, line


def test_a_store_without_rows_says_so(tmp_path):
    from curvalign.data.features import FeatureStore, TextPart
    from curvalign.errors import ConfigError
    from curvalign.train.trainer import train

    empty = FeatureStore(
        image_features=torch.zeros(0, 4),
        text=TextPart(torch.zeros(0, 3)),
        text_to_image=torch.zeros(0, dtype=torch.long),
        image_split=torch.zeros(0, dtype=torch.long),
        split_names=["train", "val", "test"],
    )
    with pytest.raises(ConfigError, match="holds 0 images and 0 captions: nothing to train"):
        train("clip", empty, tmp_path / "run", steps=2, show_progress=False)
    assert not (tmp_path / "run").exists()


class _StubSearcher:
    """What the service asks of a Searcher, without an encoder: searches must not be reached."""

    def __init__(self, images_root: Path) -> None:
        self.images_root = str(images_root)
        self.searched: list[str] = []

    def info(self) -> dict:
        return {"recipe": "stub"}

    def search_texts(self, texts, k):
        self.searched += texts
        raise AssertionError("a refused query must not be encoded")


@pytest.fixture
def stub_client(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from curvalign.index.serve import make_app

    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(b"png")
    searcher = _StubSearcher(tmp_path / "images")
    return TestClient(make_app(searcher), raise_server_exceptions=False), searcher


def test_a_nul_byte_in_an_image_path_is_a_client_error(stub_client):
    client, _ = stub_client
    assert client.get("/images/a.png").status_code == 200
    reply = client.get("/images/a%00.png")
    assert reply.status_code == 400 and "NUL" in reply.text, reply.text


def test_a_huge_text_query_is_refused_before_it_is_encoded(stub_client):
    from curvalign.index.serve import MAX_QUERY_CHARS

    client, searcher = stub_client
    reply = client.post("/search", json={"text": "dog " * 1_200_000, "k": 3})  # 4.8 MB
    assert reply.status_code == 413 and f"at most {MAX_QUERY_CHARS} characters" in reply.text
    assert searcher.searched == []
