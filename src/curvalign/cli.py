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

# --- embed / index (issue: retrieval serving) -------------------------------------------------

# --- extract (issue: real encoders) -----------------------------------------------------------


def main() -> None:
    app()


if __name__ == "__main__":
    main()
