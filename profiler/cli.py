"""The `kprof` command line: the one place that wires profiler, analyzers and reports together.

Every command reports bad input as one line on stderr and exits non-zero; no traceback reaches the user.
"""
from __future__ import annotations

import sys

import typer

app = typer.Typer(
    name="kprof",
    help="Capture, analyze and diff kernel traces of Kimi K3 decode backends.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"kprof: error: {message}", err=True)
    raise typer.Exit(code)


@app.callback()
def _root() -> None:
    """kprof: per-layer kernel analysis of decode traces."""


def main() -> None:
    try:
        app()
    except UserError as exc:  # raised from deep inside a command
        typer.echo(f"kprof: error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("kprof: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
