"""Command line: parse arguments, call library functions, print results. No logic lives here.

Each command imports its library module lazily so that ``curvalign --help`` stays fast and a
missing optional extra only affects the command that needs it.
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    name="curvalign",
    help="Geometry-aware contrastive alignment of images and texts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Geometry-aware contrastive alignment of images and texts."""


def fail(message: str) -> None:
    """One clear error line on stderr and exit status 2; no traceback."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code=2)


@app.command()
def version() -> None:
    """Print the installed curvalign version."""
    from curvalign import __version__

    typer.echo(__version__)


# --- train (issue: methods and trainer) -------------------------------------------------------

@app.command("train")
def train_command(
    overrides: list[str] = typer.Argument(
        None, metavar="KEY=VALUE",
        help="Config overrides: a trainer key (lr=1e-3) or a recipe key (temperature_init=0.05); "
             "prefix train. or recipe. to be explicit."),
    recipe: str = typer.Option(None, "--recipe", help="Method to train (clip, meru, hycoclip, atmg, "
                                                      "phyclip, proclip, agr, dualpath)."),
    data: str = typer.Option(None, "--data", help="synthetic, synthetic:k=v,..., or features:PATH."),
    steps: int = typer.Option(None, "--steps", min=1, help="Optimizer steps (train.steps)."),
    out: Path = typer.Option(..., "--out", help="Run directory to write."),
    config: Path = typer.Option(None, "--config", help="YAML file shaped like a run's config.json."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run files already in --out."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or notes."),
) -> None:
    """Train a recipe on features; writes checkpoint, config and logs into --out."""
    from curvalign.train.config import TrainError
    from curvalign.train.logging import read_log
    from curvalign.train.trainer import train

    def note(message: str) -> None:
        if not quiet:
            typer.secho(f"note: {message}", err=True, fg=typer.colors.YELLOW)

    try:
        run_dir = train(recipe, data, out, steps=steps, overrides=overrides or (), config_file=config,
                        resume=resume, overwrite=overwrite, show_progress=not quiet, notify=note)
    except TrainError as err:
        fail(str(err))
    records = read_log(run_dir)
    last = records[-1] if records else {}
    loss = f" (loss {last['loss']:.4f})" if isinstance(last.get("loss"), float) else ""
    typer.echo(f"trained to step {last.get('step', '?')}{loss}: {run_dir}")


# --- eval / benchmark / demo / study (issue: evaluation) --------------------------------------

def _eval_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that carry a message for the user (printed by ``fail``, no traceback)."""
    from curvalign.train.config import TrainError

    return (TrainError, ValueError, KeyError, FileNotFoundError, NotADirectoryError)


def _message(err: BaseException) -> str:
    return str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


@app.command("eval")
def eval_command(
    run_dir: Path = typer.Argument(..., help="A run directory written by `curvalign train`."),
    data: str = typer.Option(None, "--data", help="Data to evaluate on (default: the run's own data spec)."),
    split: str = typer.Option("test", "--split", help="Split of the store to evaluate (every image if it has none)."),
    json_output: bool = typer.Option(False, "--json", help="Print exactly one JSON object on stdout."),
    batch_size: int = typer.Option(1024, "--batch-size", min=1, help="Items embedded per forward pass."),
) -> None:
    """Evaluate a trained run: every metric the data supports (see docs/evaluation.md)."""
    import json

    from curvalign.eval import evaluate
    from curvalign.report.benchmark import load_store
    from curvalign.report.tables import metrics_lines, to_jsonable
    from curvalign.train.checkpoint import load_run

    try:
        run = load_run(run_dir)
        spec = data or run.config.data
        if not data and spec.startswith("<"):
            fail(f"{run_dir} was trained on an in-memory store ({spec}); pass --data SPEC")
        store, spec = load_store(spec)
        result = evaluate(run.recipe, store, split=split, batch_size=batch_size)
    except _eval_errors() as err:
        fail(_message(err))
    result["meta"].update(step=run.step, run_dir=str(run_dir), data=spec)
    if json_output:
        typer.echo(json.dumps(to_jsonable(result)))
        return
    typer.echo(f"{run.config.recipe} at step {run.step} on {spec} ({split}: {result['meta']['num_images']} images, "
               f"{result['meta']['num_texts']} captions)")
    for name, value in metrics_lines(result):
        typer.echo(f"  {name:40s} {value}")


def _print_benchmark(result, out: Path, title: str) -> None:
    from rich.console import Console

    from curvalign.report.tables import rich_table

    Console().print(rich_table(result.results, title=title))
    typer.echo(f"wrote {out / 'results.md'}, {out / 'results.json'}")
    pngs = [str(p) for k, p in result.files.items() if k.endswith("_png")]
    if pngs:
        typer.echo("plots: " + ", ".join(pngs))


@app.command("benchmark")
def benchmark_command(
    overrides: list[str] = typer.Argument(
        None, metavar="KEY=VALUE",
        help="Overrides for every recipe (batch_size=128); NAME.key=value for recipe NAME only."),
    recipes: str = typer.Option(..., "--recipes", help="Comma-separated recipe names, e.g. clip,meru,phyclip."),
    data: str = typer.Option("synthetic", "--data", help="synthetic, synthetic:k=v,..., or features:PATH."),
    out: Path = typer.Option(..., "--out", help="Output directory (runs/, results.md, results.json, plots)."),
    steps: int = typer.Option(None, "--steps", min=1, help="Optimizer steps for every recipe."),
    split: str = typer.Option("test", "--split", help="Split to evaluate on."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-step progress bars."),
) -> None:
    """Train each recipe on the same data with the same budget, evaluate, and compare side by side."""
    from curvalign.report.benchmark import run_benchmark

    names = [r.strip() for r in recipes.split(",") if r.strip()]
    console = _stderr_console()
    try:
        result = run_benchmark(names, data, out, steps=steps, overrides=overrides or [], split=split,
                               show_progress=not quiet, notify=console.print)
    except _eval_errors() as err:
        fail(_message(err))
    _print_benchmark(result, out, f"benchmark on {result.data}")


@app.command("demo")
def demo_command(
    overrides: list[str] = typer.Argument(None, metavar="KEY=VALUE", help="Extra overrides (as for benchmark)."),
    out: Path = typer.Option(Path("curvalign-demo"), "--out", help="Output directory."),
    recipes: str = typer.Option(None, "--recipes", help="Recipes (default: all eight)."),
    data: str = typer.Option(None, "--data", help="Data (default: a small synthetic world)."),
    steps: int = typer.Option(None, "--steps", min=1, help="Steps per recipe (default: the demo's)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-step progress bars."),
) -> None:
    """All methods on a small synthetic world in about a minute on two CPU cores: table and plots."""
    import time

    from curvalign.report.benchmark import DEMO_OVERRIDES, DEMO_RECIPES, DEMO_STEPS, DEMO_WORLD, run_benchmark

    names = [r.strip() for r in recipes.split(",") if r.strip()] if recipes else list(DEMO_RECIPES)
    console = _stderr_console()
    start = time.perf_counter()
    try:
        result = run_benchmark(names, data or DEMO_WORLD, out, steps=steps or DEMO_STEPS,
                               overrides=list(DEMO_OVERRIDES) + list(overrides or []), show_progress=not quiet,
                               notify=console.print, title="curvalign demo")
    except _eval_errors() as err:
        fail(_message(err))
    _print_benchmark(result, out, f"curvalign demo: {result.data}, {result.steps} steps per recipe")
    typer.echo(f"demo finished in {time.perf_counter() - start:.0f}s")


@app.command("study")
def study_command(
    name: str = typer.Argument(..., help="agr-curriculum, atmg-curvature, proclip-product, phyclip-factors, "
                                         "dualpath-forgetting"),
    overrides: list[str] = typer.Argument(None, metavar="KEY=VALUE", help="Overrides for every run of the study."),
    out: Path = typer.Option(None, "--out", help="Output directory (default: studies/NAME)."),
    steps: int = typer.Option(None, "--steps", min=1, help="Steps per run (default: the study's)."),
    data: str = typer.Option(None, "--data", help="Data (default: the study's synthetic world)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-step progress bars."),
) -> None:
    """Test one paper claim on the synthetic world and print the verdict with its figures."""
    from curvalign.report.studies import STUDIES, run_study

    if name not in STUDIES:
        fail(f"unknown study {name!r}; studies: {', '.join(STUDIES)}")
    console = _stderr_console()
    out = out or Path("studies") / name
    try:
        result = run_study(name, out, steps=steps, data=data, overrides=overrides or [],
                           show_progress=not quiet, notify=console.print)
    except _eval_errors() as err:
        fail(_message(err))
    typer.echo(result["markdown"])
    typer.echo(f"verdict: {result['verdict']}")
    typer.echo(f"wrote {out / 'study.json'}, {out / 'study.md'}" +
               (", " + ", ".join(result["figures"]) if result.get("figures") else ""))


# --- embed / index (issue: retrieval serving) -------------------------------------------------

# --- extract (issue: real encoders) -----------------------------------------------------------

@app.command("extract")
def extract_command(
    encoder: str = typer.Option(..., "--encoder", help="open_clip:ARCH:CHECKPOINT, hf-clip:DIR, "
                                                       "sentence-transformers:DIR, or minilm (local files only)."),
    images: Path = typer.Option(..., "--images", help="Folder the image paths are relative to."),
    out: Path = typer.Option(..., "--out", help="Feature store directory to write (use as --data features:OUT)."),
    captions: Path = typer.Option(None, "--captions", help="Captions JSON (COCO or Karpathy layout)."),
    layout: str = typer.Option(None, "--format", help="coco or karpathy (default: told apart by the keys)."),
    boxes: Path = typer.Option(None, "--boxes", help="Box-level pairs, JSON Lines {image, box, phrase}."),
    classes: Path = typer.Option(None, "--classes", help="Class names (CLIP_benchmark JSON or one per line)."),
    templates: Path = typer.Option(None, "--templates", help="Prompt templates with {c} (CLIP_benchmark JSON)."),
    taxonomy: Path = typer.Option(None, "--taxonomy", help="'parent child' edge list over class folders/names."),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Rows per encoder call."),
    shard_size: int = typer.Option(1024, "--shard-size", min=1, help="Rows per resumable shard."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing store at --out."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Encode images and captions with a local encoder into a feature store (resumable)."""
    from curvalign.data.encoders import EncoderError
    from curvalign.data.extract import SKIPPED_REPORT, ExtractError, extract_features
    from curvalign.data.features import FeatureStoreError

    try:
        summary = extract_features(
            encoder, images, out, captions=captions, layout=layout, boxes=boxes, classes=classes,
            templates=templates, taxonomy=taxonomy, batch_size=batch_size, shard_size=shard_size,
            device=device, overwrite=overwrite, progress=not quiet,
        )
    except (EncoderError, ExtractError, FeatureStoreError) as err:
        fail(str(err))
    typer.echo(
        f"wrote {summary.store}: {summary.images} images, {summary.texts} captions, {summary.boxes} boxes, "
        f"{summary.classes} classes ({summary.shards_computed} shards computed, {summary.shards_reused} reused)"
    )
    if summary.skipped_images or summary.skipped_boxes:
        typer.echo(
            f"skipped {len(summary.skipped_images)} unreadable images (dropping their {summary.dropped_captions} "
            f"captions) and {summary.dropped_boxes} boxes; listed in {summary.store / SKIPPED_REPORT}"
        )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
