"""Tower adapters: open_clip models, Hugging Face CLIP directories and sentence-transformers
directories, from local files.

Both reuse the frozen encoder adapters of ``curvalign.data.encoders`` to load the model (the
same offline loading, the same checks, the torchvision shim on CPU torch), then encode with
gradients. ``build_towers(config)`` picks the adapter from the encoder spec.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from curvalign._encoder_spec import EncoderError
from curvalign.towers.base import InputPreparer, TowerError, Towers, TowersConfig


class OpenClipTowers(Towers):
    """An open_clip model (``open_clip:ARCH:CHECKPOINT``): ``model.visual`` is the image side;
    the token embedding, text transformer, final norm and text projection the text side;
    ``logit_scale`` (and ``logit_bias``) belong to open_clip's own loss, which the recipes
    replace: no encoding uses them, so they never train (under DDP a trainable parameter
    without a gradient would silently desynchronise the ranks)."""

    default_lora_targets = (
        "c_fc",
        "c_proj",
    )  # nn.MultiheadAttention's fused in_proj is not a Linear

    def __init__(self, config: TowersConfig, device: str | torch.device = "cpu") -> None:
        super().__init__(config)
        from curvalign.data.encoders import OpenClipEncoder, _load_image

        kind, _, rest = config.encoder.partition(":")
        arch, _, checkpoint = rest.partition(":")
        try:
            encoder = OpenClipEncoder(arch, checkpoint, device=device)
        except EncoderError as err:
            raise TowerError(f"towers: {err}") from None
        self._load_image = _load_image
        self.arch = arch
        self.spec = encoder.spec
        self.model = encoder.model
        self.preprocess = encoder.preprocess
        self.tokenizer = encoder.tokenizer
        self.image_width = self.text_width = encoder.text_dim
        self._configure()

    def _enable_checkpointing(self) -> None:
        self.model.set_grad_checkpointing(True)  # open_clip: use_reentrant=False per block

    def _side_of(self, name: str) -> str | None:
        if name.startswith("visual."):
            return "image"
        if name.split(".")[0] in ("logit_scale", "logit_bias"):
            return None
        return "text"

    def _lora_modules(self, side: str) -> nn.Module:
        return self.model.visual if side == "image" else self.model.transformer

    def _side_module(self, side: str) -> nn.Module:
        if side == "image":
            return self.model.visual
        return _TextSide(self.model)

    def encode_images(self, items: Sequence[Any]) -> Tensor:
        prepared = self.input_preparer().images([self._load_image(im) for im in items])
        return self.encode_prepared_images(prepared)

    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        return self.encode_prepared_texts(self.input_preparer().texts(texts))

    def input_preparer(self) -> InputPreparer:
        return _OpenClipInputs(self.preprocess, self.tokenizer)

    def encode_prepared_images(self, prepared: Any) -> Tensor:
        return self.model.encode_image(prepared.to(self._device())).float()

    def encode_prepared_texts(self, prepared: Any) -> Tensor:
        return self.model.encode_text(prepared.to(self._device())).float()

    def _export_model(self, model: nn.Module, directory: Path) -> str:
        arch = self.arch
        if arch.endswith(".json"):  # a model config file travels with the weights
            target = directory / Path(arch).name
            shutil.copyfile(arch, target)
            arch = str(target.resolve())
        checkpoint = directory / "open_clip.pt"
        torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, checkpoint)
        return f"open_clip:{arch}:{checkpoint.resolve()}"


class _OpenClipInputs(InputPreparer):
    """open_clip's evaluation transform (resize, centre crop, normalise) and tokenizer, run in
    DataLoader workers: images -> float [N, 3, S, S], texts -> long [N, context_length]."""

    def __init__(self, preprocess: Any, tokenizer: Any) -> None:
        self.preprocess = preprocess
        self.tokenizer = tokenizer

    def images(self, images: Sequence[Any]) -> Tensor:
        return torch.stack([self.preprocess(im) for im in images])

    def texts(self, texts: Sequence[str]) -> Tensor:
        return self.tokenizer([str(t) for t in texts])


class _TextSide(nn.Module):
    """The text-side modules of an open_clip model, for switching their train/eval mode."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._parts = [m for n, m in model.named_children() if n != "visual"]

    def eval(self) -> _TextSide:  # type: ignore[override]
        for part in self._parts:
            part.eval()
        return self


class _HFClipInputs(InputPreparer):
    """A Hugging Face CLIP directory's image processor and tokenizer, run in DataLoader workers:
    images -> pixel_values float [N, 3, S, S]; texts -> {input_ids, attention_mask} long [N, L]
    (padded to the step's longest text)."""

    def __init__(self, image_processor: Any, tokenizer: Any) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer

    def images(self, images: Sequence[Any]) -> Tensor:
        return self.image_processor(images=list(images), return_tensors="pt")["pixel_values"]

    def texts(self, texts: Sequence[str]) -> dict[str, Tensor]:
        enc = self.tokenizer(
            [str(t) for t in texts], padding=True, truncation=True, return_tensors="pt"
        )
        return {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask")}


class HFClipTowers(Towers):
    """A Hugging Face CLIP-style directory (``hf-clip:DIR``): ``vision_model`` and
    ``visual_projection`` are the image side, ``text_model`` and ``text_projection`` the text
    side; ``logit_scale`` belongs to CLIP's own loss and never trains."""

    default_lora_targets = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")

    def __init__(self, config: TowersConfig, device: str | torch.device = "cpu") -> None:
        super().__init__(config)
        from curvalign.data.encoders import HFClipEncoder, _load_image

        try:
            encoder = HFClipEncoder(config.encoder.partition(":")[2], device=device)
        except EncoderError as err:
            raise TowerError(f"towers: {err}") from None
        self._load_image = _load_image
        self._embedding = encoder._embedding
        self.spec = encoder.spec
        self.model = encoder.model
        self.tokenizer = encoder.tokenizer
        self.image_processor = encoder.image_processor
        self.image_width = self.text_width = encoder.text_dim
        self._configure()

    def _enable_checkpointing(self) -> None:
        self.model.gradient_checkpointing_enable({"use_reentrant": False})

    def _side_of(self, name: str) -> str | None:
        head = name.split(".")[0]
        if head in ("vision_model", "visual_projection"):
            return "image"
        if head in ("text_model", "text_projection"):
            return "text"
        return None

    def _lora_modules(self, side: str) -> nn.Module:
        return self.model.vision_model if side == "image" else self.model.text_model

    def encode_images(self, items: Sequence[Any]) -> Tensor:
        prepared = self.input_preparer().images([self._load_image(im) for im in items])
        return self.encode_prepared_images(prepared)

    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        return self.encode_prepared_texts(self.input_preparer().texts(texts))

    def input_preparer(self) -> InputPreparer:
        return _HFClipInputs(self.image_processor, self.tokenizer)

    def encode_prepared_images(self, prepared: Any) -> Tensor:
        pixels = prepared.to(self._device())
        return self._embedding(self.model.get_image_features(pixel_values=pixels)).float()

    def encode_prepared_texts(self, prepared: Any) -> Tensor:
        device = self._device()
        inputs = {k: v.to(device) for k, v in prepared.items()}
        return self._embedding(self.model.get_text_features(**inputs)).float()

    def _export_model(self, model: nn.Module, directory: Path) -> str:
        target = directory / "hf-clip"
        model.save_pretrained(target)
        self.tokenizer.save_pretrained(target)
        self.image_processor.save_pretrained(target)
        return f"hf-clip:{target.resolve()}"


class SentenceTransformerTowers(Towers):
    """A sentence-transformers directory (``sentence-transformers:DIR`` or ``minilm``): texts
    only, so one backbone encodes both sides; images are the texts standing for them (a
    store's ``image_texts``, e.g. WordNet's lemma names)."""

    default_lora_targets = ("query", "key", "value")  # BERT/MiniLM attention projections
    shared_backbone = True

    def __init__(self, config: TowersConfig, device: str | torch.device = "cpu") -> None:
        super().__init__(config)
        from curvalign.data.encoders import load_encoder

        try:
            encoder = load_encoder(config.encoder, device=device)
        except EncoderError as err:
            raise TowerError(f"towers: {err}") from None
        if not hasattr(encoder.model, "tokenize") and not hasattr(encoder.model, "preprocess"):
            raise TowerError(f"towers: {config.encoder!r} is not a sentence-transformers model")
        self.spec = encoder.spec
        self.model = encoder.model
        self.image_width = self.text_width = encoder.text_dim
        self._configure()

    def _enable_checkpointing(self) -> None:
        self.model[0].auto_model.gradient_checkpointing_enable({"use_reentrant": False})

    def _side_of(self, name: str) -> str | None:
        return "text"

    def _lora_modules(self, side: str) -> nn.Module:
        return self.model

    def encode_images(self, items: Sequence[Any]) -> Tensor:
        return self.encode_texts([str(item) for item in items])

    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        # sentence-transformers 5 renamed tokenize() to preprocess()
        prepare = getattr(self.model, "preprocess", None) or self.model.tokenize
        features = prepare([str(t) for t in texts])
        device = self._device()
        features = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in features.items()}
        return self.model(features)["sentence_embedding"].float()

    def _export_model(self, model: nn.Module, directory: Path) -> str:
        target = directory / "sentence-transformers"
        model.save(str(target))
        return f"sentence-transformers:{target.resolve()}"


def build_towers(config: TowersConfig, device: str | torch.device = "cpu") -> Towers:
    """The towers of ``config`` (adapter chosen by the encoder spec's kind), on ``device``."""
    kind = config.encoder.partition(":")[0]
    if kind == "open_clip":
        towers: Towers = OpenClipTowers(config, device)
    elif kind == "hf-clip":
        towers = HFClipTowers(config, device)
    elif kind in ("sentence-transformers", "minilm"):
        towers = SentenceTransformerTowers(config, device)
    else:
        raise TowerError(
            f"towers: encoder {config.encoder!r} is not supported for training yet; expected "
            "open_clip:ARCH:CHECKPOINT, hf-clip:DIR, sentence-transformers:DIR or minilm"
        )
    return towers.to(device)


def describe(towers: Towers) -> dict[str, Any]:
    """JSON facts about ``towers`` for meta.json."""
    trainable = towers.trainable_named_parameters()
    return {
        **towers.config.to_dict(),
        "spec": towers.spec,
        "image_width": towers.image_width,
        "text_width": towers.text_width,
        "trainable_parameters": int(sum(p.numel() for _, p in trainable)),
        "trainable_tensors": len(trainable),
    }


__all__ = [
    "HFClipTowers",
    "OpenClipTowers",
    "SentenceTransformerTowers",
    "build_towers",
    "describe",
]
