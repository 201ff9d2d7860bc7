"""The diff report: one self-contained HTML file (plotly.js embedded once, no network) from a ``kprof.diff/1``
document and the two representative-layer timelines. Only formatting happens here; every number comes from
:mod:`analyzers.diff` (and so from ``kprof analyze`` of each side)."""
from __future__ import annotations

import html
import json

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from analyzers.diff import STAGE_ORDER

BASE_COLOR, NEW_COLOR = "#8c8c8c", "#1f77b4"
STAGE_COLORS = dict(zip(STAGE_ORDER + ("-",), [
    "#4e79a7", "#f28e2b", "#e15759", "#b07aa1", "#76b7b2", "#d62728", "#edc948", "#59a14f", "#2ca02c", "#9c755f",
    "#ff9da7", "#17becf", "#bab0ac"]))
EXTRA_COLORS = ["#7f7f7f", "#bcbd22", "#8c564b", "#e377c2", "#aec7e8", "#ffbb78"]
METRIC_TEXT = {
    "own_us": "own time: the layer's busy time less what overlaps kernels that started earlier (a kernel launched "
              "early by programmatic dependent launch waits while the previous layer finishes; that wait counts "
              "once, for the earlier layer), so the layers' own times add up to the step's busy time",
    "busy_us": "busy time: the length of the union of the layer's kernel intervals on all streams (gaps and "
               "overlapping kernels are not double-counted)",
    "span_us": "span: first kernel start to last kernel end of the layer, gaps included",
    "kernel_us": "kernel time: the sum of the layer's kernel durations (overlapping kernels count twice)",
}

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
main{max-width:1200px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:24px;margin:8px 0 4px}h2{font-size:19px;margin:32px 0 6px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 4px}
p.explain{color:#555;margin:4px 0 8px;max-width:900px;font-size:14px}
.verdict{font-size:20px;font-weight:600;margin:10px 0;padding:10px 14px;border-radius:6px;background:#eef5fb;
 border-left:6px solid #1f77b4}
.verdict.slower{background:#fdeeee;border-left-color:#d62728}
.verdict small{display:block;font-size:14px;font-weight:400;color:#444;margin-top:4px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:12px 0}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px 14px;min-width:170px}
.card .label{font-size:12px;color:#666;letter-spacing:.03em}
.card .value{font-size:22px;font-weight:600}.card .sub{font-size:13px;color:#555}
table{border-collapse:collapse;background:#fff;font-size:13px;margin:6px 0 10px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right;vertical-align:top}
th{background:#f0f0f0;position:sticky;top:0}td.t,th.t{text-align:left}
table.sortable th{cursor:pointer;user-select:none}table.sortable th:after{content:" \\2195";color:#aaa}
.gate-fail{color:#b00;font-weight:600}.gate-pass{color:#080;font-weight:600}
.added{color:#1a7f37}.removed{color:#b00}.changed{color:#9a6700}
.meta td{text-align:left}.scroll{max-height:520px;overflow:auto;display:inline-block}
code{background:#eee;padding:0 3px;border-radius:3px}
nav a{margin-right:12px;font-size:13px}
"""

SORT_JS = """
document.querySelectorAll('table.sortable').forEach(function(t){
  t.querySelectorAll('th').forEach(function(th,i){th.addEventListener('click',function(){
    var body=t.tBodies[0],rows=Array.from(body.rows),asc=th.dataset.dir!=='asc';
    t.querySelectorAll('th').forEach(function(h){delete h.dataset.dir});th.dataset.dir=asc?'asc':'desc';
    rows.sort(function(a,b){var x=a.cells[i].dataset.v??a.cells[i].textContent,
      y=b.cells[i].dataset.v??b.cells[i].textContent,nx=parseFloat(x),ny=parseFloat(y);
      var c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:String(x).localeCompare(String(y));return asc?c:-c;});
    rows.forEach(function(r){body.appendChild(r)});});});});
"""


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def num(value, unit: str = "") -> str:
    """A number as shown in the report: the analyzer's value unchanged (up to 6 significant digits), or a dash."""
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "–"
    text = format(float(value), ".6g") if isinstance(value, float) else str(value)
    return f"{text}{unit}"


def _ratio_text(value) -> str:
    return "–" if value is None else f"{value:.2f}x"


def _table(headers: list[str], rows: list[list], sortable: bool = False, text_columns: int = 1,
           css: str = "", left: tuple[int, ...] = ()) -> str:
    """An HTML table; cells are (text, sort value) pairs or plain values; the first ``text_columns`` and the
    columns in ``left`` are left-aligned text."""
    cls = " ".join(c for c in ("sortable" if sortable else "", css) if c)
    out = [f'<table class="{cls}"><thead><tr>']
    out += [f'<th class="{"t" if i < text_columns or i in left else ""}">{_e(h)}</th>' for i, h in enumerate(headers)]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>")
        for i, cell in enumerate(row):
            text, sort = cell if isinstance(cell, tuple) else (cell, None)
            attrs = ' class="t"' if i < text_columns or i in left else ""
            if sort is not None:
                attrs += f' data-v="{_e(sort)}"'
            out.append(f"<td{attrs}>{text if isinstance(text, _Raw) else _e(text)}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


class _Raw(str):
    """Already-escaped HTML for a table cell."""


def _figure(fig: go.Figure) -> str:
    fig.update_layout(template="plotly_white", margin=dict(l=60, r=20, t=50, b=40), font=dict(size=12))
    return pio.to_html(fig, full_html=False, include_plotlyjs=False,
                       config={"displaylogo": False, "responsive": True})


def _stage_color(stage: str, extra: dict) -> str:
    if stage in STAGE_COLORS:
        return STAGE_COLORS[stage]
    return extra.setdefault(stage, EXTRA_COLORS[len(extra) % len(EXTRA_COLORS)])


def _layer_label(layer: dict) -> str:
    return f"L{layer['layer']} {layer['kind'] or ''}".strip()


def layer_bars(doc: dict) -> go.Figure:
    labels = [_layer_label(l) for l in doc["layers"]]
    b, n = doc["base"]["label"], doc["new"]["label"]
    metric = doc["metric"].replace("_us", "")
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"µs per layer ({metric})", "kernels per layer"))
    for side, label, color in (("base", b, BASE_COLOR), ("new", n, NEW_COLOR)):
        fig.add_bar(x=labels, y=[l[f"{side}_us"] for l in doc["layers"]], name=label, marker_color=color,
                    legendgroup=side, hovertemplate="%{x}: %{y} µs<extra>" + _e(label) + "</extra>", row=1, col=1)
        fig.add_bar(x=labels, y=[l[f"{side}_kernels"] for l in doc["layers"]], name=label, marker_color=color,
                    legendgroup=side, showlegend=False,
                    hovertemplate="%{x}: %{y} kernels<extra>" + _e(label) + "</extra>", row=1, col=2)
    fig.update_layout(barmode="group", height=380, legend=dict(orientation="h", y=1.15))
    fig.update_yaxes(title_text="µs", row=1, col=1)
    fig.update_yaxes(title_text="kernels", row=1, col=2)
    return fig


def timeline(doc: dict, timelines: dict[str, pd.DataFrame], layer: tuple[int, str]) -> go.Figure:
    """One representative layer per side, one row per stream, on a shared time axis from the layer's first kernel."""
    titles = []
    for side in ("base", "new"):
        frame = timelines[side]
        step = f", decode step {int(frame['step_number'].iloc[0])} of {doc[side]['steps']}" if len(frame) else ""
        titles.append(f"{doc[side]['label']}: layer {layer[0]} ({layer[1]}){step}")
    lanes = [max(1, timelines[s]["stream"].nunique()) for s in ("base", "new")]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.22 / (1 + sum(lanes) / 4),
                        subplot_titles=titles, row_heights=lanes)
    shown, extra = set(), {}
    for row, side in enumerate(("base", "new"), start=1):
        frame = timelines[side]
        streams = sorted(frame["stream"].unique())
        frame = frame.assign(lane=[f"stream {s}" for s in frame["stream"]])
        for stage, part in frame.groupby("stage", sort=False):
            fig.add_bar(
                x=part["dur_us"], base=part["start_us"], y=part["lane"], orientation="h", name=stage,
                legendgroup=stage, showlegend=stage not in shown, marker_color=_stage_color(stage, extra),
                marker_line=dict(width=0.5, color="#333"),
                customdata=part[["name", "klass", "start_us", "dur_us"]].to_numpy(),
                hovertemplate="<b>%{customdata[0]}</b><br>stage " + _e(stage) +
                              ", class %{customdata[1]}<br>start %{customdata[2]:.3f} µs, "
                              "%{customdata[3]:.3f} µs<extra></extra>",
                row=row, col=1)
            shown.add(stage)
        fig.update_yaxes(categoryorder="array", categoryarray=[f"stream {s}" for s in reversed(streams)], row=row,
                         col=1)
    fig.update_xaxes(title_text="µs from the layer's first kernel", row=2, col=1)
    fig.update_xaxes(showticklabels=True, row=1, col=1)
    fig.update_layout(barmode="overlay", height=200 + 50 * sum(lanes), legend=dict(title="stage"))
    return fig


def stage_bars(doc: dict) -> go.Figure:
    kinds = list(dict.fromkeys(s["kind"] for s in doc["stages"]))
    fig = make_subplots(rows=1, cols=max(1, len(kinds)),
                        subplot_titles=[f"{(k or 'all').upper()} layers" for k in kinds] or None)
    labels = [doc["base"]["label"], doc["new"]["label"]]
    shown, extra = set(), {}
    for col, kind in enumerate(kinds, start=1):
        for s in (s for s in doc["stages"] if s["kind"] == kind):
            fig.add_bar(x=labels, y=[s["base_us"] or 0, s["new_us"] or 0], name=s["stage"], legendgroup=s["stage"],
                        showlegend=s["stage"] not in shown, marker_color=_stage_color(s["stage"], extra),
                        hovertemplate=_e(s["stage"]) + ": %{y:.3f} µs per layer<extra>%{x}</extra>", row=1, col=col)
            shown.add(s["stage"])
    fig.update_layout(barmode="stack", height=480, legend=dict(title="stage"))
    fig.update_yaxes(title_text="µs per layer", row=1, col=1)
    return fig


def overlap_bars(doc: dict) -> go.Figure:
    labels = [doc["base"]["label"], doc["new"]["label"]]
    sides = [doc["overlap"]["base"], doc["overlap"]["new"]]
    fig = go.Figure()
    fig.add_bar(y=labels, x=[s["overlap_us"] for s in sides], name="hidden under compute", orientation="h",
                marker_color="#59a14f")
    fig.add_bar(y=labels, x=[round(s["comm_us"] - s["overlap_us"], 3) for s in sides], name="exposed",
                orientation="h", marker_color="#e15759")
    fig.update_layout(barmode="stack", height=220, title="communication per decode step (µs, median)",
                      legend=dict(orientation="h", y=-0.35))
    return fig


def _meta_table(doc: dict) -> str:
    keys = ["path", "source", "gpu", "backend", "config", "versions", "steps", "unattributed kernels"]
    rows = []
    for key in keys:
        cells = [key]
        for side in ("base", "new"):
            d = doc[side]
            cap = d["capture"]
            value = {"path": d["path"], "steps": d["steps"], "unattributed kernels": d["unattributed_kernels"]}.get(
                key, cap.get(key))
            if isinstance(value, (dict, list)):
                value = json.dumps(value, sort_keys=True)
            cells.append("–" if value in (None, "", {}) else value)
        rows.append(cells)
    other = sorted({k for s in ("base", "new") for k in doc[s]["capture"]} - set(keys))
    for key in other:
        rows.append([key] + [json.dumps(doc[s]["capture"].get(key)) if doc[s]["capture"].get(key) is not None
                             else "–" for s in ("base", "new")])
    return _table(["", doc["base"]["label"], doc["new"]["label"]], rows, text_columns=3, css="meta")


def _pct(value) -> str:
    return "–" if value is None else f"{value:.2f}%"


def _ranks_section(doc: dict) -> str:
    """Tensor-parallel runs: the merged figures' definition and one row per rank and layer kind."""
    b, n, r = doc["base"]["label"], doc["new"]["label"], doc["ranks"]
    rows = [[row["rank"], (k["kind"] or "all").upper(), num(k["base_kernels_per_layer"]),
             num(k["new_kernels_per_layer"]), num(k["base_us_per_layer"]), num(k["new_us_per_layer"]),
             _ratio_text(k["speedup"]), _pct(row["base_comm_hidden_pct"]), _pct(row["new_comm_hidden_pct"])]
            for row in r["per_rank"] for k in row["kinds"]]
    return (f'<h3 id="ranks">Per rank</h3><p class="explain">{_e(b)} has ranks {_e(", ".join(map(str, r["base"])))}'
            f' and {_e(n)} ranks {_e(", ".join(map(str, r["new"])))}. The figures above are the merged run: a layer '
            f'or stage takes as long as its slowest rank (the ranks run it in lockstep), and kernel counts, overlap '
            f'and prefetch are means over ranks. The timeline and the kernel table show the lowest rank.</p>'
            + _table(["rank", "layer kind", f"{b} kernels/layer", f"{n} kernels/layer", f"{b} µs/layer",
                      f"{n} µs/layer", "speed-up", f"{b} comm hidden", f"{n} comm hidden"], rows, text_columns=2))


def render_diff(doc: dict, timelines: dict[str, pd.DataFrame] | None = None,
                layer: tuple[int, str] | None = None) -> str:
    """The whole report as one HTML string."""
    b, n = doc["base"]["label"], doc["new"]["label"]
    head = doc["headline"]
    parts = []

    # --- header -----------------------------------------------------------------------------------------------
    slower = head["speedup"] is not None and head["speedup"] < 1
    verdict = doc["verdict"][0] if doc["verdict"] else "no layers to compare"
    more = "".join(f"<small>{_e(v)}</small>" for v in doc["verdict"][1:])
    parts.append(f'<div class="verdict{" slower" if slower else ""}" id="verdict">{_e(verdict)}{more}</div>')
    kind = (head["kind"] or "all").upper()
    cards = [
        ("kernels / layer", f"{num(head['new_kernels_per_layer'])} vs {num(head['base_kernels_per_layer'])}",
         f"{n} vs {b}, {kind} layers"),
        ("µs / layer", f"{num(head['new_us_per_layer'])} vs {num(head['base_us_per_layer'])}",
         f"{n} vs {b}, {kind} layers, {doc['metric']}"),
        ("speed-up", _ratio_text(head["speedup"]), f"{b} µs / {n} µs per layer"),
    ]
    ov = doc["overlap"]
    cards.append(("comm hidden", f"{_pct(ov['new']['comm_hidden_pct'])} vs {_pct(ov['base']['comm_hidden_pct'])}",
                  f"{n} vs {b}, share of communication under compute"))
    if doc["gate"] is not None:
        g = doc["gate"]
        status = "passed" if g["passed"] else "FAILED"
        cards.append(("CI gate", f'<span class="{"gate-pass" if g["passed"] else "gate-fail"}">{status}</span>',
                      f"{n} may take at most {g['ratio']:g}x {b}'s time per layer"))
    parts.append('<div class="cards">' + "".join(
        f'<div class="card"><div class="label">{_e(l)}</div><div class="value">{v if "<span" in v else _e(v)}'
        f'</div><div class="sub">{_e(s)}</div></div>' for l, v, s in cards) + "</div>")
    if doc["gate"] is not None and not doc["gate"]["passed"]:
        parts.append("".join(f'<p class="gate-fail">{_e(f)}</p>' for f in doc["gate"]["failures"]))
    parts.append(
        f'<p class="explain">Each side is one capture of decode steps. Numbers are medians over the decode steps of '
        f'each layer, then averaged over the layers of a kind; "µs / layer" is the {_e(METRIC_TEXT[doc["metric"]])}. '
        f'The two captures are aligned by layer kind and stage (the ranges the model code names), not by kernel name, '
        f'so a fused backend with other kernels is still compared stage by stage. Every per-layer number equals '
        f'<code>kprof analyze --format json</code> of that capture.</p>')
    parts.append("<h3>Captures</h3>" + _meta_table(doc))
    rows = []
    for k in doc["kinds"]:
        rows.append([(k["kind"] or "all").upper()]
                    + [num(k[s][f]) if k[s] else "–" for s in ("base", "new")
                       for f in ("layers", "kernels_per_layer", "us_per_layer")] + [_ratio_text(k["speedup"])])
    a = doc["all_layers"]
    rows.append(["all layers"] + [num(a[s][f]) for s in ("base", "new")
                                  for f in ("layers", "kernels_per_layer", "us_per_layer")]
                + [_ratio_text(a["speedup"])])
    parts.append("<h3>Per layer kind</h3>" + _table(
        ["layer kind", f"{b} layers", f"{b} kernels/layer", f"{b} µs/layer", f"{n} layers", f"{n} kernels/layer",
         f"{n} µs/layer", "speed-up"], rows))

    if doc.get("ranks"):
        parts.append(_ranks_section(doc))

    # --- per layer --------------------------------------------------------------------------------------------
    parts.append('<h2 id="layers">Per layer</h2><p class="explain">Time and kernel count of every layer on both '
                 'sides (the median decode step); a shorter bar is faster.</p>')
    parts.append(_figure(layer_bars(doc)))
    parts.append(_table(["layer", "kind", f"{b} kernels", f"{n} kernels", f"{b} µs", f"{n} µs", "speed-up"],
                        [[l["layer"], l["kind"] or "", num(l["base_kernels"]), num(l["new_kernels"]),
                          num(l["base_us"]), num(l["new_us"]), _ratio_text(l["speedup"])] for l in doc["layers"]],
                        text_columns=2))

    # --- timeline ---------------------------------------------------------------------------------------------
    parts.append('<h2 id="timeline">One layer on the GPU</h2>')
    if timelines is not None and layer is not None and all(len(timelines[s]) for s in ("base", "new")):
        parts.append(f'<p class="explain">Layer {layer[0]} ({_e(layer[1])}) in its median decode step, one row per '
                     f'CUDA stream, colored by stage; both sides share the time axis, so bars that end earlier are '
                     f'faster and bars stacked in time on different rows ran concurrently. Hover a bar for its '
                     f'kernel.</p>')
        parts.append(_figure(timeline(doc, timelines, layer)))
    else:
        parts.append('<p class="explain">No layer present on both sides to draw.</p>')

    # --- stages -----------------------------------------------------------------------------------------------
    parts.append(f'<h2 id="stages">Stage breakdown</h2><p class="explain">Each stage\'s {_e(doc["metric"])} per '
                 f'layer of a kind (summed over the kind\'s layers and divided by their number). The stacks need not '
                 f'add up to the layer\'s time: stages on different streams can overlap.</p>')
    parts.append(_figure(stage_bars(doc)))
    parts.append(_table(["kind", "stage", f"{b} kernels", f"{n} kernels", f"{b} µs", f"{n} µs", f"{b} kernel µs",
                         f"{n} kernel µs", "speed-up"],
                        [[s["kind"] or "", s["stage"], num(s["base_kernels"]), num(s["new_kernels"]),
                          num(s["base_us"]), num(s["new_us"]), num(s["base_kernel_us"]), num(s["new_kernel_us"]),
                          _ratio_text(s["speedup"])] for s in doc["stages"]], text_columns=2))

    # --- overlap ----------------------------------------------------------------------------------------------
    parts.append('<h2 id="overlap">Communication and compute overlap</h2>')
    parts.append('<p class="explain">Communication is NCCL, custom and one-shot all-reduce and NVSHMEM kernels plus '
                 'everything in an <code>allreduce</code> stage; compute is every other kernel except memcpy, memset '
                 'and prefetch work.</p>')
    explain = {
        "comm µs": "the time at least one communication kernel runs in a decode step (union of intervals)",
        "compute µs": "the time at least one compute kernel runs in a decode step",
        "overlap µs": "the time both run at once",
        "comm hidden": "overlap / communication: the share of communication hidden under compute "
                       "(HolisticTraceAnalysis's definition); – when there is no communication",
    }
    rows = [[k, num(ov["base"][f]) if f != "comm_hidden_pct" else _pct(ov["base"][f]),
             num(ov["new"][f]) if f != "comm_hidden_pct" else _pct(ov["new"][f]), explain[k]]
            for k, f in (("comm µs", "comm_us"), ("compute µs", "compute_us"), ("overlap µs", "overlap_us"),
                         ("comm hidden", "comm_hidden_pct"))]
    parts.append(_table(["per decode step (median)", b, n, "meaning"], rows, left=(3,)))
    parts.append(_figure(overlap_bars(doc)))
    layer_rows = []
    for side in ("base", "new"):
        for l in ov[side]["layers"]:
            layer_rows.append([doc[side]["label"], l["layer"], l["kind"] or "", num(l["comm_us"]),
                               num(l["compute_us"]), num(l["overlap_us"]), _pct(l["comm_hidden_pct"])])
    parts.append('<h3>Per layer</h3><p class="explain">A layer\'s communication counts as hidden when any compute of '
                 'the same step runs at the same time, also the next layer\'s.</p>')
    parts.append(_table(["side", "layer", "kind", "comm µs", "compute µs", "overlap µs", "comm hidden"], layer_rows,
                        sortable=True, text_columns=3))
    kernel_rows = [[doc[side]["label"], k["name"], k["count"], num(k["kernel_us"]), num(k["overlap_us"]),
                    _pct(k["overlap_pct"])] for side in ("base", "new") for k in ov[side]["comm_kernels"]]
    parts.append('<h3>Per communication kernel</h3><p class="explain">For each communication kernel, the part of its '
                 'own duration that overlaps compute on its GPU, summed by name over the whole capture (Nsight '
                 'Systems\' nccl_gpu_overlap_trace definition).</p>')
    parts.append(_table(["side", "kernel", "launches", "kernel µs", "overlapped µs", "overlapped"], kernel_rows,
                        sortable=True, text_columns=2) if kernel_rows else "<p>No communication kernels.</p>")
    if ov["pairs"]:
        rows = [[p["a"], p["b"]] + [num(p[s][f]) if f != "hidden_pct" else _pct(p[s][f])
                                    for s in ("base", "new") for f in ("a_us", "b_us", "overlap_us", "hidden_pct")]
                for p in ov["pairs"]]
        parts.append('<h3>Other overlaps</h3><p class="explain">The same measure for other pairs of work: A\'s time, '
                     'B\'s time, the time both run, and the share of A hidden under B (per decode step, median); '
                     '– where a side has no A.</p>')
        parts.append(_table(["A", "B", f"{b} A µs", f"{b} B µs", f"{b} both µs", f"{b} A hidden", f"{n} A µs",
                             f"{n} B µs", f"{n} both µs", f"{n} A hidden"], rows, text_columns=2))

    # --- prefetch ---------------------------------------------------------------------------------------------
    pf = doc["prefetch"]
    parts.append('<h2 id="prefetch">Prefetch</h2><p class="explain">Prefetch work is every kernel or copy in a '
                 '<code>prefetch</code> stage and every kernel named as a prefetch.</p>')
    explain = {
        "prefetch µs": "the time prefetch work runs in a decode step (union of its intervals)",
        "hidden µs": "the part of it during which other work of the step runs on the GPU, so it costs no time",
        "exposed µs": "the part during which only prefetch runs: what the prefetch adds to the step",
        "hidden": "hidden / prefetch time; – when the capture has no prefetch work",
    }
    rows = [[k, num(pf["base"][f]) if f != "hidden_pct" else _pct(pf["base"][f]),
             num(pf["new"][f]) if f != "hidden_pct" else _pct(pf["new"][f]), explain[k]]
            for k, f in (("prefetch µs", "prefetch_us"), ("hidden µs", "hidden_us"), ("exposed µs", "exposed_us"),
                         ("hidden", "hidden_pct"))]
    parts.append(_table(["per decode step (median)", b, n, "meaning"], rows, left=(3,)))
    if pf["consumers"]:
        intro = ("One side has prefetch work and the other none; if the two captures differ only in prefetch, the "
                 "change in the consumer stages' kernel time is what the prefetch buys") if pf["toggled"] else \
            "Kernel time of the consumer stages (the stages that read prefetched weights) on both sides"
        parts.append(f'<h3>Consumer kernels</h3><p class="explain">{_e(intro)}: summed kernel durations per layer, '
                     f'negative delta = {_e(n)} faster.</p>')
        parts.append(_table(["kind", f"{b} µs/layer", f"{n} µs/layer", "delta µs"],
                            [[c["kind"] or "", num(c["base_us"]), num(c["new_us"]), num(c["delta_us"])]
                             for c in pf["consumers"]]))
    if pf["ncu"]:
        parts.append('<h3>Nsight Compute: consumer kernels</h3><p class="explain">From the ncu CSVs given: the mean '
                     'L2 hit rate (a higher rate means the data was already in L2, as a working prefetch makes it) '
                     'and the mean DRAM megabytes read and written per launch (fewer bytes from DRAM = the prefetch '
                     'moved traffic off the critical kernel).</p>')
        rows = [[r["name"]] + [num((r[s] or {}).get(f)) if r[s] else "–" for s in ("base", "new")
                               for f in ("launches", "l2_hit_pct", "dram_mb")] for r in pf["ncu"]]
        parts.append(_table(["kernel", f"{b} launches", f"{b} L2 hit %", f"{b} DRAM MB", f"{n} launches",
                             f"{n} L2 hit %", f"{n} DRAM MB"], rows, sortable=True))

    # --- kernels ----------------------------------------------------------------------------------------------
    parts.append('<h2 id="kernels">Kernels</h2><p class="explain">Every kernel name run inside a layer, per decode '
                 'step: launches and summed µs on each side; "where" lists kind/stage, most time first. Added = only '
                 f'in {_e(n)}, removed = only in {_e(b)}. Click a column to sort.</p>')
    rows = []
    for k in doc["kernels"]:
        rows.append([_Raw(f'<span class="{k["status"]}">{_e(k["status"])}</span>'), k["name"], k["where"] or "",
                     (num(k["base_count"]), k["base_count"] or 0), (num(k["base_us"]), k["base_us"] or 0),
                     (num(k["new_count"]), k["new_count"] or 0), (num(k["new_us"]), k["new_us"] or 0),
                     (num(k["delta_us"]), k["delta_us"])])
    parts.append('<div class="scroll">' + _table(
        ["status", "kernel", "where", f"{b} /step", f"{b} µs", f"{n} /step", f"{n} µs", "delta µs"], rows,
        sortable=True, text_columns=3) + "</div>")

    title = f"kprof diff: {b} vs {n}"
    data = json.dumps(doc, sort_keys=False).replace("</", "<\\/")
    nav = "".join(f'<a href="#{a}">{t}</a>' for a, t in (("layers", "per layer"), ("timeline", "timeline"),
                                                           ("stages", "stages"), ("overlap", "overlap"),
                                                           ("prefetch", "prefetch"), ("kernels", "kernels")))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<style>{CSS}</style><script type="text/javascript">{get_plotlyjs()}</script></head>'
            f'<body><main><h1>{_e(title)}</h1><nav>{nav}</nav>{"".join(parts)}'
            f'<script type="application/json" id="kprof-diff">{data}</script>'
            f'<script>{SORT_JS}</script></main></body></html>\n')
