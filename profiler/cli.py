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

try:  # typer ships its own copy of click in recent releases
    from typer import _click as click
except ImportError:
    import click

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
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree of the shard (one rank is run unless --gpus).")]
    = 16,
    gpus: Annotated[int, typer.Option(help="Run the --tp ranks together, one per GPU (cuda:0..N-1, NCCL, NVLink "
                                           "multicast off); writes NAME.rankR.kprof per rank. Needs --tp N.")] = 1,
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
        if ctx.args and gpus != 1:
            raise CaptureError("--gpus applies to the decode slice; a recorded program starts its own ranks, and "
                               "every process it starts is recorded")
        with ProgressBars(enabled=sys.stderr.isatty()) as bars:
            if ctx.args:
                capture_script(ctx.args, profiler.value, output, command_line, bars.update, bars.echo)
            else:
                options = WorkloadOptions(backend=backend, tp=tp, batch=batch, layers=layers, first_layer=first_layer,
                                          context=context, steps=steps, warmup=warmup, model=model, device=device,
                                          world=gpus)
                capture_workload(options, profiler.value, output, command_line, bars.update)
    except CaptureError as exc:
        fail(str(exc), exc.code)
    if gpus > 1 and not ctx.args:
        from profiler.capture import rank_path

        for rank in range(gpus):
            typer.echo(f"kprof: wrote {rank_path(output, rank)}", err=True)
    else:
        typer.echo(f"kprof: wrote {output}", err=True)


@app.command()
def analyze(
    trace: TraceArg,
    format: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
    layer_regex: Annotated[str, typer.Option(
        "--layer-regex", help="Pattern for layer range names: a group 'index' (or the first group) is the layer "
                              "number, an optional group 'kind' its kind.")] = DEFAULT_LAYER_REGEX,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write to this file instead of stdout.")] = None,
    classes: Annotated[Optional[Path], typer.Option("--classes", help="JSON kernel class table for the overlap "
                                                    "figures (see docs/diff.md).")] = None,
) -> None:
    """Per-layer and per-stage kernel count, kernel time, busy time and span: medians over decode steps."""
    from profiler.readers import read_trace

    with _user_errors():
        try:
            compile_layer_regex(layer_regex)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        result = analyze_layers(read_trace(trace), layer_regex=layer_regex, classes=_class_table(classes))
        if format is OutputFormat.table:
            text = _as_table(result, color=output is None and sys.stdout.isatty())
        else:
            text = _as_json(result) if format is OutputFormat.json else _as_csv(result)
        if output is None:
            sys.stdout.write(text)
        else:
            with atomic_output(output) as stream:
                stream.write(text.encode())


_METRICS = ("kernels_per_step", "kernel_us", "busy_us", "span_us", "own_us")


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
    for header in ("kernels", "kernel µs", "busy µs", "span µs", "own µs"):
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
    return [f"{row['kernels_per_step']:g}", *(f"{row[m]:.1f}" for m in _METRICS[1:])]


class DiffFormat(str, Enum):
    html = "html"
    json = "json"
    table = "table"


class DiffMetric(str, Enum):
    own_us = "own_us"
    busy_us = "busy_us"
    span_us = "span_us"
    kernel_us = "kernel_us"


def _class_table(path: Optional[Path]):
    from analyzers.classes import load_class_table

    if path is None:
        return None
    try:
        return load_class_table(path)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _read_ncu(path: Optional[Path]):
    from analyzers.prefetch import parse_ncu_csv

    if path is None:
        return None
    try:
        text = path.read_text(errors="strict")
    except UnicodeDecodeError:
        raise UserError(f"{path.name}: not a text file (expected an ncu --csv export)") from None
    try:
        return parse_ncu_csv(text, source=path.name)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _side_label(trace, path: Path, other_trace, other_path: Path, fallback: str) -> str:
    mine, theirs = trace.meta.get("backend"), other_trace.meta.get("backend")
    if mine and mine != theirs:
        return str(mine)
    return path.stem if path.stem != other_path.stem else fallback


def _read_run(path: Path):
    """(ranks, traces) of one run: a capture, or a folder or glob pattern of one capture per rank (see
    analyzers/ranks.py), ordered by rank."""
    from analyzers.ranks import order_ranks, run_files
    from profiler.readers import read_trace

    files = run_files(path)
    traces = [read_trace(f) for f in files]
    ranks = order_ranks([t.meta for t in traces], files)
    order = sorted(range(len(files)), key=ranks.__getitem__)
    return [ranks[i] for i in order], [traces[i] for i in order]


@app.command()
def diff(
    base: Annotated[Path, typer.Argument(help="The baseline capture (any format kprof analyze reads), or a folder "
                                         "or glob pattern of one capture per tensor-parallel rank.")],
    new: Annotated[Path, typer.Argument(help="The capture(s) to compare with the baseline, likewise.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write to this file (html, json) "
                                                   "instead of stdout (json, table).")] = None,
    format: Annotated[Optional[DiffFormat], typer.Option(
        "--format", "-f", help="Output format.",
        show_default="html when -o ends in .html, json for .json, else table")] = None,
    gate: Annotated[Optional[float], typer.Option(
        "--gate", help="Exit with code 1 when NEW takes more than RATIO times BASE's time per layer, for any "
                       "layer kind or over all layers (e.g. 1.05 allows 5% slower).", metavar="RATIO")] = None,
    metric: Annotated[DiffMetric, typer.Option("--metric", help="Time per layer compared: own (busy time not "
                                               "overlapping earlier-started kernels), busy (union of kernel "
                                               "intervals), span or summed kernel time.")] = DiffMetric.own_us,
    classes: Annotated[Optional[Path], typer.Option("--classes", help="JSON kernel class table (see "
                                                    "docs/diff.md).")] = None,
    pair: Annotated[Optional[list[str]], typer.Option(
        "--pair", help="Also report the overlap of A with B, as 'A,B' with class:NAME, stage:NAME or "
                       "kernel:REGEX selectors; repeatable.")] = None,
    consumer: Annotated[Optional[list[str]], typer.Option(
        "--consumer", help="A stage that consumes prefetched data; repeatable.",
        show_default="every stage but prefetch and allreduce")] = None,
    ncu_base: Annotated[Optional[Path], typer.Option("--ncu-base", help="ncu --csv export of BASE's consumer "
                                                     "kernels (L2 hit rate, DRAM bytes).")] = None,
    ncu_new: Annotated[Optional[Path], typer.Option("--ncu-new", help="ncu --csv export of NEW's consumer "
                                                    "kernels.")] = None,
    base_label: Annotated[Optional[str], typer.Option("--base-label", help="Name of BASE in the output.",
                                                      show_default="its backend or file name")] = None,
    new_label: Annotated[Optional[str], typer.Option("--new-label", help="Name of NEW in the output.")] = None,
    layer_regex: Annotated[str, typer.Option("--layer-regex", help="As for kprof analyze.")] = DEFAULT_LAYER_REGEX,
) -> None:
    """Compare two captures layer kind by layer kind and stage by stage: a verdict, JSON, or an HTML report."""
    from analyzers.diff import diff as diff_captures, layer_timeline, representative_layer
    from analyzers.layers import activity_layers
    from analyzers.ranks import merge_ranks
    from analyzers.overlap import pair_summary, select
    from analyzers.prefetch import ncu_records

    with _user_errors():
        if format is None:
            suffix = output.suffix.lower() if output else ""
            format = {".html": DiffFormat.html, ".htm": DiffFormat.html, ".json": DiffFormat.json}.get(
                suffix, DiffFormat.table)
        if format is DiffFormat.html and output is None:
            raise UserError("the html report needs a file: add -o report.html")
        if gate is not None and not gate > 0:
            raise UserError(f"--gate must be a positive ratio, got {gate}")
        pairs = []
        for spec in pair or []:
            a, sep, b = spec.partition(",")
            if not sep or not a or not b:
                raise UserError(f"--pair {spec!r}: expected 'A,B', e.g. stage:shared_experts,stage:routed_experts")
            pairs.append((a.strip(), b.strip()))
        try:
            compile_layer_regex(layer_regex)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        table = _class_table(classes)
        ncu = (_read_ncu(ncu_base), _read_ncu(ncu_new))
        runs = [_read_run(base), _read_run(new)]  # (ranks, traces) per side, lowest rank first
        traces = (runs[0][1][0], runs[1][1][0])
        labels = (base_label or _side_label(traces[0], base, traces[1], new, "BASE"),
                  new_label or _side_label(traces[1], new, traces[0], base, "NEW"))
        docs, acts, by_rank = [], [], []
        for ranks, side_traces in runs:
            rank_docs = [analyze_layers(t, layer_regex=layer_regex, classes=table) for t in side_traces]
            docs.append(merge_ranks(rank_docs, ranks))
            by_rank.append(dict(zip(ranks, rank_docs)))
            # overlap pairs, the timeline and the kernel table: the lowest rank (every rank runs the same kernels)
            acts.append(activity_layers(side_traces[0], layer_regex=layer_regex, classes=table))
        stages = [set(a["stage"]) for a in acts]
        if not pair and all({"shared_experts", "routed_experts"} <= s for s in stages):
            pairs.append(("stage:shared_experts", "stage:routed_experts"))
        names = ("a_us", "b_us", "overlap_us", "hidden_pct")
        pair_docs = []
        for a, b in pairs:
            try:
                sides = [pair_summary(x, select(x, a), select(x, b), names)[0] for x in acts]
            except ValueError as exc:
                raise UserError(str(exc)) from None
            pair_docs.append({"a": a, "b": b, "base": sides[0], "new": sides[1]})
        ncu_doc = None
        if ncu[0] is not None or ncu[1] is not None:
            by_side = [{r["name"]: r for r in ncu_records(f)} if f is not None else {} for f in ncu]
            ncu_doc = [{"name": name, "base": by_side[0].get(name), "new": by_side[1].get(name)}
                       for name in sorted(set(by_side[0]) | set(by_side[1]))]
        kernels = [a[(a["kind"] == "kernel").to_numpy()] for a in acts]
        result = diff_captures(docs[0], docs[1], kernels[0], kernels[1], metric=metric.value, gate=gate,
                               labels=labels, pairs=pair_docs, consumer_stages=consumer, ncu=ncu_doc,
                               paths=(str(base), str(new)),
                               ranks=tuple(by_rank) if any(len(r) > 1 for r in by_rank) else None)
        if format is DiffFormat.html:
            from reports.html import render_diff

            layer = representative_layer(result)
            timelines = None if layer is None else {
                side: layer_timeline(a, *layer) for side, a in zip(("base", "new"), acts)}
            text = render_diff(result, timelines, layer)
        elif format is DiffFormat.json:
            text = _as_json(result)
        else:
            text = _diff_table(result, color=output is None and sys.stdout.isatty())
        if output is None:
            sys.stdout.write(text)
        else:
            with atomic_output(output) as stream:
                stream.write(text.encode())
            typer.echo(f"kprof: wrote {output}", err=True)
    if output is not None or format is not DiffFormat.table:
        for line in result["verdict"][:1]:
            typer.echo(f"kprof: {line}", err=True)
    if result["gate"] is not None and not result["gate"]["passed"]:
        for failure in result["gate"]["failures"]:
            typer.echo(f"kprof: gate failed: {failure}", err=True)
        raise typer.Exit(1)


def _diff_table(result: dict, color: bool = False) -> str:
    from rich.console import Console
    from rich.table import Table

    b, n = result["base"]["label"], result["new"]["label"]
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=color, no_color=not color, width=110)
    for line in result["verdict"]:
        console.print(line)
    table = Table(title=f"per layer kind ({result['metric']}, medians over steps, mean over layers)")
    for header in ("kind", f"{b} kernels", f"{n} kernels", f"{b} µs", f"{n} µs", "speed-up"):
        table.add_column(header, justify="left" if header == "kind" else "right")
    for k in result["kinds"]:
        cells = [(k[s] or {}).get(f) for f in ("kernels_per_layer", "us_per_layer") for s in ("base", "new")]
        table.add_row((k["kind"] or "all").upper(), *_diff_cells(cells, k["speedup"]))
    console.print(table)
    if result["ranks"]:
        ranks = Table(title="per rank (the tables above are the merged run: slowest rank per layer and stage)")
        for header in ("rank", "kind", f"{b} kernels", f"{n} kernels", f"{b} µs", f"{n} µs", "speed-up"):
            ranks.add_column(header, justify="left" if header in ("rank", "kind") else "right")
        for row in result["ranks"]["per_rank"]:
            for k in row["kinds"]:
                cells = [k["base_kernels_per_layer"], k["new_kernels_per_layer"], k["base_us_per_layer"],
                         k["new_us_per_layer"]]
                ranks.add_row(str(row["rank"]), (k["kind"] or "all").upper(), *_diff_cells(cells, k["speedup"]))
        console.print(ranks)
    stages = Table(title="per stage (per layer of the kind)")
    for header in ("kind", "stage", f"{b} kernels", f"{n} kernels", f"{b} µs", f"{n} µs", "speed-up"):
        stages.add_column(header, justify="left" if header in ("kind", "stage") else "right")
    for s in result["stages"]:
        cells = [s["base_kernels"], s["new_kernels"], s["base_us"], s["new_us"]]
        stages.add_row(s["kind"] or "", s["stage"], *_diff_cells(cells, s["speedup"]))
    console.print(stages)
    ov = result["overlap"]
    console.print(f"communication hidden under compute: {b} {_pct_text(ov['base']['comm_hidden_pct'])}, "
                  f"{n} {_pct_text(ov['new']['comm_hidden_pct'])}")
    pf = result["prefetch"]
    console.print(f"prefetch exposed per step: {b} {pf['base']['exposed_us']:g} µs, {n} {pf['new']['exposed_us']:g} µs")
    return buffer.getvalue()


def _diff_cells(cells: list, speedup) -> list[str]:
    """A diff table row's cells: the two kernel counts as they are, the two times to 0.1 µs, the speed-up; "–" where
    a side has none."""
    counts, times = cells[:2], cells[2:]
    return [*("–" if c is None else f"{c:g}" for c in counts), *("–" if t is None else f"{t:.1f}" for t in times),
            "–" if speedup is None else f"{speedup:.2f}x"]


def _pct_text(value) -> str:
    return "n/a (no communication)" if value is None else f"{value:.1f}%"


def main() -> None:
    try:
        code = app(standalone_mode=False)
    except UserError as exc:  # raised from deep inside a command
        typer.echo(f"kprof: error: {exc}", err=True)
        sys.exit(2)
    except click.exceptions.UsageError as exc:  # unknown option, missing argument, bad value
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        typer.echo(f"kprof: error: {exc.format_message()}{hint}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        typer.echo("kprof: interrupted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("kprof: interrupted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
