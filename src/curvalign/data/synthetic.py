"""The synthetic world: a feature store whose true structure is known, built from a seed.

Latent model (all vectors in a latent space of ``latent_dim`` dimensions)
    Concepts form one taxonomy: a global root ``entity`` (no vector of its own), one child per
    concept family (``animal``, ``vehicle``, ...), and below each family a complete tree of
    ``branching`` children per node, ``depth`` levels deep; the leaves are the zero-shot
    classes. Every non-root node has a random vector; the *path vector* of a node is the sum
    of the vectors from its family down to it, so a node's path vector contains its parent's.
    Attribute families (colour, size, texture, material) have one random vector per value.

    A *mention* is (node, attributes): its latent is
        m = p + a + binding * sqrt(L) * (p Q) * a
    with ``p`` the node's path vector, ``a`` the sum of the mentioned attribute vectors and
    ``Q`` a fixed random rotation. The product term binds attributes to their object, so
    swapping attributes between two objects changes the latent.

Images
    1..``max_objects`` objects from distinct families, each a random leaf with one value of
    every attribute family. The first object is the main one (weight 1, its leaf is the image's
    class); the others are weighted ``secondary_weight``. Image latent = weighted sum of the
    objects' full mentions + ``background`` * (a nuisance vector no text describes) +
    ``image_noise`` * noise, sent through a fixed random 2-layer tanh MLP into ``image_dim``.

Texts
    Each caption mentions every object of its image, each at a level drawn from its path (the
    leaf with probability 1 - ``generality``, its parent with ``generality`` * (1 -
    ``generality``), ... never above the family), with each attribute kept with probability
    ``attribute_mention``. Caption latent = sum of the mentions + ``text_noise`` * noise, sent
    through a *different* fixed random MLP into ``text_dim``. Texts are more general than
    images and use another map: the modality gap is real.

Derived parts (every optional group of the FeatureStore is present)
    boxes       one per object: the object alone (image map) and its mention in the image's
                first caption (text map).
    text pairs  from train images: two captions of one image, captions of two images whose
                main objects share a family, random captions; the score is the cosine of the
                two texts' weighted concept sets (the nodes on each mention's path, weight 1;
                each mentioned attribute bound to its object's family, weight 0.5).
    classes     one per leaf; prompts = leaf path vector + one of ``templates`` fixed context
                vectors of norm about ``template_scale``, text map, no noise.
    multilabels every object of an image is one of its classes (its leaf): 1-3 per image;
                ``image_labels`` is the first (main) object's.
    negatives   for every test caption, as far as the caption allows: object_replaced (one
                mention's node replaced by a sibling), attribute_replaced (one mentioned value
                replaced), object_added (an object of a family absent from the image), swapped
                (attribute values exchanged between two objects); same noise as the caption, so
                only the structure differs.
    chains      for each test image whose captions mention an attribute of the main object:
                [those attributes alone, main object with them, the full caption] (general ->
                specific: each text's content contains the previous one's).
    splits      "train" / "test", a random ``test_fraction`` of the images in "test".

Determinism: every part draws from its own ``torch.Generator`` seeded from (``seed``, part
name), never from global RNG state. So the concepts and maps depend only on the seed and the
dimensions: ``synthetic:images=500`` lives in the same world as the default.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

import torch
from torch import Tensor

from curvalign.data.features import FeatureStore, TextPart

FAMILY_NAMES = ("animal", "vehicle", "plant", "furniture", "food", "tool", "instrument", "building")
ATTRIBUTE_FAMILIES: dict[str, tuple[str, ...]] = {
    "colour": ("red", "green", "blue", "yellow", "black", "white"),
    "size": ("small", "medium", "large"),
    "texture": ("smooth", "rough", "striped", "spotted"),
    "material": ("wooden", "metal", "plastic", "glass", "fabric"),
}
NEGATIVE_KINDS = ("object_replaced", "attribute_replaced", "object_added", "swapped")
CHAIN_LEVELS = ("attributes", "noun phrase", "caption")
PAIR_KINDS = ("same_image", "related", "random")
PARAPHRASE_KINDS = ("same_topic", "same_group", "random")
ROOT_NAME = "entity"


@dataclass
class SyntheticConfig:
    """Knobs of the synthetic world (every one can be set in a spec: ``synthetic:images=500,seed=3``).

    Sizes
        images              number of images
        captions_min/max    captions per image, drawn uniformly in [min, max]
        max_objects         objects per image, drawn uniformly in [1, max_objects]
        text_pairs          scored text-text pairs (DualPath)
        templates           prompt templates per class
        test_fraction       share of images in the "test" split
        val_fraction        share of images in the "val" split (model selection), drawn from
                            the non-test images so that the test split does not depend on it
    Structure
        families            concept families (at most 8 named ones, more get generic names)
        depth               levels below each family node; leaves are at this depth
        branching           children per taxonomy node; classes = families * branching**depth
        attribute_families  how many of colour, size, texture, material objects carry (0..4)
    Dimensions
        latent_dim, image_dim, text_dim, hidden_dim (width of the random MLP maps)
    Difficulty
        image_noise, text_noise  norm of the latent noise added before each map
        background          norm of the per-image nuisance vector that no text mentions
        secondary_weight    weight of the non-main objects in the image latent
        attribute_scale     norm of an attribute vector (concept vectors have norm ~1)
        binding             strength of the attribute-object binding term
        generality          probability that a caption mentions an object one level higher
        attribute_mention   probability that a caption mentions a given attribute of an object
        template_scale      norm of a prompt template's context vector
        gain                pre-activation gain of the maps (higher: more nonlinear)
    Study options (0 = off; see "Study options" at the end of the module)
        paraphrase_topics   > 0: the text pairs are paraphrases from their own distribution
                            (topics no image carries) instead of caption pairs
        paraphrase_scale    norm of a paraphrase topic vector
        heldout_pairs       held-out paraphrase pairs kept on the world (not in the store)
        leaf_pairs          > 0: images hold one or two objects, and every two-object image
                            takes its (main, second) leaves from this many fixed leaf pairs
    seed                    seeds every random draw
    """

    images: int = 3000
    captions_min: int = 3
    captions_max: int = 5
    max_objects: int = 3
    text_pairs: int = 3000
    templates: int = 4
    test_fraction: float = 0.2
    val_fraction: float = 0.1

    families: int = 4
    depth: int = 3
    branching: int = 3
    attribute_families: int = 3

    latent_dim: int = 64
    image_dim: int = 128
    text_dim: int = 96
    hidden_dim: int = 256

    image_noise: float = 1.5
    text_noise: float = 0.5
    background: float = 1.5
    secondary_weight: float = 0.6
    attribute_scale: float = 0.7
    binding: float = 0.5
    generality: float = 0.5
    attribute_mention: float = 0.6
    template_scale: float = 0.3
    gain: float = 3.0

    # Study options (off by default: the world is unchanged unless one is set; see the section
    # "Study options" at the end of this module)
    paraphrase_topics: int = 0
    paraphrase_scale: float = 1.5
    heldout_pairs: int = 600
    leaf_pairs: int = 0

    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first knob out of its range (the rules of
        :func:`_config_rules`, in order)."""
        for broken, message in _config_rules(self):
            if broken:
                raise ValueError(f"synthetic world: {message}")


_POSITIVE_KNOBS = (
    "images", "captions_min", "max_objects", "templates", "families", "depth", "branching",
    "latent_dim", "image_dim", "text_dim", "hidden_dim",
)  # fmt: skip
_COUNT_KNOBS = ("text_pairs", "paraphrase_topics", "heldout_pairs", "leaf_pairs")
_SCALE_KNOBS = (
    "image_noise", "text_noise", "background", "secondary_weight", "attribute_scale", "binding",
    "template_scale", "gain",
)  # fmt: skip


def _config_rules(cfg: SyntheticConfig) -> Iterator[tuple[bool, str]]:
    """``(broken, message)`` for every rule a world's config must satisfy, in the order they
    are checked; lazily, so a later rule may assume the earlier ones hold."""
    for name in _POSITIVE_KNOBS:
        yield getattr(cfg, name) < 1, f"{name} must be >= 1, got {getattr(cfg, name)}"
    yield (
        cfg.captions_max < cfg.captions_min,
        f"captions_max ({cfg.captions_max}) < captions_min ({cfg.captions_min})",
    )
    yield (
        cfg.max_objects > cfg.families,
        f"max_objects ({cfg.max_objects}) > families ({cfg.families}); "
        "objects of one image come from distinct families",
    )
    yield cfg.branching < 2, "branching must be >= 2 (replaced-object negatives need siblings)"
    yield (
        not 0 <= cfg.attribute_families <= len(ATTRIBUTE_FAMILIES),
        f"attribute_families must be in [0, {len(ATTRIBUTE_FAMILIES)}]",
    )
    for name in _COUNT_KNOBS:
        yield getattr(cfg, name) < 0, f"{name} must be >= 0, got {getattr(cfg, name)}"
    yield 0 < cfg.paraphrase_topics < 2, "paraphrase_topics must be 0 (off) or >= 2"
    yield bool(cfg.leaf_pairs) and cfg.families < 2, "leaf_pairs needs at least 2 families"
    yield (
        not 0.0 < cfg.test_fraction < 1.0,
        f"test_fraction must be in (0, 1), got {cfg.test_fraction}",
    )
    yield (
        not 0.0 <= cfg.generality < 1.0,
        f"generality must be in [0, 1), got {cfg.generality}",
    )
    yield (
        not 0.0 <= cfg.attribute_mention <= 1.0,
        f"attribute_mention must be in [0, 1], got {cfg.attribute_mention}",
    )
    classes = cfg.families * cfg.branching**cfg.depth
    yield (
        cfg.depth > 12 or classes > 100_000,
        f"families * branching**depth = {classes} classes; at most 100000",
    )
    for name in _SCALE_KNOBS:
        value = getattr(cfg, name)
        yield (
            not value >= 0.0 or math.isinf(value),
            f"{name} must be finite and >= 0, got {value}",
        )
    n_test = round(cfg.images * cfg.test_fraction)
    yield (
        n_test < 1 or n_test >= cfg.images,
        f"{cfg.images} images with test_fraction {cfg.test_fraction} leave one split empty",
    )
    n_val = round(cfg.images * cfg.val_fraction)
    yield (
        not 0 <= cfg.val_fraction < 1 or n_test + n_val >= cfg.images,
        f"val_fraction must lie in [0, 1) and leave train images, got {cfg.val_fraction} with "
        f"test_fraction {cfg.test_fraction} of {cfg.images} images",
    )


def config_from_spec(argument: str) -> SyntheticConfig:
    """The config of the spec ``synthetic:ARGUMENT``, ``ARGUMENT`` = ``key=value,...`` (or "")."""
    overrides: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in argument.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(
                f"synthetic spec item {item!r} is not key=value (e.g. synthetic:images=500,seed=3)"
            )
        overrides[key.strip()] = value.strip()
    return config_from_overrides(overrides)


def config_from_overrides(overrides: dict[str, str]) -> SyntheticConfig:
    """A ``SyntheticConfig`` with string overrides parsed to each field's type."""
    known = {f.name: f for f in fields(SyntheticConfig)}
    values: dict[str, int | float] = {}
    for key, raw in overrides.items():
        if key not in known:
            raise ValueError(f"synthetic world has no option {key!r}; options: {', '.join(known)}")
        kind = type(getattr(SyntheticConfig(), key))
        try:
            values[key] = kind(raw)
        except ValueError:
            raise ValueError(
                f"synthetic world option {key}={raw!r}: expected {kind.__name__}"
            ) from None
    config = SyntheticConfig(**values)  # type: ignore[arg-type]
    config.check()
    return config


# --- the world's fixed parts ---------------------------------------------------------------------


def _generator(seed: int, part: str) -> torch.Generator:
    """An independent generator per part, so resizing one part leaves the others unchanged."""
    digest = hashlib.blake2b(f"{seed}/{part}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def _gaussian(shape: tuple[int, ...], norm: float, gen: torch.Generator) -> Tensor:
    """Rows of N(0, norm^2 / d) entries: vectors of norm about ``norm`` in d = shape[-1] dimensions."""
    return torch.randn(shape, generator=gen) * (norm / math.sqrt(shape[-1]))


class _RandomMLP:
    """A fixed random map R^L -> R^D: x -> tanh(gain * x W1 + b1) W2."""

    def __init__(
        self, latent_dim: int, hidden_dim: int, out_dim: int, gain: float, gen: torch.Generator
    ) -> None:
        self.w1 = torch.randn(latent_dim, hidden_dim, generator=gen) * (
            gain / math.sqrt(latent_dim)
        )
        self.b1 = torch.randn(hidden_dim, generator=gen) * 0.5
        self.w2 = torch.randn(hidden_dim, out_dim, generator=gen) / math.sqrt(hidden_dim)

    def __call__(self, z: Tensor) -> Tensor:
        return torch.tanh(z @ self.w1 + self.b1) @ self.w2


class _Taxonomy:
    """The concept forest under one root, nodes in breadth-first order (root = node 0)."""

    def __init__(self, config: SyntheticConfig) -> None:
        names = [ROOT_NAME]
        parents = [-1]
        levels = [0]
        frontier = []
        for f in range(config.families):
            names.append(FAMILY_NAMES[f] if f < len(FAMILY_NAMES) else f"family{f}")
            parents.append(0)
            levels.append(1)
            frontier.append(len(names) - 1)
        for level in range(2, config.depth + 2):
            next_frontier = []
            for node in frontier:
                for b in range(config.branching):
                    names.append(f"{names[node]}.{b}")
                    parents.append(node)
                    levels.append(level)
                    next_frontier.append(len(names) - 1)
            frontier = next_frontier
        self.names = names
        self.parents = parents
        self.levels = levels
        self.leaf_level = config.depth + 1
        self.leaves = frontier  # class c is leaf node self.leaves[c]
        self.children: list[list[int]] = [[] for _ in names]
        for node, parent in enumerate(parents):
            if parent >= 0:
                self.children[parent].append(node)
        family_of = [0] * len(names)
        for node in range(1, len(names)):
            family_of[node] = node - 1 if parents[node] == 0 else family_of[parents[node]]
        self.family_of = family_of  # family index of each node (root: 0, unused)
        # ancestor[n][l]: the ancestor of n at level l (n itself at its own level)
        self.ancestor = [[0] * (self.leaf_level + 1) for _ in names]
        for node in range(len(names)):
            n = node
            while n >= 0:
                self.ancestor[node][levels[n]] = n
                n = parents[n]
        self.leaves_per_family = config.branching**config.depth


@dataclass
class _Mentions:
    """A table of mentions, each owned by one output row (an image, a text, ...).

    owner [M], node [M] (-1: no concept, attributes only), attrs [M, A] (value index or -1),
    weight [M].
    """

    owner: Tensor
    node: Tensor
    attrs: Tensor
    weight: Tensor

    @staticmethod
    def from_lists(
        owner: list[int], node: list[int], attrs: list[list[int]], weight: list[float], n_attr: int
    ) -> _Mentions:
        return _Mentions(
            torch.tensor(owner, dtype=torch.long),
            torch.tensor(node, dtype=torch.long),
            torch.tensor(attrs, dtype=torch.long).reshape(len(owner), n_attr),
            torch.tensor(weight, dtype=torch.float32),
        )


class _Model:
    """Every fixed random part of the world: vectors and the two maps."""

    def __init__(self, config: SyntheticConfig, taxonomy: _Taxonomy) -> None:
        gen = _generator(config.seed, "concepts")
        latent = config.latent_dim
        node_vectors = _gaussian((len(taxonomy.names), latent), 1.0, gen)
        node_vectors[0] = 0.0  # the global root says nothing
        path = torch.zeros_like(node_vectors)
        for node, parent in enumerate(taxonomy.parents):  # breadth-first: parents come first
            path[node] = node_vectors[node] + (path[parent] if parent >= 0 else 0.0)
        # one extra zero row: node -1 indexes it
        self.path = torch.cat([path, torch.zeros(1, latent)])
        self.attribute_names = list(ATTRIBUTE_FAMILIES)[: config.attribute_families]
        self.value_counts = [len(ATTRIBUTE_FAMILIES[a]) for a in self.attribute_names]
        self.value_offsets = [sum(self.value_counts[:a]) for a in range(len(self.value_counts))]
        values = _gaussian((sum(self.value_counts), latent), config.attribute_scale, gen)
        self.values = torch.cat([values, torch.zeros(1, latent)])  # row -1: no value
        self.rotation = torch.linalg.qr(torch.randn(latent, latent, generator=gen))[0]
        self.templates = _gaussian((config.templates, latent), config.template_scale, gen)
        maps = _generator(config.seed, "maps")
        self.image_map = _RandomMLP(latent, config.hidden_dim, config.image_dim, config.gain, maps)
        self.text_map = _RandomMLP(latent, config.hidden_dim, config.text_dim, config.gain, maps)
        self.binding = config.binding
        self.latent_dim = latent

    def compose(self, mentions: _Mentions, n_owners: int) -> Tensor:
        """Latent of each owner: the weighted sum of its mentions' latents. [n_owners, L]."""
        p = self.path[mentions.node]
        if mentions.attrs.shape[1]:
            offsets = torch.tensor(self.value_offsets, dtype=torch.long)
            flat = torch.where(
                mentions.attrs >= 0, mentions.attrs + offsets, torch.full_like(mentions.attrs, -1)
            )
            a = self.values[flat].sum(dim=1)
        else:
            a = torch.zeros_like(p)
        m = p + a + self.binding * math.sqrt(self.latent_dim) * (p @ self.rotation) * a
        out = torch.zeros(n_owners, self.latent_dim)
        # index_put_ rather than index_add_: the latter is many times slower on busy CPUs
        return out.index_put_((mentions.owner,), m * mentions.weight[:, None], accumulate=True)


class _Draws:
    """Uniform numbers from a generator, handed out one at a time to the loops that need them."""

    def __init__(self, gen: torch.Generator, block: int = 1 << 14) -> None:
        self.gen, self.block, self.i = gen, block, 0
        self.buffer: list[float] = []

    def uniform(self) -> float:
        if self.i == len(self.buffer):
            self.buffer = torch.rand(self.block, generator=self.gen, dtype=torch.float64).tolist()
            self.i = 0
        self.i += 1
        return self.buffer[self.i - 1]

    def below(self, n: int) -> int:
        return min(int(self.uniform() * n), n - 1)

    def choice(self, items: list):
        return items[self.below(len(items))]


# --- the world -------------------------------------------------------------------------------------


@dataclass
class SyntheticWorld:
    """The generated store plus the ground truth behind it (for tests and analyses).

    text_levels   [Nt, max_objects] taxonomy level of each mention of each caption (-1: none);
                  the leaf level is ``leaf_level``
    object_image, object_leaf, object_attrs  the objects (image-major), [No], [No], [No, A]
    """

    config: SyntheticConfig
    store: FeatureStore
    text_levels: Tensor
    object_image: Tensor
    object_leaf: Tensor
    object_attrs: Tensor
    leaf_level: int
    _model: _Model
    _taxonomy: _Taxonomy
    heldout_pairs: HeldoutPairs | None = None

    @property
    def main_objects(self) -> Tensor:
        """Index of each image's main object in the object tables. [Ni]."""
        counts = torch.bincount(self.object_image, minlength=self.store.num_images)
        return torch.cumsum(counts, 0) - counts

    def render_texts(self, image_ids: Tensor, levels_up: int, noise_seed: int = 0) -> Tensor:
        """One text per image naming all of its objects ``levels_up`` levels above their leaves
        (never above the family) and no attribute, with the world's text noise. [n, Dt]."""
        owner, node = [], []
        for row, image in enumerate(image_ids.tolist()):
            for leaf in self.object_leaf[self.object_image == image].tolist():
                owner.append(row)
                node.append(self._taxonomy.ancestor[leaf][max(1, self.leaf_level - levels_up)])
        n_attr = self.object_attrs.shape[1]
        mentions = _Mentions.from_lists(
            owner, node, [[-1] * n_attr for _ in owner], [1.0] * len(owner), n_attr
        )
        with _single_threaded():
            latent = self._model.compose(mentions, len(image_ids))
            noise = _gaussian(
                tuple(latent.shape), self.config.text_noise, _generator(noise_seed, "render")
            )
            return self._model.text_map(latent + noise)


def make_world(config: SyntheticConfig | None = None) -> FeatureStore:
    """The synthetic world's feature store (see the module docstring); deterministic in ``config``."""
    return build_world(config).store


def build_world(config: SyntheticConfig | None = None) -> SyntheticWorld:
    """The synthetic world with its ground truth."""
    config = config or SyntheticConfig()
    config.check()
    with _single_threaded():
        return _build_world(config)


@contextmanager
def _single_threaded() -> Iterator[None]:
    """Run torch on one intra-op thread, then restore the setting.

    The world's tensors are small: extra threads only add synchronisation, which on a busy
    machine made generation ten times slower; one thread also makes the floats independent of
    the machine's core count.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class _Objects:
    """The objects of all images, image-major: image [No], slot [No] (0 = main), leaf [No],
    attrs [No, A]; per image: count [Ni] and start [Ni] (index of its main object)."""

    image: Tensor
    slot: Tensor
    leaf: Tensor
    attrs: Tensor
    count: Tensor
    start: Tensor


@dataclass
class _Captions:
    """Captions, image-major: text_to_image [Nt], count [Ni] per image, their mentions (one per
    object of the image, text-major) with mention_object [M] and mention_level [M], and the
    latent noise [Nt, L] (reused by the hard negatives)."""

    text_to_image: Tensor
    count: Tensor
    mentions: _Mentions
    mention_object: Tensor
    mention_level: Tensor
    noise: Tensor

    @property
    def first_mention(self) -> Tensor:
        """Index of each caption's first mention. [Nt]."""
        per_text = torch.bincount(self.mentions.owner, minlength=len(self.text_to_image))
        return torch.cumsum(per_text, 0) - per_text

    @property
    def first_caption(self) -> Tensor:
        """Index of each image's first caption. [Ni]."""
        return torch.cumsum(self.count, 0) - self.count


def _sample_objects(
    config: SyntheticConfig, tax: _Taxonomy, model: _Model, gen: torch.Generator
) -> _Objects:
    """1..max_objects objects per image from distinct families, a random leaf and values each."""
    ni, k = config.images, config.max_objects
    count = torch.randint(1, k + 1, (ni,), generator=gen)
    families = torch.argsort(torch.rand(ni, config.families, generator=gen), dim=1)[:, :k]
    leaf_in_family = torch.randint(0, tax.leaves_per_family, (ni, k), generator=gen)
    value_counts = torch.tensor(model.value_counts, dtype=torch.float64)
    attrs = (
        torch.rand(ni, k, len(model.value_counts), generator=gen, dtype=torch.float64)
        * value_counts
    ).long()
    valid = (
        torch.arange(k)[None, :] < count[:, None]
    )  # [Ni, k]; row-major masking keeps images in order
    leaves = torch.tensor(tax.leaves, dtype=torch.long)
    return _Objects(
        image=torch.arange(ni)[:, None].expand(ni, k)[valid],
        slot=torch.arange(k)[None, :].expand(ni, k)[valid],
        leaf=leaves[families[valid] * tax.leaves_per_family + leaf_in_family[valid]],
        attrs=attrs[valid],
        count=count,
        start=torch.cumsum(count, 0) - count,
    )


def _sample_captions(
    config: SyntheticConfig, tax: _Taxonomy, objects: _Objects, gen: torch.Generator
) -> _Captions:
    """captions_min..captions_max captions per image; each mentions every object of its image at a
    level drawn from its path, with each attribute kept with probability attribute_mention."""
    ni = config.images
    count = torch.randint(config.captions_min, config.captions_max + 1, (ni,), generator=gen)
    text_to_image = torch.repeat_interleave(torch.arange(ni), count)
    nt = int(text_to_image.numel())
    per_text = objects.count[text_to_image]
    mention_text = torch.repeat_interleave(torch.arange(nt), per_text)
    rank_in_text = (
        torch.arange(mention_text.numel()) - (torch.cumsum(per_text, 0) - per_text)[mention_text]
    )
    mention_object = objects.start[text_to_image][mention_text] + rank_in_text
    n_mentions = int(mention_text.numel())
    mention_level = tax.leaf_level - _levels_up(n_mentions, config.generality, config.depth, gen)
    ancestor = torch.tensor(tax.ancestor, dtype=torch.long)
    n_attr = objects.attrs.shape[1]
    keep = torch.rand(n_mentions, n_attr, generator=gen) < config.attribute_mention
    values = objects.attrs[mention_object]
    mentions = _Mentions(
        owner=mention_text,
        node=ancestor[objects.leaf[mention_object], mention_level],
        attrs=torch.where(keep, values, torch.full_like(values, -1)),
        weight=torch.ones(n_mentions),
    )
    noise = _gaussian((nt, config.latent_dim), config.text_noise, gen)
    return _Captions(text_to_image, count, mentions, mention_object, mention_level, noise)


def _build_world(config: SyntheticConfig) -> SyntheticWorld:
    tax = _Taxonomy(config)
    model = _Model(config, tax)
    ni, latent_dim = config.images, config.latent_dim

    # Images: weighted objects + background + noise, through the image map.
    gen = _generator(config.seed, "images")
    objects = _sample_objects(config, tax, model, gen)
    if config.leaf_pairs:
        objects = _pin_leaf_pairs(config, tax, objects)
    n_objects = int(objects.image.numel())
    weight = torch.where(objects.slot == 0, 1.0, config.secondary_weight)
    image_latent = model.compose(_Mentions(objects.image, objects.leaf, objects.attrs, weight), ni)
    image_latent += _gaussian((ni, latent_dim), config.background, gen)
    image_latent += _gaussian((ni, latent_dim), config.image_noise, gen)
    image_features = model.image_map(image_latent)

    # Captions through the text map.
    captions = _sample_captions(config, tax, objects, _generator(config.seed, "captions"))
    nt = len(captions.text_to_image)
    text_features = model.text_map(model.compose(captions.mentions, nt) + captions.noise)
    text_levels = torch.full((nt, config.max_objects), -1, dtype=torch.long)
    text_levels[captions.mentions.owner, objects.slot[captions.mention_object]] = (
        captions.mention_level
    )

    # Splits.
    gen = _generator(config.seed, "splits")
    image_split = torch.zeros(ni, dtype=torch.long)
    image_split[torch.randperm(ni, generator=gen)[: round(ni * config.test_fraction)]] = 1
    # validation images from the rest, with their own generator: the test split stays as it was
    rest = torch.nonzero(image_split == 0).flatten()
    gen = _generator(config.seed, "validation")
    image_split[
        rest[torch.randperm(len(rest), generator=gen)[: round(ni * config.val_fraction)]]
    ] = 2

    # Boxes: each object alone (half the background), and its mention in the image's first caption.
    gen = _generator(config.seed, "boxes")
    every_object = torch.arange(n_objects)
    crop = _Mentions(every_object, objects.leaf, objects.attrs, torch.ones(n_objects))
    crop_latent = model.compose(crop, n_objects)
    crop_latent += _gaussian((n_objects, latent_dim), config.background * 0.5, gen)
    crop_latent += _gaussian((n_objects, latent_dim), config.image_noise, gen)
    in_first_caption = captions.first_mention[captions.first_caption[objects.image]] + objects.slot
    phrase = _Mentions(
        every_object,
        captions.mentions.node[in_first_caption],
        captions.mentions.attrs[in_first_caption],
        torch.ones(n_objects),
    )
    phrase_latent = model.compose(phrase, n_objects) + _gaussian(
        (n_objects, latent_dim), config.text_noise, gen
    )

    # Zero-shot prompts: leaf path + template context, no noise.
    leaves = torch.tensor(tax.leaves, dtype=torch.long)
    n_classes = len(tax.leaves)
    prompt_class = torch.arange(n_classes).repeat_interleave(config.templates)
    prompt_latent = model.path[leaves[prompt_class]] + model.templates.repeat(n_classes, 1)

    # The parts built by loops over structure.
    caption_mentions = _MentionLists(captions.mentions, nt)
    image_families: list[set[int]] = [set() for _ in range(ni)]
    for image, leaf in zip(objects.image.tolist(), objects.leaf.tolist(), strict=False):
        image_families[image].add(tax.family_of[leaf])
    neg_mentions, negative_to_text, negative_kind = _hard_negatives(
        config,
        tax,
        model,
        caption_mentions,
        captions.text_to_image,
        image_split,
        image_families,
        _Draws(_generator(config.seed, "negatives")),
    )
    negative_latent = (
        model.compose(neg_mentions, len(negative_to_text)) + captions.noise[negative_to_text]
    )
    chains, chain_texts = _chains(
        config,
        model,
        caption_mentions,
        captions.count,
        image_split,
        _generator(config.seed, "chains"),
    )
    chain_features = torch.empty(len(chain_texts), len(CHAIN_LEVELS), config.text_dim)
    if chain_texts:
        chain_features[:, :2] = model.text_map(chains).reshape(len(chain_texts), 2, config.text_dim)
        chain_features[:, 2] = text_features[torch.tensor(chain_texts)]
    pairs_a, pairs_b, pair_scores = _text_pairs(
        config,
        tax,
        caption_mentions,
        captions.count,
        image_split,
        objects.leaf[objects.start],
        _Draws(_generator(config.seed, "pairs")),
    )

    heldout = None
    if config.paraphrase_topics:
        paraphrases = _Paraphrases(config, tax, model)
        train_pairs = paraphrases.pairs(config.text_pairs, "paraphrase_pairs")
        heldout = paraphrases.pairs(config.heldout_pairs, "paraphrase_heldout")
        pair_a_features, pair_b_features, pair_scores = (
            train_pairs.a_features,
            train_pairs.b_features,
            train_pairs.scores,
        )
    else:
        pair_a_features, pair_b_features = text_features[pairs_a], text_features[pairs_b]

    store = FeatureStore(
        image_features=image_features,
        text=TextPart(text_features),
        text_to_image=captions.text_to_image,
        image_split=image_split,
        split_names=["train", "test", "val"]
        if bool((image_split == 2).any())
        else ["train", "test"],
        box_image_features=model.image_map(crop_latent),
        box_text_features=model.text_map(phrase_latent),
        box_to_image=objects.image.clone(),  # the world keeps its own copy
        pair_a=TextPart(pair_a_features),
        pair_b=TextPart(pair_b_features),
        pair_scores=pair_scores,
        class_names=[tax.names[n] for n in tax.leaves],
        prompt=TextPart(model.text_map(prompt_latent)),
        prompt_to_class=prompt_class,
        image_labels=objects.leaf[objects.start]
        - tax.leaves[0],  # leaves are the last, contiguous nodes
        # every object of an image is one of its classes (1-3 per image): multi-label mAP
        multilabel_to_image=objects.image.clone(),
        multilabel_class=objects.leaf - tax.leaves[0],
        taxonomy_names=list(tax.names),
        taxonomy_parents=torch.tensor(tax.parents, dtype=torch.long),
        class_to_node=leaves,
        negative=TextPart(model.text_map(negative_latent)),
        negative_to_text=negative_to_text,
        negative_kind=negative_kind,
        negative_kind_names=list(NEGATIVE_KINDS),
        chain_features=chain_features,
        meta={
            "source": "synthetic",
            # images and texts come from two different random maps of the latent world
            "shared_space": False,
            "config": asdict(config),
            "taxonomy_root": ROOT_NAME,
            "families": tax.names[1 : config.families + 1],
            "leaf_level": tax.leaf_level,
            "attributes": {a: list(ATTRIBUTE_FAMILIES[a]) for a in model.attribute_names},
            "chain_levels": list(CHAIN_LEVELS),
            "text_pairs_from": "paraphrases" if config.paraphrase_topics else "train",
            "text_pair_kinds": list(
                PARAPHRASE_KINDS if config.paraphrase_topics else PAIR_KINDS
            ),  # pair p is of kind p % 3
        },
    )
    return SyntheticWorld(
        config,
        store,
        text_levels,
        objects.image,
        objects.leaf,
        objects.attrs,
        tax.leaf_level,
        model,
        tax,
        heldout,
    )


def _levels_up(n: int, generality: float, depth: int, gen: torch.Generator) -> Tensor:
    """Geometric steps up from the leaf, P(s) ~ generality^s, capped so that the family is the top."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    if generality <= 0.0:
        return torch.zeros(n, dtype=torch.long)
    steps = torch.floor(torch.log1p(-u) / math.log(generality)).long()
    return steps.clamp(max=depth)


Mention = tuple[int, list[int]]  # (node, attribute values or -1)


class _MentionLists:
    """``table[t]``: the mentions of owner ``t`` as a list, for a table whose owners are sorted."""

    def __init__(self, m: _Mentions, n_owners: int) -> None:
        counts = torch.bincount(m.owner, minlength=n_owners)
        self.start = (torch.cumsum(counts, 0) - counts).tolist()
        self.count = counts.tolist()
        self.node = m.node.tolist()
        self.attrs = m.attrs.tolist()

    def __getitem__(self, owner: int) -> list[Mention]:
        s = self.start[owner]
        return [(self.node[i], self.attrs[i]) for i in range(s, s + self.count[owner])]


def _hard_negatives(
    config: SyntheticConfig,
    tax: _Taxonomy,
    model: _Model,
    caption_mentions: _MentionLists,
    text_to_image: Tensor,
    image_split: Tensor,
    image_families: list[set[int]],
    draws: _Draws,
) -> tuple[_Mentions, Tensor, Tensor]:
    """Up to one negative of each kind per test caption; a kind the caption cannot have is skipped."""
    owner: list[int] = []
    nodes: list[int] = []
    attrs: list[list[int]] = []
    to_text: list[int] = []
    kinds: list[int] = []
    test_image = (image_split == 1).tolist()

    def emit(text: int, kind: int, mentions: list[Mention]) -> None:
        row = len(to_text)
        for node, values in mentions:
            owner.append(row)
            nodes.append(node)
            attrs.append(list(values))
        to_text.append(text)
        kinds.append(kind)

    n_attr = len(model.attribute_names)
    for text, image in enumerate(text_to_image.tolist()):
        if not test_image[image]:
            continue
        mentions = caption_mentions[text]
        present = image_families[image]

        # object_replaced: a sibling at the mentioned level, never a family already in the image
        j = draws.below(len(mentions))
        node, values = mentions[j]
        siblings = [s for s in tax.children[tax.parents[node]] if s != node]
        if tax.parents[node] == 0:  # a family-level mention: another family, absent from the image
            siblings = [s for s in siblings if tax.family_of[s] not in present]
        if siblings:
            emit(text, 0, mentions[:j] + [(draws.choice(siblings), values)] + mentions[j + 1 :])

        # attribute_replaced: one mentioned value changed within its attribute family
        slots = [
            (j, a)
            for j, (_, values) in enumerate(mentions)
            for a in range(n_attr)
            if values[a] >= 0
        ]
        if slots:
            j, a = draws.choice(slots)
            node, values = mentions[j]
            changed = list(values)
            changed[a] = (
                values[a] + 1 + draws.below(model.value_counts[a] - 1)
            ) % model.value_counts[a]
            emit(text, 1, mentions[:j] + [(node, changed)] + mentions[j + 1 :])

        # object_added: an object of an absent family, mentioned like a caption would
        absent = [f for f in range(config.families) if f not in present]
        if absent:
            family = draws.choice(absent)
            leaf = tax.leaves[family * tax.leaves_per_family + draws.below(tax.leaves_per_family)]
            up = 0
            while up < config.depth and draws.uniform() < config.generality:
                up += 1
            values = [
                draws.below(model.value_counts[a])
                if draws.uniform() < config.attribute_mention
                else -1
                for a in range(n_attr)
            ]
            emit(text, 2, mentions + [(tax.ancestor[leaf][tax.leaf_level - up], values)])

        # swapped: exchange one attribute value both objects mention (else their attribute sets)
        if len(mentions) >= 2:
            options = [
                (i, j, a)
                for i in range(len(mentions))
                for j in range(i + 1, len(mentions))
                for a in range(n_attr)
                if mentions[i][1][a] >= 0
                and mentions[j][1][a] >= 0
                and mentions[i][1][a] != mentions[j][1][a]
            ]
            if options:
                i, j, a = draws.choice(options)
                vi, vj = list(mentions[i][1]), list(mentions[j][1])
                vi[a], vj[a] = vj[a], vi[a]
            else:
                pairs = [
                    (i, j)
                    for i in range(len(mentions))
                    for j in range(i + 1, len(mentions))
                    if mentions[i][1] != mentions[j][1]
                ]
                if not pairs:
                    continue
                i, j = draws.choice(pairs)
                vi, vj = list(mentions[j][1]), list(mentions[i][1])
            swapped = list(mentions)
            swapped[i], swapped[j] = (mentions[i][0], vi), (mentions[j][0], vj)
            emit(text, 3, swapped)

    table = _Mentions.from_lists(owner, nodes, attrs, [1.0] * len(owner), n_attr)
    return table, torch.tensor(to_text, dtype=torch.long), torch.tensor(kinds, dtype=torch.long)


def _chains(
    config: SyntheticConfig,
    model: _Model,
    caption_mentions: _MentionLists,
    n_captions: Tensor,
    image_split: Tensor,
    gen: torch.Generator,
) -> tuple[Tensor, list[int]]:
    """Latents of [attributes alone, main object with them] for each chain, and the caption of each.

    The main object is the first mention of a caption. Returns ([2 * Nc, L], Nc caption ids).
    """
    owner: list[int] = []
    nodes: list[int] = []
    attrs: list[list[int]] = []
    texts: list[int] = []
    caption_start = (torch.cumsum(n_captions, 0) - n_captions).tolist()
    for image in torch.nonzero(image_split == 1).flatten().tolist():
        for text in range(caption_start[image], caption_start[image] + int(n_captions[image])):
            node, values = caption_mentions[text][0]
            if any(v >= 0 for v in values):
                row = 2 * len(texts)
                owner += [row, row + 1]
                nodes += [-1, node]
                attrs += [list(values), list(values)]
                texts.append(text)
                break
    n_attr = len(model.attribute_names)
    table = _Mentions.from_lists(owner, nodes, attrs, [1.0] * len(owner), n_attr)
    latent = model.compose(table, 2 * len(texts))
    return latent + _gaussian(tuple(latent.shape), config.text_noise, gen), texts


def _text_pairs(
    config: SyntheticConfig,
    tax: _Taxonomy,
    caption_mentions: _MentionLists,
    n_captions: Tensor,
    image_split: Tensor,
    main_leaf: Tensor,
    draws: _Draws,
) -> tuple[Tensor, Tensor, Tensor]:
    """Caption pairs from train images, a third of each kind (two captions of one image; captions of
    two images whose main objects share their ancestor one level below the family; random),
    scored by the cosine of their weighted concept sets."""
    train_images = torch.nonzero(image_split == 0).flatten().tolist()
    caption_start = (torch.cumsum(n_captions, 0) - n_captions).tolist()
    counts = n_captions.tolist()
    group_level = min(2, tax.leaf_level)
    group_of = [tax.ancestor[leaf][group_level] for leaf in main_leaf.tolist()]
    by_group: dict[int, list[int]] = {}
    for image in train_images:
        by_group.setdefault(group_of[image], []).append(image)

    def caption_of(image: int) -> int:
        return caption_start[image] + draws.below(counts[image])

    def concepts(text: int) -> dict[tuple[int, ...], float]:
        weights: dict[tuple[int, ...], float] = {}
        for node, values in caption_mentions[text]:
            n = node
            while n > 0:  # the global root is shared by everything and says nothing
                weights[(n,)] = weights.get((n,), 0.0) + 1.0
                n = tax.parents[n]
            for a, v in enumerate(values):
                if v >= 0:
                    key = (-1, tax.family_of[node], a, v)
                    weights[key] = weights.get(key, 0.0) + 0.5
        return weights

    a_ids: list[int] = []
    b_ids: list[int] = []
    scores: list[float] = []
    for p in range(config.text_pairs):
        image = draws.choice(train_images)
        kind = p % 3
        if kind == 0 and counts[image] >= 2:
            first = draws.below(counts[image])
            second = (first + 1 + draws.below(counts[image] - 1)) % counts[image]
            a, b = caption_start[image] + first, caption_start[image] + second
        elif kind == 1:
            a = caption_of(image)
            b = caption_of(draws.choice(by_group[group_of[image]]))
        else:
            a, b = caption_of(image), caption_of(draws.choice(train_images))
        wa, wb = concepts(a), concepts(b)
        dot = sum(w * wb.get(key, 0.0) for key, w in wa.items())
        norm = math.sqrt(sum(w * w for w in wa.values()) * sum(w * w for w in wb.values()))
        a_ids.append(a)
        b_ids.append(b)
        scores.append(min(1.0, dot / norm) if norm > 0 else 0.0)
    return (
        torch.tensor(a_ids, dtype=torch.long),
        torch.tensor(b_ids, dtype=torch.long),
        torch.tensor(scores, dtype=torch.float32),
    )


# --- Study options (deterministic, off by default) ----------------------------------------------
#
# Each option draws from its own generator part, so switching one on leaves every other part of
# the world as it was (the images' noise, the captions, the splits).


@dataclass
class HeldoutPairs:
    """Scored text pairs with their topics: a_features, b_features [n, Dt], scores [n],
    topic_a, topic_b [n]."""

    a_features: Tensor
    b_features: Tensor
    scores: Tensor
    topic_a: Tensor
    topic_b: Tensor


class _Paraphrases:
    """Texts about *topics* that no image carries (DualPath's text-pair skill, seed 004).

    ``paraphrase_topics`` topics in groups of 4; topic vector = group vector + member vector (each
    of norm ``paraphrase_scale / sqrt(2)``), so two topics of one group have cosine about 0.5. A
    paraphrase text's latent = its topic vector + the path vector of a random leaf (a distractor
    concept, drawn independently for the two texts of a pair) + text noise, through the text map.
    Pair p is of kind p % 3: same topic, same group, random topic; its score is the cosine of the
    two topic vectors clipped to [0, 1]. The similarity of a pair is therefore not implied by any
    image: image-caption training can only preserve or erase it.
    """

    def __init__(self, config: SyntheticConfig, tax: _Taxonomy, model: _Model) -> None:
        gen = _generator(config.seed, "paraphrase_topics")
        n, latent = config.paraphrase_topics, config.latent_dim
        groups = (n + 3) // 4
        part = config.paraphrase_scale / math.sqrt(2.0)
        group_vectors = _gaussian((groups, latent), part, gen)
        self.group_of = torch.arange(n) // 4
        self.topics = group_vectors[self.group_of] + _gaussian((n, latent), part, gen)
        self.config, self.tax, self.model = config, tax, model

    def pairs(self, n: int, part: str) -> HeldoutPairs:
        gen = _generator(self.config.seed, part)
        t = self.config.paraphrase_topics
        topic_a = torch.randint(0, t, (n,), generator=gen)
        other = torch.randint(0, t, (n,), generator=gen)
        in_group = self.group_of[topic_a] * 4 + torch.randint(0, 4, (n,), generator=gen)
        in_group = torch.where(in_group < t, in_group, topic_a)
        kind = torch.arange(n) % 3
        topic_b = torch.where(kind == 0, topic_a, torch.where(kind == 1, in_group, other))
        unit = self.topics / self.topics.norm(dim=1, keepdim=True)
        scores = (unit[topic_a] * unit[topic_b]).sum(1).clamp(0.0, 1.0)
        scores = torch.where(topic_a == topic_b, 1.0, scores)  # exact, not 1 - ulp
        leaves = torch.tensor(self.tax.leaves, dtype=torch.long)

        def render(topic: Tensor) -> Tensor:
            leaf = leaves[torch.randint(0, len(leaves), (n,), generator=gen)]
            noise = _gaussian((n, self.config.latent_dim), self.config.text_noise, gen)
            return self.model.text_map(self.topics[topic] + self.model.path[leaf] + noise)

        return HeldoutPairs(render(topic_a), render(topic_b), scores, topic_a, topic_b)


def _pin_leaf_pairs(config: SyntheticConfig, tax: _Taxonomy, objects: _Objects) -> _Objects:
    """Images keep at most two objects; every two-object image takes its (main, second) leaves
    from one of ``leaf_pairs`` fixed pairs of leaves from two different families (so each leaf
    pair has about images / (2 leaf_pairs) images: enough for precision@5 of a composed query,
    seed 002 App. D.2). Attributes are kept."""
    gen = _generator(config.seed, "leaf_pairs")
    keep = objects.slot < 2
    image, slot = objects.image[keep], objects.slot[keep]
    leaf, attrs = objects.leaf[keep].clone(), objects.attrs[keep]
    count = torch.bincount(image, minlength=config.images)
    start = torch.cumsum(count, 0) - count
    fam = torch.argsort(torch.rand(config.leaf_pairs, config.families, generator=gen), dim=1)[:, :2]
    within = torch.randint(0, tax.leaves_per_family, (config.leaf_pairs, 2), generator=gen)
    leaves = torch.tensor(tax.leaves, dtype=torch.long)
    pair_leaves = leaves[fam * tax.leaves_per_family + within]  # [P, 2]
    two = torch.nonzero(count == 2).flatten()
    choice = torch.randint(0, config.leaf_pairs, (len(two),), generator=gen)
    leaf[start[two]] = pair_leaves[choice, 0]
    leaf[start[two] + 1] = pair_leaves[choice, 1]
    return _Objects(image=image, slot=slot, leaf=leaf, attrs=attrs, count=count, start=start)
