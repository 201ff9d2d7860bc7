"""A decode slice: N consecutive K3 layers of one rank's shard, with their caches, run eagerly or as a CUDA graph.

This is the Python API that `kprof capture` and the benchmarks drive::

    s = DecodeSlice(backend="auto", tp=16, batch=1, first_layer=1, num_layers=4, context=8192, device="cuda")
    s.capture()          # warm-up, then one decode step recorded as a CUDA graph
    s.replay()           # one decode step: every layer reads the step's input and advances its state

Each step takes the residual state that arrives at `first_layer` (the AttnRes block summaries and partial sum of the
new token, a static input buffer the caller may refill between steps) and advances the KDA states and MLA caches.
With a torch.distributed `group` of more than one rank, the tensor-parallel reductions run with it; with none (or a
group of one) they are skipped.
"""
from __future__ import annotations

import torch

from .backends import get_backend
from .config import KDA, ShardConfig, shard as make_shard
from .instrument import DECODE_STEP, rng
from .model import decode_layer
from .state import init_kda_state, init_mla_cache, init_residual
from .streams import process_stream
from .weights import init_layer

MAX_BATCH = 64


def check_slice(shard: ShardConfig, batch: int, first_layer: int, num_layers: int) -> None:
    """ValueError unless a slice of `num_layers` layers from `first_layer`, decoding `batch` sequences, exists on
    `shard`'s model."""
    m = shard.model
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch {batch} is outside the supported 1..{MAX_BATCH} single-token sequences")
    if num_layers < 1 or first_layer < 0 or first_layer + num_layers > m.num_layers:
        raise ValueError(f"layers {first_layer}..{first_layer + num_layers - 1} are outside "
                         f"0..{m.num_layers - 1} of {m.name}")


class DecodeSlice:
    def __init__(self, backend: str = "auto", model: str = "k3", tp: int = 16, rank: int = 0, batch: int = 1,
                 first_layer: int = 1, num_layers: int = 4, context: int = 8192, seed: int = 0,
                 device: str | torch.device = "cuda", group=None, pad_experts: bool = True,
                 shard: ShardConfig | None = None):
        self.shard = shard or make_shard(model, tp=tp, rank=rank, pad_experts=pad_experts)
        check_slice(self.shard, batch, first_layer, num_layers)
        m = self.shard.model
        self.device = torch.device(device)
        self.batch, self.context, self.seed, self.group = batch, context, seed, group
        self.layer_ids = list(range(first_layer, first_layer + num_layers))
        self.backend = get_backend(backend)
        self.layers = [init_layer(self.shard, i, seed=seed, device=self.device) for i in self.layer_ids]
        self.states = [
            init_kda_state(self.shard, batch, i, seed=seed, device=self.device) if m.attention_kind(i) == KDA
            else init_mla_cache(self.shard, batch, i, context=context, seed=seed, device=self.device)
            for i in self.layer_ids
        ]
        self.input = init_residual(self.shard, batch, first_layer, seed=seed, device=self.device)
        self.res = self.input.clone()
        self.graph: torch.cuda.CUDAGraph | None = None

    @property
    def kinds(self) -> list[str]:
        return [lw.kind for lw in self.layers]

    def step(self, layers: int | None = None) -> None:
        """One decode step, eagerly: the residual input is copied in, then every layer runs in place; with `layers`,
        only the slice's first `layers` layers (0: the input copy alone), as the benchmark's in-step timing needs."""
        n = len(self.layers) if layers is None else layers
        if not 0 <= n <= len(self.layers):
            raise ValueError(f"a step of {n} layers: the slice has {len(self.layers)}")
        with rng(DECODE_STEP):
            self.res.blocks.copy_(self.input.blocks)
            self.res.partial.copy_(self.input.partial)
            self.res.partial_empty = self.input.partial_empty
            for lw, st in zip(self.layers[:n], self.states[:n]):
                decode_layer(self.backend, lw, self.res, st, self.shard, self.group)

    def capture(self, warmup: int = 2) -> torch.cuda.CUDAGraph:
        """Warm up (compiles kernels, sets up cuBLAS) on a side stream, then record one step as a CUDA graph."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA-graph capture needs a CUDA device")
        side = process_stream(self.device, "warmup")
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        self.graph = graph
        return graph

    def replay(self) -> None:
        """One decode step from the captured graph (eager when nothing was captured)."""
        if self.graph is None:
            self.step()
        else:
            with rng(DECODE_STEP):
                self.graph.replay()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.replay()

    def weight_bytes(self) -> int:
        return sum(lw.nbytes() for lw in self.layers)
