"""Dropout in towers that train (``TowersConfig.dropout``, docs/training.md "Dropout").

The rule: a tower's dropout (BERT's hidden and attention dropout, drop-path, EfficientNet's
drop-connect) is off while it trains unless ``dropout=true``. The towers are then a
deterministic function of their weights, so rows split over W processes give the gradient of
the whole batch in one process. Checked on a tiny BERT that *has* dropout (0.1 hidden and
attention, BertConfig's defaults), so these tests fail where dropout stays on.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from curvalign.towers import TowersConfig, build_towers, switch_off_dropout

needs_st = pytest.mark.skipif(
    importlib.util.find_spec("sentence_transformers") is None
    or importlib.util.find_spec("peft") is None,
    reason="optional extras not installed: pip install 'curvalign[sentence,towers]'",
)

from test_towers import (  # noqa: E402, F401  (fixture: a tiny BERT with dropout 0.1)
    SENTENCE_WORDS,
    TRAIN,
    tiny_sentence_transformer,
)

TEXTS = [f"a {a} {b} animal" for a in SENTENCE_WORDS[:4] for b in SENTENCE_WORDS[4:6]]  # 8


def test_switch_off_dropout_reaches_every_kind_of_dropout_site() -> None:
    class Attention(nn.Module):  # HF CLIP's attention keeps its probability as a float
        def __init__(self) -> None:
            super().__init__()
            self.dropout = 0.1
            self.proj = nn.Linear(4, 4)

    class PatchDropout(nn.Module):  # open_clip's (by name): drops patches in train mode
        def __init__(self) -> None:
            super().__init__()
            self.prob = 0.5

    model = nn.Sequential(
        nn.Dropout(0.1),
        nn.MultiheadAttention(4, 2, dropout=0.2),
        Attention(),
        PatchDropout(),
        nn.Sequential(nn.Dropout2d(0.3), nn.Dropout(0.0)),
    )
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert switch_off_dropout(model) == 5  # the 0.0 one was already off
    assert model[0].p == model[4][0].p == 0.0
    assert model[1].dropout == model[2].dropout == model[3].prob == 0.0
    assert isinstance(model[2].proj, nn.Linear)  # a submodule is never touched
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert switch_off_dropout(model) == 0


def _lora_towers(spec: str, **kw):
    torch.manual_seed(0)
    towers = build_towers(TowersConfig(spec, image="lora", text="lora", lora_rank=2, **kw))
    with torch.no_grad():  # trained adapters (B = 0 would hide their gradient path)
        for name, param in towers.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return towers.train()


def _gradients(towers, parts: list[list[str]], weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradients of sum(rows * weight) with the texts encoded in ``parts`` (one call per
    part, as W processes encode their rows), summed as the processes' averaged gradients are."""
    for _, param in towers.trainable_named_parameters():
        param.grad = None
    start = 0
    for index, part in enumerate(parts):
        torch.manual_seed(100 + index)  # each process draws from its own state
        rows = towers.encode_texts(part)
        (rows * weight[start : start + len(part)]).sum().backward()
        start += len(part)
    return {n: p.grad.clone() for n, p in towers.trainable_named_parameters()}


@needs_st
def test_towers_train_without_dropout_so_a_split_batch_gives_the_whole_batchs_gradient(
    tiny_sentence_transformer,  # noqa: F811
) -> None:
    spec = tiny_sentence_transformer
    towers = _lora_towers(spec)
    assert towers.training and any(
        isinstance(m, nn.Dropout) for m in towers.model.modules()
    )  # the model has dropout sites
    torch.manual_seed(1)
    first = towers.encode_texts(TEXTS).detach()
    torch.manual_seed(2)
    second = towers.encode_texts(TEXTS).detach()
    assert torch.equal(first, second)  # train mode, two seeds: one function of the weights
    weight = torch.randn(len(TEXTS), towers.text_width, generator=torch.Generator().manual_seed(0))
    whole = _gradients(towers, [TEXTS], weight)
    halves = _gradients(towers, [TEXTS[:4], TEXTS[4:]], weight)
    assert whole and any(float(g.abs().sum()) > 0 for g in whole.values())
    for name, grad in whole.items():
        torch.testing.assert_close(halves[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # the frozen encoder's features at step 0 (B = 0), in train mode too
    frozen = build_towers(TowersConfig(spec, image="lora", text="lora", lora_rank=2)).train()
    reference = build_towers(TowersConfig(spec, image="locked", text="locked"))
    with torch.no_grad():
        torch.testing.assert_close(frozen.encode_texts(TEXTS), reference.encode_texts(TEXTS))


@needs_st
def test_dropout_true_keeps_the_encoders_dropout_with_masks_drawn_per_rank(
    tiny_sentence_transformer,  # noqa: F811
) -> None:
    from curvalign.train.towers import dropout_seed

    config = TowersConfig.parse(f"{tiny_sentence_transformer};image=lora;text=lora;dropout=true")
    assert config.dropout and not TowersConfig.parse(f"{config.encoder};text=lora").dropout
    towers = _lora_towers(tiny_sentence_transformer, dropout=True)
    with torch.no_grad():
        torch.manual_seed(1)
        first = towers.encode_texts(TEXTS)
        torch.manual_seed(2)
        assert not torch.allclose(first, towers.encode_texts(TEXTS))
        towers.eval()  # validation: no dropout either way
        assert torch.equal(towers.encode_texts(TEXTS), towers.encode_texts(TEXTS))
    seeds = {dropout_seed(0, rank, step) for rank in range(4) for step in range(50)}
    assert len(seeds) == 200  # every (rank, step) its own masks


def _text_store(spec: str):
    """Texts standing for images (as a WordNet store), features from the frozen encoder."""
    from curvalign.data import encoders
    from curvalign.data.features import FeatureStore, TextPart

    frozen = encoders.load_encoder(spec)
    names = [f"{a} {b}" for a in SENTENCE_WORDS for b in SENTENCE_WORDS[:3]]  # 30 "images"
    glosses = [f"a {n} animal" for n in names]
    with torch.no_grad():
        return FeatureStore(
            image_features=frozen.encode_texts(names),
            text=TextPart(frozen.encode_texts(glosses)),
            text_to_image=torch.arange(len(names)),
            image_texts=names,
            texts=glosses,
            meta={"encoder": frozen.spec},
        )


@needs_st
def test_an_encoder_that_stays_random_with_dropout_off_gets_a_note(
    tiny_sentence_transformer,  # noqa: F811
    tmp_path,
    monkeypatch,
) -> None:
    """A random module ``switch_off_dropout`` does not reach (here: all of them, the switch
    disabled) is found by the probe at the start of the run."""
    from curvalign.towers import base
    from curvalign.train import train

    monkeypatch.setattr(base, "switch_off_dropout", lambda model: 0)
    notes: list[str] = []
    towers = TowersConfig(tiny_sentence_transformer, image="lora", text="lora", lora_rank=2)
    store = _text_store(tiny_sentence_transformer)
    train("clip", store, tmp_path / "run", steps=1, towers=towers, overrides=TRAIN,
          show_progress=False, notify=notes.append)  # fmt: skip
    assert any("several processes will not equal one" in n for n in notes), notes
