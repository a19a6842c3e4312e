"""`curvalign eval RUN --suite DIR`: one run on a folder of stores (CLIP_benchmark webdataset
roots and a SugarCrepe folder extracted here), one long table in CLIP_benchmark's names;
and the named retrieval protocols."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from curvalign.cli import app
from curvalign.data.extract import extract_sugarcrepe, extract_webdataset
from curvalign.data.features import FeatureStore, TextPart
from curvalign.data.protocols import ProtocolError, RetrievalProtocol, protocol_store
from curvalign.eval import evaluate
from curvalign.report.suite import LONG_COLUMNS
from curvalign.runs import load_run
from test_extract import PixelEncoder
from test_sugarcrepe import make_sugarcrepe
from test_webdataset import make_classification, make_retrieval

TRAIN = ["batch_size=2", "tensorboard=false", "log_every=1", "checkpoint_every=0"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> dict:
    from curvalign.train.trainer import train

    tmp = tmp_path_factory.mktemp("suite")
    folder = tmp / "suite"
    make_classification(tmp / "wds_cifar3")
    make_retrieval(tmp / "wds_flickr_tiny")
    c = make_sugarcrepe(tmp / "sc")
    extract_webdataset(PixelEncoder(), tmp / "wds_cifar3", folder / "wds_cifar3", progress=False)
    extract_webdataset(
        PixelEncoder(), tmp / "wds_flickr_tiny", folder / "wds_flickr_tiny", progress=False
    )
    extract_sugarcrepe(
        PixelEncoder(), c["folder"], c["images"], folder / "sugar_crepe", progress=False
    )
    other = FeatureStore(  # another encoder's dimensions: a listed skip, not a crash
        image_features=torch.zeros(2, 3),
        text=TextPart(torch.zeros(2, 3)),
        text_to_image=torch.arange(2),
    )
    other.save(folder / "other_encoder")
    run = train(
        "meru",
        f"features:{folder / 'wds_cifar3'}",
        tmp / "run",
        steps=2,
        overrides=TRAIN,
        show_progress=False,
    )
    return {"folder": folder, "run": run, "tmp": tmp}


def test_suite_writes_the_long_table(suite) -> None:
    out = suite["tmp"] / "out"
    result = CliRunner().invoke(
        app, ["eval", str(suite["run"]), "--suite", str(suite["folder"]), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    with (out / "suite.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == LONG_COLUMNS
    by = {(r["dataset"], r["task"], r["metric"]): r for r in rows}
    # CLIP_benchmark's names: wds/NAME, its tasks and metric keys; SugarCrepe per kind
    assert ("wds/cifar3", "zeroshot_classification", "acc1") in by
    assert ("wds/flickr_tiny", "zeroshot_retrieval", "image_retrieval_recall@1") in by
    assert {"sugar_crepe/replace_obj", "sugar_crepe/swap_att", "sugar_crepe/add_att"} <= {
        r["dataset"] for r in rows if r["task"] == "image_caption_selection"
    }
    # a classification set reports classification only (its "captions" are class prompts)
    assert not any(r["dataset"] == "wds/cifar3" and r["task"] == "zeroshot_retrieval" for r in rows)
    # MERU's paper reports R@5/R@10: R@1 is in the CSV but not in the Markdown table
    assert (
        by[("wds/flickr_tiny", "zeroshot_retrieval", "image_retrieval_recall@1")]["reported"]
        == "False"
    )
    md = (out / "suite.md").read_text()
    assert "image_retrieval_recall@5" in md and "image_retrieval_recall@1 " not in md
    assert "other_encoder (meru)" in md and "3-wide but meru takes" in md
    assert "another text encoder than the run's" in md
    # the values are evaluate()'s, with the recipe's own score
    run = load_run(suite["run"])
    store = FeatureStore.load(suite["folder"] / "wds_flickr_tiny")
    direct = evaluate(run.recipe, store, diagnostics=False)
    value = float(by[("wds/flickr_tiny", "zeroshot_retrieval", "text_retrieval_recall@5")]["value"])
    assert value == pytest.approx(direct.retrieval["i2t@5"])
    sc = FeatureStore.load(suite["folder"] / "sugar_crepe")
    kinds = evaluate(run.recipe, sc, diagnostics=False).compositional
    assert float(
        by[("sugar_crepe/swap_att", "image_caption_selection", "acc")]["value"]
    ) == pytest.approx(kinds["swap_att"])
    # the wide CSV has clip_benchmark build's columns
    with (out / "suite_wide.csv").open() as handle:
        wide = list(csv.DictReader(handle))
    assert {"dataset", "model", "pretrained", "task", "language", "model_fullname", "acc1"} <= set(
        wide[0]
    )
    # CLIP_benchmark's mean_per_class_recall column, with evaluate()'s mean per-class recall
    assert "mean_per_class_recall" in wide[0]
    cifar = FeatureStore.load(suite["folder"] / "wds_cifar3")
    zeroshot = evaluate(run.recipe, cifar, diagnostics=False).zeroshot
    mpc = by[("wds/cifar3", "zeroshot_classification", "mean_per_class_recall")]
    assert float(mpc["value"]) == pytest.approx(zeroshot.mean_per_class)


def test_suite_json_and_errors(suite, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "eval",
            str(suite["run"]),
            "--suite",
            str(suite["folder"]),
            "--out",
            str(tmp_path),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["rows"] and payload["skipped"][0][0].startswith("other_encoder")
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = CliRunner().invoke(app, ["eval", str(suite["run"]), "--suite", str(empty)])
    assert bad.exit_code == 2 and "no feature store in it" in bad.output


def test_protocol_keeps_five_captions_and_checks_the_count() -> None:
    store = FeatureStore(
        image_features=torch.randn(4, 3),
        text=TextPart(torch.randn(9, 3)),
        text_to_image=torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 2]),
        image_split=torch.tensor([0, 0, 0, 1]),
        split_names=["test", "train"],
    )
    cut = protocol_store(store, RetrievalProtocol("t", "tiny", images=3, captions_per_image=2))
    assert cut.text_to_image.tolist() == [0, 0, 1, 1, 2, 2]
    torch.testing.assert_close(cut.text_features, store.text_features[[0, 1, 3, 4, 5, 6]])
    with pytest.raises(ProtocolError, match="evaluates 4 images; split 'test' of this store has 3"):
        protocol_store(store, RetrievalProtocol("t", "tiny", images=4, captions_per_image=2))
    with pytest.raises(
        ProtocolError,
        match=r"needs 3 captions per image; 1 image\(s\) of split .test. have fewer \(first: image 1 with 2\)",
    ):
        protocol_store(store, RetrievalProtocol("t", "tiny", images=3, captions_per_image=3))


def test_eval_protocol_option_refuses_a_store_of_another_size(suite) -> None:
    result = CliRunner().invoke(
        app,
        ["eval", str(suite["run"]), "--protocol", "coco-5k"],
    )
    assert result.exit_code == 2 and "COCO 5k val2017 evaluates 5000 images" in result.output


def test_benchmark_accepts_a_suite(suite, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "benchmark",
            "--recipes",
            "clip,proclip",
            "--data",
            f"features:{suite['folder'] / 'wds_cifar3'}",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "bench"),
            "--suite",
            str(suite["folder"]),
            "-q",
            *TRAIN,
        ],
    )
    assert result.exit_code == 0, result.output
    with (tmp_path / "bench" / "suite.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {r["model"] for r in rows} == {"clip", "proclip"}
    reported = {
        r["metric"]
        for r in rows
        if r["model"] == "proclip" and r["task"] == "zeroshot_retrieval" and r["reported"] == "True"
    }
    assert reported == {f"{m}_retrieval_recall@{k}" for m in ("image", "text") for k in (1, 10)}


@pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None,
    reason="optional extra not installed: pip install 'curvalign[open_clip]'",
)
def test_one_command_per_dataset_then_one_suite_with_a_real_encoder(tmp_path: Path) -> None:
    """A tiny random open_clip model saved to disk: webdataset roots and a SugarCrepe folder
    become stores with one `extract` each; a run trained on one of them evaluates on all."""
    from curvalign.data import encoders
    from test_encoders import TINY_OPEN_CLIP

    encoders._make_torchvision_importable()
    import open_clip

    config = tmp_path / "tiny-suite-test.json"
    config.write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(config)
    checkpoint = tmp_path / "tiny.pt"
    torch.manual_seed(0)
    torch.save(open_clip.create_model("tiny-suite-test").state_dict(), checkpoint)
    spec = f"open_clip:{config}:{checkpoint}"
    make_classification(tmp_path / "wds_cifar3", bad=True)
    make_retrieval(tmp_path / "wds_flickr_tiny")
    c = make_sugarcrepe(tmp_path / "sc")
    suite_dir = tmp_path / "suite"
    runner = CliRunner()
    for args in (
        ["--wds", str(tmp_path / "wds_cifar3"), "--out", str(suite_dir / "wds_cifar3")],
        ["--wds", str(tmp_path / "wds_flickr_tiny"), "--out", str(suite_dir / "wds_flickr_tiny")],
        [
            "--sugarcrepe",
            str(c["folder"]),
            "--images",
            str(c["images"]),
            "--out",
            str(suite_dir / "sugar_crepe"),
        ],
    ):
        result = runner.invoke(app, ["extract", "--encoder", spec, "-q", *args])
        assert result.exit_code == 0, result.output
        assert "items/s" in result.output
    assert (
        "skipped 3 unusable samples"
        in runner.invoke(
            app,
            [
                "extract",
                "--encoder",
                spec,
                "-q",
                "--wds",
                str(tmp_path / "wds_cifar3"),
                "--out",
                str(tmp_path / "again"),
            ],
        ).output
    )
    run = tmp_path / "run"
    trained = runner.invoke(
        app,
        [
            "train",
            "--recipe",
            "clip",
            "--data",
            f"features:{suite_dir / 'wds_cifar3'}",
            "--steps",
            "2",
            "--out",
            str(run),
            "--quiet",
            *TRAIN,
        ],
    )
    assert trained.exit_code == 0, trained.output
    result = runner.invoke(app, ["eval", str(run), "--suite", str(suite_dir)])
    assert result.exit_code == 0, result.output
    with (run / "suite" / "suite.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    datasets = {r["dataset"] for r in rows}
    assert {"wds/cifar3", "wds/flickr_tiny", "sugar_crepe/replace_obj"} <= datasets
    assert all(0.0 <= float(r["value"]) <= 1.0 for r in rows)


def test_suite_marks_stores_whose_encoders_saw_the_data(suite, tmp_path) -> None:
    """MTEB's zero-shot disclosure in the suite table: a store whose meta says its encoders saw
    its data (or classes) in training gets a dagger on every row and its one-line note."""
    import dataclasses

    from curvalign.report.suite import evaluate_on_suite, suite_markdown

    folder = tmp_path / "suite"
    store = FeatureStore.load(suite["folder"] / "wds_cifar3")
    seen = {"image": {"dataset_seen": True, "classes_seen": [], "classes_total": 0}, "any": True}
    trained = {"image": {"data": "CIFAR (pixels)", "datasets": ["cifar"]}}
    dataclasses.replace(
        store, meta={**store.meta, "trained_on": trained, "seen_in_training": seen}
    ).save(folder / "wds_cifar3")
    store.save(folder / "wds_cifar3_clean")  # the same store without a disclosure
    result = evaluate_on_suite(load_run(suite["run"]).recipe, folder, "meru", "run")
    marked = {r["dataset"]: r["seen_in_training"] for r in result.rows}
    assert marked == {"wds/cifar3": True, "wds/cifar3_clean": False}
    md = suite_markdown(result)
    assert "| wds/cifar3 † |" in md and "| wds/cifar3_clean |" in md
    assert "- wds/cifar3: † not zero-shot" in md and "CIFAR" in md
