"""The `kprof` command line: the one place that wires profiler, analyzers and reports together.

Every command reports bad input as one line on stderr and exits non-zero; no traceback reaches the user.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

from analyzers.layers import DEFAULT_LAYER_REGEX, analyze as analyze_layers, compile_layer_regex
from analyzers.trace import TraceError, atomic_output

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


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Turn library errors about the user's input into one line and exit code 2."""
    try:
        yield
    except (UserError, TraceError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": "))


class OutputFormat(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


TraceArg = Annotated[Path, typer.Argument(help="A .kprof run, a torch.profiler JSON (.json/.json.gz) or an Nsight "
                                                "Systems SQLite export; the format is detected from the content.")]


@app.callback()
def _root() -> None:
    """kprof: per-layer kernel analysis of decode traces."""


@app.command("import")
def import_trace(
    trace: TraceArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="The .kprof file to write.")],
) -> None:
    """Convert a trace into a .kprof run (kprof's compact, versioned capture format)."""
    from profiler.readers import read_trace

    with _user_errors():
        read_trace(trace).save(output)


class Profiler(str, Enum):
    cupti = "cupti"
    torch = "torch"
    nsys = "nsys"


@app.command(context_settings={"allow_extra_args": True, "allow_interspersed_args": False})
def capture(
    ctx: typer.Context,
    output: Annotated[Path, typer.Option("--output", "-o", help="The .kprof capture to write.")],
    backend: Annotated[str, typer.Option(help="Decode backend: auto, latency_specialized, ...")] = "auto",
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree of the shard (one rank is run).")] = 16,
    batch: Annotated[int, typer.Option(help="Sequences decoded per step.")] = 1,
    layers: Annotated[int, typer.Option(help="Number of consecutive layers in the slice.")] = 4,
    first_layer: Annotated[int, typer.Option(help="Index of the slice's first layer.")] = 1,
    context: Annotated[int, typer.Option(help="Context length (tokens in the MLA caches).")] = 8192,
    steps: Annotated[int, typer.Option(help="CUDA-graph replays recorded.")] = 50,
    warmup: Annotated[int, typer.Option(help="Eager warm-up steps before the first capture.")] = 2,
    profiler: Annotated[Profiler, typer.Option(help="Recorder: cupti-python, torch.profiler or Nsight Systems.")]
    = Profiler.cupti,
    model: Annotated[str, typer.Option(hidden=True)] = "k3",
    device: Annotated[str, typer.Option(hidden=True)] = "cuda",
) -> None:
    """Record decode steps on the GPU: warm up, capture one step as a CUDA graph, replay it --steps times.

    With `-- python SCRIPT ARGS...` after the options, record that program instead (CUPTI through an interpreter
    start-up hook, or Nsight Systems). See docs/capture.md.
    """
    import shlex

    from profiler.capture import CaptureError, ProgressBars, WorkloadOptions, capture_script, capture_workload

    command_line = shlex.join(["kprof", *sys.argv[1:]])
    try:
        with ProgressBars(enabled=sys.stderr.isatty()) as bars:
            if ctx.args:
                capture_script(ctx.args, profiler.value, output, command_line, bars.update, bars.echo)
            else:
                options = WorkloadOptions(backend=backend, tp=tp, batch=batch, layers=layers, first_layer=first_layer,
                                          context=context, steps=steps, warmup=warmup, model=model, device=device)
                capture_workload(options, profiler.value, output, command_line, bars.update)
    except CaptureError as exc:
        fail(str(exc), exc.code)
    typer.echo(f"kprof: wrote {output}", err=True)


@app.command()
def analyze(
    trace: TraceArg,
    format: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
    layer_regex: Annotated[str, typer.Option(
        "--layer-regex", help="Pattern for layer range names: a group 'index' (or the first group) is the layer "
                              "number, an optional group 'kind' its kind.")] = DEFAULT_LAYER_REGEX,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write to this file instead of stdout.")] = None,
) -> None:
    """Per-layer and per-stage kernel count, kernel time, busy time and span: medians over decode steps."""
    from profiler.readers import read_trace

    with _user_errors():
        try:
            compile_layer_regex(layer_regex)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        result = analyze_layers(read_trace(trace), layer_regex=layer_regex)
        if format is OutputFormat.table:
            text = _as_table(result, color=output is None and sys.stdout.isatty())
        else:
            text = _as_json(result) if format is OutputFormat.json else _as_csv(result)
        if output is None:
            sys.stdout.write(text)
        else:
            with atomic_output(output) as stream:
                stream.write(text.encode())


_METRICS = ("kernels_per_step", "kernel_us", "busy_us", "span_us")


def _as_json(result: dict) -> str:
    return json.dumps(result, indent=2) + "\n"


def _as_csv(result: dict) -> str:
    """One row per layer (``stage`` empty) followed by its stages."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["layer", "kind", "stage", *_METRICS])
    for layer in result["layers"]:
        writer.writerow([layer["layer"], layer["kind"] or "", "", *(layer[m] for m in _METRICS)])
        for stage in layer["stages"]:
            writer.writerow([layer["layer"], layer["kind"] or "", stage["name"], *(stage[m] for m in _METRICS)])
    return buffer.getvalue()


def _as_table(result: dict, color: bool = False) -> str:
    from rich.console import Console
    from rich.table import Table

    capture = result["capture"]
    title = ", ".join(str(v) for v in (capture.get("source"), capture.get("gpu"), capture.get("backend")) if v)
    table = Table(title=f"kprof analyze ({title})" if title else "kprof analyze",
                  caption=f"{result['steps']} step(s), medians per step; "
                          f"{result['unattributed_kernels']} kernel(s) unattributed to a layer")
    table.add_column("layer")
    table.add_column("stage")
    for header in ("kernels", "kernel µs", "busy µs", "span µs"):
        table.add_column(header, justify="right")
    for layer in result["layers"]:
        name = f"{layer['layer']}" + (f" {layer['kind']}" if layer["kind"] else "")
        table.add_row(name, "", *_cells(layer), style="bold")
        for stage in layer["stages"]:
            table.add_row("", stage["name"], *_cells(stage))
    buffer = io.StringIO()
    Console(file=buffer, force_terminal=color, no_color=not color, width=100).print(table)
    return buffer.getvalue()


def _cells(row: dict) -> list[str]:
    return [f"{row['kernels_per_step']:g}", f"{row['kernel_us']:.1f}", f"{row['busy_us']:.1f}", f"{row['span_us']:.1f}"]


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
