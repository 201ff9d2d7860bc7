"""The latency-specialized decode path (part 1): CuTe DSL kernels for KDA layers and the latent MoE block.

What it runs today, per stage (everything else is `auto` by construction, since this class only overrides):
- every bf16 projection of a KDA layer and of the MoE block at batch <= 64, by rows (TC_MIN_ROWS, TC_MAX_ROWS):
  at 1 row the small-batch CUDA-core GEMV (`kernels/gemv.py`); from 2 to 32 rows every projection, the plain ones
  and the MoE tail, on the warpgroup-mma projection (`kernels/gemm_wgmma.py`: wgmma over a multistage `cp.async`
  pipeline, K split over a cluster), but f_b, which up to 16 rows runs on the row-tile tensor-core projection
  (`kernels/gemm_tc_rows.py`: mma.sync over the tokens, a CTA's warps splitting the K of its 16 weight rows);
  above, the plain ones on cuBLAS as `auto`. The latent up-projection accumulates straight into the fp32 residual. A/B
  switches: `KIMI_DECODE_TC_MIN_ROWS` / `_MAX_ROWS` move the switch-overs, `KIMI_DECODE_TC_PLAIN=0` puts the plain
  projections on cuBLAS, `KIMI_DECODE_WGMMA=0` every projection on the row tiles up to 16 rows and on cuBLAS above
  ("1": the warpgroup mma above 16 rows up to 64, or names: only those projections; `KIMI_DECODE_WGMMA_MIN_ROWS`:
  from that many rows), `KIMI_DECODE_TC_FORM=split` the tensor-core ones on the split-K kernel
  (`kernels/gemm_tc.py`, the last CTA of each row group adding the splits and running the epilogue),
  `KIMI_DECODE_TC_ROWS_WARPS` caps the row tiles' warps per CTA;
- the shared experts: their SiTU-GLU in the gate/up projection's epilogue, at batch 1 the GEMV's and from 2 rows the
  warpgroup-mma projection's where that takes their gate/up (`KIMI_DECODE_SHARED_GLU=1`: batch 1 only; `0`: its own
  kernel). Where the shared rows are few (`moe_mxfp4.few_shared_rows`: TP16) they then run inside other kernels at
  batch 1, all launched under `routed_experts` (so `shared_experts` has no kernel there): the gate/up GEMV as a third
  part of the entry kernel (`moe_entry`), the down-projection in CTAs of their own in the w2 expert kernel
  (`MoEW2SumShared`); `KIMI_DECODE_SHARED_GLU_IN=w13` puts the gate/up in CTAs of the w13 expert kernel instead
  (`MoEW13ActShared`, measured slower). At TP8 (twice the shared rows) without PDL every placement inside measured
  slower than their own kernels on their own stream, which it keeps then; under PDL (below) they run inside at both
  shards, which keeps the layer on one stream (`KIMI_DECODE_SHARED_IN_EXPERTS=1` / `0`: always / never).
  With `KIMI_DECODE_SHARED_ONE_KERNEL=1` the two GEMVs are the two stages of one kernel (`kernels/shared_mlp.py`;
  off by default: slower, NOTES v12);
- the KDA core, at any batch up to 64: one fused kernel (conv, gate, beta, L2 norms, delta rule, gated RMSNorm;
  `kernels/kda_decode.py`, each head's state rows over 4 thread groups, 2 from 17 sequences, `KIMI_DECODE_KDA_SPLIT`;
  above batch 8 on the generic path's projections);
  up to batch 8 it also applies the decay gate's low-rank up-projection f_b, read from a column-major copy of f_b
  that the backend makes once per weight outside any capture (`_f_b_columns`; one GEMV kernel fewer;
  `KIMI_DECODE_FUSED_GATE=0`: the f_b GEMV as its own kernel, for A/B);
- routing: at batch 1 the router GEMV (split-K inside the CTA) whose last CTA takes the top-k and the weights
  (`kernels/router_topk.py`; `KIMI_DECODE_FUSED_ROUTER=0`: two kernels), and that inside one kernel with the latent
  down-projection (`kernels/moe_entry.py`: the router's CTAs first in the grid, then the down-projection's; the
  kernel launches under the `routed_experts` stage, where the down-projection belongs, so the `router` stage has no
  kernel of its own there; `KIMI_DECODE_MOE_ENTRY=0`: the two side by side on two streams); from 2 rows on
  (ROUTE_TOPK_MAX_ROWS: every batch the path takes) the router projection, then the same routing in a kernel of one
  CTA per row (`router_topk.route_topk`; on the H200 1-5 us faster per layer than the generic path's Triton top-k,
  whose end the expert kernels wait for, up to 32 rows, even at 64; `KIMI_DECODE_CUTE_TOPK=0` / `16`: the Triton
  kernel above 1 / 16 rows, for A/B); the projections that go to cuBLAS (above 32 rows by default) through torch's
  cuBLASLt path (`KIMI_DECODE_CUBLAS_LIB`, `blas_library`);
- the routed experts, at any batch up to 64: two MXFP4 tensor-core kernels that read only the selected experts'
  unpadded rows; per (token, expert) pair below `grouped_from` (batch 9 at TP16, 8 at TP8 and wider slices), the
  second one doing the weighted sum over experts in registers and reading its weights in chunks of 2 or 4 MX
  groups (`KIMI_DECODE_W2_CHUNK=1`: a word per load), the first one with each warp's activation operands made
  once in shared memory (`KIMI_DECODE_W13_X_ONCE=0`: by every lane) (`kernels/moe_mxfp4.py`; with
  `KIMI_DECODE_EXPERTS_ONE_KERNEL=1` both as the two stages of one kernel whose w2 CTAs load their weights and
  then wait for their token's activations, `MoEExperts`. Off by default: with it and the shared experts' one
  kernel, a KDA layer at batch 1 is 8 kernels but 12 us slower on the H200, since CTAs that wait hold SM slots
  the kernels beside them need; benchmarks/NOTES.md, v12); from there the pairs are counted into place by expert
  by a CuTe kernel that also writes the latent as the w13 kernel's fp16 operands (`kernels/moe_align.py`;
  `KIMI_DECODE_GROUPED_ALIGN=0`: the generic path's Triton sort, the w13 kernel converting the bf16 latent itself)
  and each selected expert is read once for up to 8 of its pairs at a time (`kernels/moe_mxfp4_grouped.py`; the
  w2 kernel's CTAs each loop over a share of the segments, each segment's first pairs loaded during the one
  before, `KIMI_DECODE_W2_AHEAD`, `KIMI_DECODE_GROUPED_SEG_CTAS`, and from 512 pairs on the w13 kernel's CTA rows
  take up to two segments each, `KIMI_DECODE_W13_SEG_DIV`; both copy their weights into shared memory with
  `cp.async`, w13 its whole tile at once, w2 the next segment's rows during the current one where they are whole
  quads of groups, `KIMI_DECODE_GROUPED_STAGE`); all of them read copies of the expert codes in quad-major
  order (`moe_mxfp4.quad_major`, made once per weight outside any capture, `_expert_codes`), where each lane's
  words of a load are side by side and no words are exchanged between lanes (`KIMI_DECODE_QUAD_MAJOR=0`: the
  natural rows, for A/B), w2's without a padded shard's zero columns (`KIMI_DECODE_W2_COMPACT=0`: as stored), and
  each byte's two codes moved where a dequantisation of 9 instructions per word reads them instead of 11
  (`KIMI_DECODE_MX_PACKED=0`: as stored);
- the MoE tail, up to TC_MAX_ROWS rows (16; `KIMI_DECODE_TC_MAX_ROWS` moves it) on the tensor-core projection: with
  the per-pair experts one projection over bf16(routed sum x norm weight), which the w2 expert kernel writes beside
  the partial sums of squares, applying each row's 1/rms and adding the shared experts' output into the residual in
  its epilogue; with the grouped experts (`KIMI_DECODE_GROUPED_FROM` at or below TC_MAX_ROWS) one kernel that adds
  each token's k per-pair outputs and normalises them (`rmsnorm.routed_norm`; `KIMI_DECODE_ROUTED_NORM=0`: the
  routed sum reduced first), then the projection, which adds the result and the shared output into the residual;
  with a cross-rank all-reduce of the routed sum in between, the RMSNorm as its own kernel (`kernels/rmsnorm.py`)
  before the projection. Above TC_MAX_ROWS rows, whatever the routed output's form (per-pair outputs, a routed sum,
  an all-reduced one), `routed_norm` sums, normalises and adds the shared output into the residual, and one cuBLAS
  GEMM accumulates the up-projection into it (2 kernels where the generic tail has 6); `KIMI_DECODE_PAIRS_BF16=1`:
  the grouped experts' per-pair outputs in bf16 (off: 1-2 us per layer for one more rounding, NOTES item 46);
- the MoE block's fork: the router and the shared experts read only the AttnRes output, so where they are not
  inside other kernels (above) they run on streams of their own beside the latent down-projection (a fork and join
  in the CUDA graph); the experts wait for the router branch, the tail for the shared one. `KIMI_DECODE_OVERLAP=0`
  runs them in order on one stream (for A/B timing). From SHARED_AFTER_MIN_ROWS rows (2: wherever it forks) the
  shared branch's kernels start only once the latent down-projection is done, beside the expert kernels
  (`KIMI_DECODE_SHARED_AFTER=0`: at the fork; `latent`: from 2 rows, whatever the constant); the router
  projection on the row tiles (`KIMI_DECODE_WGMMA=0`) takes CTAs of ROUTER_WARPS warps (`KIMI_DECODE_ROUTER_WARPS`,
  0: the row tiles' own plan);
- L2 prefetch, off by default because it measured slower (`KIMI_DECODE_PREFETCH_MB=N` turns it on; batch <= 8,
  `kernels/prefetch.py`, the `prefetch` stage): beside the KDA core, the first N MB of the latent down-projection's
  weights, and beside the expert kernels, the first N MB of the up-projection's, on a stream of their own (it needs
  the fork).
- the KDA output projection at batch 1 inside the AttnRes kernel after it (`kernels/oproj_attn_res.py`: the
  projection's CTAs, each also doing the AttnRes step's per-element part for its rows, then the last one the
  softmax and the mix (`KIMI_DECODE_OPROJ_RES=last`: all of the step in the last CTA); the kernel launches under the
  `attn_res` stage, so the `o_proj` stage has no kernel of its own there; `KIMI_DECODE_FUSED_O_RES=0`: two kernels);
- AttnRes (both calls of every layer, KDA and MLA, any batch): one CTA per sequence that reads each candidate once
  and reduces all its sums in one block reduction (`kernels/attn_res.py`); `KIMI_DECODE_CUTE_ATTN_RES=0` runs the
  generic path's Triton kernel instead (for A/B timing).
- programmatic dependent launch at batch 1 (`PDL_MAX_ROWS`; `kernels/cute_common.py`, `KIMI_DECODE_PDL=0` / `1`:
  never / at every batch): each CuTe kernel launches while the one before it finishes (`KIMI_DECODE_PDL_SKIP`
  names those that do not), waits for that one's results and then lets the next launch; the KDA kernel loads its
  state and weights, the w2 expert kernel its weight words (`KIMI_DECODE_W2_EARLY`, at one token: above, the
  registers this takes cost more) and the output projection its first rows (`KIMI_DECODE_OPROJ_EARLY`) before the
  wait, and the GEMVs copy their first weight slices into shared memory before it (`KIMI_DECODE_GEMV_PRELOAD`). At
  one token on a grid past one wave (TP8) the w13 kernel splits K over 4 warps instead of 7
  (`KIMI_DECODE_W13_WARPS`), and each warp loads all of its 7 weight quads before its activations' staging
  (`KIMI_DECODE_W13_FIRST`: auto; "0" none, "1".."4" the first quads, "all"); `KIMI_DECODE_GROUPED_FROM` sets the
  batch from which the experts run grouped (A/B).
It falls back to `auto`, logging the reason once per reason: MLA layers (attention), everything but AttnRes at
batches over 64, no CUDA device or no cutlass-dsl.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..config import KDA, ShardConfig
from ..instrument import rng
from ..kernels import cute_common, gemm_tc_rows
from ..kernels.shared_mlp import COUNTERS as SHARED_COUNTERS
from ..state import KDAState, ResidualState
from ..streams import process_stream
from ..weights import KDAWeights, MoEWeights
from .auto import BF16, AutoBackend

log = logging.getLogger(__name__)

GEMV_MAX_ROWS = 8  # the per-(token, expert) expert kernels and the fused MoE-tail norm at most up to here


GROUPED_AT_8_INTER = 384  # expert slices of at least this many stored rows run grouped from batch 8


def grouped_from(inter: int = 0) -> int:
    """The batch from which the routed experts run grouped by expert (`moe_mxfp4_grouped`) instead of per (token,
    expert) pair, for expert slices of `inter` stored rows: by default GEMV_MAX_ROWS where `inter` is at least
    GROUPED_AT_8_INTER (TP8: 4.3 us faster per layer at batch 8 on the H200, but 5.8 slower at batch 4), else
    GEMV_MAX_ROWS + 1 (TP16's 256 rows: 3.1 us slower grouped at batch 8; benchmarks/NOTES.md item 48).
    KIMI_DECODE_GROUPED_FROM, 2..EXPERT_MAX_ROWS + 1 (EXPERT_MAX_ROWS + 1: never), sets it for every shard, for
    A/B runs."""
    default = GEMV_MAX_ROWS if inter >= GROUPED_AT_8_INTER else GEMV_MAX_ROWS + 1
    return cute_common.env_int("KIMI_DECODE_GROUPED_FROM", default, 2, EXPERT_MAX_ROWS + 1, "a batch")


GROUPED_ALIGN = ("1", "align", "0")


def grouped_align() -> str:
    """How the grouped experts' pairs are sorted, KIMI_DECODE_GROUPED_ALIGN: "1" (the default) by the CuTe counting
    kernel (`kernels/moe_align.py`), whose other CTAs also write the latent as the w13 kernel's fp16 operands;
    "align" that kernel without the operands; "0" by the generic path's Triton sort, the w13 kernel converting the
    bf16 latent itself. "1" measured fastest on the H200: 3.5-14 us per layer at batches 16 and 64
    (benchmarks/NOTES.md, item 35)."""
    return cute_common.env_choice("KIMI_DECODE_GROUPED_ALIGN", "1", GROUPED_ALIGN)


def routed_norm_on() -> bool:
    """KIMI_DECODE_ROUTED_NORM ("1", the default, or "0"): whether the MoE tail after the grouped experts sums their
    per-pair outputs inside its RMSNorm kernel (`rmsnorm.routed_norm`); "0" keeps the reduce-then-norm tail, for
    A/B runs."""
    return cute_common.env_flag("KIMI_DECODE_ROUTED_NORM", "1")


TC_FORMS = ("rows", "split")


def tc_form() -> str:
    """KIMI_DECODE_TC_FORM: which tensor-core projection runs from TC_MIN_ROWS to TC_MAX_ROWS rows: "rows" (the
    default, `kernels/gemm_tc_rows.py` up to its 16 rows: 3.2-10.9 us faster per KDA + MoE layer at 2 to 16 rows on
    the H200, benchmarks/NOTES.md item 47) or "split" (the split-K GEMM of `kernels/gemm_tc.py`, for A/B runs)."""
    return cute_common.env_choice("KIMI_DECODE_TC_FORM", "rows", TC_FORMS)


# the projections KIMI_DECODE_WGMMA may put on the warpgroup-mma projection, up to 64 rows (the latent up-projection:
# the MoE tail, the routed sum's 1/rms, residual accumulate and shared-expert add in its epilogue)
WGMMA_PROJECTIONS = ("in_proj", "f_b", "o_proj", "router", "latent_down", "latent_up", "shared_gate_up", "shared_down")
# KIMI_DECODE_WGMMA=auto (the default): all of them from WGMMA_AUTO_MIN_ROWS to WGMMA_AUTO_ROWS rows, f_b only above
# the row tiles' TC_MAX_ROWS. On the H100 (KDA + MoE layers, NOTES items 114-116): against cuBLASLt 7.4 us faster per
# TP16 layer at 32 rows (227.2 against 234.6), 3.7 slower at 64 (285.3 against 281.6); against the row tiles 3-5
# faster at 16 rows and 1.7-3.7 at 12; at 2, 4 and 8 0.5-2 slower with the shared experts at the fork (their
# clusters beside the latent down-projection's CTAs), but with them after the latent (SHARED_AFTER_MIN_ROWS) 1.7-2.5
# us faster at TP16 and 0.5-10.0 at TP8 than the row tiles there (item 116); f_b (K 128) 0.4-0.5 us slower on it
WGMMA_AUTO_ROWS = 32
WGMMA_AUTO_MIN_ROWS = 2
WGMMA_AUTO_BELOW = tuple(n for n in WGMMA_PROJECTIONS if n != "f_b")


class WgmmaSetting(NamedTuple):
    """Where the warpgroup-mma projection runs: `names` from `min_rows` to `max_rows` rows, those of `below` also
    at or below the row tiles' last row (instead of the row tiles)."""
    names: frozenset
    below: frozenset
    min_rows: int
    max_rows: int


def wgmma_setting(tc_max_rows: int | None = None) -> WgmmaSetting:
    """KIMI_DECODE_WGMMA: which projections run on the warpgroup-mma projection instead of cuBLAS (above
    `tc_max_rows`, the row tiles' last row: TC_MAX_ROWS) or the row tiles (at or below it, from
    KIMI_DECODE_WGMMA_MIN_ROWS rows): "auto" (the default) all of WGMMA_PROJECTIONS from WGMMA_AUTO_MIN_ROWS (or
    `tc_max_rows` + 1 if less) to WGMMA_AUTO_ROWS rows, f_b only above `tc_max_rows`; "0" none, "1" all up to the
    kernel's 64, or some of them by name, comma-separated, up to 64 (those two from `tc_max_rows` + 1 unless
    KIMI_DECODE_WGMMA_MIN_ROWS says from fewer rows)."""
    from ..kernels.gemm_wgmma import MAX_ROWS

    tc_max_rows = TC_MAX_ROWS if tc_max_rows is None else tc_max_rows
    raw = os.environ.get("KIMI_DECODE_WGMMA", "auto")
    if raw == "auto":
        names, below, most = WGMMA_PROJECTIONS, WGMMA_AUTO_BELOW, WGMMA_AUTO_ROWS
        least = min(WGMMA_AUTO_MIN_ROWS, tc_max_rows + 1)
    elif raw in ("0", "1"):
        names = below = WGMMA_PROJECTIONS if raw == "1" else ()
        least, most = tc_max_rows + 1, MAX_ROWS
    else:
        names = below = tuple(n.strip() for n in raw.split(","))
        if not set(names) <= set(WGMMA_PROJECTIONS):
            raise ValueError(f"KIMI_DECODE_WGMMA must be auto, 0, 1 or some of {','.join(WGMMA_PROJECTIONS)}, "
                             f"not {raw!r}")
        least, most = tc_max_rows + 1, MAX_ROWS
    if "KIMI_DECODE_WGMMA_MIN_ROWS" in os.environ:
        least = cute_common.env_int("KIMI_DECODE_WGMMA_MIN_ROWS", 0, 2, MAX_ROWS + 1, "rows")
    return WgmmaSetting(frozenset(names), frozenset(below), least, most)


def pairs_bf16() -> bool:
    """KIMI_DECODE_PAIRS_BF16 ("0", the default, or "1"): whether the grouped w2 kernel writes its per-pair outputs
    for the MoE tail's norm kernel in bf16 (half the bytes written and read back; each pair's output rounded once
    before the sum, as vLLM's fused MoE rounds its per-expert outputs) instead of fp32. Not with the split norm,
    which takes fp32. Off by default: on the H200 it took 1.3-1.6 us off the norm kernel at batch 64 and 1-2 us off a
    layer at batches 16 and 64 (benchmarks/NOTES.md, item 46), not worth the extra rounding."""
    return cute_common.env_flag("KIMI_DECODE_PAIRS_BF16", "0")


def routed_norm_split() -> bool:
    """KIMI_DECODE_ROUTED_NORM_SPLIT ("0", the default, or "1"): whether that norm kernel spreads each token over
    `rmsnorm.split_ctas` CTAs that copy the pair rows into shared memory, all of a thread's in flight at once
    (`rmsnorm.RoutedNormSplit`), instead of one CTA of 1024 threads per token, whose loads ptxas keeps one or two in
    flight at a time (benchmarks/NOTES.md, item 43)."""
    return cute_common.env_flag("KIMI_DECODE_ROUTED_NORM_SPLIT", "0")


def prefetch_mb() -> float:
    """KIMI_DECODE_PREFETCH_MB: MB of the next projection's weights asked of L2 (default PREFETCH_MB: none)."""
    raw = os.environ.get("KIMI_DECODE_PREFETCH_MB", str(PREFETCH_MB))
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not 0 <= mb < 1024:
        raise ValueError(f"KIMI_DECODE_PREFETCH_MB must be a number of MB in 0..1024, not {raw!r}")
    return mb


# bf16 x bf16 -> fp32 accumulated into an fp32 C by one cuBLAS GEMM (torch's `addmm(..., out_dtype=)`, torch 2.9+)
_ADDMM_FP32_OUT = "out_dtype" in (torch.addmm.__doc__ or "")

FAST_MAX_ROWS = 64  # the decode path's largest batch: the CuTe projections and the rest of this class up to here
# Projections by rows: below TC_MIN_ROWS the CUDA-core GEMV; from there up to TC_MAX_ROWS every projection (the plain
# ones, and the MoE tail with its RMSNorm scale, residual accumulate and shared-expert add in the epilogue) on the
# row-tile tensor-core projection (`kernels/gemm_tc_rows.py`): 3.2-10.9 us faster per KDA + MoE layer at 2 to 16
# rows on the H200 than the split-K kernel for the tail and cuBLAS for the rest (NOTES item 47, "v29"); above, up to
# WGMMA_AUTO_ROWS the warpgroup-mma projection, then cuBLAS, and the MoE tail as the routed norm + one cuBLAS GEMM
# (the routed norm before the warpgroup-mma one too). KIMI_DECODE_TC_PLAIN=0 puts the plain projections
# back on cuBLAS from TC_MIN_ROWS, KIMI_DECODE_TC_FORM=split the tensor-core ones on `gemm_tc.py` (A/B).
TC_MIN_ROWS = 2
TC_MAX_ROWS = 16
# L2 prefetch per streaming projection, in MB: off by default, since on the H200 12 / 24 / 40 MB made the TP16 batch-1
# KDA layer 1.1 / 3.3 / 5.9 us slower (benchmarks/NOTES.md, v6); KIMI_DECODE_PREFETCH_MB turns it on
PREFETCH_MB = 0
# the shared experts' SiTU-GLU in the gate/up GEMV's epilogue only at batch 1: it saves a kernel and 0.3-0.5 us there,
# and costs 1.4 us at batch 4 and 2-8 us at batch 8 (two weight rows per warp, half the warps; NOTES, v6)
GLU_MAX_ROWS = 1
# from 2 rows, in the warpgroup-mma gate/up projection's epilogue too ("all": one kernel fewer per layer from 2 to 32
# rows; on the H100 within -3.5 / +1.1 us per KDA layer of "1" over two paired runs at batches 8-32 and one at 2-4,
# 0.2-0.9 faster on the mean at each shard: NOTES item 118)
SHARED_GLU = "all"
# the router GEMV and the top-k in one kernel (its last CTA routes the rows one after another, ~4 us each): batch 1
ROUTER_FUSED_MAX_ROWS = 1
# above it, the routing in a kernel of its own with one CTA per row (`route_topk`) at every batch the path takes:
# at 2-16 rows 1-2 us per layer faster than the generic path's Triton top-k (benchmarks/NOTES.md item 49); above 16,
# since the latent down-projection runs on cuBLASLt without a split of K (item 63), 2.5-5.6 us faster at 32 rows and
# even at 64 (item 64; beside the split-K form, v31, it was 6 us slower at TP16 batch 64). KIMI_DECODE_CUTE_TOPK=16
# keeps the Triton kernel above 16 rows, "0" above batch 1 (A/B).
ROUTE_TOPK_MAX_ROWS = FAST_MAX_ROWS
ROUTE_TOPK_ROWS = {"1": ROUTE_TOPK_MAX_ROWS, "16": 16, "0": 0}  # KIMI_DECODE_CUTE_TOPK -> the most rows it routes
# programmatic dependent launch (cute_common, KIMI_DECODE_PDL=auto) up to here: at batch 1 on the H200 the TP16
# layer 94.0 -> 91.7 us, and the TP8 one on one stream in 8 kernels at 119.0 us (120.4 forked without it); at batch 8
# it measured slower (TP8 274.1 against 238.4 us; NOTES, v14)
PDL_MAX_ROWS = 1
# where the MoE block forks, the shared experts start once the latent down-projection is done from here on
# (KIMI_DECODE_SHARED_AFTER=auto): at 64 rows 3.9 / 4.7 us faster per layer at TP16 / TP8 on the H200, beside the
# grouped expert kernels (ALU-bound; benchmarks/NOTES.md item 51); with the projections on the warpgroup mma, at 12
# and 16 rows 1.7-5.1 us faster per KDA layer on the H100, and from 2 rows it lets the kernel take the MoE entry's
# projections too (item 116; on the row tiles it measured 3-5 us slower at TP8 batch 16, item 51)
SHARED_AFTER_MIN_ROWS = 2
# the router projection's warps per row-tile CTA (KIMI_DECODE_ROUTER_WARPS; the other projections take at most
# gemm_tc_rows.DEFAULT_WARPS): 2.0-2.8 us faster per layer at 2 and 8 rows at TP16 and 2.2 at TP8 batch 2, even at
# 16 rows (benchmarks/NOTES.md item 51)
ROUTER_WARPS = 16
# torch's library for the cuBLAS projections above TC_MAX_ROWS (KIMI_DECODE_CUBLAS_LIB): "cublaslt", the default
# (`torch.backends.cuda.preferred_blas_library`, set around each such GEMM and restored after, so the rest of the
# process, `auto` included, keeps its own), or "cublas" (torch's default library, for A/B). Alone at 64 rows on the
# H200 cuBLASLt picks tiles without a split of K for the TP16 input projection and the latent down-projection (19.2
# -> 16.2 us and 21.2 -> 17.1 us; benchmarks/NOTES.md item 62), the rest within 1.2 us; in the layer at 64 rows
# 1-4.5 us faster per KDA layer at both shards, even at 32 (items 63, 64).
CUBLAS_LIBS = ("cublaslt", "cublas")


def cublas_library() -> str:
    """KIMI_DECODE_CUBLAS_LIB: which of CUBLAS_LIBS runs the projections that go to cuBLAS (default the first)."""
    return cute_common.env_choice("KIMI_DECODE_CUBLAS_LIB", CUBLAS_LIBS[0], CUBLAS_LIBS)


@contextlib.contextmanager
def blas_library(name: str):
    """The GEMMs launched inside run on torch's `name` path (`torch.backends.cuda.preferred_blas_library`); the
    setting before is restored on the way out, error or not."""
    if name == "cublas":
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


EXPERT_MAX_ROWS = 64  # the MXFP4 expert kernels work per (token, expert) pair: any batch the decode path takes
KDA_MAX_ROWS = 64  # the fused KDA kernel works per (head, sequence): any batch the decode path takes
_said: set[str] = set()  # fallback reasons already logged in this process
BRANCHES = ("router", "shared", "prefetch")  # the stages that may run on a stream of their own
COUNTERS = ("router", "o_proj")  # kernels whose last CTA finishes the stage, each with a counter of its own
# the tensor-core projection's counters (one per row group), one set per stream it may run on at the same time
TC_COUNTERS = 1024
# the two-stage expert kernel's counters: ticket, finished w2 CTAs, finished w13 CTAs per token
EXPERT_COUNTERS = 2 + GEMV_MAX_ROWS


class LatencySpecializedBackend(AutoBackend):
    name = "latency_specialized"

    def __init__(self, poison: bool = False):
        super().__init__(poison)
        self._attn_fast = False
        self._kda_fast = False
        self._mlp_fast = False
        self._fused_norm = False
        self._pairs_to_tail = False
        self._norm_split = False  # `routed_norm_split()` as read when the layer began
        self._pairs_bf16 = False  # this layer's grouped experts write bf16 per-pair outputs for the tail (`pairs_bf16`)
        self._grouped_from = GEMV_MAX_ROWS + 1  # `grouped_from()` as read when the layer began
        self._blas_lib = "cublas"  # `cublas_library()` as read when the layer began
        self._res_fast = False
        self._experts_fast = False
        self._cute_attn_res = cute_common.env_flag("KIMI_DECODE_CUTE_ATTN_RES", "1")
        self._overlap_on = cute_common.env_flag("KIMI_DECODE_OVERLAP", "1")
        self._prefetch_bytes = int(prefetch_mb() * 2**20)
        self._lw = None
        # the shared experts' SiTU-GLU in the gate/up GEMV's epilogue at batch 1 ("1"), also in the warpgroup-mma
        # projection's from 2 rows ("all", `_wgmma_glu`), or as a kernel of its own at every batch ("0")
        glu = cute_common.env_choice("KIMI_DECODE_SHARED_GLU", SHARED_GLU, ("1", "all", "0"))
        self._shared_glu, self._shared_glu_wgmma = glu != "0", glu == "all"
        # f_b inside the KDA kernel, from a column-major copy (row-major it was 2.4-3.3 us slower: NOTES, v7)
        self._fused_gate = cute_common.env_flag("KIMI_DECODE_FUSED_GATE", "1")
        # layout -> weight -> its copy in that layout, kept while the weight lives (`_copy_of`); keyed weakly by
        # identity, with no reference back to the backend, so that the copies go with the backend or the weight
        # without waiting for the cycle collector
        self._copies: dict[str, WeakIdKeyDictionary] = {}
        # the expert kernels' MXFP4 codes in quad-major order (`moe_mxfp4.quad_major`: no word exchange between
        # lanes); KIMI_DECODE_QUAD_MAJOR=0 reads the natural rows, for A/B
        self._quad_major_on = cute_common.env_flag("KIMI_DECODE_QUAD_MAJOR", "1")
        # that copy of w2 without the zero columns a padded shard stores past the used ones (TP16: 128-byte rows of
        # which 96 are used; measured 2.4 / 6.6 us faster per layer at batch 16 / 64, benchmarks/NOTES.md item 38);
        # KIMI_DECODE_W2_COMPACT=0 keeps the stored width, for A/B
        self._w2_compact = cute_common.env_flag("KIMI_DECODE_W2_COMPACT", "1")
        self._overlap = False  # this layer forks the router and the shared experts off the main stream
        self._fused_router = cute_common.env_flag("KIMI_DECODE_FUSED_ROUTER", "1")  # 0: GEMV + top-k (A/B)
        # the most rows `route_topk` routes, the generic path's Triton top-k above (`ROUTE_TOPK_ROWS`)
        self._topk_rows = ROUTE_TOPK_ROWS[cute_common.env_choice("KIMI_DECODE_CUTE_TOPK", "1", tuple(ROUTE_TOPK_ROWS))]
        # "latent": where the MoE block forks, the shared experts start only once the latent down-projection is
        # done, so that their weights (TP16 16.5 MB, TP8 33 MB) stream beside the expert kernels instead of beside
        # the router and the latent, which the experts wait for; "0": at the fork; "auto" (default): "latent" from
        # SHARED_AFTER_MIN_ROWS rows
        self._shared_after = cute_common.env_choice("KIMI_DECODE_SHARED_AFTER", "auto", ("auto", "0", "latent"))
        self._deferred_shared = None  # (x, weights, out) of those, until the latent down-projection
        # the most warps per CTA of the router projection on the row tiles (2..16 rows; 0: the row tiles' own plan,
        # KIMI_DECODE_TC_ROWS_WARPS): its 56 CTAs stream beside the latent down-projection's 224, and with a larger
        # share of the bytes in flight they end sooner (TP16 batch 8: 8 warps 18 us for 12.8 MB, 7 us alone), so the
        # routing after them, which the experts wait for, starts sooner
        self._router_warps = cute_common.env_int("KIMI_DECODE_ROUTER_WARPS", ROUTER_WARPS, 0, gemm_tc_rows.MAX_WARPS,
                                                 "warps per CTA") or None
        # 0: the router and the latent down-projection as two kernels on two streams (A/B)
        self._moe_entry_on = cute_common.env_flag("KIMI_DECODE_MOE_ENTRY", "1")
        self._moe_entry = False  # this layer's router runs inside the latent down-projection's kernel
        # 1: the per-pair expert kernels as one two-stage kernel, and the shared experts at batch 1 too; off by
        # default: 8 kernels per KDA layer at batch 1 that way, but 3 / 9 us slower at TP16 (NOTES, v12)
        self._experts_one_on = cute_common.env_flag("KIMI_DECODE_EXPERTS_ONE_KERNEL", "0")
        self._shared_one_on = cute_common.env_flag("KIMI_DECODE_SHARED_ONE_KERNEL", "0")
        # at batch 1 the shared experts inside other kernels where their rows are few (TP16: 8 kernels per KDA layer
        # and 0.8 us faster than on their own stream; at TP8 without PDL 1.2-3.4 us slower: NOTES, v13), and with
        # PDL (TP8: 119.0 us against 120.4 forked without it, NOTES v14); KIMI_DECODE_SHARED_IN_EXPERTS=1 / 0:
        # always / never (A/B)
        self._shared_riders_on = cute_common.env_choice("KIMI_DECODE_SHARED_IN_EXPERTS", "auto", ("auto", "0", "1"))
        self._shared_riders = False  # this layer's shared experts run inside the expert kernels
        # where their gate/up GEMV goes then: "entry" (the router's and latent down-projection's kernel; TP16 batch 1
        # 94.4 us on the H200) or "w13" (CTAs in the w13 expert kernel, 96.1 us); NOTES, v13
        self._glu_in_entry = cute_common.env_choice("KIMI_DECODE_SHARED_GLU_IN", "entry", ("entry", "w13")) == "entry"
        # 1: the entry kernel's down-projection CTAs also ask L2 for the selected experts' w13 rows once the router
        # has chosen them (`moe_entry`'s prefetch), for the w13 kernel after it; off: 0.6-1.8 us slower (NOTES, item 41)
        self._entry_prefetch = cute_common.env_flag("KIMI_DECODE_ENTRY_PREFETCH", "0")
        self._pending_shared = None  # (gate_up, x, act, down, out) of those, until routed_experts
        self._pending_route = None  # (x, logits, ids, weights) of that router, until routed_experts
        # 0: the output projection and the AttnRes after it as two kernels (A/B)
        self._fused_o_res_on = cute_common.env_flag("KIMI_DECODE_FUSED_O_RES", "1")
        self._fuse_o_res = False  # this layer's output projection runs inside the AttnRes kernel after it
        self._pending_o = None  # (o, W, a) of that projection, a its output, until the AttnRes call
        self._tc_rows = (cute_common.env_int("KIMI_DECODE_TC_MIN_ROWS", TC_MIN_ROWS, 1, FAST_MAX_ROWS, "rows"),
                         cute_common.env_int("KIMI_DECODE_TC_MAX_ROWS", TC_MAX_ROWS, 0, FAST_MAX_ROWS, "rows"))
        self._tc_plain = cute_common.env_flag("KIMI_DECODE_TC_PLAIN", "1")  # plain projections on tensor cores too
        self._tc_form = tc_form()  # which tensor-core projection: the split-K GEMM or the row tiles
        # the projections that run on the warpgroup-mma projection instead of cuBLAS above TC_MAX_ROWS (or of the row
        # tiles at and below it), from and up to how many rows (`kernels/gemm_wgmma.py`; `wgmma_setting`)
        self._wgmma = wgmma_setting(self._tc_rows[1])
        # last-CTA kernels' self-resetting counters, o_proj's scratch, the split routed norm's (counters, parts)
        self._counters: dict[tuple, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        self._open: dict[str, torch.cuda.Stream] = {}  # branches forked and not joined yet
        self._ssq = None  # partial sums of squares of the routed output, from the expert kernel to the tail
        self._scaled = None  # bf16(routed sum * latent norm weight), from the expert kernel to the tail
        if torch.cuda.is_available():  # the branch streams exist before any capture (a serving engine's first decode
            device = torch.device("cuda", torch.cuda.current_device())  # step may be a CUDA-graph capture)
            for name in BRANCHES:
                self._stream(name, device)
            for name in COUNTERS:
                self._counter(name, device)
            self._o_proj_parts(device)
            self._counter("experts", device, EXPERT_COUNTERS)
            self._counter("shared", device, SHARED_COUNTERS)
            self._counter("entry_prefetch", device, 2)
            for name in ("main", *BRANCHES):
                self._counter(f"tc.{name}", device, TC_COUNTERS)

    @staticmethod
    def _fallback(reason: str) -> None:
        if reason not in _said:
            _said.add(reason)
            log.warning("latency_specialized: %s; running auto there", reason)

    def begin_layer(self, lw, batch: int, reduced: bool = False) -> None:
        device_ok = cute_common.HAVE_CUTE and lw.attn_res.query.is_cuda
        if not cute_common.HAVE_CUTE:
            self._fallback("cutlass-dsl is not installed")
        elif not lw.attn_res.query.is_cuda:
            self._fallback("no CUDA device")
        small = batch <= FAST_MAX_ROWS
        if device_ok and not small:
            self._fallback(f"batch {batch} > {FAST_MAX_ROWS}: everything but AttnRes runs auto")
        if device_ok and lw.attn_kind != KDA:
            self._fallback("MLA attention is not specialized yet")
        on_cublas = [n for n in WGMMA_PROJECTIONS if self._plain_on_cublas(batch, n)] if device_ok and small else []
        if on_cublas:
            self._fallback(f"projections of {batch} rows run on cuBLAS: {', '.join(on_cublas)} (ours take "
                           f"{self._tc_rows[0]}..{self._tc_rows[1]} rows with KIMI_DECODE_TC_PLAIN=1, and up to "
                           f"{self._wgmma.max_rows} those KIMI_DECODE_WGMMA takes)")
        self._res_fast = device_ok and self._cute_attn_res
        self._attn_fast = device_ok and small and lw.attn_kind == KDA
        self._kda_fast = device_ok and batch <= KDA_MAX_ROWS and lw.attn_kind == KDA
        self._mlp_fast = device_ok and small and isinstance(lw.mlp, MoEWeights)
        self._experts_fast = device_ok and batch <= EXPERT_MAX_ROWS and isinstance(lw.mlp, MoEWeights)
        if self._experts_fast:
            from ..kernels.moe_mxfp4 import GROUP, QUAD, fits_int32_offsets

            w = lw.mlp
            if not fits_int32_offsets(w.w13, w.w13_scale, w.w2, w.w2_scale):
                self._fallback("routed-expert tensors of 2**31 bytes or more (a TP1 shard): the MXFP4 expert "
                               "kernels index with 32 bits")
                self._experts_fast = self._mlp_fast = False  # the MoE tail then needs no partial sums
            elif w.w2.shape[1] % (GROUP * QUAD):
                self._fallback(f"latent width {w.w2.shape[1]} is not a multiple of 128: the MXFP4 expert kernels "
                               "read the latent in quads of 4 groups of 32")
                self._experts_fast = self._mlp_fast = False
        # the latent RMSNorm folds into the up-projection when the routed sum is not all-reduced in between and the
        # per-pair expert kernels write its partial sums (below the grouped kernels' batches)
        self._grouped_from = grouped_from(lw.mlp.w13.shape[1] // 2 if isinstance(lw.mlp, MoEWeights) else 0)
        self._fused_norm = self._mlp_fast and not reduced and batch < self._grouped_from and self._tail_ours(batch)
        # above it the tail takes the grouped kernels' per-pair outputs and sums them in its norm kernel
        self._pairs_to_tail = (self._mlp_fast and self._experts_fast and not reduced and batch >= self._grouped_from
                               and routed_norm_on())
        self._norm_split = routed_norm_split()
        self._blas_lib = cublas_library()
        self._pairs_bf16 = self._pairs_to_tail and pairs_bf16() and not self._norm_split
        # one sequence, nothing between the projection and the AttnRes (no all-reduce): one kernel for both
        self._fuse_o_res = (self._attn_fast and self._res_fast and self._fused_o_res_on and batch == 1
                            and not reduced)
        self._pending_o = None
        self._moe_entry = (self._experts_fast and self._mlp_fast and self._fused_router and self._moe_entry_on
                           and batch <= ROUTER_FUSED_MAX_ROWS)
        self._pending_route = None
        cute_common.set_layer_pdl(device_ok and batch <= PDL_MAX_ROWS)
        self._shared_riders = (self._experts_fast and self._mlp_fast and self._shared_glu and batch == 1
                               and not self._experts_one_on and self._riders_wanted(lw.mlp))
        self._pending_shared = None
        self._ssq = self._scaled = None
        self._overlap = device_ok and self._overlap_on and isinstance(lw.mlp, MoEWeights)
        self._lw = lw

    def end_layer(self) -> None:
        cute_common.set_layer_pdl(False)
        self._deferred_shared = None  # a layer that raised before its latent down-projection

    def _riders_wanted(self, w: MoEWeights) -> bool:
        """Whether the shared experts run inside the expert kernels at batch 1: where their rows are few, and under PDL
        (which needs the layer on one stream: a fork and join is a plain dependency in the graph)."""
        if self._shared_riders_on in ("0", "1"):
            return self._shared_riders_on == "1"
        from ..kernels.moe_mxfp4 import few_shared_rows

        return few_shared_rows(w.shared_down.shape[1]) or cute_common.pdl_enabled()

    # ---- streams -----------------------------------------------------------------------------------------------------
    def _stream(self, name: str, device: torch.device) -> torch.cuda.Stream:
        """Branch `name`'s stream: the process's (one for every backend and slice, so each keeps one cuBLAS
        workspace); the router branch is on the critical path (it gates the experts): high priority."""
        return process_stream(device, name, priority=-1 if name == "router" else 0)

    def _counter(self, name: str, device: torch.device, n: int = 1) -> torch.Tensor:
        """The completion counters of one last-CTA kernel site: `n` int32, 0 between launches (the kernel's last CTAs
        reset them). Made when the backend is built, like the streams, so nothing is allocated inside a capture."""
        key = (device, name)
        if key not in self._counters:
            self._counters[key] = torch.zeros(n, dtype=torch.int32, device=device)
        return self._counters[key]

    def _routed_norm_scratch(self, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The split routed norm's counters (0 between launches) and parts (`rmsnorm.routed_norm_scratch`), one set
        per device and width: the MoE tails of a step run one after another on one stream."""
        from ..kernels.rmsnorm import routed_norm_scratch

        key = (device, "routed_norm", width)
        if key not in self._counters:
            self._counters[key] = routed_norm_scratch(width, device)
        return self._counters[key]

    def _o_proj_parts(self, device: torch.device) -> torch.Tensor:
        """Scratch for the output projection + AttnRes kernel's per-CTA score sums (`KIMI_DECODE_OPROJ_RES=split`):
        32 fp32 per SM, enough for 16 candidates. Made with the counters, outside any capture."""
        from ..kernels.cute_common import sm_count
        from ..kernels.oproj_attn_res import parts_width

        key = (device, "o_proj.parts")
        if key not in self._counters:
            self._counters[key] = torch.zeros(sm_count(device) * parts_width(15), dtype=torch.float32, device=device)
        return self._counters[key]

    def _tc_counters(self, device: torch.device) -> torch.Tensor:
        """The tensor-core projection's counters for the stream in use: kernels on one stream run one after another
        and share a set; the branches' streams, which run beside the main one, have their own."""
        current = torch.cuda.current_stream(device)
        for name in BRANCHES:
            if self._stream(name, device) == current:
                return self._counter(f"tc.{name}", device, TC_COUNTERS)
        return self._counter("tc.main", device, TC_COUNTERS)

    def _cute_rows(self, rows: int) -> bool:
        """Whether a projection of `rows` tokens may run on our kernels (up to TC_MAX_ROWS): the MoE tail's (else the
        routed norm + cuBLAS), and the plain ones with KIMI_DECODE_TC_PLAIN=1, the default (else cuBLAS)."""
        return rows <= self._tc_rows[1]

    def _wgmma_rows(self, rows: int, name: str) -> bool:
        """Whether projection `name` (one of WGMMA_PROJECTIONS) of `rows` tokens runs on the warpgroup-mma
        projection instead of the row tiles (at most TC_MAX_ROWS rows) or cuBLAS (above): where KIMI_DECODE_WGMMA
        and KIMI_DECODE_WGMMA_MIN_ROWS take it (`wgmma_setting`)."""
        w = self._wgmma
        return (name in w.names and w.min_rows <= rows <= w.max_rows
                and (rows > self._tc_rows[1] or name in w.below))

    def _tail_ours(self, rows: int) -> bool:
        """Whether the MoE tail's up-projection of `rows` tokens runs on our kernels (the row tiles or, where
        KIMI_DECODE_WGMMA takes `latent_up`, the warpgroup mma; both take the routed norm's 1/rms in their epilogue),
        else the routed norm adds into the residual and cuBLAS accumulates."""
        return self._cute_rows(rows) or self._wgmma_rows(rows, "latent_up")

    def _plain_on_cublas(self, rows: int, name: str) -> bool:
        """Whether plain projection `name` of `rows` tokens runs on cuBLAS: from TC_MIN_ROWS on, unless our
        tensor-core projections take it (KIMI_DECODE_TC_PLAIN=1, the default, up to TC_MAX_ROWS; above, where
        KIMI_DECODE_WGMMA names it)."""
        return rows >= self._tc_rows[0] and not (self._tc_plain and (self._cute_rows(rows)
                                                                     or self._wgmma_rows(rows, name)))

    def _project_kernel(self, rows: int, name: str) -> str:
        """Which of our kernels `_project` runs projection `name` of `rows` tokens on: "gemv" (the CUDA-core GEMV)
        below TC_MIN_ROWS rows, "wgmma" where `_wgmma_rows` takes it, else tensor cores up to TC_MAX_ROWS: "rows"
        (the row tiles, by KIMI_DECODE_TC_FORM) or "split" (the split-K GEMM)."""
        if rows < self._tc_rows[0]:
            return "gemv"
        if self._wgmma_rows(rows, name):
            return "wgmma"
        return "rows" if self._tc_form == "rows" and rows <= gemm_tc_rows.MAX_ROWS else "split"

    def _project(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, name: str, warps: int | None = None,
                 **epilogue) -> torch.Tensor:
        """y = x @ w.T (or `gemv`'s accumulating forms) of projection `name` on the kernel `_project_kernel` names
        (`warps`: the most warps per CTA of the row tiles' plan, for this projection)."""
        kernel = self._project_kernel(x.shape[0], name)
        if kernel == "gemv":
            from ..kernels.gemv import gemv

            return gemv(w, x, y, **epilogue)
        if kernel == "wgmma":
            from ..kernels.gemm_wgmma import project_wgmma

            return project_wgmma(w, x, y, self._tc_counters(x.device), **epilogue)
        if kernel == "rows":
            plan = gemm_tc_rows.rows_plan_for(x.shape[0], w.shape[0], w.shape[1], warps) if warps else None
            return gemm_tc_rows.project_rows(w, x, y, plan=plan, **epilogue)
        from ..kernels.gemm_tc import project

        return project(w, x, y, self._tc_counters(x.device), **epilogue)

    @contextlib.contextmanager
    def branch(self, name: str, *inputs: torch.Tensor):
        """Runs the enclosed stage on a stream of its own that starts after everything launched so far on the current
        stream; under CUDA-graph capture this is a fork in the graph. `inputs` are the main stream's tensors it reads
        (kept from reuse until it is done)."""
        if (not self._overlap or (name == "router" and self._moe_entry)  # the router: in the entry kernel
                or (name == "shared" and self._shared_riders)):  # the shared experts: in the expert kernels
            yield
            return
        main = torch.cuda.current_stream(inputs[0].device)
        side = self._stream(name, inputs[0].device)
        side.wait_stream(main)
        for t in inputs:
            t.record_stream(side)
        self._open[name] = side
        with torch.cuda.stream(side):
            yield

    def join(self, name: str, *outputs: torch.Tensor) -> None:
        if name == "shared":  # shared experts still deferred (no latent down-projection ran): launched now
            self._launch_deferred_shared()
        side = self._open.pop(name, None)
        if side is None:
            return
        main = torch.cuda.current_stream(side.device)
        main.wait_stream(side)
        for t in outputs:  # allocated on the side stream, read on the main one
            t.record_stream(main)

    def _gemv(self, x: torch.Tensor, w: torch.Tensor, name: str, dtype=BF16, out: torch.Tensor | None = None,
              warps: int | None = None) -> torch.Tensor:
        """Plain projection `name` (one of WGMMA_PROJECTIONS; bf16 or fp32 out, into `out` where given): the GEMV
        below TC_MIN_ROWS rows, our tensor-core projections up to TC_MAX_ROWS and where KIMI_DECODE_WGMMA names it
        (`_project`, `warps`), else cuBLAS (see TC_MIN_ROWS)."""
        if self._plain_on_cublas(x.shape[0], name):
            # cuBLAS, fp32 accumulation (and output, for the router's logits)
            with blas_library(self._blas_lib):
                if out is not None:
                    return torch.mm(x, w.T, out=out)
                return torch.mm(x, w.T, out_dtype=dtype) if dtype != BF16 else self.linear(x, w)
        return self._project(w, x, out if out is not None else
                             self._empty(x.shape[0], w.shape[0], dtype=dtype, device=x.device), name, warps=warps)

    def _prefetch(self, w: torch.Tensor) -> None:
        """Ask L2 for the first bytes of `w` (the weights of a streaming projection to come) on a stream beside the
        latency-bound kernels launched next, as the `prefetch` stage; joined at the end of the layer."""
        if not (self._overlap and self._prefetch_bytes > 0):
            return
        from ..kernels.prefetch import prefetch_weights

        with rng("prefetch"), self.branch("prefetch", w):
            prefetch_weights(w, self._prefetch_bytes)

    # ---- AttnRes -----------------------------------------------------------------------------------------------------
    def attn_res(self, res: ResidualState, w, *, n_blocks: int, commit: bool, delta, delta_mode: int,
                 use_partial: bool, eps: float) -> torch.Tensor:
        pending, self._pending_o = self._pending_o, None
        if pending is not None:
            if delta is not pending[2] or commit or not use_partial or delta_mode not in (1, 2):
                raise RuntimeError("latency_specialized: a deferred output projection must be the next AttnRes "
                                   "call's residual update")
            from ..kernels.oproj_attn_res import oproj_attn_res

            o, w_o, a = pending
            out = self._empty(*res.partial.shape, device=res.partial.device)
            return oproj_attn_res(w_o, o, a, res.blocks, res.partial, w.query, w.key_norm, w.input_norm, out,
                                  self._counter("o_proj", o.device), n_blocks=n_blocks, delta_mode=delta_mode,
                                  eps=eps, parts=self._o_proj_parts(o.device))
        if not self._res_fast:
            return super().attn_res(res, w, n_blocks=n_blocks, commit=commit, delta=delta, delta_mode=delta_mode,
                                    use_partial=use_partial, eps=eps)
        from ..kernels.attn_res import attn_res

        out = self._empty(*res.partial.shape, device=res.partial.device)
        return attn_res(res.blocks, res.partial, delta, w.query, w.key_norm, w.input_norm, out, n_blocks=n_blocks,
                        commit=commit, delta_mode=delta_mode, use_partial=use_partial, eps=eps)

    # ---- KDA ---------------------------------------------------------------------------------------------------------
    def kda_in_proj(self, x: torch.Tensor, w: KDAWeights, shard: ShardConfig):
        if not self._attn_fast:
            return super().kda_in_proj(x, w, shard)
        y = self._gemv(x, w.in_proj, "in_proj")
        if (self._fused_gate and x.shape[0] <= GEMV_MAX_ROWS and self._kda_fast
                and self._f_b_columns(w.f_b) is not None):
            return y, None  # the decay gate's up-projection f_b runs inside the KDA kernel (kda_core gets f=None)
        a, b = shard.kda_in_proj_layout["f_a"]
        return y, self._gemv(y[:, a:b], w.f_b, "f_b")

    def kda_core(self, y, f, w: KDAWeights, state: KDAState, shard: ShardConfig):
        if not self._kda_fast:
            return super().kda_core(y, f, w, state, shard)
        from ..kernels.kda_decode import kda_decode

        m = shard.model
        if self._mlp_fast and y.shape[0] <= GEMV_MAX_ROWS:  # KDA core, output projection and AttnRes:
            self._prefetch(self._lw.mlp.down)  # latency-bound; the latent projection comes next
        out = self._empty(y.shape[0], shard.kda_dim, device=y.device)
        fused = f is None  # from our kda_in_proj: the kernel applies f_b to y's f_a columns
        return kda_decode(y, self._f_b_columns(w.f_b) if fused else f, state.conv, w.conv, w.A_log, w.dt_bias,
                          state.recurrent, w.o_norm, out, b_col=shard.kda_in_proj_layout["b"][0], eps=m.rms_eps,
                          lower_bound=m.kda_gate_lower_bound,
                          f_col=shard.kda_in_proj_layout["f_a"][0] if fused else None)

    def _copy_of(self, w: torch.Tensor, layout: str, make, why: str) -> torch.Tensor | None:
        """`make(w)`, a copy of weight `w` in another layout, made on first use and kept while `w` lives; None when
        that first use is inside a CUDA-graph capture, where the copy would become a node of the graph (`why`, what
        runs instead, is said once)."""
        made = self._copies.get(layout)
        if made is None:
            made = self._copies[layout] = WeakIdKeyDictionary()
        hit = made.get(w)
        if hit is not None:
            return hit
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self._fallback(why)
            return None
        copy = make(w)
        made[w] = copy
        return copy

    def _f_b_columns(self, f_b: torch.Tensor) -> torch.Tensor | None:
        """f_b [d, rank] as a column-major view of a contiguous [rank, d] copy (a warp's lanes then read consecutive
        bytes), or None (`_copy_of`: the f_b GEMV then runs as its own kernel)."""
        return self._copy_of(f_b, "columns", lambda t: t.t().contiguous().t(),
                             "the decay gate's f_b first seen inside a CUDA-graph capture: its column-major copy is "
                             "made outside captures, so the f_b GEMV runs as its own kernel in this graph")

    def _expert_codes(self, w: MoEWeights, used: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(w13, w2, whether they are quad-major) for the expert kernels: copies in `moe_mxfp4.quad_major` order
        (`_copy_of`), else the natural rows. The w2 copy keeps only the `used` columns of each row
        (`KIMI_DECODE_W2_COMPACT=0`: all of them): a padded shard's zero columns share the rows' DRAM bursts with
        the used ones, so they would be read too (TP16: a third more than the used bytes)."""
        from ..kernels.cute_common import mx_packed
        from ..kernels.moe_mxfp4 import quad_major, quad_major_fits

        cols = used // 2 if self._w2_compact else w.w2.shape[2]  # w2's bytes per row in the copy
        if self._quad_major_on and quad_major_fits(w.w13) and quad_major_fits(w.w2[..., :cols]):
            why = ("expert weights first seen inside a CUDA-graph capture: their quad-major copies are made outside "
                   "captures, so the expert kernels read the natural rows in this graph")
            packed = mx_packed()  # the kernels compiled now read packed codes (KIMI_DECODE_MX_PACKED)
            w13 = self._copy_of(w.w13, f"quad_major:packed={packed}", lambda t: quad_major(t, packed=packed), why)
            w2 = self._copy_of(w.w2, f"quad_major:{cols}:packed={packed}",
                               lambda t: quad_major(t[..., :cols], packed=packed), why)
            if w13 is not None and w2 is not None:
                return w13, w2, True
        return w.w13, w.w2, False

    def attn_out_proj(self, o, w):
        if self._fuse_o_res:  # deferred: the next AttnRes call runs it in the same kernel (its residual update)
            a = self._empty(o.shape[0], w.o_proj.shape[0], device=o.device)
            self._pending_o = (o, w.o_proj, a)
            return a
        return self._gemv(o, w.o_proj, "o_proj") if self._attn_fast else super().attn_out_proj(o, w)

    # ---- MoE ---------------------------------------------------------------------------------------------------------
    def router(self, x: torch.Tensor, w: MoEWeights, shard: ShardConfig, layer: int):
        fused = self._fused_router and x.shape[0] <= ROUTER_FUSED_MAX_ROWS
        if not (self._mlp_fast and (fused or x.shape[0] <= self._topk_rows)):
            return super().router(x, w, shard, layer)
        from ..kernels.router_topk import route_topk, router_topk

        m = shard.model
        B = x.shape[0]
        ids = self._empty(B, m.top_k, dtype=torch.int32, device=x.device)
        weights = self._empty(B, m.top_k, dtype=torch.float32, device=x.device)
        self.last_routes[layer] = ids
        if not fused:  # the router projection, then one CTA per row routes it
            route_topk(self.router_logits(x, w), w.router_bias, ids, weights, scaling=m.routed_scaling)
            return ids, weights
        logits = self._empty(B, w.router.shape[0], dtype=torch.float32, device=x.device)
        if self._moe_entry:  # deferred: routed_experts launches it with the latent down-projection
            self._pending_route = (x, logits, ids, weights)
            return ids, weights
        router_topk(w.router, x, logits, w.router_bias, ids, weights, self._counter("router", x.device),
                    scaling=m.routed_scaling)
        return ids, weights

    def router_logits(self, x, w: MoEWeights):
        if not self._mlp_fast:
            return super().router_logits(x, w)
        return self._gemv(x, w.router, "router", torch.float32, warps=self._router_warps)

    def shared_experts(self, x, w: MoEWeights):
        if not self._mlp_fast:
            return super().shared_experts(x, w)
        if not (self._shared_glu and x.shape[0] <= GLU_MAX_ROWS):
            after = self._shared_after == "latent" or (self._shared_after == "auto"
                                                       and x.shape[0] >= SHARED_AFTER_MIN_ROWS)
            if after and "shared" in self._open:  # launched after the latent down-projection (`_launch_...`)
                out = self._empty(x.shape[0], w.shared_down.shape[0], device=x.device)
                self._deferred_shared = (x, w, out)
                return out
            return self._plain_shared(x, w)
        from ..kernels.gemv import gemv

        act = self._empty(x.shape[0], w.shared_gate_up.shape[0] // 2, device=x.device)
        if self._shared_riders:  # deferred: routed_experts launches them inside the expert kernels
            out = self._empty(1, w.shared_down.shape[0], device=x.device)
            self._pending_shared = (w.shared_gate_up, x, act, w.shared_down, out)
            return out
        if self._shared_one_on and x.shape[0] == 1:  # both GEMVs as the two stages of one kernel
            from ..kernels.shared_mlp import shared_mlp

            return shared_mlp(w.shared_gate_up, x, act, w.shared_down,
                              self._empty(1, w.shared_down.shape[0], device=x.device),
                              self._counter("shared", x.device, SHARED_COUNTERS))
        gemv(w.shared_gate_up, x, act, glu=True)  # gate/up GEMV with SiTU-GLU in its epilogue
        return self._gemv(act, w.shared_down, "shared_down")

    def _plain_shared(self, x, w: MoEWeights, out=None):
        """The shared experts: gate/up projection, SiTU-GLU, down-projection (into `out`), the SiTU-GLU in the gate/up
        projection's epilogue where it runs on the warpgroup mma (`_wgmma_glu`), else a kernel of its own."""
        if self._wgmma_glu(x.shape[0], w.shared_gate_up):
            from ..kernels.gemm_wgmma import project_wgmma

            act = self._empty(x.shape[0], w.shared_gate_up.shape[0] // 2, device=x.device)
            project_wgmma(w.shared_gate_up, x, act, self._tc_counters(x.device), glu=True)
        else:
            act = self.situ_glu(self._gemv(x, w.shared_gate_up, "shared_gate_up"))
        return self._gemv(act, w.shared_down, "shared_down", out=out)

    def _wgmma_glu(self, rows: int, gate_up: torch.Tensor) -> bool:
        """Whether the shared experts' gate/up projection of `rows` tokens runs on the warpgroup mma with the SiTU-GLU
        in its epilogue: where `_gemv` would run it there (not on cuBLAS, and `_project_kernel` names it) and its rows
        split into whole row groups of gate and up rows (`gemm_wgmma.glu_fits`), with KIMI_DECODE_SHARED_GLU=all."""
        from ..kernels.gemm_wgmma import glu_fits

        return (self._shared_glu_wgmma and not self._plain_on_cublas(rows, "shared_gate_up")
                and self._project_kernel(rows, "shared_gate_up") == "wgmma" and glu_fits(gate_up.shape[0]))

    def _launch_deferred_shared(self) -> None:
        """The deferred shared experts on their branch's stream (still open: `join` launches them before it closes
        it), after what the current stream has launched (the latent down-projection): a dependency edge in a captured
        graph."""
        deferred, self._deferred_shared = self._deferred_shared, None
        if deferred is None:
            return
        x, w, out = deferred
        side = self._open["shared"]
        latent_done = torch.cuda.Event()
        latent_done.record()
        side.wait_event(latent_done)
        with torch.cuda.stream(side):
            self._plain_shared(x, w, out)

    def latent_down(self, x, w: MoEWeights):
        latent = self._gemv(x, w.down, "latent_down") if self._mlp_fast else super().latent_down(x, w)
        self._launch_deferred_shared()
        return latent

    def routed_experts(self, x, ids, weights, w: MoEWeights, shard: ShardConfig):
        if not self._experts_fast:
            self.join("router", ids, weights)
            return super().routed_experts(x, ids, weights, w, shard)
        from ..kernels.moe_mxfp4 import moe_mxfp4

        shared, self._pending_shared = self._pending_shared, None
        if shared is not None and shared[1] is not x:
            raise RuntimeError("latency_specialized: deferred shared experts must take the routed experts' input")
        pending, self._pending_route = self._pending_route, None
        # the shared experts' gate/up in the entry kernel, or (with their down-projection) in the expert kernels
        glu_in_entry = shared is not None and pending is not None and self._glu_in_entry
        used = shard.expert_inter_used
        w13, w2, quad = self._expert_codes(w, used)
        if pending is not None:  # the router and the latent down-projection in one kernel
            from ..kernels.moe_entry import moe_entry, prefetch_layout

            rx, logits, rids, rweights = pending
            if rx is not x or rids is not ids or rweights is not weights:
                raise RuntimeError("latency_specialized: a deferred router must route the routed experts' input")
            prefetch = None  # the w13 rows the expert kernel will read, asked of L2 by the entry kernel
            if self._entry_prefetch and ids.shape[0] < self._grouped_from and prefetch_layout(w13, used) is not None:
                prefetch = (w13, self._counter("entry_prefetch", x.device, 2), used)
            latent = moe_entry(w.router, x, logits, w.router_bias, ids, weights, self._counter("router", x.device),
                               w.down, self._empty(x.shape[0], w.down.shape[0], device=x.device),
                               scaling=shard.model.routed_scaling,
                               glu=(shared[0], shared[2]) if glu_in_entry else None, prefetch=prefetch)
        else:
            latent = self.latent_down(x, w)  # launched before the wait: it runs beside the router branch
        self.join("router", ids, weights)
        B, k = ids.shape
        L = w.w2.shape[1]
        if B >= self._grouped_from:  # many pairs share an expert: sort them by expert and read each expert once
            from ..kernels import moe_align as counting
            from ..kernels.moe_mxfp4_grouped import moe_mxfp4_grouped

            how = grouped_align() if B * k <= counting.THREADS else "0"  # (K3: 64 x 16 pairs at the most)
            if how == "0":  # the generic path's sort
                align = self.expert_alignment(ids)
            else:  # the pairs counted into place, and (how == "1") the latent as the w13 kernel's operands
                align = [self._empty(B * k, dtype=torch.int32, device=x.device) for _ in range(4)]
                ops = self._empty(*latent.shape, dtype=torch.float16, device=x.device) if how == "1" else None
                counting.moe_align(ids.reshape(-1), *align, experts=w13.shape[0],
                                   latent=latent if how == "1" else None, operands=ops)
                latent = ops if how == "1" else latent
            return moe_mxfp4_grouped(latent, ids, weights, w13, w.w13_scale, w2, w.w2_scale, used, align,
                                     act=self._empty(B * k, used, dtype=torch.float16, device=x.device),
                                     pair_out=self._empty(B * k, L, device=x.device,
                                                          dtype=BF16 if self._pairs_bf16 else torch.float32),
                                     summed=not self._pairs_to_tail, quad_major=quad, x_operands=how == "1")
        if self._mlp_fast:  # the expert kernels are latency-bound at small batch; the tail GEMV comes next
            self._prefetch(w.up)
        act = self._empty(B * k, used, dtype=torch.float16, device=x.device)
        out = self._empty(B, L, dtype=torch.float32, device=x.device)
        self._ssq = self._empty(B, L // 16, dtype=torch.float32, device=x.device)
        # with the norm fused into the tail: the expert kernel also writes bf16(routed * norm weight) for it
        self._scaled = self._empty(B, L, device=x.device) if self._fused_norm else None
        counters = self._counter("experts", x.device, EXPERT_COUNTERS) if self._experts_one_on else None
        return moe_mxfp4(latent, ids, weights, w13, w.w13_scale, w2, w.w2_scale, used, act=act, out=out,
                         ssq=self._ssq, scaled=(w.latent_norm, self._scaled) if self._fused_norm else None,
                         counters=counters, shared=shared, shared_act_ready=glu_in_entry, quad_major=quad)

    def moe_tail(self, routed, shared, w: MoEWeights, res: ResidualState, shard: ShardConfig) -> None:
        if routed.dim() == 3:  # the grouped experts' per-pair outputs [B, k, L] (`routed_experts`)
            return self._pairs_tail(routed, shared, w, res, shard)
        if not self._mlp_fast or routed.dtype != torch.float32:
            return super().moe_tail(routed, shared, w, res, shard)
        if self._fused_norm:  # one kernel: the routed sum's 1/rms applied per row in the up-projection's epilogue
            self._project(w.up, self._scaled, res.partial, "latent_up", accumulate=True, addend=shared,
                          row_scale=(self._ssq, shard.model.rms_eps))
            self._scaled = self._ssq = None
            return
        if not self._cute_rows(routed.shape[0]):  # more rows than the row-tile tail takes: the routed norm first
            return self._pairs_tail(routed.unsqueeze(1), shared, w, res, shard)
        from ..kernels.rmsnorm import rmsnorm_rows

        normed = rmsnorm_rows(routed, w.latent_norm, self._empty(*routed.shape, device=routed.device),
                              shard.model.rms_eps)
        self._project(w.up, normed, res.partial, "latent_up", accumulate=True, addend=shared)

    def _pairs_tail(self, pairs, shared, w: MoEWeights, res: ResidualState, shard: ShardConfig) -> None:
        """The MoE tail on [B, k, L] parts of the routed output (the grouped experts' per-pair outputs, or a routed
        sum as k = 1), summed and normalised in one kernel (`rmsnorm.routed_norm`): up to TC_MAX_ROWS rows the
        tensor-core projection then adds the result and the shared output into the residual (above, the warpgroup-mma
        one where KIMI_DECODE_WGMMA takes `latent_up`: up to 32 rows by default); else the norm's kernel adds the
        shared output and one cuBLAS GEMM accumulates the up-projection into the residual."""
        from ..kernels.rmsnorm import routed_norm

        B, _, L = pairs.shape
        normed = self._empty(B, L, device=pairs.device)
        split = self._routed_norm_scratch(L, pairs.device) if self._norm_split else None
        if self._tail_ours(B):
            routed_norm(pairs, w.latent_norm, normed, shard.model.rms_eps, split=split)
            self._project(w.up, normed, res.partial, "latent_up", accumulate=True, addend=shared)
            return
        routed_norm(pairs, w.latent_norm, normed, shard.model.rms_eps, residual=(res.partial, shared), split=split)
        with blas_library(self._blas_lib):
            if _ADDMM_FP32_OUT:
                torch.addmm(res.partial, normed, w.up.t(), out_dtype=torch.float32, out=res.partial)
            else:  # an older torch: the GEMM's bf16 output added in a kernel of its own
                res.partial.add_(self.linear(normed, w.up))
