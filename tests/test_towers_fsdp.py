"""FSDP2 towers (``towers strategy=fsdp``): two gloo processes on the CPU, tiny open_clip towers.

What is checked (issue 23, item 3): the tower trainer with its towers sharded by FSDP2
(``fully_shard`` per transformer block, then the rest) takes the step one process takes on the
global batch (clipped gradients of the towers and the heads within rtol 1e-4, then the
weights); a run stopped and resumed from its distributed checkpoint ends with the weights of an
uninterrupted one; the blocks sharded are those of the sides that train.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import pickle
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None or importlib.util.find_spec("peft") is None,
    reason="optional extras not installed: pip install 'curvalign[towers]' (open_clip, peft)",
)

from _process_groups import mark_done, spawn_and_wait  # noqa: E402
from curvalign.errors import CurvalignError  # noqa: E402
from curvalign.runs import CheckpointError  # noqa: E402
from curvalign.towers import TowersConfig, build_towers  # noqa: E402
from curvalign.train.hooks import TrainerHook  # noqa: E402
from test_towers import TRAIN, world  # noqa: E402, F401  (fixture: tiny open_clip + its store)

WORLD = 2
RECIPES = ("clip", "meru")
STEPS = 2
LR = 1e-3
CLIP = 0.01


def fsdp_towers(spec: str, **kw) -> TowersConfig:
    """The image side fully trained (whole parameters sharded), LoRA on the text side (frozen
    base and trained adapters in one sharded block), under FSDP2."""
    return TowersConfig(spec, image="full", text="lora", lora_rank=4, lr=LR, strategy="fsdp", **kw)


class CaptureGradients(TrainerHook):
    """The clipped gradients of every trained parameter at each step's end (whole tensors:
    a DTensor's shards are gathered, so every rank must run it)."""

    def __init__(self) -> None:
        self.grads: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, trainer, step, record) -> None:
        from curvalign.train.towers import _whole

        grads = {}
        for prefix, module in (("recipe.", trainer.recipe), ("towers.", trainer.towers)):
            for name, param in module.named_parameters():
                if param.requires_grad and param.grad is not None:
                    grads[prefix + name] = _whole(param.grad).cpu().clone()
        self.grads[step] = grads


def run(store, out, towers, hooks=(), **kw):
    """A tower run (``curvalign.train.train`` with ``towers=``) in this process; under an initialised
    process group, the distributed trainer of ``curvalign.train.distributed`` (as torchrun)."""
    from curvalign.train import train
    from curvalign.train.distributed import DistributedContext, build_distributed_trainer

    if dist.is_initialized():
        context = DistributedContext(dist.get_rank(), dist.get_rank(), dist.get_world_size())
        kw["trainer_factory"] = functools.partial(build_distributed_trainer, context=context)
        dist.barrier()  # as a new torchrun launch: rank 0 has written the last run's files
    return train(
        kw.pop("recipe", "meru"),
        store,
        out,
        towers=towers,
        # a clip every step: the global norm then spans the heads and every rank's shards
        overrides=[*TRAIN, "val_every=0", f"grad_clip={CLIP}", *kw.pop("overrides", [])],
        show_progress=False,
        hooks=list(hooks),
        **kw,
    )


def _worker(rank: int, init_file: str, spec: str, store: str, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        grads = {}
        for name in RECIPES:
            capture = CaptureGradients()
            run(store, f"{root}/{name}", fsdp_towers(spec), [capture], recipe=name, steps=STEPS)
            grads[name] = capture.grads
        # activation checkpointing under FSDP2 (blocks recomputed, unsharded again), then
        # with bf16 autocast
        for tag, overrides in (("checkpointed", []), ("bf16", ["bf16=true"])):
            capture = CaptureGradients()
            towers = fsdp_towers(spec, checkpointing=True)
            run(
                store,
                f"{root}/{tag}",
                towers,
                [capture],
                recipe="clip",
                steps=STEPS,
                overrides=overrides,
            )
            grads[tag] = capture.grads
        if rank == 0:
            torch.save(grads, f"{root}/grads.pt")
        # stop after 2 steps, resume from the distributed checkpoint to 4: as one run of 4
        # with validation: every rank re-encodes the split, the best towers are gathered
        towers, validated = fsdp_towers(spec), ["val_every=2"]
        run(store, f"{root}/straight", towers, steps=4, overrides=validated)
        run(store, f"{root}/stopped", towers, steps=4, stop_at=2, overrides=validated)
        run(store, f"{root}/stopped", None, steps=4, resume=True, overrides=validated)
        # a copy of that run with a planted pickle as its distributed checkpoint's .metadata:
        # the resume refuses it (checksum) before torch's reader unpickles it
        planted = f"{root}/planted"
        if rank == 0:
            shutil.copytree(f"{root}/stopped", planted)
            metadata = f"{planted}/towers-dcp/step-00000004/.metadata"
            with open(metadata, "wb") as handle:
                pickle.dump(Payload(f"{root}/payload-ran"), handle)
        dist.barrier()
        try:
            run(store, planted, None, steps=6, resume=True, overrides=validated)
            outcome = "resumed"
        except CurvalignError as err:
            outcome = str(err)
        with open(f"{root}/planted.{rank}", "w") as handle:
            handle.write(outcome)
        dist.barrier()
        mark_done(root, rank)
    finally:
        dist.destroy_process_group()


class Payload:
    """A pickle that runs a command when loaded (it creates the file ``marker``)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def fsdp_runs(world, tmp_path_factory):  # noqa: F811
    """Every FSDP2 run of this module, made once by two gloo processes."""
    root = tmp_path_factory.mktemp("fsdp")
    init_file = tempfile.mktemp(dir=root)
    spawn_and_wait(_worker, (init_file, world["spec"], world["store"], str(root)), WORLD, root)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_fsdp2_two_processes_take_the_step_of_one_process_on_the_global_batch(
    world,  # noqa: F811
    fsdp_runs,
    tmp_path,
    name: str,
) -> None:
    capture = CaptureGradients()
    one = run(
        world["store"],
        tmp_path / "one",
        fsdp_towers(world["spec"]),
        [capture],
        recipe=name,
        steps=STEPS,
    )
    many = torch.load(fsdp_runs / "grads.pt", weights_only=False)[name]
    failures = []
    for step in range(1, STEPS + 1):
        ref, got = capture.grads[step], many[step]
        assert ref.keys() == got.keys(), (step, sorted(ref.keys() ^ got.keys())[:5])
        assert any(k.startswith("towers.model.visual") for k in ref)
        assert any("lora_B" in k for k in ref)
        for key, grad in ref.items():
            if not torch.allclose(got[key], grad, rtol=1e-4, atol=1e-6):
                err = (got[key] - grad).abs().max().item()
                failures.append(f"step {step} {key}: differs by {err:.2e} (norm {grad.norm():.2e})")
    assert not failures, "\n".join(failures[:20])
    for grads in many.values():  # clipped to the global norm CLIP
        norm = torch.stack([g.norm() for g in grads.values()]).norm()
        assert norm == pytest.approx(CLIP, rel=1e-3)
    # the weights after the steps: Adam turns a gradient at rounding level (open_clip's key
    # biases get none: a constant added to every key's logit) into a ±lr step of either sign
    grads = capture.grads[1]
    for file in ("model.safetensors", "towers.safetensors"):
        a, b = load_file(str(one / file)), load_file(str(fsdp_runs / name / file))
        assert a.keys() == b.keys()
        for key in a:
            grad = grads["recipe." + key if file == "model.safetensors" else "towers." + key]
            exact = grad.abs() > 1e-5
            torch.testing.assert_close(b[key][exact], a[key][exact], rtol=1e-4, atol=1e-6)
            assert ((b[key] - a[key]).abs() <= 2 * STEPS * LR + 1e-6).all(), f"{file} {key}"


@pytest.mark.slow
def test_fsdp2_resume_from_the_distributed_checkpoint_equals_an_uninterrupted_run(
    fsdp_runs,
) -> None:
    straight, resumed = fsdp_runs / "straight", fsdp_runs / "stopped"
    names = (
        "model.safetensors",
        "towers.safetensors",
        "best.safetensors",
        "towers-best.safetensors",
    )
    for file in names:
        a, b = load_file(str(straight / file)), load_file(str(resumed / file))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{file}: {key}"
    history = json.loads((straight / "meta.json").read_text())["val_history"]
    assert [step for step, _ in history] == [0, 2, 4]
    assert json.loads((resumed / "meta.json").read_text())["val_history"] == history
    # the shards and their optimizer state: one distributed checkpoint, the last one
    assert [p.name for p in (resumed / "towers-dcp").iterdir()] == ["step-00000004"]
    state = torch.load(resumed / "state.pt", weights_only=True)
    assert state["towers"] == {} and state["fsdp"]["checkpoint"] == "towers-dcp/step-00000004"
    # state.pt: the recipe's optimizer state only, plain tensors (the towers' is sharded)
    slots = state["optimizer"]["state"]
    params = sum(len(group["params"]) for group in state["optimizer"]["param_groups"])
    recipe_params = params - len(state["fsdp"]["trainable"])  # the towers' groups come last
    assert slots and all(index < recipe_params for index in slots)
    assert all(type(v) is torch.Tensor for slot in slots.values() for v in slot.values())
    # towers.safetensors holds whole tensors (export and load_towers read it unchanged)
    towers = load_file(str(resumed / "towers.safetensors"))
    assert towers["model.visual.conv1.weight"].shape == (32, 3, 16, 16)


@pytest.mark.slow
def test_fsdp2_resume_refuses_a_planted_distributed_checkpoint_metadata_before_reading_it(
    fsdp_runs,
) -> None:
    for rank in range(WORLD):
        outcome = (fsdp_runs / f"planted.{rank}").read_text()
        assert "\n" not in outcome and "step-00000004/.metadata" in outcome, outcome
        assert "changed after the run wrote it" in outcome, outcome
    assert not (fsdp_runs / "payload-ran").exists()
    # the run's checksums: every file of its distributed checkpoint, in state.pt and meta.json
    resumed = fsdp_runs / "stopped"
    state = torch.load(resumed / "state.pt", weights_only=True)
    recorded = json.loads((resumed / "meta.json").read_text())["towers"]["sharded_sha256"]
    files = sorted(p.name for p in (resumed / "towers-dcp" / "step-00000004").iterdir())
    assert ".metadata" in files and len(files) == 1 + WORLD
    assert sorted(recorded) == [f"towers-dcp/step-00000004/{f}" for f in files]
    assert state["fsdp"]["sha256"] == recorded


def test_a_planted_distributed_checkpoint_metadata_is_one_error_and_never_runs(tmp_path) -> None:
    """The checks on their own, on a distributed checkpoint one process writes: the files'
    checksums (from state.pt or meta.json), and the metadata read through an allow-list for a
    run written before checksums."""
    import torch.distributed.checkpoint as dcp

    from curvalign.train.towers import (
        read_sharded_metadata,
        sharded_checksums,
        sharded_reader,
        verify_sharded_checkpoint,
    )

    run_dir, name = tmp_path / "run", "towers-dcp/step-00000002"
    weights = torch.randn(3, 4)
    dcp.save(
        {"towers": {"w": weights}, "optimizer": {"w/exp_avg": torch.ones(3, 4)}},
        checkpoint_id=str(run_dir / name),
    )
    digests = sharded_checksums(run_dir, name)
    assert f"{name}/.metadata" in digests and len(digests) == 2
    assert verify_sharded_checkpoint(run_dir, name, digests) is None
    metadata = read_sharded_metadata(run_dir / name)
    assert set(metadata.state_dict_metadata) == {"towers.w", "optimizer.w/exp_avg"}
    loaded = {"towers": {"w": torch.zeros(3, 4)}}
    dcp.load(loaded, storage_reader=sharded_reader(run_dir / name))
    assert torch.equal(loaded["towers"]["w"], weights)

    marker = tmp_path / "payload-ran"
    genuine = (run_dir / name / ".metadata").read_bytes()
    (run_dir / name / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    with pytest.raises(CheckpointError) as refused:
        verify_sharded_checkpoint(run_dir, name, digests)
    message = str(refused.value)
    assert "\n" not in message and f"{name}/.metadata is damaged or was changed" in message
    meta = {"step": 2, "image_dim": 4, "text_dim": 4, "recipe": "clip"}
    (run_dir / "meta.json").write_text(json.dumps({**meta, "towers": {"sharded_sha256": digests}}))
    with pytest.raises(CheckpointError, match="changed after the run wrote it"):
        verify_sharded_checkpoint(run_dir, name, None)  # meta.json's record alone
    # a run written before checksums: a note, and the metadata itself refused without running
    (run_dir / "meta.json").write_text(json.dumps(meta))
    assert "without checksums" in verify_sharded_checkpoint(run_dir, name, None)
    with pytest.raises(
        CheckpointError, match=r"\.metadata is not the metadata .*system, which is refused"
    ):
        read_sharded_metadata(run_dir / name)
    with pytest.raises(CheckpointError):
        sharded_reader(run_dir / name).read_metadata()
    assert not marker.exists()
    (run_dir / name / ".metadata").write_bytes(genuine)
    (run_dir / name / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match="__0_0.distcp is missing"):
        verify_sharded_checkpoint(run_dir, name, digests)


def test_fsdp2_shards_the_blocks_of_the_sides_that_train(world) -> None:  # noqa: F811
    from curvalign.train.towers import transformer_blocks

    spec = world["spec"]
    both = build_towers(fsdp_towers(spec))
    assert transformer_blocks(both) == ["visual.transformer.resblocks.0", "transformer.resblocks.0"]
    image_only = build_towers(TowersConfig(spec, image="full", strategy="fsdp"))
    assert transformer_blocks(image_only) == ["visual.transformer.resblocks.0"]
    assert transformer_blocks(build_towers(TowersConfig(spec))) == []
    assert TowersConfig.parse(f"{spec};text=lora;strategy=fsdp").strategy == "fsdp"
    from curvalign.towers import TowerError

    with pytest.raises(TowerError, match="strategy='zero'"):
        TowersConfig(spec, strategy="zero")


@pytest.mark.slow
def test_fsdp2_with_activation_checkpointing_gives_the_same_gradients_and_bf16_is_finite(
    fsdp_runs,
) -> None:
    grads = torch.load(fsdp_runs / "grads.pt", weights_only=False)
    plain, checkpointed, bf16 = grads["clip"], grads["checkpointed"], grads["bf16"]
    for step in range(1, STEPS + 1):
        assert plain[step].keys() == checkpointed[step].keys() == bf16[step].keys()
        for key, grad in plain[step].items():
            torch.testing.assert_close(checkpointed[step][key], grad, msg=f"step {step} {key}")
            assert torch.isfinite(bf16[step][key]).all(), f"bf16 step {step} {key}"
        # bf16 rounds: near the fp32 gradient, not equal to it
        flat = torch.cat([g.flatten() for g in plain[step].values()])
        flat16 = torch.cat([g.flatten() for g in bf16[step].values()])
        assert 0 < (flat16 - flat).norm() < 0.1 * flat.norm()

    def losses(run):
        return [
            json.loads(r)["loss"] for r in (fsdp_runs / run / "log.jsonl").read_text().splitlines()
        ]

    assert losses("checkpointed") == pytest.approx(losses("clip"), rel=1e-6)
    log = (fsdp_runs / "bf16" / "log.jsonl").read_text().splitlines()
    assert len(log) == STEPS and all(math.isfinite(json.loads(r)["loss"]) for r in log)


from test_encoders import tiny_hf_clip  # noqa: E402, F401  (fixture: a tiny random CLIPModel)


def test_fsdp2_finds_the_blocks_of_a_hugging_face_clip(tiny_hf_clip) -> None:  # noqa: F811
    from curvalign.train.towers import transformer_blocks

    if importlib.util.find_spec("transformers") is None:
        pytest.skip("optional extra not installed: pip install 'curvalign[hf]'")
    _, _, root = tiny_hf_clip
    towers = build_towers(TowersConfig(f"hf-clip:{root}", image="lora", text="locked"))
    blocks = transformer_blocks(towers)
    layers = len(towers.model.vision_model.encoder.layers)
    assert blocks == [f"vision_model.encoder.layers.{i}" for i in range(layers)]
