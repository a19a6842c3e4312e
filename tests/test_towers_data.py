"""Raw rows into the towers (issue 23, item 2): DataLoader workers that decode, augment and
tokenise; box crops and phrases and scored text pairs from a store's manifest; webdataset
shards streamed and resumed at the same sample.

What is checked: the batches do not depend on the number of workers (augmentation on); a run
stopped and resumed with augmentation and workers equals an uninterrupted one; the random
resized crop draws from (seed, step, row) and changes the pixels; HyCoCLIP and DualPath train
a step from raw box crops (cut at the stored corners) and raw pair texts, gradients reaching
the towers; a webdataset stream resumed from its recorded position continues at the same
sample, also through a stopped and resumed run.
"""

from __future__ import annotations

import importlib.util
import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from curvalign.data import load_data
from curvalign.data.sampling import BatchSampler
from curvalign.recipes.base import Progress
from curvalign.towers import (
    Augment,
    RawBatchLoader,
    StoreRows,
    TowerError,
    TowersConfig,
    WebDatasetRows,
    build_towers,
)
from curvalign.towers.loader import RowPreparer, StepRows, encode_prepared, row_generator
from test_encoders import tiny_hf_clip  # noqa: F401  (fixture: a tiny random CLIPModel)
from test_towers import TRAIN, towers_config, train_towers, world  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None or importlib.util.find_spec("peft") is None,
    reason="optional extras not installed: pip install 'curvalign[towers]' (open_clip, peft)",
)


def _store(world):  # noqa: F811
    return load_data(world["store"])


def _prepared(world, workers: int, augment: Augment | None, steps: int = 3):  # noqa: F811
    towers = build_towers(towers_config(world))
    sampler = BatchSampler(_store(world), 8, seed=0)
    loader = RawBatchLoader(towers, StoreRows(sampler), workers=workers, augment=augment, seed=0)
    try:
        return [loader.next_prepared(step) for step in range(steps)]
    finally:
        loader.close()


def test_closing_the_loader_continues_after_the_last_step_handed_out(world) -> None:  # noqa: F811
    """The workers draw ahead; closing them (end of a fit) rewinds the sampler, so a later fit
    in the same process continues at the next step, not after the prefetched ones."""
    towers = build_towers(towers_config(world))
    sampler = BatchSampler(_store(world), 8, seed=0)
    loader = RawBatchLoader(towers, StoreRows(sampler), workers=2, augment=Augment(), seed=0)
    try:
        first = [loader.next_prepared(step)["text"] for step in range(2)]
        loader.close()
        rest = [loader.next_prepared(step)["text"] for step in range(2, 4)]
    finally:
        loader.close()
    straight = [p["text"] for p in _prepared(world, 0, Augment(), steps=4)]
    for a, b in zip(first + rest, straight, strict=True):
        assert torch.equal(a, b)


def test_the_number_of_workers_does_not_change_the_augmented_batches(world) -> None:  # noqa: F811
    augment = Augment(flip=0.5)
    inline = _prepared(world, 0, augment)
    parallel = _prepared(world, 2, augment)
    plain = _prepared(world, 0, None)
    for a, b, c in zip(inline, parallel, plain, strict=True):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["text"], b["text"])
        assert torch.equal(a["text"], c["text"])  # the same rows drawn
        assert not torch.equal(a["image"], c["image"])  # ...but cropped and flipped


def test_the_crop_is_a_function_of_seed_step_and_row() -> None:
    from PIL import Image

    image = Image.fromarray(
        (torch.arange(48 * 64 * 3) % 251).reshape(48, 64, 3).to(torch.uint8).numpy()
    )
    augment = Augment(scale=(0.3, 0.6), flip=0.5)

    def crop(seed, step, row):
        return torch.tensor(
            list(augment(image, row_generator(seed, step, "image", row)).get_flattened_data())
        )

    assert torch.equal(crop(0, 5, 3), crop(0, 5, 3))
    others = [crop(1, 5, 3), crop(0, 6, 3), crop(0, 5, 4)]
    assert all(o.shape != crop(0, 5, 3).shape or not torch.equal(o, crop(0, 5, 3)) for o in others)
    side = int(crop(0, 5, 3).shape[0] ** 0.5)
    assert 0.3 * 48 * 64 <= side**2 * 1.05 and side**2 <= 0.6 * 48 * 64 * 1.05  # area in scale


def test_stop_and_resume_with_augmentation_and_workers_equals_an_uninterrupted_run(
    world,  # noqa: F811
    tmp_path,
) -> None:
    straight_towers = towers_config(world, image="lora", text="lora", lr=3e-3, augment=True)
    parallel = towers_config(world, image="lora", text="lora", lr=3e-3, augment=True, workers=2)
    straight = train_towers(world, tmp_path / "straight", straight_towers, steps=5)
    stopped = train_towers(world, tmp_path / "stopped", parallel, steps=5, stop_at=2)
    assert stopped.last_step == 2
    resumed = train_towers(world, tmp_path / "stopped", None, steps=5, resume=True)
    assert resumed.last_step == 5
    for name in ("model.safetensors", "towers.safetensors"):
        a, b = load_file(str(straight / name)), load_file(str(resumed / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}: {key}"
    plain = train_towers(
        world, tmp_path / "plain", towers_config(world, image="lora", text="lora", lr=3e-3), steps=5
    )
    a, b = (
        load_file(str(straight / "towers.safetensors")),
        load_file(str(plain / "towers.safetensors")),
    )
    assert any(not torch.equal(a[k], b[k]) for k in a)  # augmentation changed the training


# --- boxes and text pairs from raw items -------------------------------------------------------


@pytest.fixture(scope="module")
def boxed(world, tmp_path_factory):  # noqa: F811
    """The world's images and captions extracted again with two boxes per image and scored text
    pairs, by the same tiny open_clip checkpoint."""
    from curvalign.data.extract import extract_features

    root = world["root"]
    out = tmp_path_factory.mktemp("boxed")
    files = sorted((root / "images").glob("*.png"))
    boxes = [
        {"image": f.name, "box": box, "phrase": f"{phrase} of {f.stem}"}
        for f in files
        for box, phrase in (([0, 0, 20, 16], "top corner"), ([8, 10, 32, 32], "lower part"))
    ]
    (out / "boxes.jsonl").write_text("".join(json.dumps(b) + "\n" for b in boxes))
    pairs = [
        {"a": f"a picture {i}", "b": f"a photo {i % 5}", "score": (i % 5) / 4} for i in range(24)
    ]
    (out / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    extract_features(
        world["spec"],
        root / "images",
        out / "store",
        captions=root / "captions.json",
        boxes=out / "boxes.jsonl",
        pairs=out / "pairs.jsonl",
        progress=False,
    )
    return {"store": f"features:{out / 'store'}"}


@pytest.mark.parametrize("recipe", ["hycoclip", "phyclip", "dualpath"])
def test_box_and_pair_recipes_train_a_step_from_raw_items(world, boxed, recipe, tmp_path) -> None:  # noqa: F811
    from curvalign.config import resolve_config
    from curvalign.data.encoders import load_image
    from curvalign.data.extract import crop_box
    from curvalign.train.towers import TowerTrainer

    store = load_data(boxed["store"])
    assert store.box_corners is not None and store.pair_a_texts is not None
    # DualPath's first steps use no image term: its image tower would be frozen as unused
    towers = towers_config(world, image="locked" if recipe == "dualpath" else "full", text="lora")
    config = resolve_config(
        recipe, boxed["store"], overrides=[*TRAIN, "steps=2", "val_every=0", "pair_batch_size=4"]
    )
    trainer = TowerTrainer(config, store, tmp_path / recipe, towers=towers, show_progress=False)
    try:
        rows = trainer.loader.source
        before = {n: p.detach().clone() for n, p in trainer.towers.trainable_named_parameters()}
        sampler_state = trainer.sampler.state_dict()
        trainer.towers.eval()  # no dropout: the encodings below are comparable
        with torch.no_grad():
            batch = trainer.loader.next_batch(0)
            # what the loader encoded is the stored rows' raw items: crops cut at the corners
            trainer.sampler.load_state_dict(sampler_state)
            indices = trainer.sampler.next_indices()
            if recipe != "dualpath":
                box_ids = indices["box"].tolist()
                owners = store.box_to_image[box_ids].tolist()
                crops = [
                    crop_box(
                        load_image(rows.items.images([o])[0]),
                        tuple(float(v) for v in store.box_corners[b].split()),
                    )
                    for o, b in zip(owners, box_ids, strict=True)
                ]
                torch.testing.assert_close(batch.box_image, trainer.towers.encode_images(crops))
                phrases = [store.box_phrases[b] for b in box_ids]
                torch.testing.assert_close(batch.box_text, trainer.towers.encode_texts(phrases))
                assert batch.pair_a is None
            else:
                pair_ids = indices["pair"].tolist()
                a = [store.pair_a_texts[p] for p in pair_ids]
                torch.testing.assert_close(batch.pair_a, trainer.towers.encode_texts(a))
                torch.testing.assert_close(batch.pair_score, store.pair_scores[pair_ids])
                assert batch.box_image is None
        trainer.sampler.load_state_dict(sampler_state)
        trainer.loader.reset(0)
        trainer.towers.train()
        out, _ = trainer.train_step(Progress(0, 2))
        assert torch.isfinite(out.total)
        named = trainer.towers.trainable_named_parameters()
        missing = [n for n, p in named if p.grad is None]
        assert not missing, missing[:3]
        moved = [n for n, p in named if not torch.equal(p.detach(), before[n])]
        assert any("lora_" in n and not n.startswith("model.visual") for n in moved)
        if recipe != "dualpath":
            assert any(n.startswith("model.visual") for n in moved)
    finally:
        trainer.loader.close()


def test_a_store_without_raw_box_items_is_one_clear_error(world, tmp_path) -> None:  # noqa: F811
    import dataclasses

    from curvalign.data.features import FeatureStore

    store = load_data(world["store"])
    n = store.num_images
    with_boxes = dataclasses.replace(
        store,
        box_image_features=store.image_features[:n],
        box_text_features=store.text_features[:n],
        box_to_image=torch.arange(n),
    )
    path = tmp_path / "store"
    FeatureStore.save(with_boxes, path)
    sampler = BatchSampler(with_boxes, 8, requires=["boxes"])
    with pytest.raises(TowerError, match="box_corners"):
        StoreRows(sampler, data=str(path))


# --- webdataset shards -------------------------------------------------------------------------


def _write_shards(root: Path, n_shards: int = 3, per_shard: int = 7) -> Path:
    """Tiny webdataset shards of PNG images and captions (every 5th sample has no caption)."""
    from PIL import Image

    folder = root / "shards"
    folder.mkdir()
    for s in range(n_shards):
        with tarfile.open(folder / f"part-{s}.tar", "w") as tar:
            for k in range(per_shard):
                key = f"s{s:02d}{k:03d}"
                buf = io.BytesIO()
                colour = (40 * s % 255, 30 * k % 255, 128)
                Image.new("RGB", (24 + k, 20 + s), colour).save(buf, format="PNG")
                members = {f"{key}.png": buf.getvalue()}
                if k % 5 != 4:
                    members[f"{key}.txt"] = f"shard {s} sample {k}\nanother {s}-{k}".encode()
                for name, data in members.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return folder


def test_a_webdataset_stream_resumes_at_the_same_sample(tmp_path) -> None:
    shards = _write_shards(tmp_path)
    straight = WebDatasetRows(shards, 4, seed=3)
    rows = [straight.next_rows(step) for step in range(8)]  # 32 samples: more than one epoch
    assert straight.epoch == 1 and straight.skipped > 0
    first = WebDatasetRows(shards, 4, seed=3)
    for step in range(3):
        first.next_rows(step)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
    resumed = WebDatasetRows(shards, 4, seed=3)
    resumed.load_state_dict(state)
    for step in range(3, 8):
        again = resumed.next_rows(step)
        assert again.images == rows[step].images and again.texts == rows[step].texts
    # rank 1 of 2 takes the second half of the same global batch
    half = WebDatasetRows(shards, 4, seed=3, rank=1, world_size=2).next_rows(0)
    assert half.images == rows[0].images[2:] and half.offset == 2
    with pytest.raises(TowerError, match="shards the run was trained on"):
        WebDatasetRows(tmp_path / "shards" / "part-0.tar", 4).load_state_dict(state)


def test_training_streams_webdataset_shards_and_resumes_bit_exact(world, tmp_path) -> None:  # noqa: F811
    shards = _write_shards(tmp_path)
    towers = towers_config(world, image="lora", text="lora", lr=3e-3, shards=str(shards))
    straight = train_towers(world, tmp_path / "straight", towers, steps=4)
    parallel = towers_config(
        world, image="lora", text="lora", lr=3e-3, shards=str(shards), workers=2, augment=True
    )
    stopped = train_towers(world, tmp_path / "stopped", parallel, steps=4, stop_at=2)
    state = torch.load(stopped / "state.pt", weights_only=False)
    assert state["stream"]["sample"] > 0  # the position is in the checkpoint
    meta = json.loads((stopped / "meta.json").read_text())
    assert meta["towers"]["stream"] == state["stream"]
    resumed = train_towers(world, tmp_path / "stopped", None, steps=4, resume=True)
    again = train_towers(world, tmp_path / "again", parallel, steps=4)
    a, b = (
        load_file(str(again / "towers.safetensors")),
        load_file(str(resumed / "towers.safetensors")),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = load_file(str(straight / "towers.safetensors"))
    assert any(not torch.equal(a[k], c[k]) for k in a)  # augmentation on vs off
    with pytest.raises(Exception, match="box crops"):
        train_towers(world, tmp_path / "boxes", towers, recipe="hycoclip")


def test_raw_row_options_parse_from_the_towers_string(world) -> None:  # noqa: F811
    spec = world["spec"]
    parsed = TowersConfig.parse(
        f"{spec};image=lora;workers=2;augment=true;crop_scale=0.4,1;flip=0.5;shards=/data/wds"
    )
    assert (parsed.workers, parsed.augment, parsed.crop_scale, parsed.flip, parsed.shards) == (
        2,
        True,
        [0.4, 1.0],
        0.5,
        "/data/wds",
    )
    # resuming with another number of workers is the same run
    assert parsed == TowersConfig.parse(
        f"{spec};image=lora;workers=0;augment=true;crop_scale=0.4,1;flip=0.5;shards=/data/wds"
    )
    for bad, words in (
        ("flip=2", "flip is a probability"),
        ("crop_scale=0.9,0.2", "crop_scale"),
        ("workers=-1", "workers must be"),
        ("augment=maybe", "boolean"),
    ):
        with pytest.raises(TowerError, match=words):
            TowersConfig.parse(f"{spec};{bad}")


def test_curvalign_train_takes_the_raw_row_options(world, tmp_path) -> None:  # noqa: F811
    from typer.testing import CliRunner

    from curvalign.cli import app

    out = tmp_path / "cli"
    towers = f"{world['spec']};text=lora;lora_rank=2;workers=2;augment=true;flip=0.5"
    args = ["train", "--recipe", "clip", "--data", world["store"], "--steps", "2", "--out", out]
    result = CliRunner().invoke(app, [*map(str, args), "--towers", towers, "-q", "--", *TRAIN])
    assert result.exit_code == 0, result.output
    saved = TowersConfig.load(out / "towers.json")
    assert (saved.workers, saved.augment, saved.flip) == (2, True, 0.5)


def test_an_unreadable_image_in_a_worker_is_one_clear_error(world, tmp_path) -> None:  # noqa: F811
    import dataclasses

    store = load_data(world["store"])
    broken = dataclasses.replace(store, image_paths=[f"gone/{p}" for p in store.image_paths])
    broken.save(tmp_path / "store")
    from curvalign.errors import TrainError
    from curvalign.train import train

    with pytest.raises(
        TrainError, match=r"step 1: image '.*gone/img\d+\.png' cannot be used"
    ) as err:
        train(
            "clip",
            f"features:{tmp_path / 'store'}",
            tmp_path / "run",
            steps=2,
            towers=towers_config(world, workers=2),
            overrides=[*TRAIN, "val_every=0"],
            show_progress=False,
        )
    assert "\n" not in str(err.value) and "Traceback" not in str(err.value)


def test_two_ranks_prepare_the_augmented_rows_of_one_process(world) -> None:  # noqa: F811
    """Each rank augments its share of the global batch as one process augments those rows
    (the crop is drawn from the row's global position), so N processes train on the batch one
    process trains on."""
    towers = build_towers(towers_config(world))
    store = load_data(world["store"])
    augment = Augment(flip=0.5)

    def prepared(rank: int, world_size: int):
        rows = StoreRows(BatchSampler(store, 8, seed=0), rank, world_size)
        loader = RawBatchLoader(towers, rows, augment=augment, seed=0)
        return [loader.next_prepared(step)["image"] for step in range(2)]

    one = prepared(0, 1)
    halves = [prepared(rank, 2) for rank in (0, 1)]
    for step in range(2):
        assert torch.equal(torch.cat([halves[0][step], halves[1][step]]), one[step])


def test_hf_clip_towers_prepare_in_workers_what_they_encode_in_process(tiny_hf_clip) -> None:  # noqa: F811
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("optional extra not installed: pip install 'curvalign[hf]'")
    from test_encoders import random_images

    _, _, root = tiny_hf_clip
    towers = build_towers(TowersConfig(f"hf-clip:{root}", image="lora", text="lora")).eval()
    images = random_images(3)
    texts = ["a dog", "the photo of two cat", "a cat"]
    rows = StepRows(0, images=images, texts=texts)
    preparer = RowPreparer(towers.input_preparer(), None, 0)
    prepared = torch.utils.data.DataLoader(preparer, batch_size=None, sampler=[rows], num_workers=1)
    (item,) = list(prepared)  # prepared in a worker process
    assert item["image"].dtype == torch.float32 and item["text"]["input_ids"].dtype == torch.long
    with torch.no_grad():
        batch = encode_prepared(towers, item)
        assert torch.equal(batch.image, towers.encode_images(images))
        assert torch.equal(batch.text, towers.encode_texts(texts))
