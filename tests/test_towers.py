"""Towers in front of the heads: tiny randomly initialised open_clip models saved to a temporary
directory, loaded back by path (nothing is downloaded), trained with LoRA or fully.

What is checked (issue 23, "Done when"): every recipe takes a finite step through the towers in
fp32 and bf16 autocast with a gradient reaching every trainable tower parameter; LoRA at step 0
gives exactly the frozen features; locked towers train the same heads as the feature-store
trainer on features extracted by the same towers; stop-and-resume equals an uninterrupted run
(adapters-only checkpoints included); export -> extract -> validation reproduces the value the
run validated with; a trainable parameter that gets no gradient is frozen with a note.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None or importlib.util.find_spec("peft") is None,
    reason="optional extras not installed: pip install 'curvalign[towers]' (open_clip, peft)",
)

from curvalign.config import resolve_config
from curvalign.data import encoders
from curvalign.data.batch import Batch
from curvalign.errors import TrainError
from curvalign.recipes import recipe_names
from curvalign.recipes.base import Gather, Progress
from curvalign.runs import build_recipe, load_run
from curvalign.towers import TowerError, TowersConfig, build_towers

TINY = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
N_IMAGES = 40
TRAIN = ["batch_size=8", "log_every=1", "num_threads=1", "val_every=3", "val_fraction=0.2"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny open_clip checkpoint, 40 images with two captions each, and the feature store
    ``curvalign extract`` makes of them with that checkpoint."""
    encoders._set_offline()
    encoders._make_torchvision_importable()
    import open_clip
    from PIL import Image

    from curvalign.data.extract import extract_features

    root = tmp_path_factory.mktemp("towers")
    config = root / "tiny-clip-towers.json"
    config.write_text(json.dumps(TINY))
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    torch.save(open_clip.create_model("tiny-clip-towers").state_dict(), root / "tiny.pt")
    rng = np.random.default_rng(0)
    (root / "images").mkdir()
    files = []
    for i in range(N_IMAGES):
        colour = rng.random(3)
        pixels = np.clip(colour + 0.3 * rng.random((32, 32, 3)), 0, 1)
        Image.fromarray((pixels * 255).astype("uint8")).save(root / "images" / f"img{i}.png")
        files.append(f"img{i}.png")
    words = ["red", "green", "blue", "dark", "light", "warm", "cold", "grey"]
    annotations = [
        {"image_id": i, "caption": f"a {words[i % 8]} picture {i} {words[(i + k) % 8]}"}
        for i in range(N_IMAGES)
        for k in range(2)
    ]
    (root / "captions.json").write_text(
        json.dumps(
            {
                "images": [{"id": i, "file_name": f} for i, f in enumerate(files)],
                "annotations": annotations,
            }
        )
    )
    spec = f"open_clip:{config}:{root / 'tiny.pt'}"
    extract_features(
        spec, root / "images", root / "store", captions=root / "captions.json", progress=False
    )
    return {"root": root, "spec": spec, "store": f"features:{root / 'store'}"}


def towers_config(world, image="locked", text="locked", **kw) -> TowersConfig:
    return TowersConfig(world["spec"], image=image, text=text, lora_rank=4, **kw)


def train_towers(world, out: Path, towers, steps=6, **kw):
    from curvalign.train import train

    return train(
        kw.pop("recipe", "meru"),
        world["store"],
        out,
        steps=steps,
        towers=towers,
        overrides=TRAIN + kw.pop("overrides", []),
        show_progress=False,
        **kw,
    )


def items(world, n=8):
    root = world["root"]
    images = [str(root / "images" / f"img{i}.png") for i in range(n)]
    texts = [f"a caption {i} of a picture" for i in range(n)]
    return images, texts


# --- the recipe contract through towers ---------------------------------------------------


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_steps_through_towers_with_gradients_to_every_trainable_parameter(
    world, name: str, bf16: bool
) -> None:
    towers = build_towers(towers_config(world, image="full", text="lora"))
    towers.train()
    trainable = towers.trainable_named_parameters()
    assert any("lora_B" in n for n, _ in trainable) and any(
        n.startswith("model.visual") for n, _ in trainable
    )
    config = resolve_config(name, "towers", steps=10)
    torch.manual_seed(0)
    recipe = build_recipe(config, towers.image_width, towers.text_width)
    recipe.train()
    progress = Progress(9, 10)  # the last step: every curriculum term of AGR / DualPath is on
    recipe.on_step_start(progress)
    images, texts = items(world)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with autocast:
        batch = Batch(image=towers.encode_images(images), text=towers.encode_texts(texts))
        if "boxes" in recipe.requires:
            batch.box_image = towers.encode_images(images[::-1])
            batch.box_text = towers.encode_texts([f"thing {t}" for t in texts])
        if "text_pairs" in recipe.requires:
            batch.pair_a = towers.encode_texts(texts)
            batch.pair_b = towers.encode_texts([t.upper() for t in texts])
            batch.pair_score = torch.linspace(0, 1, len(texts))
        out = recipe(batch, progress)
    assert torch.isfinite(out.total), f"{name}: loss {out.total}"
    out.total.backward()
    missing = [n for n, p in trainable if p.grad is None]
    assert not missing, f"{name}: no gradient reached {missing[:5]}"
    bad = [n for n, p in trainable if not torch.isfinite(p.grad).all()]
    assert not bad, f"{name}: non-finite gradient in {bad[:5]}"
    # the LoRA B matrices start at zero, so A gets a zero gradient; B must get a non-zero one
    assert any(float(p.grad.abs().sum()) > 0 for n, p in trainable if "lora_B" in n)


def test_lora_at_step_zero_gives_exactly_the_frozen_features(world) -> None:
    frozen = encoders.load_encoder(world["spec"])
    towers = build_towers(towers_config(world, image="lora", text="lora"))
    images, texts = items(world)
    towers.eval()  # as validation and export encode: the adapters add exact zeros
    with torch.no_grad():
        assert torch.equal(towers.encode_images(images), frozen.encode_images(images))
        assert torch.equal(towers.encode_texts(texts), frozen.encode_texts(texts))
    # in train mode nn.MultiheadAttention leaves its fused inference path: equal to rounding
    towers.train()
    with torch.no_grad():
        torch.testing.assert_close(towers.encode_texts(texts), frozen.encode_texts(texts))
    # and the adapters are what trains: nothing of the base, nothing of open_clip's logit_scale
    names = [n for n, _ in towers.trainable_named_parameters()]
    assert names and all("lora_" in n for n in names)


def test_export_merges_the_adapters_into_an_encoder_spec_extract_loads(world, tmp_path) -> None:
    towers = build_towers(towers_config(world, image="lora", text="lora"))
    with torch.no_grad():
        for name, p in towers.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained adapter: not the frozen features any more
    images, texts = items(world)
    towers.eval()
    with torch.no_grad():
        expected_i, expected_t = towers.encode_images(images), towers.encode_texts(texts)
    frozen = encoders.load_encoder(world["spec"])
    assert not torch.allclose(expected_t, frozen.encode_texts(texts), atol=1e-3)
    spec = towers.export(tmp_path / "export")
    exported = encoders.load_encoder(spec)
    torch.testing.assert_close(exported.encode_images(images), expected_i, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(exported.encode_texts(texts), expected_t, rtol=1e-5, atol=1e-5)


def test_a_trainable_parameter_without_gradient_is_frozen_with_a_note(world, tmp_path) -> None:
    # nn.MultiheadAttention reads out_proj.weight directly: a LoRA adapter on it never acts
    notes: list[str] = []
    towers = towers_config(world, image="lora", text="lora", lora_targets=["out_proj", "c_fc"])
    run = train_towers(world, tmp_path / "run", towers, steps=2, stop_at=1, notify=notes.append)
    assert any("froze" in n and "out_proj" in n for n in notes), notes
    saved = load_file(str(run / "towers.safetensors"))
    assert saved and all("c_fc" in k for k in saved), sorted(saved)
    # a resume freezes the same parameters (its optimizer state is for those that train)
    notes.clear()
    resumed = train_towers(world, tmp_path / "run", None, steps=2, resume=True, notify=notes.append)
    assert resumed.last_step == 2 and any("froze" in n for n in notes), notes


def test_bad_tower_settings_are_one_clear_error(world, tmp_path) -> None:
    with pytest.raises(TowerError, match="image='frozen'"):
        TowersConfig(world["spec"], image="frozen")
    with pytest.raises(TowerError, match="lora_rnk"):
        TowersConfig.parse(f"{world['spec']};lora_rnk=4")
    # boxes train from raw crops (tests/test_towers_data.py); this store has none
    with pytest.raises(TrainError, match="box-level pairs; data .* has none"):
        train_towers(world, tmp_path / "r", towers_config(world, text="lora"), recipe="hycoclip")
    from curvalign.train import train

    with pytest.raises(TrainError, match="caption strings"):  # features without a manifest
        train("clip", "synthetic", tmp_path / "s", steps=2, towers=towers_config(world))


# --- the trainer ----------------------------------------------------------------------------


def test_locked_towers_train_the_same_heads_as_the_feature_store_trainer(world, tmp_path) -> None:
    from curvalign.train.trainer import train

    features = train(
        "meru", world["store"], tmp_path / "features", steps=6, overrides=TRAIN, show_progress=False
    )
    towers = train_towers(world, tmp_path / "towers", towers_config(world))
    a = load_file(str(features / "model.safetensors"))
    b = load_file(str(towers / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=key)
    assert [s for s, _ in towers.val_history] == [s for s, _ in features.val_history]
    assert [v for _, v in towers.val_history] == pytest.approx([v for _, v in features.val_history])
    meta = json.loads((towers / "meta.json").read_text())
    assert meta["encoder"] == meta["towers"]["spec"]  # locked: the store's encoder still holds


def test_resume_with_towers_equals_an_uninterrupted_run_with_adapters_only_checkpoints(
    world, tmp_path
) -> None:
    towers = towers_config(world, image="lora", text="full", lr=3e-3)
    straight = train_towers(world, tmp_path / "straight", towers)
    stopped = train_towers(world, tmp_path / "stopped", towers, stop_at=3)
    assert stopped.last_step == 3
    resumed = train_towers(world, tmp_path / "stopped", None, resume=True)
    assert resumed.last_step == 6
    for name in ("model.safetensors", "towers.safetensors", "best.safetensors"):
        a, b = load_file(str(straight / name)), load_file(str(resumed / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}: {key}"
    assert straight.val_history == resumed.val_history
    # trained towers: the store's encoder no longer makes this run's features
    meta = json.loads((resumed / "meta.json").read_text())
    assert meta["encoder"] is None and meta["towers"]["text"] == "full"
    state = torch.load(straight / "state.pt", weights_only=False)
    # the tower part is plain tensors (what a weights_only=True reader accepts)
    assert all(type(v) is torch.Tensor for v in state["towers"].values())
    assert all(type(v) is torch.Tensor for v in state["best_towers"].values())
    visual = [k for k in state["towers"] if k.startswith("model.visual")]
    text = [k for k in state["towers"] if not k.startswith("model.visual")]
    assert visual and all("lora_" in k for k in visual)  # adapters only on the LoRA side
    assert "model.token_embedding.weight" in text  # the fully trained side: all its weights
    initial = encoders.load_encoder(world["spec"]).model.state_dict()
    trained = state["towers"]["model.token_embedding.weight"]
    assert not torch.equal(trained, initial["token_embedding.weight"])  # the towers did train


def test_export_extract_and_validation_reproduce_the_in_training_value(world, tmp_path) -> None:
    from curvalign.data import load_store
    from curvalign.data.extract import extract_features
    from curvalign.train.towers import export_towers
    from curvalign.train.validation import ValidationSet, validation_store

    towers = towers_config(world, image="lora", text="lora", lr=1e-2)
    run = train_towers(world, tmp_path / "run", towers, overrides=["val_every=6"])
    step, value = run.val_history[-1]
    assert step == 6
    spec = export_towers(run, tmp_path / "export", weights="last")
    root = world["root"]
    extract_features(
        spec, root / "images", tmp_path / "store", captions=root / "captions.json", progress=False
    )
    store, _ = load_store(f"features:{tmp_path / 'store'}")
    config = load_run(run, weights="last").config
    val_store, info = validation_store(store, config.train.val_fraction, config.train.seed)
    assert info["source"] == "holdout"
    recipe = load_run(run, weights="last").recipe
    assert ValidationSet(val_store).score(recipe) == pytest.approx(value, abs=1e-12)
    # the re-extracted features are the trained towers' ones, not the frozen ones
    original, _ = load_store(world["store"])
    assert not torch.allclose(store.text_features, original.text_features, atol=1e-4)


# --- several processes ----------------------------------------------------------------------

WORLD = 2


def _tower_step(name: str, spec: str, images, texts, rank: int = 0, world: int = 1):
    """(loss, tower gradients, recipe gradients) of one step of recipe ``name`` with towers on
    this rank's rows of the global batch (``world`` 1: the whole batch in one process)."""
    from curvalign.train.distributed import DistributedGather
    from curvalign.train.towers import average_tower_gradients

    torch.manual_seed(0)
    towers = build_towers(TowersConfig(spec, image="full", text="lora", lora_rank=4))
    with torch.no_grad():  # a trained adapter (B = 0 would hide the adapters' gradient paths)
        for n, p in towers.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    towers.eval()  # as the recipes: dropout-free, so a split batch can reproduce the whole one
    # AGR's T_gate starts on its floor, where the bound's projection blocks each rank's outward
    # gradient before DDP sums them (one process blocks the sum): started above it, both agree
    overrides = ["gate_temperature=0.6"] if name == "agr" else []
    config = resolve_config(name, "towers", steps=10, overrides=overrides)
    torch.manual_seed(0)
    recipe = build_recipe(config, towers.image_width, towers.text_width)
    progress = Progress(9, 10)
    recipe.on_step_start(progress)
    recipe.eval()
    n = len(images) // world
    part = slice(rank * n, (rank + 1) * n)
    batch = Batch(image=towers.encode_images(images[part]), text=towers.encode_texts(texts[part]))
    if "boxes" in recipe.requires:
        batch.box_image = towers.encode_images(images[::-1][part])
        batch.box_text = towers.encode_texts([f"thing {t}" for t in texts][part])
    if "text_pairs" in recipe.requires:
        batch.pair_a = towers.encode_texts(texts[part])
        batch.pair_b = towers.encode_texts([t.upper() for t in texts][part])
        batch.pair_score = torch.linspace(0, 1, len(texts))[part]
    if world == 1:
        out = recipe(batch, progress, Gather())
    else:
        from torch.nn.parallel import DistributedDataParallel

        average_tower_gradients(towers, world)
        model = DistributedDataParallel(recipe, find_unused_parameters=True)
        out = model(batch, progress, DistributedGather())
    out.total.backward()
    loss = out.total.detach().clone()
    if world > 1:
        dist.all_reduce(loss)
        loss /= world

    def grads(module):
        return {
            k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for k, p in module.named_parameters()
            if p.requires_grad
        }

    return float(loss), grads(towers), grads(recipe)


def _ddp_worker(rank: int, init_file: str, spec: str, images, texts, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results = {name: _tower_step(name, spec, images, texts, rank, WORLD) for name in recipe_names()}
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    mark_done(os.path.dirname(out_path), rank)
    dist.destroy_process_group()


import os
import tempfile

import torch.distributed as dist

from _process_groups import mark_done, spawn_and_wait


@pytest.mark.slow
def test_two_processes_with_towers_equal_one_process_on_the_global_batch(world, tmp_path) -> None:
    images, texts = items(world, 8)
    with tempfile.NamedTemporaryFile(dir=tmp_path, delete=False) as handle:
        init_file = handle.name
    out_path = str(tmp_path / "ddp.pt")
    spawn_and_wait(
        _ddp_worker, (init_file, world["spec"], images, texts, out_path), WORLD, tmp_path
    )
    results = torch.load(out_path, weights_only=False)
    failures = []
    for name in recipe_names():
        loss, tower_grads, recipe_grads = _tower_step(name, world["spec"], images, texts)
        ddp_loss, ddp_tower, ddp_recipe = results[name]
        if abs(loss - ddp_loss) > 1e-5 * max(1.0, abs(loss)):
            failures.append(f"{name}: loss {ddp_loss} with {WORLD} processes, {loss} with one")
        assert tower_grads.keys() == ddp_tower.keys() and recipe_grads.keys() == ddp_recipe.keys()
        assert any(float(g.abs().sum()) > 0 for g in tower_grads.values()), name
        for what, one, many in (
            ("tower", tower_grads, ddp_tower),
            ("head", recipe_grads, ddp_recipe),
        ):
            for key, grad in one.items():
                # N processes sum the batch in another order than one: float32 rounding of a
                # sum over the batch, judged against the tensor's largest entry (an entry near 0
                # carries the rounding of its large neighbours' sums)
                err = (many[key] - grad).abs().max().item()
                if err > 1e-5 * grad.abs().max().item() + 1e-6:
                    failures.append(
                        f"{name}: {what} gradient of {key} differs by {err:.2e} (norm {grad.norm():.2e})"
                    )
    assert not failures, "\n".join(failures)


# --- the command line -----------------------------------------------------------------------


def test_curvalign_train_towers_on_the_command_line(world, tmp_path) -> None:
    from typer.testing import CliRunner

    from curvalign.cli import app

    runner = CliRunner()
    out = tmp_path / "cli"
    args = ["train", "--recipe", "clip", "--data", world["store"], "--steps", "2", "--out", out]
    towers = f"{world['spec']};image=locked;text=lora;lora_rank=2;lr=1e-3"
    result = runner.invoke(app, [*map(str, args), "--towers", towers, "-q", "--", *TRAIN])
    assert result.exit_code == 0, result.output
    saved = TowersConfig.load(out / "towers.json")
    assert (saved.image, saved.text, saved.lora_rank, saved.lr) == ("locked", "lora", 2, 1e-3)
    assert all("lora_" in k for k in load_file(str(out / "towers.safetensors")))
    bad = runner.invoke(
        app, [*map(str, args), "--towers", f"{world['spec']};text=frozen", "--overwrite"]
    )
    assert bad.exit_code != 0 and "text='frozen'" in bad.output
    assert "Traceback" not in bad.output


# --- a text-only encoder (sentence-transformers) --------------------------------------------


@pytest.fixture(scope="module")
def tiny_sentence_transformer(tmp_path_factory):
    """A tiny random BERT with mean pooling, saved as a sentence-transformers directory."""
    if importlib.util.find_spec("sentence_transformers") is None:
        pytest.skip("optional extra not installed: pip install 'curvalign[sentence]'")
    encoders._set_offline()
    encoders._make_torchvision_importable()
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    root = tmp_path_factory.mktemp("st")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *SENTENCE_WORDS]
    (root / "vocab.txt").write_text("\n".join(words) + "\n")
    torch.manual_seed(0)
    bert = BertModel(
        BertConfig(
            vocab_size=len(words),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        )
    )
    bert.save_pretrained(root / "bert")
    BertTokenizerFast(vocab_file=str(root / "vocab.txt")).save_pretrained(root / "bert")
    modules = [
        models.Transformer(str(root / "bert"), max_seq_length=16),
        models.Pooling(16, "mean"),
    ]
    SentenceTransformer(modules=modules).save(str(root / "st"))
    return f"sentence-transformers:{root / 'st'}"


SENTENCE_WORDS = ["a", "dog", "cat", "wolf", "fox", "animal", "pet", "wild", "small", "big"]


def test_sentence_transformer_towers_lora_start_frozen_and_train_on_texts_standing_for_images(
    tiny_sentence_transformer, tmp_path
) -> None:
    from curvalign.data.features import FeatureStore, TextPart
    from curvalign.train import train
    from curvalign.train.towers import export_towers

    spec = tiny_sentence_transformer
    frozen = encoders.load_encoder(spec)
    towers = build_towers(TowersConfig(spec, image="lora", text="lora", lora_rank=2))
    names = [f"{a} {b}" for a in SENTENCE_WORDS for b in SENTENCE_WORDS[:3]]  # 30 "images"
    glosses = [f"a {n} animal" for n in names]
    towers.eval()
    with torch.no_grad():
        assert torch.equal(towers.encode_texts(glosses[:5]), frozen.encode_texts(glosses[:5]))
    with pytest.raises(TowerError, match="same mode"):
        build_towers(TowersConfig(spec, image="locked", text="lora"))
    # a store of texts standing for images (as wordnet: makes), features from the frozen encoder
    store = FeatureStore(
        image_features=frozen.encode_texts(names),
        text=TextPart(frozen.encode_texts(glosses)),
        text_to_image=torch.arange(len(names)),
        image_texts=names,
        texts=glosses,
    )
    run = train(
        "clip",
        store,
        tmp_path / "run",
        steps=3,
        towers=TowersConfig(spec, image="lora", text="lora", lora_rank=2, lr=1e-2),
        overrides=TRAIN,
        show_progress=False,
    )
    trained = load_file(str(run / "towers.safetensors"))
    assert trained and all("lora_" in k for k in trained)
    assert any(float(v.abs().sum()) > 0 for k, v in trained.items() if "lora_B" in k)
    exported = encoders.load_encoder(export_towers(run, tmp_path / "export", weights="last"))
    assert not torch.allclose(exported.encode_texts(glosses[:3]), frozen.encode_texts(glosses[:3]))


# --- a Hugging Face CLIP directory ----------------------------------------------------------

from test_encoders import tiny_hf_clip  # noqa: E402, F401  (fixture: a tiny random CLIPModel)


def test_hf_clip_towers_lora_start_frozen_get_gradients_and_export(tiny_hf_clip, tmp_path) -> None:  # noqa: F811
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("optional extra not installed: pip install 'curvalign[hf]'")
    _, _, root = tiny_hf_clip
    spec = f"hf-clip:{root}"
    frozen = encoders.load_encoder(spec)
    towers = build_towers(TowersConfig(spec, image="lora", text="full", lora_rank=2))
    assert not towers.model.is_gradient_checkpointing
    checkpointed = build_towers(TowersConfig(spec, image="lora", text="full", checkpointing=True))
    assert checkpointed.model.is_gradient_checkpointing
    from test_encoders import random_images

    images = random_images(4)
    texts = ["a dog", "the photo of two cat", "a cat", "two dog"]
    towers.eval()
    with torch.no_grad():
        assert torch.equal(towers.encode_images(images), frozen.encode_images(images))
        assert torch.equal(towers.encode_texts(texts), frozen.encode_texts(texts))
    names = [n for n, _ in towers.trainable_named_parameters()]
    assert not any("logit_scale" in n for n in names)
    vision = [n for n in names if ".vision_model." in n or ".visual_projection" in n]
    assert vision and all("lora_" in n for n in vision)
    towers.train()
    loss = towers.encode_images(images).square().sum() + towers.encode_texts(texts).square().sum()
    loss.backward()
    missing = [n for n, p in towers.trainable_named_parameters() if p.grad is None]
    assert not missing, missing[:5]
    with torch.no_grad():
        for n, p in towers.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    towers.eval()
    with torch.no_grad():
        expected = towers.encode_images(images)
    exported = encoders.load_encoder(towers.export(tmp_path / "export"))
    torch.testing.assert_close(exported.encode_images(images), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, frozen.encode_images(images), atol=1e-3)


# --- torchrun end to end --------------------------------------------------------------------


@pytest.mark.slow
def test_curvalign_train_nproc_2_with_towers_ends_with_the_weights_of_one_process(
    world, tmp_path
) -> None:
    """LoRA on both sides (no parameter with a zero true gradient: open_clip's key bias, fully
    trained, gets rounding noise that Adam turns into ±lr steps, differently per world size)."""
    import subprocess
    import sys

    threads = torch.get_num_threads()
    towers = f"{world['spec']};image=lora;text=lora;lora_rank=2;lr=1e-2"
    common = [
        "--recipe",
        "clip",
        "--data",
        world["store"],
        "--steps",
        "3",
        "-q",
        "--towers",
        towers,
    ]
    from typer.testing import CliRunner

    from curvalign.cli import app

    # one process: the command line's entry in this process (what --nproc 1 runs), a Python,
    # torch and open_clip start saved; two processes: the launcher in a process of its own
    one = CliRunner().invoke(app, ["train", *common, "--out", str(tmp_path / "n1"), "--", *TRAIN])
    torch.set_num_threads(threads)  # TRAIN's num_threads=1 must not outlive the run
    assert one.exit_code == 0, one.output[-3000:]
    done = subprocess.run(
        [sys.executable, "-m", "curvalign", "train", "--nproc", "2", *common]
        + ["--out", str(tmp_path / "n2"), "--", *TRAIN],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("model.safetensors", "towers.safetensors"):
        one, two = load_file(str(tmp_path / "n1" / name)), load_file(str(tmp_path / "n2" / name))
        assert one.keys() == two.keys()
        for key in one:
            torch.testing.assert_close(
                two[key], one[key], rtol=1e-4, atol=1e-5, msg=f"{name} {key}"
            )
    moved = load_file(str(tmp_path / "n2" / "towers.safetensors"))
    assert any(float(v.abs().sum()) > 0 for k, v in moved.items() if "lora_B" in k)


def test_activation_checkpointing_gives_the_same_gradients(world) -> None:
    images, texts = items(world, 4)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        towers = build_towers(
            towers_config(world, image="full", text="lora", checkpointing=checkpointing)
        )
        with torch.no_grad():
            for n, p in towers.named_parameters():
                if "lora_B" in n:
                    p.fill_(0.01)
        assert towers.model.transformer.grad_checkpointing is checkpointing
        towers.train()
        loss = towers.encode_images(images).square().sum() + towers.encode_texts(texts).sum()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in towers.trainable_named_parameters()})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for key in grads[0]:
        torch.testing.assert_close(grads[1][key], grads[0][key], msg=key)
    assert TowersConfig.parse(f"{world['spec']};text=lora;checkpointing=true").checkpointing
