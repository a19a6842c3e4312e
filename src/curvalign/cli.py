"""Command line: parse arguments, call library functions, print results. No logic lives here.

Each command imports its library module lazily so that ``curvalign --help`` stays fast and a
missing optional extra only affects the command that needs it.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from typer.core import TyperGroup

from curvalign._extract_kinds import EXTRACT_KINDS
from curvalign.errors import CurvalignError
from curvalign.plugins import available_recipe_names

if TYPE_CHECKING:
    from curvalign.data.extract import ExtractSummary

app = typer.Typer(
    name="curvalign",
    help="Geometry-aware contrastive alignment of images and texts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain help: rich markup would swallow text in brackets ("[n, d]") and label flags <bool>
    rich_markup_mode=None,
)


#: the data specs every command that trains accepts (data/__init__.py's load_data)
DATA_HELP = (
    "synthetic, synthetic:k=v,..., features:PATH, wordnet:SYNSET "
    "(the WordNet noun tree below SYNSET, e.g. wordnet:mammal.n.01), or clip-retrieval:DIR "
    "(img_emb/, text_emb/, metadata/ shards, memory-mapped in place)."
)
#: the run argument and --weights option of every command that reads a trained run
RUN_DIR_HELP = "A run directory written by `curvalign train`."
WEIGHTS_HELP = "best (the best validation step, default) or last."


@app.callback()
def _root(
    check: bool = typer.Option(
        False,
        "--check",
        help="Scan every float of the data for NaN/inf when it is opened, even where the "
        "store records that scan (stores written by curvalign open without it).",
    ),
) -> None:
    """Geometry-aware contrastive alignment of images and texts."""
    if check:
        import os

        from curvalign.data.features import CHECK_ENV

        os.environ[CHECK_ENV] = "1"  # inherited by the processes of --nproc


def fail(message: str, code: int = 2) -> NoReturn:
    """One clear error line on stderr and exit status ``code`` (2); no traceback.

    Commands catch ``CurvalignError`` (bad input, named by its message) and pass its message
    here; any other exception is a bug and keeps its traceback."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code=code)


def refuse_unknown_recipes(names: list[str]) -> None:
    """Fail at once on a recipe name no module or entry point provides (the names are known
    without importing torch: ``curvalign.plugins``). Where the registry is already imported
    (the Python API, a program that registered its own recipes), it is the list to check."""
    registry = sys.modules.get("curvalign.recipes")
    known = registry.recipe_names() if registry is not None else available_recipe_names()
    unknown = [name for name in names if name not in known]
    if unknown:
        listed = ", ".join(repr(name) for name in unknown)
        fail(f"unknown recipe {listed}; known recipes: {', '.join(known)}")


def check_out(out: Path | None, what: str = "--out") -> None:
    """Fail at once (before loading data or models) when ``out`` cannot be written."""
    from curvalign._io import OutputError, check_output_location

    if out is None:
        return
    try:
        check_output_location(out, what)
    except OutputError as err:
        fail(str(err))


def _signal_label(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _stopped(signum: int, message: str) -> None:
    """One "stopped:" line (not an error: the command was asked to stop and kept what it says)
    and the exit status a shell gives a process ended by ``signum`` (130 Ctrl-C, 143 SIGTERM)."""
    typer.secho(
        f"stopped: interrupted ({_signal_label(signum)}); {message}",
        err=True,
        fg=typer.colors.YELLOW,
    )
    raise typer.Exit(code=128 + int(signum))


def _training_interrupted(err: BaseException) -> int | None:
    """The signal of a ``TrainingInterrupted`` (a training loop that stopped with a checkpoint on
    Ctrl-C or SIGTERM), else None. Looked up lazily: the trainer imports torch."""
    trainer = sys.modules.get("curvalign.train.trainer")
    if trainer is not None and isinstance(err, trainer.TrainingInterrupted):
        return int(err.signum)
    return None


@contextlib.contextmanager
def stoppable(resume: str | Callable[[], str]) -> Iterator[None]:
    """Around every long command (train, its --lr-range, benchmark and --tune, demo, study,
    embed, index build): SIGTERM (what ``kill``, ``timeout`` and job schedulers send) is handled
    like Ctrl-C, wherever the command is (loading data, a range test, training, evaluating,
    writing). Either ends the command with one "stopped:" line that says what was kept and how
    to continue (``resume``, or a function that says it once the command has stopped) and exit
    status 130 (Ctrl-C) or 143 (SIGTERM). A training loop stopped by either first writes a
    checkpoint (``TrainingInterrupted``, the trainer's own stop request)."""
    from curvalign._io import Terminated, terminate_as_interrupt

    def hint() -> str:
        return resume() if callable(resume) else resume

    try:
        with terminate_as_interrupt():
            yield
    except KeyboardInterrupt as err:
        _stopped(signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT, hint())
    except CurvalignError as err:
        signum = _training_interrupted(err)
        if signum is None:
            raise
        _stopped(signum, hint())


def write_failed(err: OSError, out: Path, kept: str | None = None) -> None:
    """A write that failed midway (disk full, read-only, permissions) as one line saying what
    was kept; any other OSError is a bug or an input problem and is raised as it was."""
    from curvalign._io import WRITE_FAILURES, describe_write_failure

    if err.errno not in WRITE_FAILURES:
        raise err
    kept = kept or (
        f"what was completely written before it is kept in {out} "
        "(every file is written whole or not at all)"
    )
    fail(f"{describe_write_failure(err, out)}; {kept}")


@contextlib.contextmanager
def _command_errors(out: Path, kept: str | None = None) -> Iterator[None]:
    """Around a command's library call that writes ``out``: bad input (a ``CurvalignError``)
    ends as its one line (``fail``), a write failing midway (disk full, read-only) as one line
    saying what was ``kept`` (``write_failed``); any other error is a bug and keeps its
    traceback."""
    try:
        yield
    except CurvalignError as err:
        if _training_interrupted(err) is not None:
            raise  # a stop request, not an error: ``stoppable`` says how to continue
        fail(str(err))
    except OSError as err:
        write_failed(err, out, kept)


def print_notes(notes) -> None:
    for message in notes:
        typer.secho(f"note: {message}", err=True, fg=typer.colors.YELLOW)


@app.command()
def version() -> None:
    """Print the installed curvalign version."""
    from curvalign import __version__

    typer.echo(__version__)


# --- train a recipe on a store or the synthetic world; the learning-rate range test ---------------


@app.command("train")
def train_command(
    overrides: list[str] = typer.Argument(
        None,
        metavar="KEY=VALUE",
        help="Config overrides: a trainer key (lr=1e-3) or a recipe key (temperature_init=0.05); "
        "prefix train. or recipe. to be explicit.",
    ),
    recipe: str = typer.Option(
        None,
        "--recipe",
        help=f"Method to train ({', '.join(available_recipe_names())}).",
    ),
    data: str = typer.Option(None, "--data", help=DATA_HELP),
    steps: int = typer.Option(None, "--steps", min=1, help="Optimizer steps (train.steps)."),
    out: Path = typer.Option(
        None, "--out", help="Run directory to write (required unless --print-config)."
    ),
    config: Path = typer.Option(
        None, "--config", help="YAML file shaped like a run's config.json."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the run in --out from its checkpoint."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace the run files already in --out."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or notes."),
    print_config: bool = typer.Option(
        False,
        "--print-config",
        help="Print the resolved config (recipe's paper defaults, --config file, overrides) "
        "as YAML and exit without training.",
    ),
    towers: str = typer.Option(
        None,
        "--towers",
        help="Train the encoders too: 'ENCODER_SPEC[;image=lora;text=full;lora_rank=8;lr=1e-5]' "
        "(modes locked|lora|full; the store's images and captions are re-encoded each step; "
        "raw rows: ';workers=4;augment=true;flip=0.5;shards=DIR'; "
        "see docs/training.md, 'Train the towers').",
    ),
    nproc: int = typer.Option(
        1,
        "--nproc",
        min=1,
        help="Processes on this machine (launched through torchrun; "
        "DDP with global-batch negatives, see docs/scale.md).",
    ),
    lr_range: bool = typer.Option(
        False,
        "--lr-range",
        help="Instead of training: a learning-rate range test (validation error against an exponential lr "
        "ramp from 1e-6 to 1 over --steps steps, default 100), written to --out as "
        "lr_range.json and lr_range.png, with a suggested lr range.",
    ),
) -> None:
    """Train a recipe on features; writes checkpoint, config and logs into --out.

    Ctrl-C or SIGTERM stops at the next step with a checkpoint (exit status 130 or 143);
    continue with --resume."""
    refuse_unknown_recipes([recipe] if recipe else [])  # before seconds of importing torch
    if lr_range:
        _lr_range_command(recipe, data, steps, out, config, overrides or [])
        return
    if print_config:
        _print_train_config(recipe, data, steps, overrides or [], config)
        return
    if out is None:
        fail("missing option --out DIR: the run directory to write")
    check_out(out)  # before seconds of importing torch
    from curvalign.train.distributed import (
        is_main_process,
        launch_training,
        run_training,
        train_arguments,
    )

    try:
        if nproc > 1:  # the ranks run this same command under torchrun (and print their own errors)
            raise typer.Exit(
                code=launch_training(
                    nproc,
                    train_arguments(
                        recipe=recipe,
                        data=data,
                        steps=steps,
                        out=out,
                        config=config,
                        resume=resume,
                        overwrite=overwrite,
                        quiet=quiet,
                        overrides=overrides or [],
                        towers=towers,
                    ),
                )
            )
        # run_training is train() itself unless torchrun launched this process
        with stoppable(lambda: _train_resume_hint(out)):
            run_dir = run_training(
                recipe,
                data,
                out,
                steps=steps,
                overrides=overrides or (),
                config_file=config,
                resume=resume,
                overwrite=overwrite,
                show_progress=not quiet,
                notify=lambda message: _train_note(message, quiet),
                towers=towers,
            )
    except CurvalignError as err:
        fail(str(err))
    except OSError as err:
        write_failed(err, out)
    if not is_main_process():
        return
    _report_trained_run(run_dir, quiet)


def _train_resume_hint(out: Path) -> str:
    """What a stopped ``train`` kept in ``out`` and how to continue it."""
    from curvalign.runs import read_meta

    try:
        step = read_meta(out)["step"]
    except CurvalignError:  # no checkpoint yet: train() removed what it had begun
        return "no checkpoint had been written, so nothing was kept; start it again"
    return f"stopped at step {step} with a checkpoint in {out}; continue with: curvalign train --out {out} --resume"


def _train_note(message: str, quiet: bool) -> None:
    """A trainer note on stderr; warnings are shown under -q too."""
    if message.startswith("warning: "):
        typer.secho(message, err=True, fg=typer.colors.YELLOW)
    elif not quiet:
        typer.secho(f"note: {message}", err=True, fg=typer.colors.YELLOW)


def _print_train_config(
    recipe: str | None,
    data: str | None,
    steps: int | None,
    overrides: list[str],
    config: Path | None,
) -> None:
    """``curvalign train --print-config``: the resolved config as YAML."""
    from curvalign.config import describe_config

    try:
        typer.echo(describe_config(recipe, data, steps=steps, overrides=overrides, config=config))
    except CurvalignError as err:
        fail(str(err))


def _report_trained_run(run_dir: Path, quiet: bool) -> None:
    """The last step and loss of a finished run, its best validation step, and (unless -q) the
    health warnings of the run."""
    from curvalign.runs import read_log

    records = read_log(run_dir)
    last = records[-1] if records else {}
    loss = f" (loss {last['loss']:.4f})" if isinstance(last.get("loss"), float) else ""
    typer.echo(f"trained to step {last.get('step', '?')}{loss}: {run_dir}")
    best_step = getattr(run_dir, "best_step", None)
    best_val = getattr(run_dir, "best_val", None)
    if best_step is not None and best_val is not None:
        typer.echo(
            f"best validation (mean R@1 {100 * best_val:.1f}%) at step {best_step}: "
            "best.safetensors (what eval, embed and benchmark use by default)"
        )
    if not quiet:
        from curvalign.eval.health import health_of_run
        from curvalign.runs import load_run

        try:
            for warning in health_of_run(load_run(run_dir)).warnings:
                typer.secho(f"warning: {warning}", err=True, fg=typer.colors.YELLOW)
        except CurvalignError as err:
            fail(str(err))


def _lr_range_command(
    recipe: str | None,
    data: str | None,
    steps: int | None,
    out: Path | None,
    config: Path | None,
    overrides: list[str],
) -> None:
    """``curvalign train --lr-range``: the range test, its plot and its suggestion."""
    if out is None:
        fail("missing option --out DIR: where lr_range.json and lr_range.png go")
    check_out(out)
    from curvalign.report.tables import write_json
    from curvalign.report.tuning import plot_lr_range
    from curvalign.train.lr_range import lr_range_test

    with stoppable("nothing was written; run it again"), _command_errors(out):
        found = lr_range_test(
            recipe, data, steps=steps or 100, overrides=overrides, config_file=config
        )
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "lr_range.json", found.to_json())
        plot_lr_range(found, out / "lr_range.png")
    typer.echo(found.describe())
    typer.echo(f"wrote {out / 'lr_range.json'}, {out / 'lr_range.png'}")


# --- evaluate runs (eval), compare recipes (benchmark, demo), test the seeds' claims (study) ------


#: the width tables get off a terminal (a pipe, a log file): wide enough for every column
#: (rich would otherwise assume 80 and drop or squeeze them); a table is only as wide as it needs
OFF_TERMINAL_WIDTH = 2000


def _table_console(width: int | None = None):
    """A rich console for tables: ``width`` if given, the terminal's on a terminal, else
    ``OFF_TERMINAL_WIDTH`` (``curvalign demo > log`` gets the whole table)."""
    from rich.console import Console

    if width:
        return Console(width=width)
    console = Console()
    return console if console.is_terminal else Console(width=OFF_TERMINAL_WIDTH)


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


@app.command("eval")
def eval_command(
    run_dir: Path = typer.Argument(..., help=RUN_DIR_HELP),
    data: str = typer.Option(
        None, "--data", help="Data to evaluate on (default: the run's own data spec)."
    ),
    split: str = typer.Option(
        "test", "--split", help="Split of the store to evaluate (every image if it has none)."
    ),
    json_output: bool = typer.Option(
        False, "--json", help="Print exactly one JSON object on stdout."
    ),
    batch_size: int = typer.Option(
        1024, "--batch-size", min=1, help="Items embedded per forward pass."
    ),
    suite: Path = typer.Option(
        None,
        "--suite",
        help="A folder of feature stores (one per dataset): evaluate on each, write one long "
        "table (CSV + Markdown, CLIP_benchmark's columns).",
    ),
    out: Path = typer.Option(
        None,
        "--out",
        help="--suite: folder for suite.csv, suite_wide.csv, suite.md (default: RUN/suite).",
    ),
    protocol: str = typer.Option(
        None,
        "--protocol",
        help="Evaluate retrieval under a named protocol: coco-5k or flickr30k-1k "
        "(5 captions per image; the store's meta.protocol otherwise).",
    ),
    weights: str = typer.Option("best", "--weights", help=WEIGHTS_HELP),
) -> None:
    """Evaluate a trained run: every metric the data supports (see docs/evaluation.md)."""
    import json

    from curvalign.report.run_eval import evaluate_run
    from curvalign.report.tables import UNITS, metrics_lines, to_jsonable

    if suite is not None:
        if data is not None or protocol is not None:
            fail("--suite evaluates every store of the folder; drop --data and --protocol")
        _run_suite([run_dir], suite, out or Path(run_dir) / "suite", split, batch_size, json_output)
        return
    try:
        evaluation = evaluate_run(
            run_dir,
            data=data,
            split=split,
            batch_size=batch_size,
            protocol=protocol,
            weights=weights,
            on_loaded=lambda loaded: print_notes(loaded.notes),
        )
    except CurvalignError as err:
        fail(str(err))
    run, result, spec, split = evaluation.run, evaluation.result, evaluation.spec, evaluation.split
    if json_output:
        typer.echo(json.dumps(to_jsonable(result.to_json())))
        return
    for warning in result.health.warnings if result.health is not None else ():
        typer.secho(f"warning: {warning}", err=True, fg=typer.colors.YELLOW)
    typer.echo(
        f"{run.config.recipe}, {run.describe()}, on {spec} ({split}: "
        f"{result.meta.num_images} images, {result.meta.num_texts} captions)"
    )
    typer.echo(f"  units: {UNITS}")
    for name, value in metrics_lines(result.to_json()):
        typer.echo(f"  {name:40s} {value}")


def _run_suite(
    run_dirs: list[Path], suite: Path, out: Path, split: str, batch_size: int, json_output: bool
) -> None:
    """Evaluate each run on every store of ``suite``; write and print the long table."""
    import json

    from curvalign.report.suite import evaluate_runs_on_suite, suite_markdown, write_suite

    console = _stderr_console()
    try:
        total = evaluate_runs_on_suite(
            run_dirs,
            suite,
            split=split,
            batch_size=batch_size,
            notify=lambda m: None if json_output else console.print(m),
        )
        files = write_suite(total, out)
    except CurvalignError as err:
        fail(str(err))
    except OSError as err:  # a full disk while writing the tables: one line
        write_failed(err, out)
    if json_output:
        typer.echo(json.dumps({"rows": total.rows, "skipped": total.skipped}))
        return
    typer.echo(suite_markdown(total), nl=False)
    typer.echo(f"wrote {files['csv']}, {files['wide_csv']}, {files['markdown']}")


#: ``--columns`` of ``benchmark`` and ``demo``
COLUMNS_HELP = (
    "headline (default): the few metrics that differ between rows, with each trained row's "
    "mean R@1 gain over the alignment and its step-0 row, in 120 columns; all: every column "
    "the terminal fits."
)


def _check_columns(columns: str) -> None:
    """One line for a ``--columns`` value other than headline or all (before any training)."""
    if columns not in ("headline", "all"):
        fail(f"--columns must be headline or all, got {columns!r}")


def _print_benchmark(
    result, out: Path, title: str, width: int | None = None, columns: str = "headline"
) -> None:
    """The benchmark's terminal table: the headline table (``report.benchmark.headline``, at
    most ``HEADLINE_WIDTH`` characters wide) or, with ``columns="all"``, every column fitted to
    the terminal's width (columns that do not fit are named below it; results.md and
    results.json have all of them)."""

    from curvalign.report.benchmark import (
        best_step_cells,
        converged_cells,
        headline,
        summary_lines,
        verdicts_of,
    )
    from curvalign.report.tables import HEADLINE_WIDTH, terminal_stats_table

    _check_columns(columns)
    console = _table_console(width)
    extra = {"conv": converged_cells(result), "best step": best_step_cells(result)}
    notes: list[str] = []
    if columns == "headline":
        from rich.console import Console

        console = Console(width=min(console.width, HEADLINE_WIDTH))
        head = headline(result)
        table, _, left_out = terminal_stats_table(
            result.stats,
            console.width,
            verdicts_of(result),
            extra,
            title=title,
            columns=head["columns"],
            lead=head["lead"],
        )
        notes = head["notes"]
        left_out = list(left_out) + head["more"]
    else:
        table, _, left_out = terminal_stats_table(
            result.stats, console.width, verdicts_of(result), extra, title=title
        )
    console.print(table)
    for line in notes:
        console.print(line, highlight=False)
    for line in summary_lines(result):
        console.print(line.replace("`", ""), highlight=False)
    if left_out:
        console.print(
            (
                "more columns (--columns all, results.md): "
                if columns == "headline"
                else "not shown (terminal too narrow): "
            )
            + ", ".join(c[0] for c in left_out)
            + ("" if columns == "headline" else "; see results.md"),
            highlight=False,
        )
    console.print("conv = seeds whose validation had stopped improving by the end", highlight=False)
    for name, why in result.absent.items():
        console.print(f"{name}: absent ({why})", highlight=False)
    for name, row in result.rows.items():
        if row.get("status") == "failed":
            console.print(f"{name}: FAILED ({row.get('reason')})", highlight=False)
    typer.echo(f"wrote {out / 'results.md'}, {out / 'results.json'}")
    pngs = [str(p) for k, p in result.files.items() if k.endswith("_png")]
    if pngs:
        typer.echo("plots: " + ", ".join(pngs))


@app.command("benchmark")
def benchmark_command(
    overrides: list[str] = typer.Argument(
        None,
        metavar="KEY=VALUE",
        help="Overrides for every recipe (batch_size=128); NAME.key=value for recipe NAME only.",
    ),
    recipes: str = typer.Option(
        ..., "--recipes", help="Comma-separated recipe names, e.g. clip,meru,phyclip."
    ),
    data: str = typer.Option("synthetic", "--data", help=DATA_HELP),
    out: Path = typer.Option(
        ..., "--out", help="Output directory (runs/, results.md, results.json, plots)."
    ),
    steps: int = typer.Option(None, "--steps", help="Optimizer steps for every recipe."),
    split: str = typer.Option("test", "--split", help="Split to evaluate on."),
    seeds: int = typer.Option(
        None,
        "--seeds",
        help="Training seeds per recipe, the same for every recipe (paired); cells are mean ± "
        "95% interval over them. Default 3; 5 with --tune.",
    ),
    json_output: bool = typer.Option(
        False, "--json", help="Print results.json's content (one JSON object) on stdout."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-step progress bars."),
    suite: Path = typer.Option(
        None,
        "--suite",
        help="Also evaluate every trained recipe on each store of this folder (OUT/suite.csv, "
        "suite_wide.csv, suite.md).",
    ),
    tune: int = typer.Option(
        None,
        "--tune",
        min=1,
        help="Tune every recipe first with this many Optuna trials each (the same for every "
        "recipe, validation only; OUT/tuning/: study.db (resumable), trials.csv, best/NAME.yaml, "
        "history.png), then benchmark paper defaults and tuned configurations side by side.",
    ),
    tune_metric: str = typer.Option(
        "mean_r1",
        "--tune-metric",
        help="Selection metric of --tune on the validation split: mean_r1 (mean of T2I and I2T "
        "R@1) or any metric path of `curvalign eval --json`, e.g. zeroshot/top1, hierarchy/TIE.",
    ),
    lr_range_steps: int = typer.Option(
        60,
        "--lr-range-steps",
        min=0,
        help="Steps of the learning-rate range test that sets each recipe's lr range for --tune "
        "(0: the recipe's declared range).",
    ),
    towers: str = typer.Option(
        None,
        "--towers",
        help="Train the encoders too, every recipe with the same settings (as `curvalign train "
        "--towers`, e.g. 'ENCODER_SPEC;image=lora;text=lora;lora_rank=8'); each run is evaluated "
        "on the store re-encoded by its best towers (docs/training.md, 'Train the towers'). With "
        "--tune every trial trains them too (selected on mean_r1, no lr range test).",
    ),
    columns: str = typer.Option("headline", "--columns", help=COLUMNS_HELP),
) -> None:
    """Train each recipe on the same data with the same budget and seeds, evaluate, and compare
    side by side with baselines (untrained heads, frozen features, chance).

    With --tune N: an equal tuning budget for every recipe first (docs/evaluation.md); a killed
    run continues where it stopped when started again with the same arguments."""
    refuse_unknown_recipes([r.strip() for r in recipes.split(",") if r.strip()])
    _check_columns(columns)
    from curvalign.report.benchmark import run_benchmark

    if seeds is None:
        seeds = 5 if tune else 3
    if seeds < 1:
        fail(f"--seeds must be >= 1 (training runs per recipe), got {seeds}")
    if steps is not None and steps < 1:
        fail(f"--steps must be >= 1, got {steps}")
    if towers is not None and suite is not None:
        fail("--towers trains and evaluates on re-encoded features: not with --suite")
    check_out(out)
    names = [r.strip() for r in recipes.split(",") if r.strip()]
    console = _stderr_console()
    resume = (
        f"run the same command again: it continues where it stopped ({out}/tuning/study.db)"
        if tune
        else f"the runs finished so far are in {out}/runs; run the same command again to start "
        "the benchmark over"
    )
    with stoppable(resume), _command_errors(out):
        if tune:
            from curvalign.report.tuning import run_tuned_benchmark

            result = run_tuned_benchmark(
                names,
                data,
                out,
                trials=tune,
                steps=steps,
                overrides=overrides or [],
                metric=tune_metric,
                seeds=seeds,
                split=split,
                lr_range_steps=lr_range_steps,
                show_progress=not quiet and not json_output,
                notify=console.print,
                towers=towers,
            )
        else:
            result = run_benchmark(
                names,
                data,
                out,
                steps=steps,
                overrides=overrides or [],
                split=split,
                seeds=seeds,
                show_progress=not quiet and not json_output,
                notify=console.print,
                towers=towers,
            )
    if json_output:
        typer.echo((out / "results.json").read_text().strip())
        return
    _print_benchmark(result, out, f"benchmark on {result.data}", columns=columns)
    if suite is not None:
        runs = [d for dirs in result.run_dirs.values() for d in dirs]  # every seed's run
        _run_suite(runs, suite, out, split, 1024, False)


@app.command("demo")
def demo_command(
    overrides: list[str] = typer.Argument(
        None, metavar="KEY=VALUE", help="Extra overrides (as for benchmark)."
    ),
    out: Path = typer.Option(Path("curvalign-demo"), "--out", help="Output directory."),
    recipes: str = typer.Option(None, "--recipes", help="Recipes (default: all eight)."),
    data: str = typer.Option(None, "--data", help="Data (default: a small synthetic world)."),
    steps: int = typer.Option(
        None, "--steps", min=1, help="Steps per recipe (default: the demo's)."
    ),
    seeds: int = typer.Option(
        1, "--seeds", min=1, help="Seeds per recipe (the demo's 1 gives no intervals)."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-step progress bars."),
    columns: str = typer.Option("headline", "--columns", help=COLUMNS_HELP),
) -> None:
    """All methods on a small synthetic world in about a minute on two CPU cores: table and plots."""
    import time

    from curvalign.report.benchmark import (
        DEMO_RECIPES,
        DEMO_STEPS,
        DEMO_WORLD,
        demo_overrides,
        run_benchmark,
    )

    _check_columns(columns)
    check_out(out)
    names = [r.strip() for r in recipes.split(",") if r.strip()] if recipes else list(DEMO_RECIPES)
    console = _stderr_console()
    start = time.perf_counter()
    resume = f"the runs finished so far are in {out}/runs; run it again to start over"
    with stoppable(resume), _command_errors(out):
        result = run_benchmark(
            names,
            data or DEMO_WORLD,
            out,
            steps=steps or DEMO_STEPS,
            overrides=demo_overrides(names) + list(overrides or []),
            seeds=seeds,
            show_progress=not quiet,
            notify=console.print,
            title="curvalign demo",
        )
    _print_benchmark(
        result,
        out,
        f"curvalign demo: {result.data}, {result.steps} steps per recipe",
        columns=columns,
    )
    typer.echo(f"demo finished in {time.perf_counter() - start:.0f}s")


@app.command("study")
def study_command(
    name: str = typer.Argument(
        ...,
        help="all, agr-curriculum, dualpath-forgetting, atmg-curvature, phyclip-factors, "
        "proclip-product, proclip-regime, wordnet-dimensions",
    ),
    overrides: list[str] = typer.Argument(
        None, metavar="KEY=VALUE", help="Overrides for every run of the study."
    ),
    out: Path = typer.Option(None, "--out", help="Output directory (default: studies/NAME)."),
    steps: int = typer.Option(None, "--steps", min=1, help="Steps per run (default: the study's)."),
    seeds: int = typer.Option(3, "--seeds", min=1, help="Seeds per arm (paired across arms)."),
    seed_base: int = typer.Option(
        0, "--seed-base", min=0, help="First seed (seeds SEED_BASE .. SEED_BASE+SEEDS-1)."
    ),
    power: bool = typer.Option(
        False,
        "--power",
        help="Treat --seeds as a pilot and re-run with the seeds each claim's paper effect needs "
        "at 80 percent power (at most --max-seeds).",
    ),
    max_seeds: int = typer.Option(10, "--max-seeds", min=2, help="Seed budget for --power."),
    lr_cache: Path = typer.Option(
        None,
        "--lr-cache",
        help="Store the learning-rate choice's runs here and read them back (they use one tuning "
        "seed on every seed base: a second --seed-base run with the same cache skips them).",
    ),
    data: str = typer.Option(None, "--data", help="Data (default: the study's own world)."),
    options: list[str] = typer.Option(
        None,
        "--set",
        help="Study option NAME=VALUE (a Python literal), e.g. "
        "curvatures=0.1,1,3 or factors=1,4,16 (see docs/evaluation.md).",
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="A smoke run: the study's tiny store, 2 seeds, a few steps, no learning-rate grid "
        "and no pilot (checks that the study runs; its verdicts mean nothing).",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-step progress bars."),
) -> None:
    """Test paper claims (one study, or `all` into OUT/NAME) and print each verdict.

    Regenerate docs/results.md from the outputs with `python -m curvalign_lab.results OUT`."""
    # the laboratory, a sibling package the library never imports: loaded only by this command
    from curvalign_lab.runner import STUDIES, parse_study_options, run_all, run_study

    if name != "all" and name not in STUDIES:
        fail(f"unknown study {name!r}; studies: all, {', '.join(STUDIES)}")
    console = _stderr_console()
    out = out or Path("studies") / name
    check_out(out)
    resume = f"what was written is in {out}; run the same command again to start the study over" + (
        f" (the learning-rate runs stored in {lr_cache} are reused)" if lr_cache else ""
    )
    with stoppable(resume), _command_errors(out):
        if name == "all":
            if data or options:
                fail("study all runs every study with its own data and options (no --data/--set)")
            results = run_all(
                out,
                steps=steps,
                seeds=seeds,
                seed_base=seed_base,
                power=power,
                max_seeds=max_seeds,
                quick=quick,
                overrides=overrides or [],
                lr_cache=lr_cache,
                show_progress=not quiet,
                notify=console.print,
            )
        else:
            results = {
                name: run_study(
                    name,
                    out,
                    steps=steps,
                    data=data,
                    seeds=seeds,
                    seed_base=seed_base,
                    power=power,
                    max_seeds=max_seeds,
                    quick=quick,
                    overrides=overrides or [],
                    lr_cache=lr_cache,
                    show_progress=not quiet,
                    notify=console.print,
                    **parse_study_options(name, options or []),
                )
            }
    for key, result in results.items():
        typer.echo(result.markdown)
        typer.echo(f"{key}: {result.verdict} ({result.wall_s:.0f} s)")
    if name == "all" and (out / "wall.json").exists():
        import json

        wall = json.loads((out / "wall.json").read_text())["wall_s"]
        typer.echo(f"study all: {len(results)} studies in {wall:.0f} s wall ({wall / 60:.1f} min)")
    typer.echo(f"wrote {out}")


# --- embed a store with a run; index build, search, add and export --------------------------------

index_app = typer.Typer(
    help="Build and search retrieval indexes over embeddings (docs/search.md).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(index_app, name="index")


def _ids_option(text: str | None, name: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"{name} must be comma-separated row ids, e.g. 0,5,9; got {text!r}")
    return None


@app.command("embed")
def embed_command(
    run_dir: Path = typer.Argument(..., help=RUN_DIR_HELP),
    data: str = typer.Option(
        None, "--data", help="Store to embed (default: the run's own data spec)."
    ),
    out: Path = typer.Option(
        ..., "--out", help="Embeddings directory to write (.npy memory maps + embedding.json)."
    ),
    batch_size: int = typer.Option(4096, "--batch-size", min=1, help="Items per forward pass."),
    boxes: bool = typer.Option(False, "--boxes", help="Also embed the store's box-level pairs."),
    weights: str = typer.Option("best", "--weights", help=WEIGHTS_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Embed a feature store's images and texts through a trained run, to memory-mapped files."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from curvalign.index.embed import embed_run

    def loaded(run) -> None:
        print_notes(run.notes)
        if not quiet:
            typer.secho(f"note: embedding with the {run.describe()}", err=True)

    check_out(out)
    try:
        with (
            stoppable(f"{out} was left as it was before this command; run it again to write it"),
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=_stderr_console(),
                disable=quiet,
            ) as bar,
        ):

            def progress(label: str, total: int):
                task = bar.add_task(label, total=total)
                return lambda n: bar.advance(task, n)

            done = embed_run(
                run_dir,
                out,
                data=data,
                weights=weights,
                batch_size=batch_size,
                boxes=boxes,
                progress=progress,
                on_loaded=loaded,
            )
    except CurvalignError as err:
        fail(str(err))
    typer.echo(
        f"embedded {done.num_images} images and {done.num_texts} texts with {done.recipe} "
        f"(step {done.step}): {done.path}"
    )


@index_app.command("build")
def index_build_command(
    embeddings: Path = typer.Argument(
        ..., help="An embeddings directory written by `curvalign embed`."
    ),
    out: Path = typer.Option(..., "--out", help="Index directory to write."),
    exact: bool = typer.Option(False, "--exact", help="Exact search (the default)."),
    ann: str = typer.Option(
        None,
        "--ann",
        help="Approximate search: hnsw or ivf (Lorentz-distance recipes); hnsw or ivfpq "
        "(every other recipe: candidates for the rerank; ivfpq for 10M+ items).",
    ),
    side: str = typer.Option("images", "--side", help="What to index: images or texts."),
    M: int = typer.Option(32, "--M", min=2, help="HNSW: links per node."),
    ef_construction: int = typer.Option(
        80, "--ef-construction", min=1, help="HNSW: build beam width."
    ),
    ef_search: int = typer.Option(128, "--ef-search", min=1, help="HNSW: search beam width."),
    nlist: int = typer.Option(
        None, "--nlist", min=1, help="IVF: number of cells (default 4 sqrt(N))."
    ),
    nprobe: int = typer.Option(16, "--nprobe", min=1, help="IVF, IVF-PQ: cells visited per query."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace what --out already holds (an index built before)."
    ),
    block_rows: int = typer.Option(
        None,
        "--block-rows",
        min=1,
        help="Items read and transformed at a time (the build's memory outside the maps is "
        "about this many float32 rows; default: 64 MiB of them).",
    ),
    verify: bool = typer.Option(
        False, "--verify", help="Hash every embeddings file read, even where size and time match."
    ),
) -> None:
    """Build an index over one side of an embeddings directory."""
    from curvalign.index.checked import verifying
    from curvalign.index.embed import (
        build_from_embeddings,
        index_build_options,
        index_side,
        load_embeddings,
    )

    check_out(out)
    if not overwrite and (out / "index.json").exists():
        fail(f"--out {out} already holds an index; pass --overwrite to replace it")
    try:
        options = index_build_options(
            ann,
            exact=exact,
            M=M,
            ef_construction=ef_construction,
            ef_search=ef_search,
            nlist=nlist,
            nprobe=nprobe,
        )
        if block_rows is not None:
            options["block_rows"] = block_rows
        # SIGTERM removes the half-built index like Ctrl-C
        with (
            verifying() if verify else contextlib.nullcontext(),
            stoppable(f"{out} was left as it was before this command; run it again to write it"),
        ):
            emb = load_embeddings(embeddings, verify=verify)
            path = build_from_embeddings(emb, out, side=index_side(side), **options)
    except CurvalignError as err:
        fail(str(err))
    mode = f"approximate ({ann})" if ann else "exact"
    typer.echo(f"indexed {emb.meta['counts'][side]} {side} of {emb.recipe_name} ({mode}): {path}")


@index_app.command("search")
def index_search_command(
    index: Path = typer.Argument(
        ..., help="An index directory written by `curvalign index build`."
    ),
    query_text_ids: str = typer.Option(
        None, "--query-text-ids", help="Rows of the embedded texts, e.g. 0,5,9."
    ),
    query_image_ids: str = typer.Option(
        None, "--query-image-ids", help="Rows of the embedded images."
    ),
    queries: Path = typer.Option(
        None,
        "--queries",
        help="Embeddings directory to take the queries from (default: the index's).",
    ),
    query_npy: Path = typer.Option(
        None, "--query-npy", help="A .npy of query points [n, d] (Lorentz indexes)."
    ),
    all_queries: bool = typer.Option(
        False,
        "--all-queries",
        help="Query with every embedded text (or image) of the other side.",
    ),
    k: int = typer.Option(10, "--k", min=1, help="Results per query."),
    candidates: int = typer.Option(
        200, "--candidates", min=1, help="Rerank indexes: proxy candidates per query."
    ),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    verify: bool = typer.Option(
        False,
        "--verify",
        help="Hash every index and embeddings file read (by default a file whose size and "
        "modification time are the recorded ones is not read to check it).",
    ),
) -> None:
    """Search an index with embedded texts or images (or a .npy of points); prints a table or JSON."""
    import json

    from curvalign.index.checked import verifying
    from curvalign.index.queries import search_queries

    text_ids = _ids_option(query_text_ids, "--query-text-ids")
    image_ids = _ids_option(query_image_ids, "--query-image-ids")
    try:
        with verifying() if verify else contextlib.nullcontext():
            found = search_queries(
                index,
                text_ids=text_ids,
                image_ids=image_ids,
                queries=queries,
                query_npy=query_npy,
                all_queries=all_queries,
                k=k,
                candidates=candidates,
            )
    except CurvalignError as err:
        fail(str(err))
    if json_output:
        typer.echo(json.dumps(found.to_json()))
        return
    from rich.table import Table

    table = Table(title=f"{found.meta['recipe']} {found.meta['side']} index: {index}")
    for column in found.columns():
        table.add_column(column, justify="right")
    for row in found.table_rows():
        table.add_row(*row)
    _table_console().print(table)
    if found.truth_note:
        typer.echo(found.truth_note)


@index_app.command("add")
def index_add_command(
    index: Path = typer.Argument(
        ..., help="An index directory written by `curvalign index build`."
    ),
    embeddings: Path = typer.Argument(
        ..., help="Embeddings of new items by the same run (`curvalign embed --data NEW`)."
    ),
) -> None:
    """Add the new items of an embeddings directory to an index, without rebuilding it."""
    from curvalign.index.embed import add_embeddings, load_embeddings, open_index

    try:
        added = add_embeddings(index, load_embeddings(embeddings))
        raw, lorentz = open_index(index)
    except CurvalignError as err:
        fail(str(err))
    total = len(lorentz) if lorentz is not None else raw["count"]
    typer.echo(f"added {added} {raw['meta']['side']} to {index} (now {total})")


@index_app.command("export")
def index_export_command(
    index: Path = typer.Argument(
        ..., help="A Lorentz index (`curvalign index build`, meru/hycoclip)."
    ),
    to: str = typer.Option(
        ..., "--to", help="qdrant (a vector database) or poincare (ball coordinates)."
    ),
    path: Path = typer.Option(
        ...,
        "--path",
        help="qdrant: directory of Qdrant's embedded local mode (no server); poincare: a .npz "
        "or .parquet file.",
    ),
    collection: str = typer.Option(
        None, "--collection", help="Collection name (default curvalign-RECIPE-SIDE)."
    ),
) -> None:
    """Write an index's points into a vector database that ranks by Lorentz distance (docs/search.md)."""
    from curvalign.index.export import export_poincare, export_qdrant

    if to == "poincare":
        try:
            ball = export_poincare(index, path)
        except CurvalignError as err:
            fail(str(err))
        typer.echo(
            f"exported {ball.count} points to {ball.path} ({ball.format}): Poincare ball of "
            f"radius 1/sqrt({ball.curvature:g}), float64; dist0 = geodesic distance to the origin"
        )
        return
    if to != "qdrant":
        fail(f"--to must be qdrant or poincare, got {to!r}")
    try:
        done = export_qdrant(index, path, collection)
    except CurvalignError as err:
        fail(str(err))
    typer.echo(
        f"exported {done.count} points to the Qdrant collection {done.collection!r} in {done.path} "
        f"(DOT on [x, t(x)]; query [y, -t(y)]; distance = acosh(-{done.curvature:g} * score) / "
        f"sqrt({done.curvature:g}))"
    )


# --- towers: export a tower run's trained encoders as encoder specs --------------------------------

towers_app = typer.Typer(
    help="Trained towers (`curvalign train --towers`): export them as encoder specs.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(towers_app, name="towers")


@towers_app.command("export")
def towers_export_command(
    run: Path = typer.Argument(..., help="A tower run directory (`curvalign train --towers`)."),
    out: Path = typer.Option(..., "--out", help="Directory to write the exported encoder into."),
    weights: str = typer.Option(
        "best",
        "--weights",
        help="best: the towers kept with the best validation (the last ones when the run kept "
        "none); last: the latest checkpoint.",
    ),
) -> None:
    """Write a tower run's towers (LoRA adapters merged) as an encoder that `curvalign extract
    --encoder` (then eval, index, search) accepts; prints its encoder spec, alone, on stdout
    (SPEC=$(curvalign towers export RUN --out DIR)); notes go to stderr."""
    from curvalign.train.towers import TOWERS_BEST_FILE, export_towers

    if weights not in ("best", "last"):
        fail(f"--weights must be best or last, got {weights!r}")
    check_out(out)
    used = "last"
    if weights == "best" and (run / TOWERS_BEST_FILE).exists():
        used = "best"
    with _command_errors(out):
        spec = export_towers(run, out, weights=used)
    note = "" if used == weights else " (the run kept no best towers)"
    # stdout is the spec alone, so that SPEC=$(curvalign towers export ...) captures it
    typer.echo(f"exported the {used} towers of {run}{note} to {out}", err=True)
    typer.echo(f"next: curvalign extract --encoder '{spec}' --images ... --out STORE", err=True)
    typer.echo(spec)


# --- search an index from the terminal; serve it over HTTP with a search page ---------------------


def _open_searcher(run_dir: Path, index: Path, encoder: str | None, candidates: int):
    from curvalign.index.searcher import Searcher

    return Searcher.open(run_dir, index, encoder=encoder, candidates=candidates)


@app.command("search")
def search_command(
    run_dir: Path = typer.Argument(..., help=RUN_DIR_HELP),
    queries: list[str] = typer.Argument(None, metavar="TEXT...", help="Free-text queries."),
    index: Path = typer.Option(
        ..., "--index", help="An index of the run's embeddings (`curvalign index build`)."
    ),
    queries_file: Path = typer.Option(
        None, "--queries-file", help="A UTF-8 file of text queries, one per line."
    ),
    images: list[Path] = typer.Option(
        None, "--image", help="An image file as query (repeatable; for an index of texts)."
    ),
    encoder: str = typer.Option(
        None, "--encoder", help="Local encoder spec (default: the one the run records)."
    ),
    k: int = typer.Option(10, "--k", min=1, help="Results per query."),
    candidates: int = typer.Option(
        200, "--candidates", min=1, help="Rerank indexes: proxy candidates per query."
    ),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Search a run's index with free text or image files; prints rank, score and the items."""
    import json

    from curvalign.index.searcher import read_queries

    try:
        texts = read_queries(queries or [], queries_file)
    except CurvalignError as err:
        fail(str(err))
    images = list(images or [])
    if not texts and not images:
        fail("give at least one query: TEXT, --queries-file FILE or --image PATH")
    try:
        searcher = _open_searcher(run_dir, index, encoder, candidates)
        results = searcher.search_texts(texts, k=k) if texts else []
        results += searcher.search_images(images, k=k) if images else []
    except CurvalignError as err:
        fail(str(err))
    if json_output:
        payload = {**searcher.info(), "images_root": searcher.images_root}
        payload["results"] = [r.to_dict() for r in results]
        typer.echo(json.dumps(payload))
        return
    from rich.table import Table

    console = _table_console()
    for result in results:
        table = Table(title=f"{result.query}", title_justify="left")
        table.add_column("rank", justify="right")
        table.add_column(result.ranked_by, justify="right")
        for column in result.ITEM_COLUMNS:
            table.add_column(column)
        for row in result.table_rows():
            table.add_row(*row)
        console.print(table)
    if searcher.images_root:
        typer.echo(f"image paths are relative to {searcher.images_root}")


@app.command("serve")
def serve_command(
    run_dir: Path = typer.Argument(..., help=RUN_DIR_HELP),
    index: Path = typer.Option(
        ..., "--index", help="An index of the run's embeddings (`curvalign index build`)."
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to bind (default: this machine only)."
    ),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port."),
    encoder: str = typer.Option(
        None, "--encoder", help="Local encoder spec (default: the one the run records)."
    ),
    candidates: int = typer.Option(
        200, "--candidates", min=1, help="Rerank indexes: proxy candidates per query."
    ),
    max_upload_mb: float = typer.Option(
        8.0, "--max-upload-mb", min=0.001, help="Largest request body accepted (MiB)."
    ),
) -> None:
    """A local HTTP service and page: POST /search, GET /health, GET / (docs/search.md)."""
    from curvalign._net import bind_port

    try:  # the port first: a busy one fails at once, before seconds of loading
        sock = bind_port(host, port)
    except CurvalignError as err:
        fail(str(err))
    from curvalign.index.serve import serve

    try:
        searcher = _open_searcher(run_dir, index, encoder, candidates)
        searcher.encoder()  # load the model now, not on the first request
    except CurvalignError as err:
        fail(str(err))
    if host not in ("127.0.0.1", "localhost", "::1"):
        typer.secho(
            f"note: binding to {host}: the service is reachable from other machines",
            err=True,
            fg=typer.colors.YELLOW,
        )
    bound = sock.getsockname()[1]  # --port 0: the port the system chose

    def ready() -> None:  # printed once the server listens, not before
        recipe = searcher.info()["recipe"]
        typer.echo(f"serving {recipe} search on http://{host}:{bound}/ (Ctrl-C stops)")

    try:
        serve(
            searcher,
            max_upload_bytes=int(max_upload_mb * 1024 * 1024),
            sock=sock,
            on_ready=ready,
        )
    except (CurvalignError, OSError) as err:
        fail(str(err))


# --- extract a feature store with an encoder: one subcommand per input kind (_extract_kinds) ----


class _ExtractGroup(TyperGroup):
    """``curvalign extract KIND``; the one-command form from before the subcommands
    (``curvalign extract --encoder E --images DIR ...``) is routed to the kind its flags select,
    and a flag that kind does not read is named before anything is loaded."""

    # ctx: click's Context as the installed typer has it (typer >= 0.29 vendors click as
    # typer._click and no longer installs the click package; earlier typer uses click's own)
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0].startswith("-") and args[0] not in ctx.help_option_names:
            from curvalign._extract_kinds import kind_of_flags, not_read_message

            # option names (a negative number is a value, not an option)
            flags = [a.split("=", 1)[0] for a in args if a[:1] == "-" and not a[1:2].isdigit()]
            kind = kind_of_flags(flags)
            command = self.get_command(ctx, kind)
            assert command is not None
            known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
            not_read = [f for f in flags if f not in known and f not in ctx.help_option_names]
            if not_read:
                fail(not_read_message(kind, not_read))
            args = [kind, *args]
        return super().parse_args(ctx, args)


extract_app = typer.Typer(
    cls=_ExtractGroup,
    no_args_is_help=True,
    help="Encode inputs with a local encoder into a feature store (resumable), one subcommand "
    "per input kind: images, texts, wds, sugarcrepe. The one-command form "
    "(curvalign extract --encoder E --images DIR ...) still works: its flags select the kind.",
)
app.add_typer(extract_app, name="extract")

_ENCODER = typer.Option(
    ...,
    "--encoder",
    help="open_clip:ARCH:CHECKPOINT, hf-clip:DIR, "
    "sentence-transformers:DIR, minilm, efficientnet-lite0[:WEIGHTS], torchvision:ARCH:CKPT, "
    "timm:ARCH:CKPT, or IMAGE_SPEC+TEXT_SPEC (e.g. efficientnet-lite0+minilm); local files only.",
)
_STORE_OUT = typer.Option(
    ..., "--out", help="Feature store directory to write (use as --data features:OUT)."
)
_CAPTIONS = typer.Option(None, "--captions", help="Captions JSON (COCO or Karpathy layout).")
_LAYOUT = typer.Option(None, "--format", help="coco or karpathy (default: told apart by the keys).")
_CLASSES = typer.Option(
    None, "--classes", help="Class names (CLIP_benchmark JSON or one per line)."
)
_TEMPLATES = typer.Option(
    None, "--templates", help="Prompt templates with {c} (CLIP_benchmark JSON)."
)
_PAIRS = typer.Option(
    None,
    "--pairs",
    help="Scored text pairs (DualPath): JSON Lines {a, b, score} or TSV a<TAB>b<TAB>score.",
)
_SCORE_MAX = typer.Option(
    1.0, "--score-max", help="--pairs: divide scores by this (5 for STS-B) into [0, 1]."
)
_PROTOCOL = typer.Option(
    None,
    "--protocol",
    help="Record the retrieval protocol the store is for (coco-5k, flickr30k-1k): eval then "
    "keeps 5 captions per image and checks the image count.",
)
_TOKENS = typer.Option(
    False,
    "--tokens",
    help="Also store every text part's token-level features and masks (captions, prompts, "
    "pairs; hf-clip, sentence-transformers), for DualPath pool_tokens=true.",
)
_BATCH_SIZE = typer.Option(64, "--batch-size", min=1, help="Rows per encoder call.")
_SHARD_SIZE = typer.Option(1024, "--shard-size", min=1, help="Rows per resumable shard.")
_DEVICE = typer.Option("cpu", "--device", help="cpu or cuda.")
_OVERWRITE = typer.Option(False, "--overwrite", help="Replace an existing store at --out.")
_QUIET = typer.Option(False, "--quiet", "-q", help="No progress bar.")


@contextlib.contextmanager
def _extracting(encoder: str, out: Path) -> Iterator[None]:
    """The checks before an extraction (``--out``, the encoder's local files: before torch is
    imported, so that a missing model fails in milliseconds), then its errors as one line; a
    write failing midway (disk full while writing a shard) keeps the finished shards."""
    from curvalign._encoder_spec import check_encoder_paths

    check_out(out)
    try:
        check_encoder_paths(encoder)
    except CurvalignError as err:
        fail(str(err))
    resume = f"the shards finished before are kept in {out}.partial; run the same command again to resume from them"
    with (
        stoppable(resume),
        _command_errors(
            out,
            kept=f"the shards finished before are kept in {out}.partial: free space and run the "
            "same command again to resume from them",
        ),
    ):
        yield


@extract_app.command("images", help=EXTRACT_KINDS["images"].reads)
def extract_images_command(
    encoder: str = _ENCODER,
    images: Path = typer.Option(..., "--images", help="Folder the image paths are relative to."),
    out: Path = _STORE_OUT,
    captions: Path = _CAPTIONS,
    layout: str = _LAYOUT,
    boxes: Path = typer.Option(
        None, "--boxes", help="Box-level pairs, JSON Lines {image, box, phrase}."
    ),
    classes: Path = _CLASSES,
    templates: Path = _TEMPLATES,
    taxonomy: Path = typer.Option(
        None, "--taxonomy", help="'parent child' edge list over class folders/names."
    ),
    pairs: Path = _PAIRS,
    score_max: float = _SCORE_MAX,
    protocol: str = _PROTOCOL,
    tokens: bool = _TOKENS,
    batch_size: int = _BATCH_SIZE,
    shard_size: int = _SHARD_SIZE,
    device: str = _DEVICE,
    overwrite: bool = _OVERWRITE,
    quiet: bool = _QUIET,
) -> None:
    with _extracting(encoder, out):
        from curvalign.data.extract import extract_features

        summary = extract_features(
            encoder,
            images,
            out,
            captions=captions,
            layout=layout,
            boxes=boxes,
            classes=classes,
            templates=templates,
            taxonomy=taxonomy,
            batch_size=batch_size,
            shard_size=shard_size,
            device=device,
            overwrite=overwrite,
            progress=not quiet,
            pairs=pairs,
            score_max=score_max,
            protocol=protocol,
            tokens=tokens,
        )
    _echo_extracted(summary, *summary.contents("images"))


@extract_app.command("texts", help=EXTRACT_KINDS["texts"].reads)
def extract_texts_command(
    encoder: str = _ENCODER,
    out: Path = _STORE_OUT,
    captions: Path = _CAPTIONS,
    layout: str = _LAYOUT,
    pairs: Path = _PAIRS,
    score_max: float = _SCORE_MAX,
    classes: Path = _CLASSES,
    templates: Path = _TEMPLATES,
    tokens: bool = _TOKENS,
    batch_size: int = _BATCH_SIZE,
    shard_size: int = _SHARD_SIZE,
    device: str = _DEVICE,
    overwrite: bool = _OVERWRITE,
    quiet: bool = _QUIET,
) -> None:
    with _extracting(encoder, out):
        from curvalign.data.extract import extract_texts

        summary = extract_texts(
            encoder,
            out,
            captions=captions,
            layout=layout,
            pairs=pairs,
            score_max=score_max,
            classes=classes,
            templates=templates,
            tokens=tokens,
            batch_size=batch_size,
            shard_size=shard_size,
            device=device,
            overwrite=overwrite,
            progress=not quiet,
        )
    _echo_extracted(summary, *summary.contents("texts"))


@extract_app.command("wds", help=EXTRACT_KINDS["wds"].reads)
def extract_wds_command(
    encoder: str = _ENCODER,
    wds: Path = typer.Option(
        ...,
        "--wds",
        help="A CLIP_benchmark webdataset root ({split}/nshards.txt, {split}/N.tar, "
        "classnames.txt, zeroshot_classification_templates.txt, dataset_type.txt).",
    ),
    out: Path = _STORE_OUT,
    splits: str = typer.Option(
        None, "--splits", help="Comma-separated split folders (default: every one)."
    ),
    protocol: str = _PROTOCOL,
    batch_size: int = _BATCH_SIZE,
    device: str = _DEVICE,
    overwrite: bool = _OVERWRITE,
    quiet: bool = _QUIET,
) -> None:
    with _extracting(encoder, out):
        from curvalign.data.extract import extract_webdataset

        summary = extract_webdataset(
            encoder,
            wds,
            out,
            splits=[s.strip() for s in splits.split(",") if s.strip()] if splits else None,
            batch_size=batch_size,
            device=device,
            overwrite=overwrite,
            progress=not quiet,
            protocol=protocol,
        )
    _echo_extracted(summary, *summary.contents("wds"))


@extract_app.command("sugarcrepe", help=EXTRACT_KINDS["sugarcrepe"].reads)
def extract_sugarcrepe_command(
    encoder: str = _ENCODER,
    sugarcrepe: Path = typer.Option(
        ..., "--sugarcrepe", help="A folder of SugarCrepe KIND.json files."
    ),
    images: Path = typer.Option(
        None,
        "--images",
        help="The COCO val2017 folder; without it, text only: each caption and negative "
        "scored against another caption.",
    ),
    out: Path = _STORE_OUT,
    batch_size: int = _BATCH_SIZE,
    shard_size: int = _SHARD_SIZE,
    device: str = _DEVICE,
    overwrite: bool = _OVERWRITE,
    quiet: bool = _QUIET,
) -> None:
    with _extracting(encoder, out):
        from curvalign.data.extract import extract_sugarcrepe

        summary = extract_sugarcrepe(
            encoder,
            sugarcrepe,
            images,
            out,
            batch_size=batch_size,
            shard_size=shard_size,
            device=device,
            overwrite=overwrite,
            progress=not quiet,
        )
    _echo_extracted(summary, *summary.contents("sugarcrepe", text_only=images is None))


def _echo_extracted(summary: ExtractSummary, contents: str, skipped: str = "") -> None:
    """The summary lines of ``curvalign extract``: ``wrote STORE<contents> (shard counts)``, the
    ``skipped`` items (when any) with where they are listed, and the throughput."""
    from curvalign.data.extract import SKIPPED_REPORT

    typer.echo(
        f"wrote {summary.store}{contents} ({summary.shards_computed} shards computed, "
        f"{summary.shards_reused} reused)"
    )
    if skipped:
        typer.echo(f"skipped {skipped}; listed in {summary.store / SKIPPED_REPORT}")
    typer.echo(summary.throughput_line())


def main() -> None:
    # Python hides a DeprecationWarning raised inside a library; a deprecated setting passed on
    # the command line (``scale_init=...``) is the user's own, so show curvalign's once each
    warnings.filterwarnings("default", category=DeprecationWarning, module="curvalign")
    app()


if __name__ == "__main__":
    main()
