"""Command line: parse arguments, call library functions, print results. No logic lives here.

Each command imports its library module lazily so that ``curvalign --help`` stays fast and a
missing optional extra only affects the command that needs it.
"""

from __future__ import annotations

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

# --- eval / benchmark / demo / study (issue: evaluation) --------------------------------------

# --- embed / index (issue: retrieval serving) -------------------------------------------------

# --- extract (issue: real encoders) -----------------------------------------------------------


def main() -> None:
    app()


if __name__ == "__main__":
    main()
