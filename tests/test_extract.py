"""curvalign extract on real image files: sharding, resume after an interruption, corrupt images.

Most tests use a small deterministic stand-in encoder (pixel statistics and character counts),
so they exercise the extraction pipeline itself; one test runs the real command line with a
tiny local open_clip checkpoint and trains on the result.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from curvalign.data.encoders import Encoder
from curvalign.data.extract import SKIPPED_REPORT, ExtractError, extract_features
from curvalign.data.features import TENSOR_FIELDS, FeatureStore


class PixelEncoder(Encoder):
    """Deterministic stand-in: an image is its 4x4 grey thumbnail, a text its letter counts."""

    def __init__(self, fail_after: int | None = None):
        self.spec = "test:pixels"
        self.image_dim, self.text_dim = 16, 26
        self.device = torch.device("cpu")
        self.calls = 0
        self.fail_after = fail_after

    def _tick(self) -> None:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise KeyboardInterrupt("simulated interruption")

    def encode_images(self, images):
        self._tick()
        rows = [
            np.asarray(im.convert("L").resize((4, 4)), dtype=np.float32).reshape(-1) / 255
            for im in images
        ]
        return torch.from_numpy(np.stack(rows))

    def encode_texts(self, texts):
        self._tick()
        return torch.tensor(
            [[t.lower().count(chr(97 + k)) for k in range(26)] for t in texts], dtype=torch.float32
        )


def make_collection(root: Path) -> dict[str, Path]:
    """6 real images (PNG and JPEG) in two class folders, one truncated JPEG, one missing file."""
    images = root / "images"
    rng = np.random.default_rng(0)
    files = []
    for i in range(6):
        folder = "cat" if i % 2 else "dog"
        (images / folder).mkdir(parents=True, exist_ok=True)
        name = f"{folder}/img{i}.{'png' if i % 3 else 'jpg'}"
        Image.fromarray((rng.random((20 + i, 24, 3)) * 255).astype("uint8")).save(images / name)
        files.append(name)
    good = (images / files[0]).read_bytes()
    (images / "dog/truncated.jpg").write_bytes(good[: len(good) // 3])
    files.insert(3, "dog/truncated.jpg")
    files.append("cat/missing.png")
    annotations = [
        {"image_id": i, "caption": f"caption {k} about picture {f}"}
        for i, f in enumerate(files)
        for k in range(2)
    ]
    captions = root / "captions.json"
    captions.write_text(
        json.dumps(
            {
                "images": [{"id": i, "file_name": f} for i, f in enumerate(files)],
                "annotations": annotations,
            }
        )
    )
    boxes = root / "boxes.jsonl"
    boxes.write_text(
        "\n".join(
            json.dumps({"image": f, "box": [1, 2, 12, 14], "phrase": f"thing in {f}"})
            for f in files
        )
        + "\n"
    )
    (root / "classes.json").write_text(json.dumps(["a cat", "a dog"]))
    (root / "templates.json").write_text(json.dumps(["a photo of {c}.", "{c}"]))
    (root / "is_a.txt").write_text("animal cat\nanimal dog\n")
    return {
        "images": images,
        "captions": captions,
        "boxes": boxes,
        "files": files,
        "classes": root / "classes.json",
        "templates": root / "templates.json",
        "taxonomy": root / "is_a.txt",
    }


def run(c: dict, out: Path, encoder: Encoder, **kw):
    return extract_features(
        encoder,
        c["images"],
        out,
        captions=c["captions"],
        boxes=c["boxes"],
        classes=c["classes"],
        templates=c["templates"],
        taxonomy=c["taxonomy"],
        batch_size=2,
        shard_size=3,
        progress=False,
        **kw,
    )


def test_extract_skips_corrupt_images_consistently(tmp_path: Path) -> None:
    c = make_collection(tmp_path)
    summary = run(c, tmp_path / "store", PixelEncoder())
    store = FeatureStore.load(tmp_path / "store")
    kept = [f for f in c["files"] if f not in ("dog/truncated.jpg", "cat/missing.png")]
    assert store.num_images == 6 and summary.images == 6
    assert [f for f, _ in summary.skipped_images] == ["dog/truncated.jpg", "cat/missing.png"]
    assert summary.dropped_captions == 4 and store.num_texts == 12
    assert summary.dropped_boxes == 2 and store.box_to_image.shape == (6,)
    report = (tmp_path / "store" / SKIPPED_REPORT).read_text()
    assert "dog/truncated.jpg\t" in report and "cat/missing.png\t" in report
    assert store.meta["extract"]["skipped_images"] == 2 and store.meta["encoder"] == "test:pixels"

    # Every kept row still belongs to the right image: features match a direct encoding.
    enc = PixelEncoder()
    for i, f in enumerate(kept):
        with Image.open(c["images"] / f) as im:
            torch.testing.assert_close(store.image_features[i], enc.encode_images([im])[0])
        own = (store.text_to_image == i).nonzero().flatten()
        assert len(own) == 2
        torch.testing.assert_close(
            store.text_features[own[0]], enc.encode_texts([f"caption 0 about picture {f}"])[0]
        )
        torch.testing.assert_close(
            store.box_text_features[i], enc.encode_texts([f"thing in {f}"])[0]
        )
    # Classes from the sub-folders, prompts = every template for every class, taxonomy over classes.
    assert store.class_names == ["a cat", "a dog"]
    assert store.image_labels.tolist() == [0 if f.startswith("cat/") else 1 for f in kept]
    assert store.prompt_to_class.tolist() == [0, 0, 1, 1]
    torch.testing.assert_close(store.prompt_features[0], enc.encode_texts(["a photo of a cat."])[0])
    assert store.taxonomy_names == ["animal", "cat", "dog"] and store.taxonomy_parents.tolist() == [
        -1,
        0,
        0,
    ]
    assert store.class_to_node.tolist() == [1, 2]
    assert not (tmp_path / "store.partial").exists()


def test_resume_after_interruption_reuses_shards_and_matches(tmp_path: Path) -> None:
    c = make_collection(tmp_path)
    clean = run(c, tmp_path / "clean", PixelEncoder())
    with pytest.raises(KeyboardInterrupt):
        run(c, tmp_path / "resumed", PixelEncoder(fail_after=5))
    manifest = json.loads((tmp_path / "resumed.partial" / "manifest.json").read_text())
    finished = len(manifest["done"])
    assert finished >= 2 and not (tmp_path / "resumed").exists()

    again = PixelEncoder()
    summary = run(c, tmp_path / "resumed", again)
    total = clean.shards_computed
    assert summary.shards_reused == finished and summary.shards_computed == total - finished
    a, b = FeatureStore.load(tmp_path / "clean"), FeatureStore.load(tmp_path / "resumed")
    for name in TENSOR_FIELDS:
        x, y = a.field(name), b.field(name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name
    assert a.meta == b.meta
    assert (tmp_path / "clean" / SKIPPED_REPORT).read_text() == (
        tmp_path / "resumed" / SKIPPED_REPORT
    ).read_text()


def test_partial_dir_of_other_inputs_is_refused(tmp_path: Path) -> None:
    c = make_collection(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        run(c, tmp_path / "s", PixelEncoder(fail_after=2))
    c["captions"].write_text(c["captions"].read_text().replace("caption 0", "caption zero"))
    with pytest.raises(ExtractError, match="different extraction"):
        run(c, tmp_path / "s", PixelEncoder())


def test_existing_output_and_bad_inputs(tmp_path: Path) -> None:
    c = make_collection(tmp_path)
    run(c, tmp_path / "s", PixelEncoder())
    with pytest.raises(ExtractError, match="already exists"):
        run(c, tmp_path / "s", PixelEncoder())
    run(c, tmp_path / "s", PixelEncoder(), overwrite=True)
    with pytest.raises(ExtractError, match="needs --classes"):
        extract_features(
            PixelEncoder(),
            c["images"],
            tmp_path / "t",
            captions=c["captions"],
            taxonomy=c["taxonomy"],
        )
    with pytest.raises(ExtractError, match="nothing to extract"):
        extract_features(PixelEncoder(), c["images"], tmp_path / "t")
    bad_boxes = tmp_path / "b.jsonl"
    bad_boxes.write_text(
        json.dumps({"image": "elsewhere.jpg", "box": [0, 0, 1, 1], "phrase": "x"}) + "\n"
    )
    with pytest.raises(ExtractError, match="'elsewhere.jpg' is not among the captioned images"):
        extract_features(
            PixelEncoder(), c["images"], tmp_path / "t", captions=c["captions"], boxes=bad_boxes
        )
    text_only = PixelEncoder()
    text_only.image_dim = None
    with pytest.raises(ExtractError, match="encodes texts only"):
        extract_features(text_only, c["images"], tmp_path / "t", captions=c["captions"])


def test_class_folder_without_captions(tmp_path: Path) -> None:
    c = make_collection(tmp_path)
    summary = extract_features(
        PixelEncoder(),
        c["images"],
        tmp_path / "zs",
        classes=c["classes"],
        templates=c["templates"],
        progress=False,
    )
    store = FeatureStore.load(tmp_path / "zs")
    assert summary.skipped_images[0][0] == "dog/truncated.jpg"  # missing.png is not in the folder
    assert (
        store.num_images == store.num_texts == 6
        and store.meta["captions_from_class_prompts"] is True
    )
    enc = PixelEncoder()
    for i in range(store.num_texts):
        name = store.class_names[int(store.image_labels[i])]
        torch.testing.assert_close(
            store.text_features[i], enc.encode_texts([f"a photo of {name}."])[0]
        )


@pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None,
    reason="optional extra not installed: pip install 'curvalign[open_clip]'",
)
def test_cli_extract_with_open_clip_then_train(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from curvalign.cli import app
    from curvalign.data import encoders

    encoders._make_torchvision_importable()
    import open_clip

    config = tmp_path / "tiny-extract-test.json"
    config.write_text(
        json.dumps(
            {
                "embed_dim": 8,
                "vision_cfg": {
                    "image_size": 32,
                    "layers": 1,
                    "width": 16,
                    "head_width": 8,
                    "patch_size": 16,
                },
                "text_cfg": {
                    "context_length": 12,
                    "vocab_size": 49408,
                    "width": 16,
                    "heads": 2,
                    "layers": 1,
                },
            }
        )
    )
    open_clip.add_model_config(config)
    checkpoint = tmp_path / "tiny.pt"
    torch.save(open_clip.create_model("tiny-extract-test").state_dict(), checkpoint)
    c = make_collection(tmp_path)
    store = tmp_path / "store"
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "extract",
            "--encoder",
            f"open_clip:{config}:{checkpoint}",
            "--images",
            str(c["images"]),
            "--captions",
            str(c["captions"]),
            "--boxes",
            str(c["boxes"]),
            "--out",
            str(store),
            "--batch-size",
            "4",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert (
        "6 images, 12 captions" in result.output and "skipped 2 unreadable images" in result.output
    )
    loaded = FeatureStore.load(store)
    assert loaded.image_dim == loaded.text_dim == 8 and loaded.has_boxes

    missing = runner.invoke(
        app,
        [
            "extract",
            "--encoder",
            f"open_clip:ViT-B-32:{tmp_path / 'nope.pt'}",
            "--images",
            str(c["images"]),
            "--captions",
            str(c["captions"]),
            "--out",
            str(tmp_path / "x"),
        ],
    )
    assert missing.exit_code == 2 and "never downloads" in missing.output

    trained = runner.invoke(
        app,
        [
            "train",
            "--recipe",
            "clip",
            "--data",
            f"features:{store}",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "run"),
            "--quiet",
            "batch_size=4",
        ],
    )
    assert trained.exit_code == 0, trained.output
