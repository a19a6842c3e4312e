"""What a new user and a second fault-injection pass found (issue 25): a resume that would
overwrite trained weights, a full disk under `embed`, a busy port under `serve`, damaged
embeddings and indexes, pickles and planted libraries, refused recipes in a benchmark, silent
skips, and README commands. Each check uses the real thing it is about (a subprocess, a full
tmpfs, a bound socket, a planted file)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from curvalign._io import sha256_file
from test_faults import _cli, _error_lines, _invoke, _mount_tmpfs, _train


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
    code, text = _invoke("train", "--out", run, "--resume", "--steps", "8", "-q")
    assert code == 2, text
    (line,) = _error_lines(text)
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
    # in this process: were the pickle unpickled, its os.system would leave the marker here too
    code, text = _invoke("train", "--out", run, "--resume", "--steps", "8", "-q")
    assert code == 2, text
    (line,) = _error_lines(text)
    assert str(run / "state.pt") in line, line
    assert not marker.exists()


# --- item 5: the kernel cache loads only what it built -------------------------------------------

_PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w"); if (f) fclose(f);
}
"""

_LOAD = """
import sys, warnings
from curvalign.geometry import _fused_l1 as m
if sys.argv[1] == "target":
    print(m.KERNEL.target())
else:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = m.KERNEL.load()
    print("loaded" if lib is not None else "refused", *[str(w.message) for w in caught])
"""


def _kernel(cache: Path, what: str) -> str:
    """``what="load"``: the kernel loaded from ``cache`` by a fresh process (a library once
    loaded stays in its process: never in the test's)."""
    result = _run_python(_LOAD, what, env={"TORCH_EXTENSIONS_DIR": str(cache)})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _run_python(code: str, *args: str, env: dict[str, str]):
    import subprocess
    import sys

    from test_faults import _env

    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**_env(), **env},
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("how", ["unrecorded", "open-directory"])
def test_a_planted_kernel_library_is_never_loaded(tmp_path, how, monkeypatch):
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler to build the planted library")
    import subprocess

    from curvalign.geometry import _fused_l1

    cache = tmp_path / "cache"
    marker = tmp_path / "planted-ran"
    with monkeypatch.context() as env:  # the name the loading process computes (same env)
        env.setenv("TORCH_EXTENSIONS_DIR", str(cache))
        target = _fused_l1.KERNEL.target()
    target.parent.mkdir(parents=True)
    source = tmp_path / "plant.c"
    source.write_text(_PLANT.replace("MARKER", json.dumps(str(marker))))
    built = subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(target), str(source)], capture_output=True
    )
    assert built.returncode == 0, built.stderr
    if how == "open-directory":  # a shared cache: the planter also wrote a matching record
        target.with_name(target.name + ".sha256").write_text(sha256_file(target) + "\n")
        target.parent.chmod(0o777)
    outcome = _kernel(cache, "load")
    assert not marker.exists(), outcome
    if how == "open-directory":
        assert outcome.startswith("refused") and "writable by others" in outcome, outcome
    else:  # rebuilt from the source in place of the planted file
        assert outcome.startswith("loaded"), outcome
        assert sha256_file(target) == target.with_name(target.name + ".sha256").read_text().strip()


# --- item 2: a full disk under embed -------------------------------------------------------------


@pytest.fixture
def tiny_filesystem(tmp_path):
    yield from _mount_tmpfs(tmp_path, "size=1m")


def test_embed_onto_a_full_disk_is_one_line_and_leaves_no_temporary(tmp_path, tiny_filesystem):
    from curvalign.train.trainer import train

    run = train("clip", "synthetic", tmp_path / "run", steps=1, show_progress=False)  # ~6 MiB
    out = tiny_filesystem / "emb"
    result = _cli("embed", run, "--out", out, "-q")
    assert result.returncode == 2, result.stderr  # not -7 (SIGBUS from a memory map)
    (line,) = _error_lines(result.stderr)
    assert "no space left on the device" in line and "MiB free" in line, line
    assert f"nothing was written at {out}" in line and "Traceback" not in result.stderr
    assert list(tiny_filesystem.iterdir()) == []  # the .emb.tmp-* directory is gone


# --- item 4: damaged embeddings and indexes are named --------------------------------------------


@pytest.fixture(scope="module")
def meru_embedded(tmp_path_factory):
    root = tmp_path_factory.mktemp("issue25-meru")
    run = _train(root / "run", steps=3, recipe="meru")
    code, text = _invoke("embed", run, "--out", root / "emb", "-q")
    assert code == 0, text
    code, text = _invoke("index", "build", root / "emb", "--out", root / "idx")
    assert code == 0, text
    return root


@pytest.mark.parametrize("recorded", [True, False])
def test_a_truncated_embedding_file_is_named_in_one_line(meru_embedded, tmp_path, recorded):
    emb = shutil.copytree(meru_embedded / "emb", tmp_path / "emb")
    damaged = emb / "images.point.npy"
    with open(damaged, "r+b") as handle:
        handle.truncate(damaged.stat().st_size // 2)
    if not recorded:  # embeddings written before checksums: the read itself is checked
        meta = json.loads((emb / "embedding.json").read_text())
        del meta["sha256"]
        (emb / "embedding.json").write_text(json.dumps(meta))
    code, text = _invoke("index", "build", emb, "--out", tmp_path / "idx")
    assert code == 2, text
    (line,) = _error_lines(text)
    assert str(damaged) in line and "curvalign embed" in line, line
    assert ("SHA-256" in line) == recorded and "Traceback" not in text


def test_a_damaged_index_file_is_named_before_it_is_read(meru_embedded, tmp_path):
    idx = shutil.copytree(meru_embedded / "idx", tmp_path / "idx")
    with open(idx / "index.faiss", "ab") as handle:
        handle.write(b"\0\0")
    code, text = _invoke("index", "search", idx, "--query-text-ids", "0")
    assert code == 2, text
    (line,) = _error_lines(text)
    assert str(idx / "index.faiss") in line and "SHA-256" in line, line


# --- item 3: serve on a busy port ----------------------------------------------------------------


def test_serve_on_a_busy_port_fails_first_without_serving(tmp_path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # neither run nor index exists: the port must be refused before either is looked at
        result = _cli(
            "serve", tmp_path / "no-run", "--index", tmp_path / "no-index", "--port", port
        )
    assert result.returncode == 2, result.stderr
    assert "serving" not in result.stdout
    assert result.stderr.strip().splitlines() == [
        f"error: cannot serve on 127.0.0.1:{port}: the port is already in use (choose another "
        "--port or stop what listens there)"
    ]


# --- item 6: a benchmark over recipes some of which cannot run -----------------------------------


def test_a_refused_benchmark_says_which_recipes_to_type(tmp_path):
    from _train_toy import toy_store
    from curvalign.errors import ConfigError
    from curvalign.report.benchmark import run_benchmark

    store = toy_store(num_images=40, test_images=10)  # no boxes, no text pairs
    asked = ["clip", "hycoclip", "meru", "dualpath"]
    with pytest.raises(ConfigError) as info:
        run_benchmark(asked, store, tmp_path / "b", steps=2, show_progress=False)
    message = str(info.value)
    assert message.endswith("to benchmark the 2 that can run, pass --recipes clip,meru"), message
    typed = message.rsplit("--recipes ", 1)[1].split(",")
    result = run_benchmark(
        typed, store, tmp_path / "b", steps=2, seeds=1, show_progress=False, plots=False
    )  # what the message says to type does run
    assert set(result.run_dirs) == {"clip", "meru"}


# --- item 7: silent skips, units, a best step of 0 -----------------------------------------------


@pytest.fixture(scope="module")
def toy_suite(tmp_path_factory):
    from _train_toy import toy_store
    from curvalign.train.trainer import train

    tmp_path = tmp_path_factory.mktemp("issue25-suite")
    suite = tmp_path / "suite"
    toy_store(num_images=40, test_images=10).save(suite / "toy")
    (suite / "empty").mkdir()
    (suite / "notes").mkdir()
    (suite / "notes" / "README.txt").write_text("not a store")
    run = train(
        "clip", f"features:{suite / 'toy'}", tmp_path / "run", steps=2,
        overrides=["batch_size=8", "val_every=0"], show_progress=False,
    )  # fmt: skip
    return suite, run


def test_suite_names_the_sub_folders_it_skipped_and_labels_units(toy_suite, tmp_path):
    suite, run = toy_suite
    code, text = _invoke("eval", run, "--suite", suite, "--out", tmp_path / "out")
    assert code == 0, text
    assert "- empty (clip): not a feature store (it is empty;" in text, text
    assert "- notes (clip): not a feature store (it holds no meta.json;" in text, text
    assert "| value | unit |" in text and "| % |" in text


def test_suite_tables_onto_a_full_disk_are_one_line(toy_suite, tiny_filesystem):
    suite, run = toy_suite
    with open(tiny_filesystem / "filler", "wb") as handle:  # fill it to the last block
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError:
            pass
    code, text = _invoke("eval", run, "--suite", suite, "--out", tiny_filesystem / "out")
    assert code == 2, text
    (line,) = _error_lines(text)
    assert "no space left on the device" in line and "Traceback" not in text, line


def test_tree_distances_are_labelled_as_tree_edges_not_percent():
    from curvalign.report.suite import SuiteResult, suite_markdown

    row = dict(dataset="d", model="m", task="hierarchical_classification", protocol="")
    rows = [
        {**row, "metric": "TIE", "value": 2.5, "reported": True},
        {**row, "metric": "J", "value": 0.25, "reported": True},
    ]
    table = suite_markdown(SuiteResult(rows=rows))
    assert "| TIE | 2.500 | tree edges |" in table and "| J | 25.0 | % |" in table, table
    assert "value (%)" not in table


def test_a_best_validation_step_of_0_is_a_warning_with_the_split_size(tmp_path):
    # the situation WordNet's small trees met (a validation split too small to rank): here a tiny
    # synthetic world whose head does not move (lr 1e-12), validated at steps 0 and 2 only
    from test_faults import DATA, SMALL

    code, text = _invoke(
        "train", "--recipe", "clip", "--data", DATA, "--steps", "2", "--out", tmp_path / "run",
        "-q", *SMALL, "val_every=2", "lr=1e-12", "head_init=paper",
    )  # fmt: skip
    assert code == 0, text
    (line,) = [x for x in text.splitlines() if x.startswith("warning:")]
    assert "the best validation step is 0" in line and "16 images and 60 captions" in line, line
    # a warm-started head's step 0 is the data's linear alignment: a note that says so
    code, text = _invoke(
        "train", "--recipe", "clip", "--data", DATA, "--steps", "2", "--out", tmp_path / "align",
        *SMALL, "val_every=2", "lr=1e-12",
    )  # fmt: skip
    assert code == 0 and not [x for x in text.splitlines() if x.startswith("warning:")], text
    assert "holds the start, the data's linear alignment" in text, text


# --- item 9: the four plots ----------------------------------------------------------------------

_NAMES = [f"{r}{tag}" for r in ("clip", "meru", "hycoclip", "atmg", "phyclip", "proclip", "agr",
          "dualpath") for tag in ("", " (step 0)")] + ["chance"]  # fmt: skip


def _seventeen_rows():
    rng = np.random.default_rng(0)
    return {
        name: {
            "retrieval": {f"{d}@{k}": rng.uniform(0, 0.5) for d in ("t2i", "i2t") for k in (1, 5, 10)},
            "hierarchy": {"TIE": rng.uniform(2, 8), "LCA": rng.uniform(1, 4), "J": 0.3,
                          "PH": 0.4, "RH": 0.4},
            "zeroshot": {"top1": 0.2},
        }
        for name in _NAMES
    }  # fmt: skip


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions save (kept open), with their PNG files."""
    from curvalign.report import plots

    figures = []
    real = plots.save_figure  # the real PNG (conftest draws the others only)

    def keep(fig, path, layout=True):
        out = real(fig, path, layout)
        figures.append(fig)
        return out

    monkeypatch.setattr(plots, "_save", keep)
    monkeypatch.setattr(plots.plt, "close", lambda fig=None: None)
    return plots, figures


def test_seventeen_retrieval_rows_get_seventeen_colours(drawn, tmp_path):
    plots, figures = drawn
    plots.retrieval_bars(_seventeen_rows(), tmp_path / "retrieval.png")
    (ax,) = figures[0].axes
    colours = {container.get_label(): container.patches[0].get_facecolor()
               for container in ax.containers if hasattr(container, "patches")}  # fmt: skip
    assert len(colours) == 17 and len(set(colours.values())) == 17


def _overlaps(labels) -> int:
    boxes = [t.get_window_extent() for t in labels if t.get_text()]
    return sum(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def test_hierarchy_labels_do_not_overlap(drawn, tmp_path):
    plots, figures = drawn
    plots.hierarchy_bars(_seventeen_rows(), tmp_path / "hierarchy.png")
    fig = figures[0]
    fig.canvas.draw()
    for ax in fig.axes:
        assert _overlaps(ax.get_xticklabels()) == 0 and _overlaps(ax.get_yticklabels()) == 0
    named = [ax for ax in fig.axes if any(t.get_text() == "chance" for t in ax.get_yticklabels())]
    assert named, "the row names are shown"


def test_spectra_axis_ends_where_the_spectrum_does(drawn, tmp_path):
    plots, figures = drawn
    decaying = np.concatenate([np.logspace(0, -3, 12), np.full(500, 1e-15)])
    plots.spectra({"meru": {"image": decaying, "text": decaying}}, tmp_path / "spectra.png")
    for ax in figures[0].axes:
        low, high = ax.get_xlim()
        assert high <= 13, (low, high)  # 12 eigenvalues above the floor, not 512


def test_the_image_histogram_is_not_hidden_under_the_text_one(drawn, tmp_path):
    plots, figures = drawn
    rng = np.random.default_rng(0)
    distances = {"meru": {"image": rng.normal(3, 0.2, 300), "text": rng.normal(3, 0.5, 3000)}}
    plots.distance_histograms(distances, tmp_path / "distances.png")
    ax = figures[0].axes[0]
    text_fill = max(p.get_zorder() for p in ax.patches if p.get_fill())
    image_outline = [p for p in ax.patches if not p.get_fill() and p.get_label() == "image"]
    assert image_outline and image_outline[0].get_zorder() > text_fill


# --- item 9: output off a terminal, a clean stop, an unknown recipe ------------------------------


def test_a_benchmark_table_off_a_terminal_has_every_column(tmp_path, monkeypatch):
    from test_faults import DATA, SMALL

    # as `curvalign demo > log`: the command's output is no terminal (the runner's stream) and
    # no COLUMNS says a width; the table's console is made when the table is printed
    monkeypatch.delenv("COLUMNS", raising=False)
    code, text = _invoke(
        "benchmark", "--recipes", "clip,meru", "--data", DATA, "--steps", "2", "--seeds", "1",
        "--out", tmp_path / "b", "-q", "--columns", "all", *SMALL,
    )  # fmt: skip
    assert code == 0, text
    assert "not shown (terminal too narrow)" not in text, text
    header = next(line for line in text.splitlines() if "T2I R@1" in line)
    for column in ("ZS top1", "TIE", "HardNeg", "Order img", "conv"):
        assert column in header, header


_REFUSE = """
import sys
from curvalign.cli import main
sys.argv = ["curvalign", *sys.argv[1:]]
try:
    main()
except SystemExit as exit:
    print("exit", exit.code, "torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--recipe", "nosuch", "--data", "synthetic", "--out", "x"],
        ["benchmark", "--recipes", "clip,nosuch", "--data", "synthetic", "--out", "x"],
    ],
)
def test_an_unknown_recipe_is_refused_before_torch_is_imported(tmp_path, args):
    result = _run_python(_REFUSE, *args, env={})
    assert result.stdout.strip() == "exit 2 torch imported: False", result.stdout + result.stderr
    assert result.stderr.startswith("error: unknown recipe 'nosuch'; known recipes: agr,")


def test_text_only_search_hits_show_the_matched_text(tmp_path):
    from curvalign.data.extract import extract_texts
    from curvalign.data.features import FeatureStore
    from curvalign.index.searcher import _StoreItems
    from test_extract_texts import WordEncoder

    pairs = tmp_path / "pairs.jsonl"
    rows = [("a dog runs", "a puppy running", 0.9), ("a red car", "a bowl of soup", 0.05)]
    pairs.write_text("\n".join(json.dumps({"a": a, "b": b, "score": s}) for a, b, s in rows))
    extract_texts(WordEncoder(), tmp_path / "s", pairs=pairs, progress=False)
    store = FeatureStore.load(tmp_path / "s")
    assert [_StoreItems(store, "text")(i, i).caption for i in (0, 1)] == [
        "a puppy running",
        "a bowl of soup",
    ]
    assert _StoreItems(store, "image")(1, 1).caption == "a red car"


# --- item 8: what a user's own `import open_clip` needs beside a CPU torch -----------------------


def test_a_users_own_open_clip_import_works_after_the_documented_call(tmp_path):
    if importlib.util.find_spec("open_clip") is None:
        pytest.skip("open_clip not installed (pip install -e '.[encoders]')")
    plain = _run_python("import open_clip", env={})
    if plain.returncode == 0:
        pytest.skip("torchvision imports cleanly here (a build that matches torch)")
    assert "torchvision::nms" in plain.stderr  # what docs/real-data.md says a plain import does
    documented = (
        "from curvalign.data.encoders import make_torchvision_importable\n"
        "make_torchvision_importable()\n"
        "import open_clip\n"
        "print(open_clip.__name__)\n"
    )
    result = _run_python(documented, env={})
    assert result.returncode == 0 and result.stdout.strip() == "open_clip", result.stderr[-2000:]


def test_a_damaged_embedding_json_is_named(meru_embedded, tmp_path):
    emb = shutil.copytree(meru_embedded / "emb", tmp_path / "emb")
    (emb / "embedding.json").write_text('{"format_version": 1, "files": ')  # cut short
    code, text = _invoke("index", "build", emb, "--out", tmp_path / "idx")
    assert code == 2, text
    (line,) = _error_lines(text)
    assert str(emb / "embedding.json") in line and "not valid JSON" in line, line
