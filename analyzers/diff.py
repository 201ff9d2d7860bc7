"""Diff of two captures (BASE and NEW), aligned by layer kind and stage, never by kernel name.

A fused backend runs other kernels under the same ranges, so the unit of comparison is the instrumentation contract:
layers of a kind (``kda``, ``mla``, ``dense``) and the stages inside them. Every per-layer and per-stage number comes
from each side's ``kprof.analyze/1`` document (:func:`analyzers.layers.analyze`), so the diff and the report show
exactly what ``kprof analyze`` prints for each side.

Per layer kind the headline is the mean over the layers of that kind of the chosen time metric (``own_us`` by
default: the layer's busy time, in the median step, less what overlaps kernels that started earlier, so that a
kernel launched early under programmatic dependent launch, waiting while the previous layer finishes, does not count
that wait twice; see :mod:`analyzers.layers`) and of ``kernels_per_step``. The speed-up is
BASE time / NEW time (above 1: NEW is faster). See ``docs/diff.md`` for the ``kprof.diff/1`` document.
"""
from __future__ import annotations

import pandas as pd

from analyzers.prefetch import consumer_change

SCHEMA = "kprof.diff/1"
METRICS = ("own_us", "busy_us", "span_us", "kernel_us")
STAGE_ORDER = ("attn_res", "qkv_proj", "kda_core", "mla_core", "o_proj", "allreduce", "router", "shared_experts",
               "routed_experts", "moe_tail", "dense_mlp", "prefetch")
# Within this relative difference two times count as equal (verdict "as fast", kernel "same").
TOLERANCE = 0.02


def _r(value, digits: int = 3):
    return None if value is None or pd.isna(value) else round(float(value), digits)


def _ratio(base, new):
    """BASE / NEW (the speed-up of NEW), None where either side is missing or NEW is zero."""
    if base is None or new is None or pd.isna(base) or pd.isna(new) or new == 0:
        return None
    return round(float(base) / float(new), 3)


def layer_table(doc: dict, metric: str) -> pd.DataFrame:
    """One row per layer of an analyze document: ``layer``, ``layer_kind``, ``kernels``, ``us`` (the metric),
    ``kernel_us``, ``busy_us``, ``span_us``, ``own_us``."""
    times = ("kernel_us", "busy_us", "span_us", "own_us")
    rows = [{"layer": l["layer"], "layer_kind": l["kind"] or "", "kernels": l["kernels_per_step"], "us": l[metric],
             **{t: l[t] for t in times}} for l in doc["layers"]]
    return pd.DataFrame(rows, columns=["layer", "layer_kind", "kernels", "us", *times])


def stage_table(doc: dict, metric: str) -> pd.DataFrame:
    """Per (layer kind, stage): ``kernels``, ``us`` (the metric) and ``kernel_us`` per layer of that kind (summed
    over the kind's layers, divided by their number, so a stage missing from some layers counts as 0 there)."""
    layers = layer_table(doc, metric)
    n_layers = layers.groupby("layer_kind").size()
    rows = [{"layer_kind": l["kind"] or "", "stage": s["name"], "kernels": s["kernels_per_step"], "us": s[metric],
             "kernel_us": s["kernel_us"]} for l in doc["layers"] for s in l["stages"]]
    frame = pd.DataFrame(rows, columns=["layer_kind", "stage", "kernels", "us", "kernel_us"])
    out = frame.groupby(["layer_kind", "stage"], sort=False)[["kernels", "us", "kernel_us"]].sum().reset_index()
    out[["kernels", "us", "kernel_us"]] = out[["kernels", "us", "kernel_us"]].div(
        out["layer_kind"].map(n_layers).to_numpy(), axis=0)
    return out


def kernel_names(kernels: pd.DataFrame, steps: int) -> pd.DataFrame:
    """Per kernel name, over the kernels in a step and a layer (a :func:`analyzers.layers.kernel_layers` frame):
    ``count`` and ``us`` per step, and ``where``, the ``kind/stage`` places it ran, most time first."""
    k = kernels[(kernels["step"] >= 0) & (kernels["layer"] >= 0)]
    if len(k) == 0:
        return pd.DataFrame(columns=["name", "count", "us", "where"])
    dur = (k["end_ns"] - k["start_ns"]).to_numpy()
    place = (k["layer_kind"].astype(str) + "/" + k["stage"].replace("", "-").astype(str)).to_numpy()
    frame = pd.DataFrame({"name": k["name"].astype(str).to_numpy(), "place": place, "dur": dur})
    out = frame.groupby("name", sort=True).agg(count=("dur", "size"), ns=("dur", "sum")).reset_index()
    places = (frame.groupby(["name", "place"], sort=True)["dur"].sum().reset_index()
              .sort_values(["name", "dur", "place"], ascending=[True, False, True]))
    where = places.groupby("name", sort=True)["place"].agg(lambda p: ", ".join(p))
    out["count"] = out["count"] / steps
    out["us"] = out["ns"] / steps / 1000.0
    out["where"] = out["name"].map(where)
    return out[["name", "count", "us", "where"]]


def _kernel_status(row) -> str:
    if pd.isna(row.base_count):
        return "added"
    if pd.isna(row.new_count):
        return "removed"
    same_time = abs(row.new_us - row.base_us) <= TOLERANCE * max(row.base_us, row.new_us, 1e-9)
    return "same" if row.base_count == row.new_count and same_time else "changed"


def kernel_diff(base: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """Outer join of two :func:`kernel_names` frames on the name, with ``status``: added, removed, changed, same."""
    out = base.rename(columns=lambda c: c if c == "name" else f"base_{c}").merge(
        new.rename(columns=lambda c: c if c == "name" else f"new_{c}"), on="name", how="outer")
    out["status"] = [_kernel_status(r) for r in out.itertuples(index=False)] if len(out) else []
    out["delta_us"] = out["new_us"].fillna(0) - out["base_us"].fillna(0)
    out["where"] = out["new_where"].fillna(out["base_where"])
    order = out["delta_us"].abs().sort_values(ascending=False, kind="stable").index
    return out.loc[order, ["name", "status", "where", "base_count", "base_us", "new_count", "new_us",
                           "delta_us"]].reset_index(drop=True)


def _kind_summary(layers: pd.DataFrame) -> pd.DataFrame:
    return layers.groupby("layer_kind", sort=False).agg(layers=("layer", "size"), kernels=("kernels", "mean"),
                                                        us=("us", "mean"))


def _verdict_line(kind: str, speedup, base_k, new_k, labels) -> str:
    base_label, new_label = labels
    scope = f"{kind.upper()} layers" if kind else "all layers"
    counts = f"{new_k:.3g} vs {base_k:.3g} kernels/layer"
    if speedup is None:
        return f"{new_label} and {base_label} cannot be compared on {scope}"
    if abs(speedup - 1.0) <= TOLERANCE:
        return f"{new_label} is as fast as {base_label} per layer ({scope}, {speedup:.2f}x), {counts}"
    word = "faster" if speedup > 1 else "slower"
    factor = speedup if speedup > 1 else 1.0 / speedup
    return f"{new_label} is {factor:.2f}x {word} per layer ({scope}), {counts}"


def rank_table(base: dict[int, dict], new: dict[int, dict], metric: str) -> list[dict]:
    """Per rank present on both sides (analyze documents by rank), per layer kind present on both: time and
    kernels per layer (means over the kind's layers), the speed-up, and each side's share of communication hidden
    under compute on that rank."""
    out = []
    for rank in sorted(set(base) & set(new)):
        b, n = _kind_summary(layer_table(base[rank], metric)), _kind_summary(layer_table(new[rank], metric))
        kinds = [{"kind": kind or None, "base_kernels_per_layer": _r(b.loc[kind].kernels),
                  "new_kernels_per_layer": _r(n.loc[kind].kernels), "base_us_per_layer": _r(b.loc[kind].us),
                  "new_us_per_layer": _r(n.loc[kind].us), "speedup": _ratio(b.loc[kind].us, n.loc[kind].us)}
                 for kind in b.index if kind in n.index]
        out.append({"rank": rank, "kinds": kinds, "base_comm_hidden_pct": base[rank]["overlap"]["comm_hidden_pct"],
                    "new_comm_hidden_pct": new[rank]["overlap"]["comm_hidden_pct"]})
    return out


def diff(base: dict, new: dict, base_kernels: pd.DataFrame, new_kernels: pd.DataFrame, *, metric: str = "own_us",
         gate: float | None = None, labels: tuple[str, str] = ("BASE", "NEW"), pairs: list[dict] | None = None,
         consumer_stages: list[str] | None = None, ncu: list[dict] | None = None, paths: tuple[str, str] = ("", ""),
         ranks: tuple[dict[int, dict], dict[int, dict]] | None = None) -> dict:
    """The ``kprof.diff/1`` document (a JSON-ready dict) of two analyze documents and their labelled kernels.

    ``pairs`` (extra overlap pairs) and ``ncu`` (per-kernel-name L2/DRAM rows of both sides) are passed through into
    the ``overlap`` and ``prefetch`` sections; ``consumer_stages`` names the stages whose kernel time the prefetch
    section compares (see :func:`analyzers.prefetch.consumer_change`).
    ``gate`` is the largest NEW / BASE time per layer allowed for any layer kind (and for all layers).
    ``ranks``: for tensor-parallel runs, each side's analyze documents by rank; ``base`` and ``new`` are then the
    merged documents (:func:`analyzers.ranks.merge_ranks`) and the ``ranks`` section compares rank by rank."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}: use one of {', '.join(METRICS)}")
    base_layers, new_layers = layer_table(base, metric), layer_table(new, metric)
    layers = base_layers.merge(new_layers, on=["layer", "layer_kind"], how="outer", suffixes=("_base", "_new"))
    layers = layers.sort_values(["layer", "layer_kind"]).reset_index(drop=True)

    base_kinds, new_kinds = _kind_summary(base_layers), _kind_summary(new_layers)
    kind_order = list(base_kinds.sort_values("layers", ascending=False, kind="stable").index)
    kind_order += [k for k in new_kinds.index if k not in kind_order]
    kinds = []
    for kind in kind_order:
        b = base_kinds.loc[kind] if kind in base_kinds.index else None
        n = new_kinds.loc[kind] if kind in new_kinds.index else None
        kinds.append({
            "kind": kind or None,
            "base": None if b is None else {"layers": int(b.layers), "kernels_per_layer": _r(b.kernels),
                                            "us_per_layer": _r(b.us)},
            "new": None if n is None else {"layers": int(n.layers), "kernels_per_layer": _r(n.kernels),
                                           "us_per_layer": _r(n.us)},
            "speedup": _ratio(None if b is None else b.us, None if n is None else n.us),
        })
    both = [k for k in kinds if k["base"] and k["new"]]
    overall = {
        "base": {"layers": len(base_layers), "kernels_per_layer": _r(base_layers["kernels"].mean()),
                 "us_per_layer": _r(base_layers["us"].mean())},
        "new": {"layers": len(new_layers), "kernels_per_layer": _r(new_layers["kernels"].mean()),
                "us_per_layer": _r(new_layers["us"].mean())},
    }
    overall["speedup"] = _ratio(overall["base"]["us_per_layer"], overall["new"]["us_per_layer"])

    lines = [_verdict_line(k["kind"] or "", k["speedup"], k["base"]["kernels_per_layer"],
                           k["new"]["kernels_per_layer"], labels) for k in both]
    if len(both) != 1:
        lines.append(_verdict_line("", overall["speedup"], overall["base"]["kernels_per_layer"] or 0,
                                   overall["new"]["kernels_per_layer"] or 0, labels))
    headline_kind = both[0] if both else None

    base_stages, new_stages = stage_table(base, metric), stage_table(new, metric)
    stages = base_stages.merge(new_stages, on=["layer_kind", "stage"], how="outer", suffixes=("_base", "_new"))
    rank = {s: i for i, s in enumerate(STAGE_ORDER)}
    kind_rank = {k: i for i, k in enumerate(kind_order)}
    stages = stages.assign(_k=stages["layer_kind"].map(kind_rank), _s=stages["stage"].map(rank).fillna(len(rank)))
    stages = stages.sort_values(["_k", "_s", "stage"]).drop(columns=["_k", "_s"]).reset_index(drop=True)

    stage_times = stages.rename(columns={"kernel_us_base": "base_kernel_us", "kernel_us_new": "new_kernel_us"})
    consumers = consumer_change(stage_times.fillna({"base_kernel_us": 0.0, "new_kernel_us": 0.0}), consumer_stages)
    kernels = kernel_diff(kernel_names(base_kernels, base["steps"]), kernel_names(new_kernels, new["steps"]))

    gate_doc = None
    if gate is not None:
        failures = []
        for k in both + [{"kind": None, **overall}]:
            b, n = k["base"]["us_per_layer"], k["new"]["us_per_layer"]
            if b and n is not None and n / b > gate:
                scope = f"{k['kind'].upper()} layers" if k["kind"] else "all layers"
                failures.append(f"{labels[1]} takes {n / b:.2f}x {labels[0]}'s {metric} per layer on {scope} "
                                f"({n:.1f} vs {b:.1f} us; allowed {gate:g}x)")
        gate_doc = {"ratio": gate, "passed": not failures, "failures": failures}

    def side(doc, label, path):
        return {"label": label, "path": path, "capture": doc["capture"], "steps": doc["steps"],
                "unattributed_kernels": doc["unattributed_kernels"]}

    def none_if_nan(v):
        return None if pd.isna(v) else v

    return {
        "schema": SCHEMA,
        "metric": metric,
        "base": side(base, labels[0], paths[0]),
        "new": side(new, labels[1], paths[1]),
        "headline": {
            "kind": headline_kind["kind"] if headline_kind else None,
            "base_kernels_per_layer": headline_kind["base"]["kernels_per_layer"] if headline_kind else None,
            "new_kernels_per_layer": headline_kind["new"]["kernels_per_layer"] if headline_kind else None,
            "base_us_per_layer": headline_kind["base"]["us_per_layer"] if headline_kind else None,
            "new_us_per_layer": headline_kind["new"]["us_per_layer"] if headline_kind else None,
            "speedup": headline_kind["speedup"] if headline_kind else None,
        },
        "verdict": lines,
        "kinds": kinds,
        "all_layers": overall,
        "layers": [{"layer": int(r.layer), "kind": r.layer_kind or None,
                    "base_kernels": _r(r.kernels_base), "new_kernels": _r(r.kernels_new),
                    "base_us": _r(r.us_base), "new_us": _r(r.us_new), "speedup": _ratio(r.us_base, r.us_new)}
                   for r in layers.itertuples(index=False)],
        "stages": [{"kind": r.layer_kind or None, "stage": r.stage,
                    "base_kernels": _r(r.kernels_base), "new_kernels": _r(r.kernels_new),
                    "base_us": _r(r.us_base), "new_us": _r(r.us_new),
                    "base_kernel_us": _r(r.kernel_us_base), "new_kernel_us": _r(r.kernel_us_new),
                    "speedup": _ratio(r.us_base, r.us_new)} for r in stages.itertuples(index=False)],
        "kernels": [{"name": r.name, "status": r.status, "where": none_if_nan(r.where),
                     "base_count": _r(r.base_count), "base_us": _r(r.base_us),
                     "new_count": _r(r.new_count), "new_us": _r(r.new_us), "delta_us": _r(r.delta_us)}
                    for r in kernels.itertuples(index=False)],
        "overlap": {"base": base["overlap"], "new": new["overlap"], "pairs": pairs or []},
        "prefetch": {
            "base": base["prefetch"], "new": new["prefetch"],
            "toggled": (base["prefetch"]["prefetch_us"] > 0) != (new["prefetch"]["prefetch_us"] > 0),
            "consumers": [
                {"kind": r.layer_kind or None, "base_us": _r(r.base_us), "new_us": _r(r.new_us),
                 "delta_us": _r(r.delta_us)} for r in consumers.itertuples(index=False)],
            "ncu": ncu,
        },
        "gate": gate_doc,
        "ranks": None if ranks is None else {"base": sorted(ranks[0]), "new": sorted(ranks[1]),
                                              "per_rank": rank_table(ranks[0], ranks[1], metric)},
    }


def layer_timeline(activities: pd.DataFrame, layer: int, kind: str) -> pd.DataFrame:
    """The GPU activities of one layer in its median step (by span), for a timeline: ``stream``, ``name``,
    ``stage``, ``klass``, ``start_us`` (from the layer's first activity), ``dur_us``, the ``step`` chosen and its
    ``step_number`` (1 = the first decode step of the capture)."""
    rows = activities[(activities["layer"] == layer) & (activities["layer_kind"] == kind) & (activities["step"] >= 0)]
    columns = ["step", "step_number", "device", "stream", "name", "stage", "klass", "start_us", "dur_us"]
    if len(rows) == 0:
        return pd.DataFrame(columns=columns)
    spans = rows.groupby("step").agg(first=("start_ns", "min"), last=("end_ns", "max"))
    spans["span"] = spans["last"] - spans["first"]
    ordered = spans.sort_values(["span"], kind="stable")
    step = ordered.index[(len(ordered) - 1) // 2]
    chosen = rows[rows["step"] == step].sort_values("start_ns")
    first = chosen["start_ns"].min()
    return pd.DataFrame({
        "step": step, "step_number": int((sorted(activities.loc[activities["step"] >= 0, "step"].unique())).index(step)) + 1,
        "device": chosen["device"].to_numpy(), "stream": chosen["stream"].to_numpy(),
        "name": chosen["name"].astype(str).to_numpy(), "stage": chosen["stage"].replace("", "-").to_numpy(),
        "klass": chosen["klass"].to_numpy(), "start_us": (chosen["start_ns"] - first).to_numpy() / 1000.0,
        "dur_us": (chosen["end_ns"] - chosen["start_ns"]).to_numpy() / 1000.0,
    }, columns=columns)


def representative_layer(doc: dict) -> tuple[int, str] | None:
    """The first layer of the headline kind present on both sides, else the first layer on both sides."""
    both = [l for l in doc["layers"] if l["base_us"] is not None and l["new_us"] is not None]
    kind = doc["headline"]["kind"]
    for l in both:
        if l["kind"] == kind:
            return l["layer"], l["kind"] or ""
    return (both[0]["layer"], both[0]["kind"] or "") if both else None


