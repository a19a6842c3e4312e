"""The recipe contract: what a method is, as the trainer, the evaluations and the index see it.

A recipe is an ``nn.Module`` that owns its heads and learnable scalars and composes
geometry, scores and losses. It never runs a loop, reads files or logs: the trainer does.

Embeddings
    A recipe maps features to an ``Embedding``: a ``dict[str, Tensor]`` whose tensors all have
    the number of items as leading dimension. The keys are the recipe's own, e.g. CLIP
    ``{"point": [N, d]}`` (unit vectors), MERU ``{"point": [N, d]}`` (Lorentz space components),
    PHyCLIP ``{"point": [N, k, d]}``, ProCLIP ``{"hyperbolic", "euclidean", "sphere"}``, AGR
    ``{"euclidean", "lorentz", "context"}``. A dict of tensors slices, concatenates, gathers
    across processes and saves (safetensors) without knowing the method.

Scores
    ``scores(texts, images, query)`` is the ranking score, higher is better, ``[Nt, Ni]``: the
    same quantity the recipe trains with (distance, angle, routed score), never a cosine
    stand-in. ``query`` says which side is the query, for methods whose score depends on it
    (AGR's query gate; AtMG's angle at the text for text->image). ``pair_scores`` is the same
    score for matched rows, ``[n]``, used to rerank candidates.

Geometry questions (evaluation, diagnostics, index)
    Everything ``eval/`` and ``index/`` need to know about a method they ask the recipe:
    ``embedding_geometry`` (which key holds which kind of point), ``curvature_value()`` (the one
    curvature query), ``distance_to_origin`` and ``tangent_features`` (hierarchy ordering,
    spectra), ``factor_activation`` and ``embedding_diagnostics`` (method-specific diagnostics),
    and ``index_proxies()`` (what an index holds and whether it ranks exactly; candidates are
    reranked with ``pair_scores``). ``HyperbolicRecipe`` answers the geometric ones for a recipe
    with one Lorentz part, ``CosineRecipe`` everything for a unit-sphere cosine recipe.

Shared bases
    ``CosineRecipe`` (CLIP, DualPath), ``HyperbolicRecipe`` (PHyCLIP, ProCLIP, AGR) and
    ``LorentzRecipe`` with ``LorentzConfig`` (MERU, HyCoCLIP, AtMG: Lorentz heads, one learnable
    curvature, a temperature, ``-d_L`` ranking, MERU's class embedding). ``check_batch`` gives
    every recipe the same clear error for a batch that lacks what it trains on.

Distributed training
    ``loss`` receives a ``Gather``. A recipe embeds its local batch, gathers the embeddings of
    all ranks (with gradients flowing to the local part), and scores its local rows against
    all columns, with targets ``arange(B) + gather.offset(B)``. With the default single-process
    ``Gather`` this is ordinary in-batch contrastive learning; with ``torch.distributed`` it
    equals single-process training on the global batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import Tensor, nn

from curvalign.data.alignment import LinearAlignment
from curvalign.data.batch import Batch
from curvalign.data.statistics import FeatureNorms
from curvalign.errors import InputError
from curvalign.geometries import Geometry, Lift, named_geometry
from curvalign.geometry import lorentz, sphere
from curvalign.losses import symmetric_info_nce
from curvalign.nn.heads import (
    LorentzHead,
    linear_proj,
    resolve_tangent_scale,
    share_input_preserving_projection,
)
from curvalign.nn.scalars import LearnableScalar, scalar_parameter_names
from curvalign.scores import (
    cosine_pair_scores,
    cosine_scores,
    lorentz_distance_pair_scores,
    lorentz_distance_scores,
)

Embedding = dict[str, Tensor]
Query = Literal["text", "image"]
#: the name of the space an embedding key's points live in (``Recipe.embedding_geometry``; a
#: ``Geometry``'s ``kind``): the built-ins' "sphere", "lorentz", "lorentz-product", "euclidean",
#: "features", or a plug-in's own (an open set: ``curvalign.geometries``)
GeometryKind = str
#: the name of an index proxy: a built-in lift's (``geometries.BUILTIN_LIFTS``: "cosine",
#: "lorentz", "angle", "product-lorentz", "mixed") or any name with ``IndexProxy.lift`` given
ProxyKind = str
#: where an "angle" proxy's angle has its vertex: at the query point or at the database item
AngleVertex = Literal["query", "database"]


@dataclass(frozen=True)
class AngleScore:
    """How a score reads the exterior angle (AtMG Eq. 9) for one query side of an index.

    vertex            "query": the angle at the query point towards the database item;
                      "database": the angle at the database item towards the query
    larger_is_better  False: the score is minus the angle (smallest angle first); True: the
                      angle itself (largest first)
    """

    vertex: AngleVertex = "query"
    larger_is_better: bool = False


@dataclass(frozen=True)
class IndexProxy:
    """What a search index holds for a recipe: vectors whose inner product ranks candidates.

    kind     the vector map (a built-in lift, ``curvalign.geometries``): "cosine" (unit vectors of ``key``),
             "lorentz" (``-d_L`` of the Lorentz points of ``key``), "angle" (the exterior angle
             with the vertex and sign ``angle`` names: its own value over a flat index, Dinkelbach
             candidates over an HNSW graph), "product-lorentz" (sum over factors of
             ``c_f <x_f, y_f>_L``, points ``[N, k, d]`` of ``key``), "mixed" (a weighted H x E x S
             product over the keys "hyperbolic", "euclidean", "sphere")
    key      the embedding key the map reads (None for "mixed")
    exact    True when the proxy ranks exactly like the recipe's score (no rerank needed)
    weights  part weights of "mixed" ({"hyperbolic", "euclidean", "sphere"} -> float)
    angle    "angle": how the score reads the angle for each query side ("text": texts query
             an image database, "image": the reverse), an ``AngleScore`` (where the angle's
             vertex is, and its sign); a side left out means ``AngleScore()`` (minus the angle
             at the query)
    lift     the vectors themselves (a ``geometries.Lift``), for a method whose geometry the
             built-in kinds do not cover; ``kind`` is then only its name
    """

    kind: ProxyKind
    key: str | None = "point"
    exact: bool = False
    weights: Mapping[str, float] | None = None
    angle: Mapping[Query, AngleScore] | None = None
    lift: Lift | None = None

    def angle_score(self, query: Query) -> AngleScore:
        """How the score of an "angle" proxy reads the angle when ``query`` is the query side."""
        return (self.angle or {}).get(query, AngleScore())


def slice_embedding(emb: Embedding, index: slice | Tensor) -> Embedding:
    """Rows ``index`` of every tensor in ``emb``."""
    return {k: v[index] for k, v in emb.items()}


def cat_embeddings(parts: list[Embedding]) -> Embedding:
    """Concatenate embeddings along the item dimension."""
    if not parts:
        raise ValueError("cat_embeddings needs at least one embedding")
    return {k: torch.cat([p[k] for p in parts], dim=0) for k in parts[0]}


def embedding_size(emb: Embedding) -> int:
    """Number of items in ``emb`` (the shared leading dimension)."""
    return int(next(iter(emb.values())).shape[0])


@dataclass
class Progress:
    """Where training stands; schedules read it. ``step`` counts from 0, ``total`` is the run's length."""

    step: int
    total: int

    @property
    def fraction(self) -> float:
        return self.step / max(1, self.total)


@dataclass
class LossOutput:
    """``total`` is the scalar to minimise; ``terms`` its weighted parts (they sum to ``total``),
    named so a non-finite one can be reported; ``logs`` extra scalars for logging
    (temperature, curvature, routing weight, gate, ...)."""

    total: Tensor
    terms: dict[str, Tensor]
    logs: dict[str, float] = field(default_factory=dict)


def sum_terms(terms: Mapping[str, Tensor]) -> Tensor:
    """``LossOutput.total`` of weighted ``terms``: their sum, in order (what ``sum`` gives,
    typed as the tensor it is); ValueError for no terms."""
    values = iter(terms.values())
    try:
        total = next(values)
    except StopIteration:
        raise ValueError("a loss needs at least one term") from None
    for value in values:
        total = total + value
    return total


class Gather:
    """Single-process gather: identity. ``train/distributed.py`` provides the multi-process one."""

    rank: int = 0
    world_size: int = 1

    def __call__(self, emb: Embedding) -> Embedding:
        return emb

    def offset(self, local_batch: int) -> int:
        """Index of this rank's first row in the gathered batch."""
        return self.rank * local_batch

    def average(self, value: Tensor) -> Tensor:
        """Mean of ``value`` over ranks, with gradients. A loss term that is nonlinear in a batch
        statistic (AGR's load balance ``(mean w - 0.5)^2``) must take the statistic through this,
        or multi-process training would not equal training on the global batch."""
        return value


def check_batch(batch: Batch, recipe: str, boxes: bool = False) -> None:
    """One clear error when a batch lacks what the recipe trains on: matched image/text rows,
    and (``boxes``) one box image and box text per image."""
    if batch.image.shape[0] != batch.text.shape[0]:
        raise ValueError(
            f"{recipe}: batch has {batch.image.shape[0]} images but {batch.text.shape[0]} "
            "texts; rows must be matched pairs"
        )
    if boxes:
        if batch.box_image is None or batch.box_text is None:
            raise ValueError(
                f"{recipe} trains on box-level pairs: the batch needs box_image and box_text "
                "(a feature store with boxes)"
            )
        if (
            batch.box_image.shape[0] != batch.image.shape[0]
            or batch.box_text.shape[0] != batch.image.shape[0]
        ):
            raise ValueError(
                f"{recipe}: one box per image expected; got {batch.box_image.shape[0]} box "
                f"images and {batch.box_text.shape[0]} box texts for {batch.image.shape[0]} images"
            )


class Recipe(nn.Module):
    """Base class of the eight methods. Subclasses set ``name``, ``Config`` and ``requires``."""

    name: ClassVar[str]
    Config: ClassVar[type]
    #: optional store parts the method trains on: subset of {"boxes", "text_pairs"}
    requires: ClassVar[frozenset[str]] = frozenset()
    #: the Recall@K its paper reports on the standard retrieval protocols (COCO 5k, Flickr30k
    #: 1k); tables of those protocols show these (every K is still computed and kept)
    reported_recall_ks: ClassVar[tuple[int, ...]] = (1, 5, 10)
    #: the paper's optimiser and schedule as ``TrainConfig`` keys (lr, weight_decay, warmup,
    #: min_lr_ratio, grad_clip, ...). The trainer starts from these and the user's config file
    #: and ``key=value`` overrides win; docs/methods.md lists each value with its paper section.
    train_defaults: ClassVar[Mapping[str, Any]] = {}
    #: ``Config`` values for keys that a saved ``config.json`` from an earlier version lacks, where
    #: the current default would change what the saved run computes (ProCLIP's input normalisation)
    saved_config_defaults: ClassVar[Mapping[str, Any]] = {}
    #: the embedding keys through which the loss's gradient reaches the input features, i.e.
    #: the trunk (trainable towers in front of the recipe, ``curvalign.towers``); None: every
    #: key. A method whose paper fixes the paths into its backbone declares them (AGR, Table 1:
    #: the Lorentz head only); tests check the declaration against autograd and tower runs
    #: record it in ``meta.json`` (docs/methods.md, "Regimes: what trains the encoders").
    trunk_gradient_keys: ClassVar[tuple[str, ...] | None] = None
    #: how far (R@1 points) the step-0 validation mean R@1 of the recipe's own scores may lie
    #: from the alignment's ``val_r1`` after ``warm_start`` (tests/test_warm_start.py): 0 where
    #: the start ranks exactly like the alignment, a measured bound where the geometry cannot
    #: hold it exactly (the recipe's ``warm_start`` says why); None: no warm start
    warm_start_tolerance: ClassVar[float | None] = None

    def __init__(self, config, image_dim: int, text_dim: int) -> None:
        super().__init__()
        self.config = config
        self.image_dim = image_dim
        self.text_dim = text_dim

    # --- inputs -------------------------------------------------------------------------------
    @classmethod
    def reads_text_tokens(cls, config) -> bool:
        """True when the recipe, so configured, embeds texts from token-level features: then
        ``embed_texts(tokens [N, L, Dk], mask [N, L])`` instead of ``embed_texts([N, Dt])``, and
        ``text_dim`` is ``Dk``. The trainer, the sampler, eval and index ask this (before the
        recipe is built, hence a class method) and feed every text part as tokens + mask from
        the store's token groups; images stay pooled vectors. Default: pooled features."""
        return False

    @property
    def text_tokens(self) -> bool:
        """``reads_text_tokens`` of this recipe's config."""
        return self.reads_text_tokens(self.config)

    # --- embeddings -------------------------------------------------------------------------
    def embed_images(self, features: Tensor) -> Embedding:
        """[N, Di] image features -> Embedding with N items."""
        raise NotImplementedError

    def embed_texts(self, features: Tensor, mask: Tensor | None = None) -> Embedding:
        """[N, Dt] text features -> Embedding with N items; a recipe that ``reads_text_tokens``
        takes ``(tokens [N, L, Dk], mask [N, L])``. A recipe on pooled features is never given
        a mask (callers pass one only where ``text_tokens`` holds) and may ignore it."""
        raise NotImplementedError

    def embed_text_pairs(self, features: Tensor, mask: Tensor | None = None) -> Embedding:
        """[N, Dt] texts embedded for text-text similarity (a method with task prefixes uses its
        text-pair prefix), tokens + mask as in ``embed_texts``. Default: ``embed_texts``."""
        return self.embed_texts(features, mask)

    # --- ranking ----------------------------------------------------------------------------
    def scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        """[Nt, Ni] ranking score, higher is better. Default: the score of the recipe's one
        geometry (``geometries()``); a recipe with several embedding keys answers itself."""
        key, geometry = self._sole_geometry("scores")
        return geometry.scores(texts[key], images[key])

    def pair_scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        """[n] score of matched rows (text i with image i); equals the diagonal of ``scores``.
        Default: as ``scores``, from the recipe's one geometry."""
        key, geometry = self._sole_geometry("pair_scores")
        return geometry.pair_scores(texts[key], images[key])

    def _sole_geometry(self, question: str) -> tuple[str, Geometry]:
        """The one ``(key, Geometry)`` of ``geometries()``, for the default answers."""
        geometries = self.geometries()
        if len(geometries) != 1:
            raise NotImplementedError(
                f"{type(self).__name__}.{question}: the default answers from a recipe's one "
                f"geometry, and this recipe has {len(geometries)} embedding keys "
                f"({sorted(geometries)}); define {question} in the recipe"
            )
        return next(iter(geometries.items()))

    def zero_shot_scores(
        self, images: Embedding, prompts: Embedding, prompt_to_class: Tensor, num_classes: int
    ) -> Tensor:
        """[Ni, C] class scores from prompt embeddings ([Nq] items, class of each in
        ``prompt_to_class``). Default: a class embedding per class (``class_embedding``), then
        ``scores`` with the image as query."""
        classes = cat_embeddings(
            [
                self.class_embedding(
                    slice_embedding(prompts, torch.nonzero(prompt_to_class == c).flatten())
                )
                for c in range(num_classes)
            ]
        )
        return self.scores(classes, images, query="image").T

    def class_embedding(self, prompts: Embedding) -> Embedding:
        """One class's P prompt embeddings -> an Embedding with 1 item (the method's protocol)."""
        raise NotImplementedError

    # --- training ---------------------------------------------------------------------------
    def loss(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        raise NotImplementedError

    def forward(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        """``loss`` under the name DistributedDataParallel calls: the trainer calls
        ``model(batch, progress, gather)`` so that a DDP-wrapped recipe reduces its gradients."""
        return self.loss(batch, progress, gather)

    def on_step_start(self, progress: Progress) -> None:
        """Curriculum hook, called before each step's forward (e.g. DualPath's path copy)."""

    def no_decay_parameter_names(self) -> set[str]:
        """Names of parameters that get no weight decay: scalars, curvatures, temperatures, gates.
        Default: every parameter with fewer than two dimensions, and every ``LearnableScalar``'s
        log whatever its shape (decay would pull the log towards 0, the value towards 1)."""
        small = {n for n, p in self.named_parameters() if p.ndim < 2}
        return small | scalar_parameter_names(self)

    def log_values(self) -> dict[str, float]:
        """Scalars worth a curve (temperature, curvature(s), gates), read at logging time."""
        return {}

    # --- geometry questions (eval/ and index/ ask these; see the module docstring) ------------
    #: kind of point each embedding key holds (for embeddings files, index checks and messages)
    embedding_geometry: ClassVar[Mapping[str, GeometryKind]] = {}

    def geometries(self) -> dict[str, Geometry]:
        """The ``Geometry`` of each embedding key (``curvalign.geometries``): its kind, curvature
        and bounds, scores, distance to the origin, tangent features and index lift. Default:
        the built-in geometry each ``embedding_geometry`` name calls for, at this recipe's
        ``curvature_value()`` and ``curvature_bounds()``. A method in a geometry of its own
        returns its own objects here."""
        c, bounds = self.curvature_value(), self.curvature_bounds()
        return {
            key: named_geometry(kind, c, bounds) for key, kind in self.embedding_geometry.items()
        }

    def curvature_value(self) -> Tensor | None:
        """The positive curvature ``c`` (sectional curvature ``-c``) of the recipe's hyperbolic
        part, detached float64: a scalar, or ``[k]`` per factor. None without a hyperbolic part."""
        return None

    def distance_to_origin(self, emb: Embedding) -> Tensor | None:
        """[N] float64 distance of each item to the origin of the recipe's geometry (hierarchy
        ordering: more specific items lie further out). None when the geometry has no origin
        (a sphere has none): ordering then does not apply. Default: the one geometry's
        ``Geometry.distance_to_origin`` of its key; None for a recipe with several keys (which
        answers itself where one of them has an origin)."""
        geometries = self.geometries()
        if len(geometries) != 1:
            return None
        key, geometry = next(iter(geometries.items()))
        return geometry.distance_to_origin(emb[key]) if key in emb else None

    def tangent_features(self, emb: Embedding) -> Tensor:
        """[N, D] float64 flat vectors whose covariance spectrum describes the embedding (seed
        001, Fig. 7). Default: every ``[N, ...]`` tensor of ``emb`` as its key's geometry maps
        it to the tangent space at the origin (``Geometry.tangent``: the logarithmic map of a
        Lorentz part, the vectors themselves elsewhere), flattened, keys in sorted order,
        concatenated."""
        geometries = self.geometries()
        mapped = {key: geometries[key].tangent(emb[key]) for key in emb if key in geometries}
        return _flat_parts(emb, mapped)

    def gate_value(self) -> float | None:
        """The scalar gate the method learns, as it acts now (DualPath's effective g, warm-up
        factor times sigmoid(theta)), or None for a recipe without one."""
        return None

    def factor_activation(self, emb: Embedding) -> Tensor | None:
        """[N, k] float64 activation of each of k factors (PHyCLIP's factor-wise distance to the
        origin), or None for a recipe without factors."""
        return None

    def embedding_diagnostics(
        self, images: Embedding, texts: Embedding
    ) -> dict[str, dict[str, Tensor]]:
        """Method-specific per-item quantities worth a distribution summary in the evaluation,
        by name and modality, e.g. AGR's ``{"query_gate": {"image": [Ni], "text": [Nt]}}``.
        Default: none."""
        return {}

    def index_proxies(self) -> dict[str, IndexProxy]:
        """The proxies an index may hold for this recipe, by name; the first is the default.
        Default: the lift of each key's geometry (``Geometry.lift``), named by the geometry's
        kind, in key order; none where no geometry has one (``index`` then refuses the recipe
        with a message naming it)."""
        proxies: dict[str, IndexProxy] = {}
        for key, geometry in self.geometries().items():
            lift = geometry.lift(key)
            if lift is not None and geometry.kind not in proxies:
                proxies[geometry.kind] = IndexProxy(geometry.kind, key, exact=lift.exact, lift=lift)
        return proxies

    # --- initialisation and the step-0 health check (recipes/health.py asks these) -----------
    #: config keys that set the step-0 radius of the points (the scale before ``expmap0``):
    #: the step-0 check names them when the points start too near the origin
    scale_knobs: ClassVar[tuple[str, ...]] = ()
    #: a config key that separates the text and image radii at step 0, for a loss that reads
    #: angles at both ends of a pair (AtMG): at equal radii its two directions cancel
    radius_gap_knob: ClassVar[str | None] = None
    #: the config key of the temperature that divides the logits at step 0
    temperature_knob: ClassVar[str | None] = None

    @classmethod
    def resolve_init(cls, config: Any, norms: FeatureNorms) -> dict[str, Any]:
        """The ``Config`` values this recipe resolves from the train features' statistics,
        for the keys the user left unset (e.g. MERU's per-modality scale): ``{key: value}``.
        ``config.resolve_data_init`` writes them into the run's config, so that they are shown
        by ``--print-config``, saved in ``config.json`` and rebuilt by ``load_run``. Default:
        nothing to resolve."""
        return {}

    @classmethod
    def uses_alignment(cls, config: Any) -> bool:
        """Whether a run of this recipe, so configured, starts its heads at the data's linear
        alignment (``data.alignment``; ``warm_start``). Default: its config's ``head_init`` is
        "align"."""
        return getattr(config, "head_init", None) == "align"

    def warm_start(self, alignment: LinearAlignment) -> str:
        """Start the heads at ``alignment`` (called once, before step 0, after ``__init__`` and
        with the RNG seeded), so that the step-0 score ranks like the alignment in this recipe's
        geometry. Returns one line saying how close the start is and why. Default: the recipe
        has no warm start, a ``ConfigError``-worthy request (``uses_alignment`` said yes)."""
        raise NotImplementedError(f"recipe {self.name!r} has no warm start (head_init=align)")

    def curvature_bounds(self) -> tuple[float, float] | None:
        """``(min, max)`` clamp of the learned curvature, or None when the recipe learns none
        (a fixed curvature, or no hyperbolic part). Health checks read it (a curvature sitting
        on its bound), never a parameter name."""
        return None

    def logit_temperature(self, progress: Progress) -> float:
        """The temperature that divides ``scores`` (text queries) in the contrastive loss's
        logits at ``progress``; 1.0 when the score is itself the logit (AGR's routed score)."""
        return 1.0

    def step0_scalars(self) -> dict[str, tuple[LearnableScalar, str]]:
        """Learned scalars whose effect on the loss the step-0 check measures, by role
        ("curvature", "temperature"): ``{role: (scalar, config key of its start value)}``."""
        return {}

    # --- entailment (eval/entailment.py asks this) ---------------------------------------------
    #: one line naming what ``entailment_scores`` measures, for reports (None: nothing)
    entailment_measure: ClassVar[str | None] = None

    def entailment_scores(
        self, general: Embedding, specific: Embedding, specific_modality: Query = "image"
    ) -> Tensor | None:
        """[n] float64: how strongly text row i of ``general`` entails row i of ``specific``
        (an image, or a more specific text: ``specific_modality``), higher = more; the recipe's
        own entailment-capable quantity (a cone margin, an exterior angle, an order of distances
        to the origin). None when the geometry has none (a sphere has no origin and no cones):
        the evaluation then marks entailment n/a. Default: None."""
        return None

    # --- tuning (curvalign.report.tuning) -------------------------------------------------------
    @classmethod
    def search_space(cls) -> dict[str, Knob]:
        """The knobs ``curvalign benchmark --tune`` searches, {override key: Knob}: keys are
        ``TrainConfig`` or ``Config`` fields (or names ``search_overrides`` turns into fields).
        Default: the shared nuisance knobs (``shared_search_space``); a recipe adds the method
        knobs its paper leaves open at the end of its class."""
        return shared_search_space(cls)

    @classmethod
    def search_overrides(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """Config overrides {key: value} for one sampled point of ``search_space``. Default: the
        point itself (every knob is a config field)."""
        return dict(params)

    def phase_steps(self, total: int) -> tuple[int, ...]:
        """The steps at which this recipe's curriculum changes phase in a run of ``total`` steps
        (ascending; a ramp counts until it ends). Tuning prunes no trial before the last of them
        (a curriculum is judged after its phases). Default: () (no curriculum)."""
        return ()


def _flat_parts(emb: Embedding, mapped: Mapping[str, Tensor]) -> Tensor:
    """Every ``[N, ...]`` tensor of ``emb`` (or its replacement in ``mapped``) flattened to
    ``[N, -1]`` float64, keys in sorted order, concatenated."""
    parts = []
    for key in sorted(emb):
        v = mapped[key] if key in mapped else emb[key].detach().double()
        if v.ndim < 2:
            continue
        parts.append(v.reshape(v.shape[0], -1))
    if not parts:
        raise InputError("embedding has no [N, ...] vectors to take a spectrum of")
    return torch.cat(parts, dim=1)


class HyperbolicRecipe(Recipe):
    """A recipe with one Lorentz part: the points under ``hyperbolic_key`` (``[N, d]``, or
    ``[N, k, d]`` for a product of k factors) with the learnable curvature ``self.curvature``
    (a ``LearnableScalar``: scalar, or ``[k]`` per factor). Answers the geometry questions."""

    hyperbolic_key: ClassVar[str] = "point"
    curvature: LearnableScalar

    def curvature_value(self) -> Tensor:
        with torch.no_grad():
            return self.curvature().detach().double()

    def distance_to_origin(self, emb: Embedding) -> Tensor | None:
        """``dist0`` of the Lorentz part in float64; for k factors the mean over the factors (the
        same 1/k average as PHyCLIP's training distance)."""
        points = emb.get(self.hyperbolic_key)
        if points is None:
            return None
        d = lorentz.dist0(points.detach().double(), self.curvature_value())
        return d.mean(dim=-1) if points.ndim == 3 else d

    def curvature_bounds(self) -> tuple[float, float] | None:
        c = self.curvature
        if not c.learnable:
            return None
        return (c.min or 0.0, c.max if c.max is not None else float("inf"))

    def step0_scalars(self) -> dict[str, tuple[LearnableScalar, str]]:
        out = {"curvature": (self.curvature, "curvature_init")}
        temperature = getattr(self, "temperature", None)
        if isinstance(temperature, LearnableScalar):
            out["temperature"] = (temperature, "temperature_init")
        return out

    entailment_measure: ClassVar[str | None] = (
        "distance-to-origin order: dist0(specific) - dist0(general)"
    )

    def entailment_scores(
        self, general: Embedding, specific: Embedding, specific_modality: Query = "image"
    ) -> Tensor | None:
        """The more specific item lies further from the origin: ``dist0(specific) -
        dist0(general)`` (the order hierarchy ordering tests), for a recipe whose training has
        no cone or angle of its own. None without a hyperbolic part."""
        d_general = self.distance_to_origin(general)
        d_specific = self.distance_to_origin(specific)
        if d_general is None or d_specific is None:
            return None
        return d_specific - d_general

    def tangent_features(self, emb: Embedding) -> Tensor:
        mapped = {}
        if self.hyperbolic_key in emb:
            points = emb[self.hyperbolic_key].detach().double()
            mapped[self.hyperbolic_key] = lorentz.logmap0(points, self.curvature_value())
        return _flat_parts(emb, mapped)


def cone_margin(general: Tensor, specific: Tensor, c: Tensor, eta: float, K: float) -> Tensor:
    """[n] float64 ``eta * half_aperture(g) - exterior_angle(g, s)``: how far the specific
    point lies inside the general point's entailment cone (negative outside). Minus MERU's cone
    violation (Eq. 7) without its hinge, so points inside the cone keep their order instead of
    all scoring 0. Points ``[n, d]``, or ``[n, k, d]`` with ``c: [k]`` (the mean over the k
    factors, as PHyCLIP's entailment loss averages them)."""
    g, s = general.detach().double(), specific.detach().double()
    margin = eta * lorentz.half_aperture(g, c, K=K) - lorentz.exterior_angle(g, s, c)
    return margin.mean(dim=-1) if g.ndim == 3 else margin


def eta_cone_margin(
    recipe: HyperbolicRecipe, general: Embedding, specific: Embedding, specific_modality: Query
) -> Tensor:
    """:func:`cone_margin` of ``{"point"}`` embeddings with the cone width of a recipe whose
    config names ``eta_inter`` (the specific item is an image), ``eta_intra`` (a text) and
    ``aperture_K``: HyCoCLIP's and PHyCLIP's cones."""
    cfg = recipe.config
    eta = cfg.eta_inter if specific_modality == "image" else cfg.eta_intra
    return cone_margin(
        general["point"], specific["point"], recipe.curvature_value(), eta, cfg.aperture_K
    )


class CosineRecipe(Recipe):
    """A recipe whose embedding is ``{"point": [N, d]}`` unit vectors ranked by cosine (CLIP,
    DualPath): scores, class embeddings (renormalised mean of the prompts) and an exact cosine
    index proxy. No origin (the sphere has none), so no hierarchy ordering."""

    embedding_geometry: ClassVar[Mapping[str, GeometryKind]] = {"point": "sphere"}
    #: a cosine head at the alignment's projections ranks exactly like its cosine (only float
    #: rounding can split a near-tie differently)
    warm_start_tolerance: ClassVar[float | None] = 0.0

    def scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        return cosine_scores(texts["point"], images["point"])

    def pair_scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        return cosine_pair_scores(texts["point"], images["point"])

    def class_embedding(self, prompts: Embedding) -> Embedding:
        return {"point": sphere.project(prompts["point"].mean(dim=0, keepdim=True), 1.0)}

    def index_proxies(self) -> dict[str, IndexProxy]:
        return {"cosine": IndexProxy("cosine", "point", exact=True)}


#: the head initialisations a recipe may offer: "align" (the default) starts the heads at the
#: data's linear alignment (``data.alignment``: the identity where the two sides share a space,
#: else a ridge map, chosen on validation; ``Recipe.warm_start``), "input" at one shared
#: orthonormal projection (the frozen features' ranking where the sides share a space, random
#: otherwise), "paper" at the paper's random init
HEAD_INITS = ("align", "paper", "input")


def set_projections(heads: list[nn.Module], alignment: LinearAlignment) -> None:
    """Set the linear ``proj`` [width, D] of an (image head, text head) pair to the alignment's
    projections (``LinearAlignment.projections(width)``, transposed)."""
    image_layer, text_layer = (linear_proj(h) for h in heads)
    width = image_layer.weight.shape[0]
    if text_layer.weight.shape[0] != width:
        raise ValueError("the image and text heads of a warm start must have one width")
    image_proj, text_proj = alignment.projections(int(width))
    with torch.no_grad():
        for layer, proj in ((image_layer, image_proj), (text_layer, text_proj)):
            if layer.weight.shape[1] != proj.shape[0]:
                raise ValueError(
                    f"the warm start was fit on {proj.shape[0]}-d features, the head takes "
                    f"{layer.weight.shape[1]}-d"
                )
            layer.weight.copy_(proj.T.to(layer.weight.dtype))
            if layer.bias is not None:
                layer.bias.zero_()


def start_agreement(recipe: Recipe, alignment: LinearAlignment, max_texts: int = 512) -> str:
    """How close ``recipe``'s start ranks to ``alignment``, on train captions the alignment was
    fit on (``LinearAlignment.train_pairs``): "train mean R@1 <recipe> vs <alignment>" (both
    directions averaged; the recipe's own ``scores``, text and image queries). For the
    ``warm_start`` line; the validation figures are the run's step-0 validation."""
    from curvalign.data.alignment import cosine_mean_r1, mean_r1

    images, texts, owner = alignment.train_pairs(max_texts)
    was_training = recipe.training
    recipe.eval()
    try:
        with torch.no_grad():
            dtype = next(recipe.parameters()).dtype
            emb_i = recipe.embed_images(images.to(dtype))
            emb_t = recipe.embed_texts(texts.to(dtype))
            score = mean_r1(
                recipe.scores(emb_t, emb_i, "text").float(),
                owner,
                recipe.scores(emb_t, emb_i, "image").float(),
            )
    finally:
        recipe.train(was_training)
    reference = cosine_mean_r1(images @ alignment.image_map, texts, owner)
    return f"train mean R@1 {score:.1f} vs the alignment's {reference:.1f}"


def box_batch_points(
    image_head: nn.Module, text_head: nn.Module, batch: Batch, c: Tensor
) -> dict[str, Tensor]:
    """The points of a batch with boxes (``check_batch(..., boxes=True)`` first) for the recipes
    that embed box crops and box phrases through the same heads as whole images and captions
    (HyCoCLIP, PHyCLIP): "image", "text", "box_image", "box_text", each [B, ...] at curvature c."""
    return {
        "image": image_head(batch.image, c),
        "text": text_head(batch.text, c),
        "box_image": image_head(batch.box_image, c),
        "box_text": text_head(batch.box_text, c),
    }


def check_scalar_range(name: str, init: float, low: float, high: float | None = None) -> None:
    """A learnable scalar's config range, one clear error otherwise: ``0 < NAME_min <= NAME_init``
    and, where the scalar has an upper bound, ``NAME_init <= NAME_max``."""
    if high is None:
        if not 0 < low <= init:
            raise ValueError(f"need 0 < {name}_min <= {name}_init, got {low}, {init}")
    elif not 0 < low <= init <= high:
        raise ValueError(
            f"need 0 < {name}_min <= {name}_init <= {name}_max, got {low}, {init}, {high}"
        )


def check_head_init(head_init: str, embed_dim: int) -> None:
    """The config of a recipe whose two heads may start at the input-preserving projection:
    ``head_init`` one of ``HEAD_INITS`` and a positive ``embed_dim``."""
    if head_init not in HEAD_INITS:
        raise ValueError(f"head_init must be one of {', '.join(HEAD_INITS)}, got {head_init!r}")
    if embed_dim <= 0:
        raise ValueError(f"embed_dim must be positive, got {embed_dim}")


class TemperatureSettings(Protocol):
    """The config fields of a learnable contrastive temperature (``learnable_temperature``)."""

    @property
    def temperature_init(self) -> float: ...
    @property
    def temperature_min(self) -> float | None: ...
    @property
    def learn_temperature(self) -> bool: ...


class CurvatureSettings(Protocol):
    """The config fields of a learnable curvature (``learnable_curvature``)."""

    @property
    def curvature_init(self) -> float: ...
    @property
    def curvature_min(self) -> float | None: ...
    @property
    def curvature_max(self) -> float | None: ...
    @property
    def learn_curvature(self) -> bool: ...


def learnable_temperature(config: TemperatureSettings) -> LearnableScalar:
    """The contrastive temperature tau of a config with ``temperature_init``, ``temperature_min``
    and ``learn_temperature`` (no upper bound)."""
    return LearnableScalar(
        config.temperature_init, min=config.temperature_min, learnable=config.learn_temperature
    )


def learnable_curvature(config: CurvatureSettings, shape: tuple[int, ...] = ()) -> LearnableScalar:
    """The curvature c of a config with ``curvature_init``, ``_min``, ``_max`` and
    ``learn_curvature``: a scalar, or one per factor with ``shape=(k,)``."""
    return LearnableScalar(
        config.curvature_init,
        min=config.curvature_min,
        max=config.curvature_max,
        shape=shape,
        learnable=config.learn_curvature,
    )


class HeadScaleSettings(Protocol):
    """The config fields that set a curved head's scale before ``expmap0`` (``head_scales``)."""

    scale_init: float | None
    image_scale_init: float | None
    text_scale_init: float | None
    tangent_norm_init: float
    text_radius_ratio: float


#: the config keys of the head-scale rule (``head_scales``): its input, then the per-side
#: overrides; the step-0 check names them when the points start too near the origin
HEAD_SCALE_KNOBS = ("tangent_norm_init", "image_scale_init", "text_scale_init")


def check_head_scale_settings(config: HeadScaleSettings) -> None:
    """Validate the head-scale fields (a config's ``__post_init__`` calls this) and fold the
    deprecated ``scale_init`` into the per-side overrides: ``scale_init=v`` reads as
    ``image_scale_init=v``, ``text_scale_init=v * text_radius_ratio`` (what it meant before),
    for a side not set itself, with a ``DeprecationWarning``; ``scale_init`` is then None, so a
    run saves only the per-side values. A saved config whose per-side values are both set
    (every run resolves them) loads without the warning."""
    for name in ("scale_init", "image_scale_init", "text_scale_init"):
        value = getattr(config, name)
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"{name} must be positive or None, got {value}")
    for name in ("tangent_norm_init", "text_radius_ratio"):
        value = getattr(config, name)
        if not 0 < value < float("inf"):
            raise ValueError(f"{name} must be positive, got {value}")
    old = config.scale_init
    if old is None:
        return
    if config.image_scale_init is None or config.text_scale_init is None:
        warnings.warn(
            f"scale_init is deprecated (removed in 0.3.0): scale_init={old:g} is read as "
            f"image_scale_init={old:g}, text_scale_init={old * config.text_radius_ratio:g}; set "
            "those (the explicit per-side scales), or tangent_norm_init (the images' step-0 "
            "radius) and text_radius_ratio for the data-aware rule (docs/methods.md, 'The rule')",
            DeprecationWarning,
            stacklevel=4,
        )
    if config.image_scale_init is None:
        config.image_scale_init = old
    if config.text_scale_init is None:
        config.text_scale_init = old * config.text_radius_ratio
    config.scale_init = None


def head_scales(
    config: HeadScaleSettings, resolve: Callable[[str, float], float]
) -> tuple[float, float]:
    """(image, text) scale of a curved head pair: **the one rule** (docs/methods.md, "The rule").

    Each side's explicit scale wins (``image_scale_init``, ``text_scale_init``: also what a run
    records as its resolved start); a side left unset is resolved from the data so that its
    mean step-0 tangent norm (= distance to the origin) is ``tangent_norm_init`` for the
    images and ``text_radius_ratio`` times that for the texts: ``resolve(side, target)`` is
    the recipe's resolution (``nn.heads.resolve_tangent_scale`` through its projection)."""
    image = config.image_scale_init
    text = config.text_scale_init
    if image is None:
        image = resolve("image", config.tangent_norm_init)
    if text is None:
        text = resolve("text", config.tangent_norm_init * config.text_radius_ratio)
    return float(image), float(text)


@dataclass
class LorentzConfig:
    """Fields shared by the Lorentz recipes (MERU, HyCoCLIP, AtMG); defaults from MERU/HyCoCLIP.

    embed_dim         d, the hyperboloid's space dimension (512)
    curvature_*       c init 1.0, learnable, clamped to [0.1, 10] (docs/design.md; MERU's code: init/10,
                      init*10); ``learn_curvature=False`` fixes it (the curvature study)
    temperature_*     tau init 0.07, learnable, floored at 0.01
    tangent_norm_init the images' mean step-0 tangent norm (= distance to the origin) the
                      head scales are resolved for (1.0: MERU's init on MERU's features)
    text_radius_ratio texts' step-0 radius over the images' (1.0; AtMG: a gap, see atmg.py)
    image_scale_init, text_scale_init
                      each side's scale before ``expmap0``; None: resolved by the rule above
                      from the train rows' mean feature norm (``head_scales``,
                      ``nn.heads.resolve_tangent_scale``, docs/methods.md); a run records the
                      resolved values here. Without feature statistics (a recipe built by hand)
                      the rule reads the papers' features, norm sqrt(D): MERU's 1/sqrt(embed_dim)
    scale_init        deprecated: ``scale_init=v`` reads as ``image_scale_init=v``,
                      ``text_scale_init=v * text_radius_ratio`` (``check_head_scale_settings``)
    scale_max         the scale's upper bound (MERU: 1, it may only shrink features); raised to
                      the resolved scale where that lies above it (features of norm < 1)
    clip_norm         optional bound kappa on the tangent norm before ``expmap0`` (None = off)
    aperture_K        the cone constant K of the half-aperture (0.1)
    head_init         "align" (the data's linear alignment, ``Recipe.warm_start``), "input" (one
                      shared orthonormal projection for both sides: the frozen features'
                      ranking where they share a space; ``nn.heads.
                      share_input_preserving_projection``) or "paper" (MERU's random projections)
    """

    embed_dim: int = 512
    curvature_init: float = 1.0
    curvature_min: float = 0.1
    curvature_max: float = 10.0
    learn_curvature: bool = True
    temperature_init: float = 0.07
    temperature_min: float = 0.01
    learn_temperature: bool = True
    scale_init: float | None = None
    scale_max: float | None = 1.0
    clip_norm: float | None = None
    aperture_K: float = 0.1
    head_init: str = "align"
    image_scale_init: float | None = None
    text_scale_init: float | None = None
    tangent_norm_init: float = 1.0
    text_radius_ratio: float = 1.0

    def __post_init__(self) -> None:
        check_head_init(self.head_init, self.embed_dim)
        check_head_scale_settings(self)
        check_scalar_range("curvature", self.curvature_init, self.curvature_min, self.curvature_max)
        check_scalar_range("temperature", self.temperature_init, self.temperature_min)
        if self.aperture_K <= 0:
            raise ValueError(f"aperture_K must be positive, got {self.aperture_K}")


def round_resolved(value: float) -> float:
    """A value resolved from feature statistics, kept to 4 significant digits: what
    ``--print-config`` shows and ``config.json`` saves is what the run is built with."""
    return float(f"{value:.4g}")


def lorentz_head_scales(
    config: LorentzConfig,
    image_dim: int,
    text_dim: int,
    image_norm: float | None = None,
    text_norm: float | None = None,
) -> tuple[float, float]:
    """(image, text) scale of the Lorentz heads of ``config`` for features of widths
    ``image_dim``/``text_dim`` and mean norms ``image_norm``/``text_norm`` (None: the papers'
    features, norm sqrt(D)), by ``head_scales``; a side's target tangent norm is reached
    through the head's projection (``nn.heads.resolve_tangent_scale``)."""
    # the warm start's projections keep each side's mean norm (gain 1), as the shared
    # orthonormal projection does where the two sides share a width
    preserving = config.head_init == "align" or (
        config.head_init == "input" and image_dim == text_dim
    )
    if config.head_init == "align":  # gain 1 at any width, narrower than the input too
        image_dim = text_dim = config.embed_dim
    inputs = {"image": (image_dim, image_norm), "text": (text_dim, text_norm)}

    def resolve(side: str, target: float) -> float:
        dim, norm = inputs[side]
        return resolve_tangent_scale(target, norm, dim, config.embed_dim, preserving)

    return head_scales(config, resolve)


class LorentzRecipe(HyperbolicRecipe):
    """Image and text ``LorentzHead``s sharing one learnable curvature, and a temperature.
    Ranked by ``-d_L`` of ``point``: a Lorentz index answers exactly."""

    embedding_geometry = {"point": "lorentz"}
    scale_knobs = HEAD_SCALE_KNOBS
    temperature_knob = "temperature_init"
    #: ``-d_L`` ranks like the alignment's cosine only for points at one radius; the ridge
    #: map spreads the images' norms (``warm_start``): the largest gap measured on the test
    #: stores of tests/test_warm_start.py over three world seeds is 4.5 (MERU, HyCoCLIP; AtMG
    #: 2.6), plus a margin of about three validation images
    warm_start_tolerance = 6.0

    @classmethod
    def resolve_init(cls, config: LorentzConfig, norms: FeatureNorms) -> dict[str, Any]:
        """Each side's scale from its mean feature norm (``lorentz_head_scales``), and
        ``scale_max`` where the resolved scale lies above it."""
        image, text = lorentz_head_scales(
            config, norms.image_dim, norms.text_dim, norms.image_norm, norms.text_norm
        )
        image, text = round_resolved(image), round_resolved(text)
        out: dict[str, Any] = {"image_scale_init": image, "text_scale_init": text}
        if config.scale_max is not None and max(image, text) > config.scale_max:
            out["scale_max"] = max(image, text)
        return out

    def logit_temperature(self, progress: Progress) -> float:
        return float(self.temperature.value)

    def __init__(self, config: LorentzConfig, image_dim: int, text_dim: int) -> None:
        super().__init__(config, image_dim, text_dim)
        image_scale, text_scale = lorentz_head_scales(config, image_dim, text_dim)
        scale_max = config.scale_max
        if scale_max is not None:
            scale_max = max(scale_max, image_scale, text_scale)
        self.image_head = LorentzHead(
            image_dim,
            config.embed_dim,
            scale_init=image_scale,
            scale_max=scale_max,
            clip_norm=config.clip_norm,
        )
        self.text_head = LorentzHead(
            text_dim,
            config.embed_dim,
            scale_init=text_scale,
            scale_max=scale_max,
            clip_norm=config.clip_norm,
        )
        if config.head_init == "input":
            share_input_preserving_projection([self.image_head, self.text_head])
        self.curvature = learnable_curvature(config)
        self.temperature = learnable_temperature(config)

    def warm_start(self, alignment: LinearAlignment) -> str:
        """Both heads' projections at the alignment's (``set_projections``), each side at its
        data-aware tangent scale (unchanged: the projections keep the mean norm). ``-d_L``
        ranks like the alignment's cosine for points at one radius (at a fixed radius the
        distance is monotone in the angle); the ridge map's images spread in norm, so the start
        is close, not equal (the run records both validation scores)."""
        set_projections([self.image_head, self.text_head], alignment)
        return "Lorentz heads at the alignment's projections, data-aware tangent scales"

    def embed_images(self, features: Tensor) -> Embedding:
        return {"point": self.image_head(features, self.curvature())}

    def embed_texts(self, features: Tensor, mask: Tensor | None = None) -> Embedding:
        return {"point": self.text_head(features, self.curvature())}

    def scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        return lorentz_distance_scores(texts["point"], images["point"], self.curvature())

    def pair_scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        return lorentz_distance_pair_scores(texts["point"], images["point"], self.curvature())

    def class_embedding(self, prompts: Embedding) -> Embedding:
        return {"point": lorentz.tangent_mean(prompts["point"], self.curvature())}

    def index_proxies(self) -> dict[str, IndexProxy]:
        return {"lorentz": IndexProxy("lorentz", "point", exact=True)}

    def log_values(self) -> dict[str, float]:
        return {
            **self.temperature.summary("temperature"),
            **self.curvature.summary("curvature"),
            **self.image_head.scale.summary("scale/image"),
            **self.text_head.scale.summary("scale/text"),
        }

    def _distance_info_nce(
        self,
        local: dict[str, Tensor],
        everyone: dict[str, Tensor],
        c: Tensor,
        tau: Tensor,
        offset: int,
    ) -> Tensor:
        """Symmetric InfoNCE on ``-d_L / tau``: local images vs all texts, local texts vs all images."""
        if everyone["text"] is local["text"] and everyone["image"] is local["image"]:
            # one process: the two directions score the same pairs and the distance is
            # symmetric, so one matrix and its transpose (half the B x B work)
            scores = lorentz_distance_scores(local["image"], local["text"], c)
            return symmetric_info_nce(scores, scores.T, temperature=tau, offset=offset)
        return symmetric_info_nce(
            lorentz_distance_scores(local["image"], everyone["text"], c),
            lorentz_distance_scores(local["text"], everyone["image"], c),
            temperature=tau,
            offset=offset,
        )


# --- search spaces: what tuning may change, declared next to the method -----------------------


@dataclass(frozen=True)
class Knob:
    """One tunable setting of a search space.

    kind     "float" (``low`` .. ``high``, log-uniform when ``log``), "int" (``low`` .. ``high``)
             or "choice" (one of ``choices``)
    role     "nuisance" (learning rate, decay, temperature, scales: tuned for every method alike)
             or "method" (a knob of the method its paper leaves open)
    why      one line: where the range comes from
    default  the knob's value at the recipe's defaults when the knob is not itself a config
             field (``curriculum_scale`` 1.0: the paper's boundaries); None: the config's value
    factor_of  config keys whose data-resolved values this knob multiplies (a factor on the
             per-side scales a recipe resolves from the features: the tuner resolves them on
             the tuning store, then scales them; default 1.0 = the resolved values)
    covers   config keys the knob moves without being one of them (the per-side scales that
             ``tangent_norm_init`` is resolved into): the step-0 check may name them, and the
             search space holds them through this knob
    """

    kind: Literal["float", "int", "choice"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()
    role: Literal["nuisance", "method"] = "nuisance"
    why: str = ""
    default: Any = None
    factor_of: tuple[str, ...] = ()
    covers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind == "choice":
            if not self.choices:
                raise ValueError("a 'choice' knob needs choices")
        elif self.kind in ("float", "int"):
            if self.low is None or self.high is None or not self.low < self.high:
                raise ValueError(
                    f"a {self.kind!r} knob needs low < high, got {self.low}, {self.high}"
                )
            if self.log and self.low <= 0:
                raise ValueError(f"a log-scale knob needs low > 0, got {self.low}")
        else:
            raise ValueError(f"knob kind must be float, int or choice, got {self.kind!r}")

    def contains(self, value: Any) -> bool:
        """Whether ``value`` lies in this knob's range (or is one of its choices)."""
        if self.kind == "choice":
            return value in self.choices
        return self.low <= value <= self.high

    @property
    def moves(self) -> tuple[str, ...]:
        """The config keys this knob moves besides its own name (``factor_of`` and ``covers``)."""
        return (*self.factor_of, *self.covers)


#: the learning-rate range around a recipe's paper rate: the papers' rates were set for 100K+
#: step runs at batch sizes in the thousands; short runs on frozen features want more (the
#: studies train at 10x), so the range reaches 30x above and 3x below
LR_RANGE_BELOW, LR_RANGE_ABOVE = 3.0, 30.0


def config_field_defaults(cls: type[Recipe]) -> dict[str, Any]:
    """{field: default} of a recipe's ``Config`` (fields without a plain default left out)."""
    import dataclasses

    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls.Config):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def shared_search_space(cls: type[Recipe]) -> dict[str, Knob]:
    """The nuisance knobs every recipe is tuned on, where its ``Config`` has them: learning rate
    (log, ``LR_RANGE_BELOW`` below to ``LR_RANGE_ABOVE`` above its paper rate), weight decay,
    temperature init, the head scale (the step-0 tangent norm the data-aware per-side scales aim
    at, ``tangent_norm_init``, where the recipe resolves its scales from the features; else the
    raw scale up to its cap) and the curvature (init around the default within its bounds,
    learned or fixed)."""
    lr = float(dict(cls.train_defaults).get("lr", 1e-3))
    space: dict[str, Knob] = {
        "lr": Knob(
            "float",
            lr / LR_RANGE_BELOW,
            lr * LR_RANGE_ABOVE,
            log=True,
            why=f"paper rate {lr:g}: /{LR_RANGE_BELOW:g} to x{LR_RANGE_ABOVE:g}",
        ),
        "weight_decay": Knob("float", 1e-5, 0.5, log=True, why="AdamW decay, 1e-5 to 0.5"),
    }
    fields = config_field_defaults(cls)
    if "temperature_init" in fields:
        space["temperature_init"] = Knob(
            "float", 0.02, 0.2, log=True, why="CLIP's 0.07 within about 3x either way"
        )
    if "tangent_norm_init" in fields:
        # a factor on the data-aware per-side scales: one raw scale for both sides would undo
        # them where image and text norms differ (COCO-MINI: EfficientNet images vs unit-norm
        # MiniLM texts, tuned MERU/HyCoCLIP/PHyCLIP fell to chance with ``scale_init``)
        space["tangent_norm_init"] = Knob(
            "float",
            0.1,
            3.0,
            log=True,
            why="step-0 tangent norm the per-side scales aim at",
            covers=tuple(k for k in getattr(cls, "scale_knobs", ()) if k != "tangent_norm_init"),
        )
    elif "scale_init" in fields:
        cap = fields.get("scale_max") or 1.0
        space["scale_init"] = Knob(
            "float", min(0.03, cap / 2), cap, log=True, why=f"head scale up to its cap {cap:g}"
        )
    if "curvature_init" in fields:
        c0 = float(fields["curvature_init"])
        low = max(float(fields.get("curvature_min") or c0 / 10), c0 / 10)
        high = min(float(fields.get("curvature_max") or c0 * 10), c0 * 10)
        if low < high:
            space["curvature_init"] = Knob(
                "float", low, high, log=True, role="method", why="within the clamp, 10x around"
            )
        if "learn_curvature" in fields:
            space["learn_curvature"] = Knob(
                "choice", choices=(True, False), role="method", why="learned or fixed curvature"
            )
    return space
