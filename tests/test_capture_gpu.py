"""GPU smoke test of `kprof capture`: CUPTI and torch.profiler captures of the decode slice's CUDA-graph replays, with
every kernel of a replayed step attributed to a layer and a stage."""
import os
import subprocess
import sys

import numpy as np
import pytest

from analyzers.attribution import attribute
from analyzers.layers import analyze, kernel_layers
from analyzers.trace import Trace
from profiler.recorders import CAPTURED_STEP

pytestmark = pytest.mark.gpu

STEPS = 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kprof_capture(output, profiler):
    command = [sys.executable, "-m", "profiler.cli", "capture", "--backend", "auto", "--tp", "16", "--batch", "1",
               "--layers", "2", "--steps", str(STEPS), "--profiler", profiler, "-o", str(output)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    return Trace.load(output)


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    directory = tmp_path_factory.mktemp("captures")
    return {p: kprof_capture(directory / f"{p}.kprof", p) for p in ("cupti", "torch")}


@pytest.mark.parametrize("profiler", ["cupti", "torch"])
def test_every_replayed_kernel_is_attributed_to_a_layer_and_stage(captures, profiler):
    trace = captures[profiler]
    kernels = kernel_layers(trace)
    # The source range of each kernel: a kernel outside every layer must have run outside layers, that is, directly
    # in the captured step (the step's input copies), not somewhere unmapped.
    source = attribute(trace)["range"].to_numpy()[(trace.kernels["kind"] == "kernel").to_numpy()]
    names = trace.ranges["name"].astype(str).to_numpy()
    kernels["source"] = np.where(source >= 0, names[np.maximum(source, 0)], "")
    stepped = kernels[kernels["step"] >= 0]
    assert len(stepped) > 0, "no kernel inside a decode_step"
    outside = stepped[stepped["layer"] < 0]
    assert (outside["source"] == CAPTURED_STEP).all(), outside.groupby(["source", "name"]).size().head(10)
    layered = stepped[stepped["layer"] >= 0]
    assert len(layered) > 0
    assert (layered["stage"] != "").all(), layered[layered["stage"] == ""]["name"].value_counts().head(10)
    assert analyze(trace)["unattributed_kernels"] == len(outside) + int((kernels["step"] < 0).sum())
    result = analyze(trace)
    assert result["steps"] == STEPS
    assert [l["layer"] for l in result["layers"]] == [1, 2]
    assert trace.meta["backend"] == "auto" and trace.meta["gpu"]
    assert trace.meta["config"]["tp"] == 16 and trace.meta["steps"] == STEPS


def test_cupti_capture_has_graph_nodes_and_nvtx_ranges(captures):
    trace = captures["cupti"]
    assert len(trace.graph_nodes) > 0
    assert (trace.kernels["graph_node_id"] >= 0).any()
    assert {"decode_step", "kprof:graph_capture"} <= set(trace.ranges["name"].astype(str))
    assert "recorder_errors" not in trace.meta


def test_cupti_and_torch_agree_on_kernels_per_layer(captures):
    counts = {p: {(l["layer"], s["name"]): s["kernels_per_step"] for l in analyze(t)["layers"] for s in l["stages"]}
              for p, t in captures.items()}
    assert counts["cupti"] == counts["torch"]
