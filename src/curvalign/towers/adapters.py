"""Tower adapters: open_clip models, Hugging Face CLIP directories and sentence-transformers
directories, from local files.

Both reuse the frozen encoder adapters of ``curvalign.data.encoders`` to load the model (the
same offline loading, the same checks, the torchvision shim on CPU torch), then encode with
gradients. ``build_towers(config)`` picks the adapter from the encoder spec.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from curvalign._encoder_spec import EncoderError
from curvalign.towers.base import InputPreparer, TowerError, Towers, TowersConfig


def _method(model: nn.Module, name: str) -> Callable[..., object]:
    """Method ``name`` of a third-party model (``save_pretrained`` of a transformers model,
    ``save`` of a SentenceTransformer): ``nn.Module``'s typing knows only submodules and
    tensors as attributes."""
    method = getattr(model, name, None)
    if not callable(method):
        raise TowerError(f"towers: {type(model).__name__} has no {name}() to export with")
    return method


def _text_width(width: int | None, spec: str) -> int:
    """An encoder's text width; TowerError for an encoder without a text side."""
    if width is None:
        raise TowerError(f"towers: {spec!r} has no text side (its encoder embeds images only)")
    return width


class OpenClipTowers(Towers):
    """An open_clip model (``open_clip:ARCH:CHECKPOINT``): ``model.visual`` is the image side;
    the token embedding, text transformer, final norm and text projection the text side;
    ``logit_scale`` (and ``logit_bias``) belong to open_clip's own loss, which the recipes
    replace: no encoding uses them, so they never train (under DDP a trainable parameter
    without a gradient would silently desynchronise the ranks)."""

    #: the open_clip model (a third-party module without type information: its
    #: methods and submodules are read as Any)
    model: Any

    default_lora_targets = (
        "c_fc",
        "c_proj",
    )  # nn.MultiheadAttention's fused in_proj is not a Linear

    def __init__(self, config: TowersConfig, device: str | torch.device = "cpu") -> None:
        super().__init__(config)
        from curvalign.data.encoders import OpenClipEncoder, load_image

        kind, _, rest = config.encoder.partition(":")
        arch, _, checkpoint = rest.partition(":")
        self._load_image = load_image
        self.arch = arch
        if config.init == "random":
            self._build_random(arch, checkpoint, device)
        else:
            try:
                encoder = OpenClipEncoder(arch, checkpoint, device=device)
            except EncoderError as err:
                raise TowerError(f"towers: {err}") from None
            self.spec = encoder.spec
            self.model = encoder.model
            self.preprocess = encoder.preprocess
            self.tokenizer = encoder.tokenizer
            self.image_width = self.text_width = _text_width(encoder.text_dim, encoder.spec)
        self._configure()

    def _build_random(self, arch: str, checkpoint: str, device: str | torch.device) -> None:
        """``open_clip.create_model(ARCH)`` without pretrained weights (towers from scratch):
        the architecture's own initialisation, drawn from torch's seeded generator."""
        from curvalign.data.encoders import import_optional

        if checkpoint:
            raise TowerError(
                f"towers {self.config.encoder!r}: init=random reads no weights; drop the "
                "checkpoint (open_clip:ARCH) or drop init=random"
            )
        try:
            open_clip = import_optional("open_clip", "open_clip")
        except EncoderError as err:
            raise TowerError(f"towers: {err}") from None
        name = arch
        if arch.endswith(".json"):
            if not Path(arch).is_file():
                raise TowerError(f"towers: open_clip model config {arch} does not exist")
            open_clip.add_model_config(arch)
            name = Path(arch).stem
        elif arch not in open_clip.list_models():
            raise TowerError(
                f"towers: open_clip has no architecture {arch!r}; pass one of "
                "open_clip.list_models() or a model-config .json file"
            )
        model, _, preprocess = open_clip.create_model_and_transforms(
            name, pretrained=None, device=torch.device(device)
        )
        self.model = model
        self.preprocess = preprocess
        self.tokenizer = open_clip.get_tokenizer(name)
        arch_spec = str(Path(arch).resolve()) if arch.endswith(".json") else arch
        self.spec = f"open_clip:{arch_spec}"  # no checkpoint: random weights
        with torch.no_grad():
            width = self.model.encode_text(self.tokenizer(["a"]).to(torch.device(device)))
        self.image_width = self.text_width = int(width.shape[-1])

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

    def eval(self) -> _TextSide:
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

    #: the transformers CLIP model (a third-party module without type information: its
    #: methods and submodules are read as Any)
    model: Any

    default_lora_targets = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")

    def __init__(self, config: TowersConfig, device: str | torch.device = "cpu") -> None:
        super().__init__(config)
        from curvalign.data.encoders import HFClipEncoder, load_image

        self._load_image = load_image
        self._embedding = HFClipEncoder._embedding
        directory = config.encoder.partition(":")[2]
        if config.init == "random":
            self._build_random(directory, device)
        else:
            try:
                encoder = HFClipEncoder(directory, device=device)
            except EncoderError as err:
                raise TowerError(f"towers: {err}") from None
            self.spec = encoder.spec
            self.model = encoder.model
            self.tokenizer = encoder.tokenizer
            self.image_processor = encoder.image_processor
            self.image_width = self.text_width = _text_width(encoder.text_dim, encoder.spec)
        self._configure()

    def _build_random(self, directory: str, device: str | torch.device) -> None:
        """The model of the directory's ``config.json`` with random weights (towers from
        scratch; no weight file is read), its tokenizer and image processor."""
        from curvalign.data.encoders import import_optional

        root = Path(directory)
        if not (root / "config.json").is_file():
            raise TowerError(f"towers: {directory} has no config.json to build a model from")
        try:
            transformers = import_optional("transformers", "hf")
            model_config = transformers.AutoConfig.from_pretrained(root, local_files_only=True)
            self.model = transformers.AutoModel.from_config(model_config).to(device)
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(root, local_files_only=True)
            self.image_processor = transformers.AutoImageProcessor.from_pretrained(
                root, local_files_only=True
            )
        except (EncoderError, OSError, ValueError) as err:
            raise TowerError(f"towers: {directory}: cannot build it offline ({err})") from None
        self.spec = f"hf-clip:{root.resolve()}"
        with torch.no_grad():
            width = self.encode_texts(["a"])
        self.image_width = self.text_width = int(width.shape[-1])

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

    @property
    def text_token_width(self) -> int:  # type: ignore[override]
        return int(self.model.config.text_config.hidden_size)

    def encode_text_tokens(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        enc = self.tokenizer(
            [str(t) for t in texts], padding=True, truncation=True, return_tensors="pt"
        )
        device = self._device()
        inputs = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        hidden = self.model.text_model(**inputs).last_hidden_state.float()
        return hidden, inputs["attention_mask"].bool()

    def _export_model(self, model: nn.Module, directory: Path) -> str:
        target = directory / "hf-clip"
        _method(model, "save_pretrained")(target)
        self.tokenizer.save_pretrained(target)
        self.image_processor.save_pretrained(target)
        return f"hf-clip:{target.resolve()}"


class SentenceTransformerTowers(Towers):
    """A sentence-transformers directory (``sentence-transformers:DIR`` or ``minilm``): texts
    only, so one backbone encodes both sides; images are the texts standing for them (a
    store's ``image_texts``, e.g. WordNet's lemma names)."""

    #: the SentenceTransformer (a third-party module without type information: its
    #: methods and submodules are read as Any)
    model: Any

    default_lora_targets = ("query", "key", "value")  # BERT/MiniLM attention projections
    shared_backbone = True

    def __init__(self, config: TowersConfig, device: str | torch.device = "cpu") -> None:
        super().__init__(config)
        from curvalign.data.encoders import (
            MeanPooledTextEncoder,
            SentenceTransformerEncoder,
            load_encoder,
            shipped_minilm_path,
        )

        if config.init == "random":
            raise TowerError(
                f"towers {config.encoder!r}: init=random builds open_clip:ARCH and hf-clip:DIR "
                "towers; a sentence-transformers directory loads its weights (drop init=random)"
            )
        try:
            encoder = load_encoder(config.encoder, device=device)
            if isinstance(encoder, MeanPooledTextEncoder):
                # extract's lean path (transformers alone, the same features); training wraps
                # the sentence-transformers model, its modules and tokenizer
                encoder = SentenceTransformerEncoder(
                    shipped_minilm_path(), device=device, spec=encoder.spec
                )
        except EncoderError as err:
            raise TowerError(f"towers: {err}") from None
        model = getattr(encoder, "model", None)
        if not hasattr(model, "tokenize") and not hasattr(model, "preprocess"):
            raise TowerError(f"towers: {config.encoder!r} is not a sentence-transformers model")
        self.spec = encoder.spec
        self.model = model
        self.image_width = self.text_width = _text_width(encoder.text_dim, encoder.spec)
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

    @property
    def text_token_width(self) -> int:  # type: ignore[override]
        return int(self.model[0].auto_model.config.hidden_size)

    def encode_text_tokens(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        prepare = getattr(self.model, "preprocess", None) or self.model.tokenize
        features = prepare([str(t) for t in texts])
        device = self._device()
        features = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in features.items()}
        mask = features["attention_mask"].bool()
        # padding positions zeroed, as the frozen encoder pads its per-text token rows
        tokens = self.model[0](features)["token_embeddings"].float() * mask[..., None]
        return tokens, mask

    def _export_model(self, model: nn.Module, directory: Path) -> str:
        target = directory / "sentence-transformers"
        _method(model, "save")(str(target))
        return f"sentence-transformers:{target.resolve()}"


class EfficientNetTowers(Towers):
    """The image side alone: an EfficientNet-Lite ImageNet classifier (``efficientnet-liteN``
    or ``efficientnet-liteN:WEIGHTS``) from the offline weights ``curvalign extract`` uses, with
    the same preprocessing (TF's evaluation crop, ``(x - 127) / 128``; see
    ``data.encoders.ImageClassifierEncoder``) and the same features (global average pooling of
    the last feature map, 1280-d for Lite0). It has no text side: it trains as the image half
    of a pair (``efficientnet-lite0+minilm``, :class:`PairedTowers`).

    Modes:

    * ``locked`` and ``full`` as for every tower (``full``: every convolution and norm scale);
    * ``lora``: adapters on the **pointwise (1x1) convolutions** of every MBConv block and the
      head (``_expand_conv``, ``_project_conv``, ``_conv_head``): a 1x1 convolution is a linear
      map applied at every pixel, so a rank-r update ``B A`` is exactly LoRA on a linear layer.
      The depthwise convolutions (one input channel per group) and the 3x3 stem get none: a
      depthwise kernel has no channel mixing for a low-rank factor to compress. Blocks are
      chosen by name (peft matches suffixes): ``lora_targets=_blocks.15._project_conv,
      _conv_head`` adapts only the last block and the head, the convnet's "last k blocks".

    BatchNorm statistics stay frozen (eval mode) in every mode: they are buffers, not
    parameters, so they would be neither checkpointed nor averaged across ranks, and the small
    batches of contrastive steps would move them away from the statistics the exported spec
    evaluates with. The classifier ``_fc`` belongs to ImageNet's loss: no encoding uses it.
    """

    #: the pooled EfficientNet backbone (around a third-party network without type
    #: information, reached as ``model.net``: read as Any)
    model: Any

    default_lora_targets = ("_expand_conv", "_project_conv", "_conv_head")

    def __init__(self, config: TowersConfig, device: str | torch.device = "cpu") -> None:
        super().__init__(config)
        from curvalign.data.encoders import ImageClassifierEncoder, load_encoder, load_image

        kind, _, weights = config.encoder.partition(":")
        if config.init == "random":
            raise TowerError(
                f"towers {config.encoder!r}: init=random builds open_clip:ARCH and hf-clip:DIR "
                "towers; EfficientNet loads its ImageNet weights (drop init=random)"
            )
        if config.text != "locked":
            raise TowerError(
                f"towers {config.encoder!r}: an image classifier has no text side "
                f"(text={config.text}); pair it with a text tower, e.g. {kind}+minilm"
            )
        try:
            encoder = load_encoder(config.encoder, device=device)
        except EncoderError as err:
            raise TowerError(f"towers: {err}") from None
        if not isinstance(encoder, ImageClassifierEncoder):
            raise TowerError(f"towers: {config.encoder!r} is not an image classifier backbone")
        self._load_image = load_image
        self.variant = kind.removeprefix("efficientnet-")
        self.spec = encoder.spec
        self.model = encoder.backbone  # pixels [B, 3, S, S] -> pooled features [B, Di]
        self.preprocess = encoder.preprocess
        self.image_width = int(encoder.image_dim)
        self.text_width = 0
        _plain_pointwise_convolutions(self.model)
        self._configure()

    def _switch_off_dropout(self) -> None:
        # drop-connect (stochastic depth) reads the network's global rate at forward time
        super()._switch_off_dropout()
        net = self.model.net
        net._global_params = net._global_params._replace(drop_connect_rate=0.0)

    def _side_of(self, name: str) -> str | None:
        return None if name.startswith("net._fc.") else "image"

    def _lora_modules(self, side: str) -> nn.Module:
        return self.model if side == "image" else nn.Module()  # no text side: nothing to adapt

    def train(self, mode: bool = True) -> EfficientNetTowers:
        super().train(mode)
        for module in self.model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
        return self

    def encode_images(self, items: Sequence[Any]) -> Tensor:
        pixels = torch.stack([self.preprocess(self._load_image(im)) for im in items])
        return self.model(pixels.to(self._device())).float()

    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        raise TowerError(
            f"towers {self.spec!r} encode images only; pair them with a text tower, "
            f"e.g. {self.spec}+minilm"
        )

    def _export_model(self, model: nn.Module, directory: Path) -> str:
        path = directory / f"efficientnet-{self.variant}.pth"
        net = model.net
        assert isinstance(net, nn.Module)  # the EfficientNet inside the pooled backbone
        torch.save({k: v.contiguous() for k, v in net.state_dict().items()}, path)
        return f"efficientnet-{self.variant}:{path.resolve()}"


def _plain_pointwise_convolutions(model: nn.Module) -> None:
    """Replace every 1x1, stride-1 convolution of ``model`` that is a subclass of ``nn.Conv2d``
    (EfficientNet's ``Conv2dStaticSamePadding``, whose padding is then zero) by a plain
    ``nn.Conv2d`` holding the same tensors: the same output bit for bit, the same state-dict
    keys, and a class peft can clone for its LoRA factors (it builds them with the base
    layer's own class, whose constructor here needs an image size)."""
    for name, module in list(model.named_modules()):
        if (
            type(module) is nn.Conv2d
            or not isinstance(module, nn.Conv2d)
            or module.kernel_size != (1, 1)
            or module.stride != (1, 1)
            or module.groups != 1
        ):
            continue
        plain = nn.Conv2d(
            module.in_channels,
            module.out_channels,
            1,
            bias=module.bias is not None,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        plain.weight, plain.bias = module.weight, module.bias
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)


class PairedTowers(Towers):
    """Images by one tower, texts by another (``IMAGE_SPEC+TEXT_SPEC``, as ``extract`` reads
    it): e.g. ``efficientnet-lite0+minilm``. Two spaces, each side with its own mode: the image
    tower is built with ``image=<image mode>``, the text tower with ``text=<text mode>`` (a
    sentence-transformers text tower encodes with one backbone, so both of its modes are the
    text mode). ``lora_targets`` may be prefixed ``image:`` or ``text:`` to reach one side
    only; unprefixed names go to both. Exports as the pair of the two exported specs."""

    def __init__(self, config: TowersConfig, device: str | torch.device = "cpu") -> None:
        super().__init__(config)
        parts = config.encoder.split("+")
        if len(parts) != 2 or not all(parts):
            raise TowerError(f"towers {config.encoder!r}: expected IMAGE_SPEC+TEXT_SPEC")
        shared = {
            k: getattr(config, k)
            for k in ("lora_rank", "lora_alpha", "lr", "weight_decay", "checkpointing", "dropout")
        }

        def part(spec: str, image: str, text: str, side: str) -> Towers:
            # a part's targets: those of its side, when that side is lora (the pair's config
            # refused a prefixed target on a side that is not)
            targets = config.side_targets(side) if getattr(config, side) == "lora" else []
            part_config = TowersConfig(spec, image=image, text=text, lora_targets=targets, **shared)
            # the part's other side is unused (locked), which init=random would refuse as
            # "set text=full": the pair's own sides were checked; the part's adapter then says
            # whether it can start from random weights
            part_config.init = config.init
            return build_towers(part_config, device)

        text_kind = parts[1].partition(":")[0]
        text_image_mode = (
            config.text if text_kind in ("sentence-transformers", "minilm") else "locked"
        )
        self.image_tower = part(parts[0], config.image, "locked", "image")
        self.text_tower = part(parts[1], text_image_mode, config.text, "text")
        self.spec = f"{self.image_tower.spec}+{self.text_tower.spec}"
        self.image_width = self.image_tower.image_width
        self.text_width = self.text_tower.text_width
        self.notes = [*self.image_tower.notes, *self.text_tower.notes]

    def _side_of(self, name: str) -> str | None:  # pragma: no cover - the parts configure
        return name.partition("_")[0]

    def _lora_modules(self, side: str) -> nn.Module:  # pragma: no cover - the parts configure
        return self.image_tower if side == "image" else self.text_tower

    def train(self, mode: bool = True) -> PairedTowers:
        nn.Module.train(self, mode)  # each part applies its own locked / BatchNorm rules
        return self

    def encode_images(self, items: Sequence[Any]) -> Tensor:
        return self.image_tower.encode_images(items)

    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        return self.text_tower.encode_texts(texts)

    @property
    def text_token_width(self) -> int | None:  # type: ignore[override]
        return self.text_tower.text_token_width

    def encode_text_tokens(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        return self.text_tower.encode_text_tokens(texts)

    def _all_tensors(self) -> Iterator[Tensor]:
        yield from self.parameters()

    def export(self, directory: str | Path) -> str:
        """Each trained part exported into ``directory/image`` or ``directory/text``; a locked
        part keeps its own spec (its weights are the frozen ones)."""
        directory = Path(directory)
        images, texts = (
            part.export(directory / side) if part.config.trains else part.spec
            for side, part in (("image", self.image_tower), ("text", self.text_tower))
        )
        return f"{images}+{texts}"

    def _export_model(self, model: nn.Module, directory: Path) -> str:  # pragma: no cover
        raise TowerError("paired towers export part by part (export())")


def build_towers(config: TowersConfig, device: str | torch.device = "cpu") -> Towers:
    """The towers of ``config`` (adapter chosen by the encoder spec's kind), on ``device``."""
    kind = config.encoder.partition(":")[0]
    if "+" in config.encoder:
        towers: Towers = PairedTowers(config, device)
    elif kind.startswith("efficientnet-"):
        towers = EfficientNetTowers(config, device)
    elif kind == "open_clip":
        towers = OpenClipTowers(config, device)
    elif kind == "hf-clip":
        towers = HFClipTowers(config, device)
    elif kind in ("sentence-transformers", "minilm"):
        towers = SentenceTransformerTowers(config, device)
    else:
        raise TowerError(
            f"towers: encoder {config.encoder!r} is not supported for training yet; expected "
            "open_clip:ARCH:CHECKPOINT, hf-clip:DIR, sentence-transformers:DIR, minilm, "
            "efficientnet-liteN[:WEIGHTS] (images) or IMAGE_SPEC+TEXT_SPEC"
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
    "EfficientNetTowers",
    "HFClipTowers",
    "PairedTowers",
    "OpenClipTowers",
    "SentenceTransformerTowers",
    "build_towers",
    "describe",
]
