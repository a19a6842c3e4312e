"""``run_benchmark(..., towers=...)`` / ``curvalign benchmark --towers``: every recipe trains the
same towers in front of its heads and is evaluated on the store re-encoded by its run's best
towers (``curvalign.train.towers.reencode_store``), checked against an independent path (export
the towers, extract a store with them, evaluate) on the tiny open_clip world of test_towers."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None or importlib.util.find_spec("peft") is None,
    reason="optional extras not installed: pip install 'curvalign[towers]' (open_clip, peft)",
)

from curvalign.data import load_store  # noqa: E402
from curvalign.errors import ConfigError  # noqa: E402
from curvalign.towers import TowerError  # noqa: E402
from test_towers import TRAIN, towers_config, world  # noqa: E402, F401  (fixture)


def test_a_tower_benchmark_evaluates_each_run_on_the_store_its_towers_extract(
    world,  # noqa: F811
    tmp_path,
) -> None:
    from curvalign.data.extract import extract_features
    from curvalign.eval import evaluate
    from curvalign.report.benchmark import run_benchmark
    from curvalign.runs import load_run
    from curvalign.train.towers import export_towers

    towers = towers_config(world, image="full", text="full", lr=1e-2)
    out = tmp_path / "bench"
    # no validation: each run's best weights are its last, so its towers have moved (a tiny
    # random model's best validation step is often 0, where re-encoding changes nothing)
    result = run_benchmark(
        ["clip", "meru"],
        world["store"],
        out,
        steps=4,
        seeds=1,
        overrides=[*TRAIN, "val_every=0"],
        show_progress=False,
        plots=False,
        towers=towers,
    )
    payload = json.loads((out / "results.json").read_text())
    assert payload["towers"] == towers.to_dict()
    assert "trained the towers too" in (out / "results.md").read_text()
    plain, _ = load_store(world["store"])
    root = world["root"]
    changed = 0
    for name in ("clip", "meru"):
        assert result.rows[name].status == "ok", result.rows[name].reason
        (run,) = result.run_dirs[name]
        # the independent path: export the best towers, extract a store with them, evaluate
        spec = export_towers(run, tmp_path / f"export-{name}", weights="best")
        extract_features(
            spec,
            root / "images",
            tmp_path / f"store-{name}",
            captions=root / "captions.json",
            progress=False,
        )
        store, _ = load_store(f"features:{tmp_path / f'store-{name}'}")
        changed += not torch.allclose(store.image_features, plain.image_features, atol=1e-4)
        direct = evaluate(load_run(run).recipe, store, split="test", diagnostics=False)
        for key, value in direct.retrieval.items():
            assert result.results[name]["retrieval"][key] == pytest.approx(value, abs=1e-6), key
        # the step-0 row is the untrained heads on the frozen towers' features: the plain store
        assert result.rows[f"{name} (step 0)"].kind == "untrained"
    assert changed, "no run's best towers changed the features: the check would not bite"


def test_a_store_part_that_cannot_be_re_encoded_is_refused_before_any_training(
    world,  # noqa: F811
    tmp_path,
) -> None:
    from curvalign.report.benchmark import run_benchmark

    store, _ = load_store(world["store"])
    torch.manual_seed(0)
    prompts = torch.randn(3, store.text_dim)  # rows that are no caption: no texts to re-encode
    store = store.with_fields(prompt_features=prompts, prompt_to_class=torch.arange(3))
    with pytest.raises(ConfigError) as err:
        run_benchmark(
            ["clip"],
            store,
            tmp_path / "bench",
            steps=2,
            seeds=1,
            overrides=TRAIN,
            show_progress=False,
            plots=False,
            towers=towers_config(world, image="lora", text="lora"),
        )
    message = str(err.value)
    assert "\n" not in message and "prompt_features" in message
    assert not (tmp_path / "bench" / "runs").exists()


from test_towers import SENTENCE_WORDS, tiny_sentence_transformer  # noqa: E402, F401  (fixture)


def test_reencode_store_rebuilds_texts_standing_for_images_prompts_and_chains(
    tiny_sentence_transformer,  # noqa: F811
) -> None:
    """A WordNet-like store (names stand for images; prompts and gloss chains are caption rows):
    every part is what the towers encode from its texts."""
    from curvalign.data import encoders
    from curvalign.data.features import FeatureStore, TextPart
    from curvalign.towers import TowersConfig, build_towers
    from curvalign.train.towers import reencode_store

    frozen = encoders.load_encoder(tiny_sentence_transformer)
    names = [f"{a} {b}" for a in SENTENCE_WORDS[:4] for b in SENTENCE_WORDS[4:7]]
    glosses = [f"a {n} animal" for n in names]
    captions = frozen.encode_texts(glosses)
    chains = torch.tensor([[0, 3], [5, 1]])
    store = FeatureStore(
        image_features=frozen.encode_texts(names),
        text=TextPart(captions),
        text_to_image=torch.arange(len(names)),
        prompt=TextPart(captions[[2, 4, 6]].clone()),
        prompt_to_class=torch.arange(3),
        chain_features=captions[chains],
        image_texts=names,
        texts=glosses,
    )
    towers = build_towers(TowersConfig(tiny_sentence_transformer, image="full", text="full"))
    with torch.no_grad():  # move the towers off the frozen encoder
        for _, param in towers.trainable_named_parameters():
            param.add_(0.05 * torch.randn_like(param))
    towers.eval()
    out = reencode_store(store, towers, batch_size=5)
    with torch.no_grad():
        texts = towers.encode_texts(glosses)
        images = towers.encode_images(names)
    assert not torch.allclose(texts, captions, atol=1e-4)
    assert torch.allclose(out.image_features, images, atol=1e-6)
    assert torch.allclose(out.text_features, texts, atol=1e-6)
    assert torch.allclose(out.prompt_features, texts[[2, 4, 6]], atol=1e-6)
    assert torch.allclose(out.chain_features, texts[chains], atol=1e-6)
    bad = store.with_fields(negative_features=captions[:2] + 1, negative_to_text=torch.arange(2))
    with pytest.raises(TowerError, match="negative_features"):
        reencode_store(bad, towers)


def test_curvalign_benchmark_towers_on_the_command_line(world, tmp_path) -> None:  # noqa: F811
    from typer.testing import CliRunner

    from curvalign.cli import app

    runner = CliRunner()
    out = tmp_path / "cli"
    args = ["benchmark", "--recipes", "clip", "--data", world["store"], "--steps", "2"]
    args += ["--seeds", "1", "--out", str(out), "-q"]
    towers = f"{world['spec']};image=lora;text=lora;lora_rank=2"
    result = runner.invoke(app, [*args, "--towers", towers, "--", *TRAIN])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())["towers"]
    assert (saved["image"], saved["text"], saved["lora_rank"]) == ("lora", "lora", 2)
    assert (out / "runs" / "clip" / "seed-0" / "towers.json").exists()
    bad = runner.invoke(app, [*args, "--towers", f"{world['spec']};text=frozen", "--", *TRAIN])
    assert bad.exit_code != 0 and "text='frozen'" in bad.output
    assert "Traceback" not in bad.output


def test_reencode_store_cuts_the_boxes_at_their_corners(world) -> None:  # noqa: F811
    from PIL import Image

    from curvalign.towers import build_towers
    from curvalign.train.towers import reencode_store

    store, _ = load_store(world["store"])
    corners = ["0 0 16 16", "8 4 32 30", "2 2 20 12"]
    owners = [0, 3, 3]
    phrases = ["a red box", "a blue corner", "a warm part"]
    store = store.with_fields(
        box_image_features=torch.zeros(3, store.image_dim),
        box_text_features=torch.zeros(3, store.text_dim),
        box_to_image=torch.tensor(owners),
        box_corners=corners,
        box_phrases=phrases,
    )
    towers = build_towers(towers_config(world)).eval()
    out = reencode_store(store, towers, batch_size=2)
    root = world["root"] / "images"
    crops = [
        Image.open(root / f"img{i}.png").convert("RGB").crop(tuple(int(v) for v in c.split()))
        for i, c in zip(owners, corners, strict=True)
    ]
    with torch.no_grad():
        assert torch.allclose(out.box_image_features, towers.encode_images(crops), atol=1e-6)
        assert torch.allclose(out.box_text_features, towers.encode_texts(phrases), atol=1e-6)
    assert torch.allclose(out.image_features, store.image_features, atol=1e-5)  # frozen towers
    no_corners = store.with_fields(box_corners=None)
    with pytest.raises(TowerError, match="box_image_features"):
        reencode_store(no_corners, towers)
