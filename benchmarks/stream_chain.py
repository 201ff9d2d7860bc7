"""How close to the HBM floor can a decode layer's bytes come on this GPU, read in the layer's kernel structure?

A pure streaming read (each thread keeps `UNROLL` 16-byte loads in flight; no arithmetic but an XOR) stands in for
each kernel of a `latency_specialized` KDA + MoE layer, reading exactly that kernel's bytes, cold in L2 (buffer
copies rotate between replays). The chain is timed as one CUDA graph in four forms:

- `fused`: all of the layer's bytes in one kernel (one stream of loads, no kernel boundary);
- `serial`: one kernel per stage of the layer, each starting when the one before has ended;
- `pdl-wait`: the same under programmatic dependent launch, each kernel waiting for the one before at its start
  (the launch is hidden, the loads are not);
- `pdl-early`: each kernel issues all its loads before it waits (weights do not depend on the kernel before, only
  the activations do): the best a chain of these kernels can do;
- `pdl-firstN` (`--first N`): each CTA reads its first N x 32 KB (N x 8 loads per thread) before the wait, the rest
  after it: what a kernel that can hold that much of its weights until its input arrives could do. With
  `--w13-waits` the w13 stage waits first in both early forms (mode `...+w13w`): its weight addresses are the expert
  ids the kernel before writes. Under PDL every kernel lets the next one launch at its start, or with
  `--trigger wait` right after its own wait, as the `latency_specialized` kernels do (mode `...+tw`);
- `grid-wait`, `grid-firstN` (`--grid-first N`): the 8 stages as one kernel, one grid whose CTAs take tickets in the
  order they start; the first tickets run the first stage, the next ones the second, and so on. A CTA of a later
  stage reads its first N x 32 KB (none in `grid-wait`), then waits until every CTA of the stage before has counted
  itself done (an acquire poll on a global counter), then reads the rest. No kernel boundary, no launch: what a
  persistent layer kernel, whose stages hand over through counters instead of grid completion, could reach.
  `--w13-waits` applies as above. With `--handover flag` (mode `...+flag`) the waiters poll a flag that the stage's
  last CTA sets instead of the count itself, which every CTA of the stage adds to.

Medians of graph replays timed with CUDA events; % of floor = bytes / 4.3 TB/s over the time. Since the real kernels
also compute and wait on dependent loads, these are upper bounds on what the layer's kernels can reach.

    python benchmarks/stream_chain.py --tp 16 8 --batch 1 8 64 [--replays 100 --copies 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kimi_decode.bench import write_json  # noqa: E402
from kimi_decode.config import shard  # noqa: E402
from kimi_decode.kernels.cute_common import (HAVE_CUTE, compile_kernel, cute, cutlass, fake_like,  # noqa: E402
                                             launch, signature, sm_count)

HBM_BYTES_PER_S = 4.3e12
THREADS = 256
UNROLL = 8  # 16-byte loads in flight per thread: 32 KB per CTA
CTAS_PER_SM = 4
MODES = ("fused", "serial", "pdl-wait", "pdl-early")
TRIGGERS = ("start", "wait")
HANDOVERS = ("count", "flag")
LINE = 32  # int32 words per 128-byte line: each counter of the one-grid chain on a line of its own
# distinct experts the benchmark's router selects at layer 1 (from `kimi_decode.bench`'s weight bytes, both shards)
DISTINCT_SEEN = {1: 16, 8: 101, 64: 300}


def first_iters(mode: str) -> int | None:
    """N of a "pdl-firstN" mode (N > 0), else None."""
    n = mode[len("pdl-first"):] if mode.startswith("pdl-first") else ""
    return int(n) if n.isdigit() and int(n) > 0 else None


def plan(nbytes: int, sms: int) -> tuple[int, int]:
    """(CTAs, iterations) of a read of at least `nbytes`: each CTA iteration reads THREADS x UNROLL x 16 bytes; at
    most CTAS_PER_SM CTAs per SM, with as few iterations as cover the bytes."""
    per_cta_iter = THREADS * UNROLL * 16
    chunks = max(1, -(-nbytes // per_cta_iter))
    iters = max(1, -(-chunks // (sms * CTAS_PER_SM)))
    return -(-chunks // iters), iters


if HAVE_CUTE:
    from cutlass import Int32

    from kimi_decode.kernels.cute_common import load4

    @cute.jit
    def xor_reads(data: cute.Tensor, first, acc, ctas: int, start: int, stop: int):
        """The XOR into acc of this thread's vectors of iterations start..stop-1 of a read by `ctas` CTAs, the
        thread's first vector at `first` (UNROLL loads in flight per iteration)."""
        for it in cutlass.range(start, stop, unroll=1):
            base = first + it * (ctas * THREADS * UNROLL)
            vals = [load4(data[base + u * THREADS, None]) for u in range(UNROLL)]
            for v in vals:
                acc = acc ^ v[0] ^ v[1] ^ v[2] ^ v[3]
        return acc

    class StreamRead:
        """XOR of every 16-byte vector of `data` [vectors, 4] int32, one result per thread into `out`."""

        def __init__(self, ctas: int, iters: int, mode: str, trigger: str = "start"):
            self.ctas, self.iters, self.mode, self.trigger = ctas, iters, mode, trigger
            # "pdl-firstN": each CTA's first N iterations (N x 32 KB) before the wait, the rest after it
            self.early = min(iters, first_iters(mode) or 0)

        def wait(self):
            """The wait for the kernel before; with the "wait" trigger, then the next kernel's launch (a plain
            function, inlined)."""
            cute.arch.griddepcontrol_wait()
            if self.trigger == "wait":
                cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def iterations(self, data: cute.Tensor, first, acc, start: int, stop: int):
            """The XOR of this thread's vectors of iterations start..stop-1 into acc."""
            return xor_reads(data, first, acc, self.ctas, start, stop)

        @cute.jit
        def __call__(self, data: cute.Tensor, out: cute.Tensor, stream):
            self.kernel(data, out).launch(grid=[self.ctas, 1, 1], block=[THREADS, 1, 1], stream=stream,
                                          use_pdl=self.mode != "serial")

        @cute.kernel
        def kernel(self, data: cute.Tensor, out: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            if cutlass.const_expr(self.mode != "serial" and self.trigger == "start"):
                cute.arch.griddepcontrol_launch_dependents()
            if cutlass.const_expr(self.mode == "pdl-wait"):
                self.wait()
            first = bidx * (THREADS * UNROLL) + tidx
            acc = Int32(0)
            if cutlass.const_expr(self.early > 0):
                acc = self.iterations(data, first, acc, 0, self.early)
                self.wait()
                if cutlass.const_expr(self.early < self.iters):
                    acc = self.iterations(data, first, acc, self.early, self.iters)
            else:
                acc = self.iterations(data, first, acc, 0, self.iters)
                if cutlass.const_expr(self.mode == "pdl-early"):
                    self.wait()
            out[bidx * THREADS + tidx] = acc


if HAVE_CUTE:
    from cutlass._mlir.dialects import llvm

    from kimi_decode.kernels.cute_common import count_done, last_cta, take_ticket, wait_count

    def store_release(tensor: cute.Tensor, index: int, value: int) -> None:
        """tensor[index] = value (an int32 in global memory), a release store at gpu scope."""
        llvm.inline_asm(None, [(tensor.iterator + index).toint().ir_value(), Int32(value).ir_value()],
                        "st.release.gpu.global.u32 [$0], $1;", "l,r", has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)

    class TicketChain:
        """The stages' reads as one grid: `plans` [(ctas, iterations)] per stage, stage s's vectors at `offsets[s]`
        of `data` in StreamRead's order, `early[s]` iterations read before the wait (stage 0 waits for nothing).
        `counters` [counter_words(stages)] int32, 0 at launch, each on a 128-byte line of its own (LINE words
        apart): line 0 hands out the tickets, line 1 + s counts stage s's CTAs done and line 1 + stages + s is
        stage s's flag. `handover` "count": a CTA of stage s waits until stage s - 1's count reaches its CTAs;
        "flag": the last CTA of stage s - 1 to count itself (the count's old value says which) sets the flag, and
        the waiters poll the flag, a line no atomic writes to. The last CTA of the last stage sets every line back
        to 0, so the kernel replays in a CUDA graph as it is."""

        def __init__(self, plans: list[tuple[int, int]], early: list[int], handover: str = "count"):
            self.plans, self.early = plans, [min(e, it) for e, (_, it) in zip(early, plans)]
            self.handover = handover
            self.starts, self.offsets = [], []
            t = v = 0
            for ctas, iters in plans:
                self.starts.append(t)
                self.offsets.append(v)
                t += ctas
                v += ctas * iters * THREADS * UNROLL
            self.ctas, self.vectors = t, v

        @cute.jit
        def __call__(self, data: cute.Tensor, out: cute.Tensor, counters: cute.Tensor, stream):
            self.kernel(data, out, counters).launch(grid=[self.ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, data: cute.Tensor, out: cute.Tensor, counters: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            smem = cutlass.utils.SmemAllocator()
            slot = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            ticket = take_ticket(counters, slot, tidx)
            S = len(self.plans)
            flagged = self.handover == "flag"
            for s in cutlass.range_constexpr(S):
                ctas, iters = self.plans[s]
                if ticket >= self.starts[s]:
                    if ticket < self.starts[s] + ctas:
                        cta = ticket - self.starts[s]
                        first = self.offsets[s] + cta * (THREADS * UNROLL) + tidx
                        acc = Int32(0)
                        E = self.early[s] if s > 0 else iters
                        if cutlass.const_expr(E > 0):
                            acc = xor_reads(data, first, acc, ctas, 0, E)
                        if cutlass.const_expr(s > 0):
                            if cutlass.const_expr(flagged):
                                wait_count(counters, (1 + S + s - 1) * LINE, 1, tidx)
                            else:
                                wait_count(counters, s * LINE, self.plans[s - 1][0], tidx)
                        if cutlass.const_expr(E < iters):
                            acc = xor_reads(data, first, acc, ctas, E, iters)
                        out[ticket * THREADS + tidx] = acc
                        if cutlass.const_expr(s < S - 1 and not flagged):
                            count_done(counters, (s + 1) * LINE, tidx)
                        else:
                            if last_cta(counters, flag, tidx, ctas, (s + 1) * LINE) != 0:
                                if tidx == 0:
                                    if cutlass.const_expr(s < S - 1):
                                        store_release(counters, (1 + S + s) * LINE, 1)
                                    else:
                                        for i in cutlass.range_constexpr(2 * S + 1):
                                            counters[i * LINE] = Int32(0)


def counter_words(stages: int) -> int:
    """The int32 words a one-grid chain of `stages` stages counts in: tickets, counts and flags, a line each."""
    return (2 * stages + 1) * LINE


def compile_grid(data: torch.Tensor, out: torch.Tensor, counters: torch.Tensor, plans: list[tuple[int, int]],
                 early: list[int], handover: str = "count"):
    """The one-grid chain of `plans` (TicketChain), compiled once; `data` [vectors, 4] int32 holds every stage's
    vectors in order, `out` one int32 per thread of the grid, `counters` counter_words(stages) int32 zeros."""
    if handover not in HANDOVERS:
        raise ValueError(f"handover must be one of {HANDOVERS}, not {handover!r}")
    op = TicketChain(plans, early, handover)
    if (data.shape != (op.vectors, 4) or out.shape != (op.ctas * THREADS,)
            or counters.shape != (counter_words(len(plans)),)):
        raise ValueError("data must be [every stage's vectors, 4], out [grid threads] and counters "
                         "[counter_words(stages)]")
    return compile_kernel(("ticket_chain", tuple(plans), tuple(op.early), handover,
                           *signature(data, out, counters)), op, fake_like(data), fake_like(out), fake_like(counters))


def compile_read(data: torch.Tensor, out: torch.Tensor, ctas: int, iters: int, mode: str, trigger: str = "start"):
    """The read of `data` ([ctas x iters x THREADS x UNROLL, 4] int32) by `ctas` CTAs in `mode`, compiled once; under
    PDL each CTA lets the next kernel launch at its `trigger`: "start", or "wait" (right after its own wait, as the
    `latency_specialized` kernels do by default)."""
    if trigger not in TRIGGERS:
        raise ValueError(f"trigger must be one of {TRIGGERS}, not {trigger!r}")
    if mode not in MODES[1:] and first_iters(mode) is None:
        raise ValueError(f"mode must be one of {MODES[1:]} or pdl-firstN (N > 0), not {mode!r}")
    if data.shape != (ctas * iters * THREADS * UNROLL, 4) or out.shape != (ctas * THREADS,):
        raise ValueError("data must be [ctas * iters * THREADS * UNROLL, 4] and out [ctas * THREADS]")
    return compile_kernel(("stream_read", ctas, iters, mode, trigger, *signature(data, out)),
                          StreamRead(ctas, iters, mode, trigger), fake_like(data), fake_like(out))


def distinct_experts(batch: int, experts: int = 896, top_k: int = 16) -> int:
    """Distinct experts a batch reads: as the benchmark's routing selects them where seen, else the expectation under
    uniform routing."""
    if batch in DISTINCT_SEEN:
        return DISTINCT_SEEN[batch]
    return round(experts * (1 - (1 - top_k / experts) ** batch))


def stages(tp: int, batch: int, distinct: int | None = None) -> list[tuple[str, int]]:
    """The bytes each kernel of a `latency_specialized` KDA + MoE layer (layer 1: one completed block) must move at
    this shard and batch, reading `distinct` experts (default `distinct_experts`)."""
    s = shard("k3", tp=tp)
    m = s.model
    H, L = m.hidden, m.moe_latent
    inter, shared = s.expert_inter_used, s.shared_inter
    heads, dim = s.kda_heads, s.kda_dim
    candidates = 2 * batch * H * 4  # the completed block and the partial, fp32
    if distinct is None:
        distinct = distinct_experts(batch, m.num_experts, m.top_k)
    expert13 = 2 * inter * (L // 2 + L // 32)
    expert2 = L * (inter // 2 + inter // 32)
    return [
        ("attn_res", candidates + 2 * H * 4),
        ("in_proj", s.kda_in_proj_rows * H * 2),
        ("kda", 2 * batch * heads * 128 * 128 * 4 + dim * 128 * 2),
        ("o_proj+attn_res", H * dim * 2 + candidates + 2 * H * 4),
        ("entry", (m.num_experts + L + 2 * shared) * H * 2),
        ("w13", distinct * expert13),
        ("w2+shared_down", distinct * expert2 + H * shared * 2),
        ("tail", H * L * 2),
    ]


class Chain:
    """The stages' reads in one mode, `copies` buffer sets, one CUDA graph per set."""

    def __init__(self, sizes: list[int], mode: str, copies: int, sms: int, waits_first: tuple[int, ...] = (),
                 trigger: str = "start"):
        """`waits_first`: stages (by index) that wait for the one before at their start whatever `mode` says, as a
        kernel must whose weight addresses come from it (the w13 expert kernel: the expert ids)."""
        if mode == "fused":
            sizes = [sum(sizes)]
        self.bytes = 0
        self.graphs = []
        kernel_mode = "serial" if mode == "fused" else mode
        for _ in range(copies):
            reads = []
            for i, n in enumerate(sizes):
                ctas, iters = plan(n, sms)
                data = torch.randint(-2**31, 2**31 - 1, (ctas * iters * THREADS * UNROLL, 4), dtype=torch.int32,
                                     device="cuda")
                out = torch.empty(ctas * THREADS, dtype=torch.int32, device="cuda")
                m = "pdl-wait" if i in waits_first and kernel_mode != "serial" else kernel_mode
                reads.append((compile_read(data, out, ctas, iters, m, trigger), data, out))
            self.bytes = sum(d.numel() * 4 for _, d, _ in reads)
            for fn, data, out in reads:  # warm-up (and module load) outside the capture
                launch(fn, data, out)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for fn, data, out in reads:
                    launch(fn, data, out)
            self.graphs.append((g, reads))

    def time_us(self, replays: int, warmup: int = 5) -> float:
        for r in range(warmup):
            self.graphs[r % len(self.graphs)][0].replay()
        # the GPU busy while the replays are queued: each event pair then times the GPU's work, not the launches
        torch.cuda._sleep(100_000_000)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for r, (a, b) in enumerate(events):
            a.record()
            self.graphs[r % len(self.graphs)][0].replay()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) * 1e3 for a, b in events)


def expected_xor(data: torch.Tensor, plans: list[tuple[int, int]]) -> torch.Tensor:
    """What every thread of a one-grid chain (or of StreamRead, one stage) stores: the XOR of its stage's vectors
    that it reads, in ticket order."""
    outs, v = [], 0
    for ctas, iters in plans:
        n = ctas * iters * THREADS * UNROLL
        x = data[v:v + n].view(iters, ctas, UNROLL, THREADS, 4).permute(1, 3, 0, 2, 4).reshape(ctas, THREADS, -1)
        acc = torch.zeros(ctas, THREADS, dtype=data.dtype, device=data.device)
        for j in range(x.shape[-1]):
            acc ^= x[..., j]
        outs.append(acc.reshape(-1))
        v += n
    return torch.cat(outs)


class GridChain(Chain):
    """The stages' reads as one kernel (`TicketChain`), each CTA reading `early` iterations before its wait (0 for
    the stages in `waits_first`), `copies` buffer sets, one CUDA graph per set."""

    def __init__(self, sizes: list[int], early: int, copies: int, sms: int, waits_first: tuple[int, ...] = (),
                 handover: str = "count"):
        plans = [plan(n, sms) for n in sizes]
        per_stage = [0 if i in waits_first else early for i in range(len(sizes))]
        op = TicketChain(plans, per_stage, handover)  # the grid's size and vectors, the same for every copy
        self.graphs = []
        for _ in range(copies):
            data = torch.randint(-2**31, 2**31 - 1, (op.vectors, 4), dtype=torch.int32, device="cuda")
            out = torch.empty(op.ctas * THREADS, dtype=torch.int32, device="cuda")
            counters = torch.zeros(counter_words(len(plans)), dtype=torch.int32, device="cuda")
            fn = compile_grid(data, out, counters, plans, per_stage, handover)
            self.bytes = data.numel() * 4
            launch(fn, data, out, counters)  # warm-up (and module load) outside the capture
            torch.cuda.synchronize()
            if counters.any():
                raise RuntimeError("stream_chain: the one-grid chain left its counters set")
            if not torch.equal(out, expected_xor(data, plans)):
                raise RuntimeError("stream_chain: the one-grid chain's CTAs did not each read their stage's vectors")
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                launch(fn, data, out, counters)
            self.graphs.append((g, (data, out, counters)))


def row(tp: int, batch: int, what: str, mode: str, kernels: int, chain: Chain, replays: int) -> dict:
    """One table row: the chain timed, its bytes and their share of the floor."""
    us = chain.time_us(replays)
    return {"tp": tp, "batch": batch, "what": what, "mode": mode, "kernels": kernels, "bytes": chain.bytes,
            "us": round(us, 2), "pct_floor": round(100 * chain.bytes / HBM_BYTES_PER_S / (us * 1e-6), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[16, 8])
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--first", type=int, nargs="*", default=[],
                        help="also the chain with each CTA reading its first N x 32 KB before its wait (pdl-firstN)")
    parser.add_argument("--w13-waits", action="store_true",
                        help="in pdl-early / pdl-firstN, the w13 stage still waits first (its expert ids)")
    parser.add_argument("--grid-first", type=int, nargs="*", default=None, metavar="N",
                        help="also the chain as one grid handing over through counters: grid-wait, and grid-firstN "
                             "for each N given (no N: grid-wait only)")
    parser.add_argument("--handover", choices=HANDOVERS, nargs="+", default=["count"],
                        help="how a one-grid stage hands over: its CTAs' count, or a flag its last CTA sets (+flag)")
    parser.add_argument("--trigger", choices=TRIGGERS, default="start",
                        help="under PDL, each kernel lets the next launch at its start or after its wait (mode +tw)")
    parser.add_argument("--no-alone", dest="alone", action="store_false", help="skip timing each stage alone")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not HAVE_CUTE:
        print("stream_chain: needs a CUDA device and nvidia-cutlass-dsl", file=sys.stderr)
        return 2
    sms = sm_count()
    rows = []
    for tp in args.tp:
        for batch in args.batch:
            st = stages(tp, batch)
            sizes = [n for _, n in st]
            for name, n in st if args.alone else []:  # each stage alone: its own ceiling
                rows.append(row(tp, batch, name, "alone", 1, Chain([n], "serial", args.copies, sms), args.replays))
            names = [name for name, _ in st]
            for mode in [*args.modes, *(f"pdl-first{n}" for n in args.first)]:
                waits = (names.index("w13"),) if args.w13_waits and mode.startswith(("pdl-early", "pdl-first")) else ()
                tag = ("+w13w" if waits else "") + ("+tw" if args.trigger == "wait" and mode.startswith("pdl") else "")
                rows.append(row(tp, batch, "layer", mode + tag, 1 if mode == "fused" else len(sizes),
                                Chain(sizes, mode, args.copies, sms, waits_first=waits, trigger=args.trigger),
                                args.replays))
            grid = [] if args.grid_first is None else [0, *(n for n in args.grid_first if n > 0)]
            for n in grid:
                for how in args.handover:
                    waits = (names.index("w13"),) if args.w13_waits and n > 0 else ()
                    mode = (("grid-wait" if n == 0 else f"grid-first{n}") + ("+w13w" if waits else "")
                            + ("+flag" if how == "flag" else ""))
                    rows.append(row(tp, batch, "layer", mode, 1, GridChain(sizes, n, args.copies, sms, waits, how),
                                    args.replays))
            torch.cuda.empty_cache()
    print(f"{'tp':>3}{'batch':>6}  {'what':<16}{'mode':<16}{'kernels':>8}{'MB':>9}{'us':>9}{'% floor':>9}")
    for r in rows:
        print(f"{r['tp']:>3}{r['batch']:>6}  {r['what']:<16}{r['mode']:<16}{r['kernels']:>8}"
              f"{r['bytes'] / 1e6:>9.2f}{r['us']:>9.2f}{r['pct_floor']:>9.1f}")
    if args.json:
        return write_json(args.json, {"meta": {"device": torch.cuda.get_device_name(), "sms": sms,
                                               "threads": THREADS, "unroll": UNROLL}, "rows": rows}, "stream_chain")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
