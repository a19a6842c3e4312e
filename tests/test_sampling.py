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


# --- the chunk shuffle: runs of neighbouring rows, for memory-mapped shards ----------------------


def test_the_row_shuffle_draws_the_batches_it_always_drew():
    # a store in memory keeps the uniform shuffle: the first batch is torch.randperm's prefix
    store = toy_store(num_images=50, captions=1)
    sampler = BatchSampler(store, 8, seed=11)
    assert sampler.shuffle == "rows" and "shuffle" not in sampler.summary()
    expected = torch.randperm(50, generator=torch.Generator().manual_seed(11))[:8]
    assert torch.equal(sampler.next_indices()["image"], sampler.image_ids[expected])


@settings(max_examples=20, deadline=None)
@given(n=st.integers(8, 120), chunk=st.integers(1, 9), window=st.integers(1, 5), data=st.data())
def test_the_chunk_shuffle_visits_each_image_once_in_windows_of_whole_runs(n, chunk, window, data):
    batch = data.draw(st.integers(2, min(n, 16)))
    store = toy_store(num_images=n, captions=1)
    sampler = BatchSampler(
        store,
        batch,
        seed=data.draw(st.integers(0, 50)),
        shuffle="chunks",
        chunk_rows=chunk,
        window_chunks=window,
    )
    order = sampler._images.order  # the first epoch, before any batch moves it
    assert sorted(order.tolist()) == list(range(n))
    # read in windows of `window` runs of `chunk` consecutive rows, each run whole (the last
    # run of the rows may be short), the rows of a window in any order
    size = {r: min(chunk, n - r * chunk) for r in range(-(-n // chunk))}
    at, runs = 0, order // chunk
    while at < n:
        seen: dict[int, int] = {}
        while at < n and not (len(seen) == window and all(seen[r] == size[r] for r in seen)):
            seen[int(runs[at])] = seen.get(int(runs[at]), 0) + 1
            at += 1
        assert all(seen[r] == size[r] for r in seen) and len(seen) <= window
    stream = torch.cat([sampler.next_indices()["image"] for _ in range(-(-2 * n // batch))])
    for e in range(2):
        assert sorted(stream[e * n : (e + 1) * n].tolist()) == sorted(sampler.image_ids.tolist())
    for d in [stream[i : i + batch] for i in range(0, len(stream) - batch + 1, batch)]:
        assert len(set(d.tolist())) == batch


def test_the_chunk_shuffle_resumes_exactly_and_an_old_state_keeps_its_shuffle():
    store = toy_store(num_images=90, captions=2)
    a = BatchSampler(store, 16, seed=4, shuffle="chunks", chunk_rows=8, window_chunks=3)
    for _ in range(7):  # past the first epoch's end
        a.next_indices()
    b = BatchSampler(store, 16, seed=99, shuffle="chunks", chunk_rows=8, window_chunks=3)
    b.load_state_dict(a.state_dict())
    for _ in range(9):
        x, y = a.next_indices(), b.next_indices()
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["text"], y["text"])
    # a run saved with the row shuffle resumes with it, whatever this sampler would pick
    rows = BatchSampler(store, 16, seed=4, shuffle="rows")
    rows.next_indices()
    state = rows.state_dict()
    del state["images"]["shuffle"]  # as saved before there was a choice
    c = BatchSampler(store, 16, seed=0, shuffle="auto")
    c.load_state_dict(state)
    assert c.shuffle == "rows"
    assert torch.equal(c.next_indices()["image"], rows.next_indices()["image"])


def test_a_bad_shuffle_is_one_clear_error():
    store = toy_store(num_images=20, captions=1)
    with pytest.raises(SamplingError, match="shuffle 'pages'"):
        BatchSampler(store, 4, shuffle="pages")
    with pytest.raises(SamplingError, match="chunk_rows"):
        BatchSampler(store, 4, shuffle="chunks", chunk_rows=0)
