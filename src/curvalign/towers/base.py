"""The tower protocol: encoders that sit in front of the heads and train with them.

A :class:`Towers` object is one local encoder (an open_clip model, a sentence-transformers
directory) seen as two sides, ``image`` and ``text``, each in one of three modes:

    locked   frozen and in eval mode: the features are the ones ``curvalign extract`` writes
    lora     the base frozen, low-rank adapters (``peft``: rank, alpha, target modules) trained;
             the adapters start at zero (LoRA's B = 0), so step 0 gives the frozen features
    full     every parameter of that side trained

It encodes raw items to features that carry gradients::

    encode_images(items) -> float32 [N, Di]   items: image paths / PIL images (or, for a
                                              text-only encoder, the texts standing for images)
    encode_texts(texts)  -> float32 [N, Dt]

and exports itself (adapters merged) as an encoder spec that ``curvalign extract``,
``curvalign search`` and ``curvalign.data.encoders.load_encoder`` accept, so evaluation, index
and search run unchanged on features re-extracted with the trained towers.

Checkpoints hold ``trainable_state()`` only: the LoRA adapters for a LoRA side ("adapters-only
checkpoints"), every weight of a fully trained side, nothing for a locked side; the frozen base
is read again from the encoder spec on resume. Recipes never see a tower: they get a ``Batch``
of features as from a feature store.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from curvalign.errors import CurvalignError

MODES = ("locked", "lora", "full")
SIDES = ("image", "text")
#: how several processes share the towers: each holds them whole and averages their gradients
#: (ddp), or each holds a shard of every trainable block (fsdp: FSDP2 ``fully_shard``)
STRATEGIES = ("ddp", "fsdp")
#: where the tower weights start: the encoder's checkpoint, or random (from scratch)
INITS = ("pretrained", "random")
#: ``TowersConfig`` keys that take true / false
BOOLEAN_KEYS = ("checkpointing", "augment", "dropout")
#: plain float attributes through which modules apply dropout at forward time: HF CLIP's
#: attention ``dropout``, ``nn.MultiheadAttention``'s ``dropout``, timm's DropPath
#: ``drop_prob``, open_clip's PatchDropout ``prob``, and the like
DROPOUT_ATTRIBUTES = ("dropout", "attention_dropout", "dropout_p", "dropout_prob", "drop_prob")


def switch_off_dropout(model: nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0, in place: each ``nn.Dropout``-like
    module's ``p`` (BERT's attention reads ``self.dropout.p`` at forward time) and the plain
    float attributes of ``DROPOUT_ATTRIBUTES`` (and PatchDropout's ``prob``). Train mode stays
    (activation checkpointing of HF models runs in train mode only). Returns how many were on.

    The weights and the saved configs are untouched: an exported model keeps its dropout."""
    switched = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            switched += module.p > 0
            module.p = 0.0
            continue
        names = (
            *DROPOUT_ATTRIBUTES,
            *(("prob",) if type(module).__name__ == "PatchDropout" else ()),
        )
        for name in names:
            value = vars(module).get(name)  # plain attributes only, never a submodule
            if isinstance(value, float) and value > 0:
                setattr(module, name, 0.0)
                switched += 1
    return switched


class TowerError(CurvalignError, ValueError):
    """A bad tower setting, a tower that cannot be built, or one that cannot train as asked."""


@dataclass
class TowersConfig:
    """What to train in front of the heads (saved as ``towers.json`` in the run directory).

    encoder      an encoder spec (``curvalign.data.encoders``): ``open_clip:ARCH:CKPT``,
                 ``hf-clip:DIR``, ``sentence-transformers:DIR`` or ``minilm``; local files only
    image, text  mode of each side: locked | lora | full (a text-only encoder has one shared
                 backbone: both sides must then have the same mode)
    lora_rank, lora_alpha   LoRA's r and alpha (scaling alpha / r)
    lora_targets names of the linear modules that get adapters (peft ``target_modules``);
                 empty: the adapter's default (open_clip: the MLP ``c_fc``, ``c_proj`` of every
                 block; HF CLIP: ``q_proj, k_proj, v_proj, out_proj, fc1, fc2``; BERT-like:
                 ``query``, ``key``, ``value``); ``image:NAME`` / ``text:NAME`` reach one side
                 only, and must name a ``lora`` side (a target nothing would act on is refused)
    lr           learning rate of the tower parameters (the heads keep ``train.lr``); None:
                 ``train.lr``
    weight_decay decay of the tower matrices (never of biases, norms, embeddings of rank < 2);
                 None: ``train.weight_decay``
    checkpointing  activation checkpointing of the transformer blocks (recompute activations
                 in the backward pass: less memory, about one more forward of time)
    init         pretrained (the encoder's weights) or random: towers from scratch, as MERU,
                 AtMG, PHyCLIP and HyCoCLIP train them; the architecture of ``open_clip:ARCH``
                 (a name or a model-config JSON, no checkpoint) or the config of ``hf-clip:DIR``
                 (its tokenizer and image processor, no weights read) with random weights;
                 every side must be ``full`` (LoRA or a locked side on random weights has
                 nothing to adapt)

    Raw training rows (``curvalign.towers.loader``):

    workers      DataLoader worker processes that decode, crop, augment and tokenise each
                 step's rows (0: in the training process); the batches do not depend on it, so
                 a run may resume with another number
    augment      random resized crop (+ optional horizontal flip) of every training image and
                 box crop, drawn from (seed, step, row): never on validation
    crop_scale   area fraction range of the crop (MERU/HyCoCLIP: 0.5 to 1.0)
    crop_ratio   aspect ratio range of the crop (torchvision's 3/4 to 4/3)
    flip         probability of a horizontal flip (0: the papers' crop-only recipe; captions may
                 say "left" and "right")
    shards       a webdataset folder (``*.tar`` of image + ``txt`` caption samples) or one
                 ``.tar`` to stream the training pairs from, instead of the store's manifest;
                 the store still gives validation and the head initialisation
    strategy     under torchrun: ddp (every rank holds the whole towers, gradients averaged)
                 or fsdp (FSDP2: every transformer block of a trained side and the rest of the
                 towers sharded over the ranks, distributed checkpoints); one process: ignored
    dropout      keep the encoder's own dropout (and drop-path / drop-connect) while the towers
                 train; off by default (``switch_off_dropout``): the towers are then a
                 deterministic function of their weights, so W processes take the step one
                 process takes on the global batch, and a LoRA side at step 0 gives exactly the
                 extracted features the heads were initialised on. On, each rank draws its
                 masks from (seed, rank, step): W processes then differ from one by the noise
    """

    encoder: str
    image: str = "locked"
    text: str = "locked"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: list[str] = field(default_factory=list)
    lr: float | None = None
    weight_decay: float | None = None
    checkpointing: bool = False
    # raw training rows (see above); the number of workers never changes the batches
    workers: int = field(default=0, compare=False)
    augment: bool = False
    crop_scale: list[float] = field(default_factory=lambda: [0.5, 1.0])
    crop_ratio: list[float] = field(default_factory=lambda: [3 / 4, 4 / 3])
    flip: float = 0.0
    shards: str | None = None
    strategy: str = "ddp"
    init: str = "pretrained"
    dropout: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.encoder, str) or not self.encoder:
            raise TowerError("towers: 'encoder' must be an encoder spec string")
        for side in SIDES:
            if getattr(self, side) not in MODES:
                raise TowerError(
                    f"towers: {side}={getattr(self, side)!r}; expected one of {', '.join(MODES)}"
                )
        if int(self.lora_rank) < 1 or not float(self.lora_alpha) > 0:
            raise TowerError(
                f"towers: lora_rank must be >= 1 and lora_alpha > 0, got {self.lora_rank}, "
                f"{self.lora_alpha}"
            )
        if self.strategy not in STRATEGIES:
            raise TowerError(
                f"towers: strategy={self.strategy!r}; expected one of {', '.join(STRATEGIES)}"
            )
        if self.lr is not None and not float(self.lr) > 0:
            raise TowerError(f"towers: lr must be > 0, got {self.lr}")
        if self.init not in INITS:
            raise TowerError(f"towers: init={self.init!r}; expected one of {', '.join(INITS)}")
        if self.init == "random":
            for side in SIDES:
                if getattr(self, side) != "full":
                    raise TowerError(
                        f"towers: init=random starts from random weights, which {side}="
                        f"{getattr(self, side)} would not train; set {side}=full"
                    )
        self.lora_targets = list(self.lora_targets or [])
        self._check_lora_targets()
        self._check_raw_rows()

    def _check_lora_targets(self) -> None:
        """A LoRA target acts on a ``lora`` side only: a target prefixed with a side that is not
        ``lora`` (``text:query`` with text=locked), or targets with no ``lora`` side at all,
        would be ignored; both are refused, naming the target."""
        lora_sides = [side for side in SIDES if getattr(self, side) == "lora"]
        for target in self.lora_targets:
            prefix, sep, name = target.partition(":")
            if not sep:
                continue
            if prefix not in SIDES or not name:
                raise TowerError(
                    f"towers: lora_targets {target!r}: expected a module name, image:NAME or "
                    "text:NAME"
                )
            if prefix not in lora_sides:
                raise TowerError(
                    f"towers: lora_targets {target!r} names the {prefix} side, which is "
                    f"{prefix}={getattr(self, prefix)}: adapters go on a lora side only; set "
                    f"{prefix}=lora or drop that target"
                )
        if self.lora_targets and not lora_sides:
            raise TowerError(
                f"towers: lora_targets {','.join(self.lora_targets)} given but no side is lora "
                f"(image={self.image}, text={self.text}); set image=lora or text=lora, or drop "
                "lora_targets"
            )

    def side_targets(self, side: str) -> list[str]:
        """The LoRA targets of ``side``: the unprefixed names and those prefixed ``side:``
        (prefix removed); empty: the tower's defaults."""
        picked = []
        for target in self.lora_targets:
            prefix, sep, name = target.partition(":")
            if not sep:
                picked.append(target)
            elif prefix == side:
                picked.append(name)
        return picked

    def _check_raw_rows(self) -> None:
        if int(self.workers) < 0:
            raise TowerError(f"towers: workers must be >= 0, got {self.workers}")
        self.workers = int(self.workers)
        for name, low in (("crop_scale", 0.0), ("crop_ratio", 0.0)):
            value = [float(v) for v in getattr(self, name)]
            if len(value) != 2 or not low < value[0] <= value[1]:
                raise TowerError(
                    f"towers: {name} must be two numbers 0 < lo <= hi, got {getattr(self, name)}"
                )
            setattr(self, name, value)
        if self.crop_scale[1] > 1:
            raise TowerError(f"towers: crop_scale must lie in (0, 1], got {self.crop_scale}")
        if not 0.0 <= float(self.flip) <= 1.0:
            raise TowerError(f"towers: flip is a probability in [0, 1], got {self.flip}")

    @property
    def trains(self) -> bool:
        """Whether any side trains (a fully locked pair only re-encodes)."""
        return self.image != "locked" or self.text != "locked"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "towers") -> TowersConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise TowerError(f"{source}: unknown key(s) {unknown}; expected {sorted(known)}")
        return cls(**dict(raw))

    @classmethod
    def parse(cls, text: str) -> TowersConfig:
        """``"ENCODER_SPEC[;key=value...]"``, e.g.
        ``"open_clip:ViT-B-16:/m/clip.pt;image=lora;text=lora;lora_rank=8;lr=1e-5"``
        (``lora_targets`` comma-separated)."""
        spec, *pairs = [p.strip() for p in str(text).split(";")]
        values: dict[str, Any] = {"encoder": spec}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for pair in filter(None, pairs):
            key, sep, value = pair.partition("=")
            key = key.strip()
            if not sep or key not in types or key == "encoder":
                raise TowerError(
                    f"towers {text!r}: {pair!r} is not key=value with a key of "
                    f"{sorted(k for k in types if k != 'encoder')}"
                )
            value = value.strip()
            try:
                if key == "lora_targets":
                    values[key] = [v.strip() for v in value.split(",") if v.strip()]
                elif key == "lora_rank":
                    values[key] = int(value)
                elif key in ("lora_alpha", "lr", "weight_decay"):
                    values[key] = None if value.lower() == "none" else float(value)
                elif key in BOOLEAN_KEYS:
                    if value.lower() not in ("true", "false", "1", "0"):
                        raise ValueError(value)
                    values[key] = value.lower() in ("true", "1")
                elif key == "workers":
                    values[key] = int(value)
                elif key == "flip":
                    values[key] = float(value)
                elif key in ("crop_scale", "crop_ratio"):
                    values[key] = [float(v) for v in value.split(",")]
                elif key == "shards":
                    values[key] = value or None
                else:
                    values[key] = value
            except ValueError:
                raise TowerError(
                    f"towers {text!r}: {key}={value!r} is not a "
                    f"{'boolean' if key in BOOLEAN_KEYS else 'number'}"
                ) from None
        config = cls(**values)
        if "image" not in values and "text" not in values:
            # both sides default to locked: such towers train nothing (0 parameters)
            raise TowerError(
                f"towers {text!r}: no side trains (image and text default to locked, 0 trainable "
                "parameters); add image=lora|full and/or text=lora|full, or image=locked;"
                "text=locked to re-encode with frozen towers"
            )
        return config

    def save(self, path: Path) -> None:
        from curvalign._io import atomic_write_text

        atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> TowersConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise TowerError(f"{path} is not a readable towers config ({err})") from None
        return cls.from_dict(raw, source=str(path))


class InputPreparer:
    """Turns decoded PIL images and texts into a tower's inputs, in a DataLoader worker: here
    nothing (the tower's ``encode_images`` / ``encode_texts`` take them as they are)."""

    def images(self, images: Sequence[Any]) -> Any:
        return list(images)

    def texts(self, texts: Sequence[str]) -> Any:
        return [str(t) for t in texts]


class Towers(nn.Module):
    """An image tower and a text tower in front of a recipe's heads (see the module docstring).

    Subclasses build ``self.model`` (the whole encoder, an ``nn.Module``), set ``spec``,
    ``image_width``, ``text_width``, and implement ``_side_of(name)`` (which side a parameter
    belongs to: "image", "text" or None for a parameter no encoding uses), ``_lora_modules(side)``
    (the submodule that gets a side's adapters), ``encode_images``, ``encode_texts`` and
    ``export``. ``_configure()`` then applies the modes.
    """

    spec: str
    image_width: int
    text_width: int
    #: the whole encoder (a submodule the subclass assigns in its ``__init__``)
    model: nn.Module
    #: peft target modules when ``TowersConfig.lora_targets`` is empty
    default_lora_targets: tuple[str, ...] = ()
    #: one backbone for both sides (a text-only encoder encodes the texts standing for images)
    shared_backbone: bool = False

    def __init__(self, config: TowersConfig) -> None:
        super().__init__()
        self.config = config
        #: parameters frozen because no encoding uses them (named in ``notes``)
        self.notes: list[str] = []

    # --- what subclasses provide --------------------------------------------------------------
    @abstractmethod
    def _side_of(self, name: str) -> str | None:
        """The side parameter ``name`` (of ``self.model``) belongs to; None: used by neither."""

    @abstractmethod
    def _lora_modules(self, side: str) -> nn.Module:
        """The submodule whose linear layers get the adapters of ``side``."""

    @abstractmethod
    def encode_images(self, items: Sequence[Any]) -> Tensor:
        """Images (paths or PIL images; texts for a text-only encoder) -> float32 [N, Di]."""

    @abstractmethod
    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        """Texts -> float32 [N, Dt]."""

    # --- raw rows prepared in DataLoader workers (curvalign.towers.loader) --------------------
    def input_preparer(self) -> InputPreparer:
        """What DataLoader workers run on decoded (and augmented) PIL images and on texts; the
        default passes them through and ``encode_prepared_*`` then preprocess and tokenise in
        the training process. An adapter returns a preparer that preprocesses and tokenises
        there too (no model weights in it: it is sent to the workers)."""
        return InputPreparer()

    def encode_prepared_images(self, prepared: Any) -> Tensor:
        """``input_preparer().images(...)`` output -> float32 [N, Di] (with gradients)."""
        return self.encode_images(prepared)

    def encode_prepared_texts(self, prepared: Any) -> Tensor:
        """``input_preparer().texts(...)`` output -> float32 [N, Dt] (with gradients)."""
        return self.encode_texts(prepared)

    #: width Dk of ``encode_text_tokens``' token states; None: the towers give none
    text_token_width: int | None = None

    def encode_text_tokens(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Texts -> (the text tower's last token states float32 [N, L, Dk], mask bool [N, L]),
        with gradients: what a recipe that pools tokens (DualPath's attention pooling) reads,
        the states ``curvalign extract --tokens`` stores, so no stored tokens are needed."""
        raise TowerError(
            f"towers {self.config.encoder!r} give no token states; a recipe that pools text "
            "tokens needs a sentence-transformers, HF CLIP or paired text tower"
        )

    @abstractmethod
    def _export_model(self, model: nn.Module, directory: Path) -> str:
        """Write ``model`` (adapters merged, the original module names) into ``directory``;
        return its encoder spec."""

    # --- modes --------------------------------------------------------------------------------
    def mode(self, side: str) -> str:
        return getattr(self.config, side)

    def _configure(self) -> None:
        """Freeze everything, add the adapters of the LoRA sides, unfreeze what trains."""
        cfg = self.config
        if self.shared_backbone and cfg.image != cfg.text:
            raise TowerError(
                f"towers {cfg.encoder!r}: one backbone encodes both sides, so image and text "
                f"must have the same mode (got image={cfg.image}, text={cfg.text})"
            )
        self.model.requires_grad_(False)
        sides = ("text",) if self.shared_backbone else SIDES
        for side in sides:
            if self.mode(side) == "lora":
                self._add_lora(side)
        unused: list[str] = []
        for name, param in self.model.named_parameters():
            owner = self._side_of(name)
            if owner is None:
                if self.mode("image") != "locked" or self.mode("text") != "locked":
                    unused.append(name)
                continue
            mode = self.mode(owner)
            if mode == "full" or (mode == "lora" and "lora_" in name):
                param.requires_grad_(True)
        if cfg.checkpointing:
            self._enable_checkpointing()
        if not cfg.dropout:
            self._switch_off_dropout()
        if unused:
            self.notes.append(
                f"towers: {len(unused)} parameter(s) no encoding uses stay frozen "
                f"({', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''})"
            )
        self.train(self.training)

    def _switch_off_dropout(self) -> None:
        """``dropout=false``: the towers' dropout off (``switch_off_dropout`` on the model)."""
        switch_off_dropout(self.model)

    def _enable_checkpointing(self) -> None:
        """Turn on the model's own activation checkpointing (non-reentrant, so gradients reach
        adapters inside blocks whose inputs need none)."""
        raise TowerError(f"towers {self.config.encoder!r}: no activation checkpointing here")

    def _add_lora(self, side: str) -> None:
        from curvalign.data.encoders import import_optional

        peft = import_optional("peft", "towers")
        targets = self.config.side_targets(side) or list(self.default_lora_targets)
        if self.shared_backbone:  # one backbone: a target of either side is the backbone's
            targets = sorted(
                {*self.config.side_targets("image"), *self.config.side_targets("text")}
            ) or list(self.default_lora_targets)
        config = peft.LoraConfig(
            r=int(self.config.lora_rank),
            lora_alpha=float(self.config.lora_alpha),
            target_modules=targets,
            lora_dropout=0.0,
            bias="none",
        )
        module = self._lora_modules(side)
        try:
            peft.inject_adapter_in_model(config, module)
        except ValueError as err:  # no module matches the targets
            raise TowerError(
                f"towers {self.config.encoder!r}: LoRA on the {side} side: {str(err).splitlines()[0]} "
                f"(lora_targets={targets})"
            ) from None

    def train(self, mode: bool = True) -> Towers:
        """Train mode for the sides that train; a locked side always stays in eval mode (its
        features are then exactly the extracted ones, dropout off)."""
        super().train(mode)
        for side in SIDES if not self.shared_backbone else ("text",):
            if self.mode(side) == "locked":
                self._side_module(side).eval()
        return self

    def _side_module(self, side: str) -> nn.Module:
        return self._lora_modules(side) if not self.shared_backbone else self.model

    # --- parameters and state -----------------------------------------------------------------
    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of every tower parameter that trains, in a fixed order."""
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def freeze(self, names: Sequence[str], why: str) -> None:
        """Freeze the named parameters (names as in ``named_parameters()``), with a note."""
        params = dict(self.named_parameters())
        for name in names:
            params[name].requires_grad_(False)
        if names:
            self.notes.append(
                f"towers: froze {len(names)} trainable parameter(s) {why} "
                f"({', '.join(list(names)[:4])}{', ...' if len(names) > 4 else ''})"
            )

    def trainable_state(self) -> dict[str, Tensor]:
        """The trained tensors only (LoRA: the adapters; full: that side's weights), as plain
        CPU tensors: what a checkpoint stores."""
        names = {n for n, _ in self.trainable_named_parameters()}
        return {k: v.detach().to("cpu").clone() for k, v in self.state_dict().items() if k in names}

    def load_trainable_state(self, state: Mapping[str, Tensor]) -> None:
        """Load ``trainable_state()`` output (TowerError when it does not fit these towers)."""
        expected = {n for n, _ in self.trainable_named_parameters()}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise TowerError(
                f"tower state does not fit towers {self.config.encoder!r} as configured "
                f"(missing {missing[:3]}, unexpected {extra[:3]})"
            )
        self.load_state_dict(dict(state), strict=False)

    # --- export -------------------------------------------------------------------------------
    def merged_model(self) -> nn.Module:
        """A copy of the encoder with the adapters merged into their base layers and the peft
        wrappers removed (the original module names and weights layout)."""
        model = copy.deepcopy(self.model).to("cpu")
        for name, module in list(model.named_modules()):
            base = getattr(module, "base_layer", None)
            if base is None or not hasattr(module, "merge"):
                continue
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, base)
        model.requires_grad_(False)
        return model.eval()

    def export(self, directory: str | Path) -> str:
        """Write the towers (adapters merged) into ``directory``; returns the encoder spec that
        ``curvalign extract --encoder`` accepts."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        return self._export_model(self.merged_model(), directory)

    # --- helpers ------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return next(iter(self._all_tensors()), torch.empty(0)).device

    def _all_tensors(self) -> Iterator[Tensor]:
        yield from self.model.parameters()


__all__ = [
    "MODES",
    "SIDES",
    "STRATEGIES",
    "InputPreparer",
    "TowerError",
    "Towers",
    "TowersConfig",
    "switch_off_dropout",
]
