"""The batch sampler: epochs cover every train image once, captions/boxes belong to their image,
no image twice in a batch, exact state round trip, clear errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _train_toy import toy_store
from curvalign.data.sampling import BatchSampler, SamplingError


def _draw(sampler: BatchSampler, batches: int) -> list[dict[str, torch.Tensor]]:
    return [sampler.next_indices() for _ in range(batches)]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 30), data=st.data())
def test_each_train_image_once_per_epoch_and_never_twice_in_a_batch(n, data):
    batch = data.draw(st.integers(2, n))
    store = toy_store(num_images=n, captions=1, test_images=3)
    sampler = BatchSampler(store, batch, seed=data.draw(st.integers(0, 100)))
    epochs = 3
    draws = _draw(sampler, -(-epochs * n // batch))
    stream = torch.cat([d["image"] for d in draws])
    for e in range(epochs):
        assert sorted(stream[e * n : (e + 1) * n].tolist()) == list(
            range(n)
        )  # test images never drawn
    for d in draws:
        assert len(d["image"]) == batch and len(set(d["image"].tolist())) == batch


def test_captions_and_boxes_belong_to_their_image_and_vary_over_epochs():
    store = toy_store(num_images=12, captions=3, boxes=True)
    sampler = BatchSampler(store, 4, seed=1, requires={"boxes"})
    seen = {i: set() for i in range(12)}
    for d in _draw(sampler, 60):
        assert torch.equal(store.text_to_image[d["text"]], d["image"])
        assert torch.equal(store.box_to_image[d["box"]], d["image"])
        for image, text in zip(d["image"].tolist(), d["text"].tolist(), strict=False):
            seen[image].add(text)
    assert all(len(texts) == 3 for texts in seen.values())  # 20 epochs: every caption gets its turn


def test_images_without_box_or_caption_are_left_out_and_counted():
    store = toy_store(num_images=10, captions=1, boxes=True)
    keep = store.box_to_image != 3
    store.box_image_features, store.box_text_features = (
        store.box_image_features[keep],
        store.box_text_features[keep],
    )
    store.box_to_image = store.box_to_image[keep]
    store.text_to_image = torch.where(
        store.text_to_image == 5, torch.tensor(0), store.text_to_image
    )
    sampler = BatchSampler(store, 4, requires={"boxes"})
    assert sampler.summary() == {
        "train_images": 8,
        "skipped_without_caption": 1,
        "skipped_without_box": 1,
    }
    drawn = torch.cat([d["image"] for d in _draw(sampler, 10)])
    assert 3 not in drawn.tolist() and 5 not in drawn.tolist()


def test_text_pairs_are_drawn_once_per_epoch():
    store = toy_store(num_images=10, pairs=9)
    sampler = BatchSampler(store, 5, requires={"text_pairs"}, pair_batch_size=3)
    batch = sampler.next_batch()
    assert (
        batch.pair_a.shape == (3, 5)
        and batch.pair_b.shape == (3, 5)
        and batch.pair_score.shape == (3,)
    )
    assert batch.box_image is None
    epoch = torch.cat(
        [sampler.next_indices()["pair"] for _ in range(3)]
    )  # pairs 3..11 of the stream
    second = torch.cat([sampler.next_indices()["pair"] for _ in range(3)])
    stream = torch.cat([epoch, second])
    assert sorted(stream[6:15].tolist()) == list(range(9))  # the second epoch, whole


def test_batch_features_match_indices():
    store = toy_store(num_images=10, boxes=True, pairs=6)
    a = BatchSampler(store, 4, seed=5, requires={"boxes", "text_pairs"}, pair_batch_size=2)
    b = BatchSampler(store, 4, seed=5, requires={"boxes", "text_pairs"}, pair_batch_size=2)
    idx, batch = a.next_indices(), b.next_batch()
    assert torch.equal(batch.image, store.image_features[idx["image"]])
    assert torch.equal(batch.text, store.text_features[idx["text"]])
    assert torch.equal(batch.box_text, store.box_text_features[idx["box"]])
    assert torch.equal(batch.pair_score, store.pair_scores[idx["pair"]])


def test_state_round_trip_continues_identically():
    store = toy_store(num_images=13, captions=2, boxes=True, pairs=7)
    kwargs = dict(seed=4, requires={"boxes", "text_pairs"}, pair_batch_size=3)
    a = BatchSampler(store, 5, **kwargs)
    _draw(a, 4)
    state = a.state_dict()
    expected = _draw(a, 6)
    b = BatchSampler(store, 5, **kwargs)
    b.load_state_dict(state)
    got = _draw(b, 6)
    for x, y in zip(expected, got, strict=False):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert b.epoch == a.epoch


def test_state_for_other_data_is_refused():
    a = BatchSampler(toy_store(num_images=10), 4)
    b = BatchSampler(toy_store(num_images=11), 4)
    with pytest.raises(SamplingError, match="sampler state is for 10"):
        b.load_state_dict(a.state_dict())


def test_missing_parts_and_bad_sizes_are_clear_errors():
    store = toy_store(num_images=10)
    with pytest.raises(
        SamplingError,
        match="recipe 'hycoclip' trains on box-level pairs; data 'features:X' has none",
    ):
        BatchSampler(store, 4, requires={"boxes"}, recipe="'hycoclip'", data="features:X")
    with pytest.raises(SamplingError, match="scored text pairs"):
        BatchSampler(store, 4, requires={"text_pairs"})
    with pytest.raises(
        SamplingError, match="batch_size 11 is larger than the 10 usable train images"
    ):
        BatchSampler(store, 11)
    with pytest.raises(SamplingError, match="pair_batch_size 8"):
        BatchSampler(
            toy_store(num_images=10, pairs=5), 4, requires={"text_pairs"}, pair_batch_size=8
        )
    with pytest.raises(SamplingError, match="no 'valid' split"):
        BatchSampler(store, 4, split="valid")


def test_non_finite_features_are_named_when_drawn():
    store = toy_store(num_images=10, captions=1)
    store.text_features[7, 2] = float("nan")
    sampler = BatchSampler(store, 5)
    with pytest.raises(SamplingError, match="'text_features' has non-finite values \\(row 7\\)"):
        for _ in range(2):  # one epoch: image 7 and its only caption are drawn
            sampler.next_batch()


def test_store_without_splits_trains_on_all_images():
    store = toy_store(num_images=6)
    store.image_split = store.split_names = None
    sampler = BatchSampler(store, 3)
    assert sorted(torch.cat([d["image"] for d in _draw(sampler, 2)]).tolist()) == list(range(6))
