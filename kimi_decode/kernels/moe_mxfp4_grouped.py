"""Routed experts at batches 9..64 (8..64 where the backend's `grouped_from` says so: TP8), grouped by expert: each
selected expert's MXFP4 rows are read once per step.

At batch 64 the 1,024 (token, expert) pairs select about 610 distinct experts of 896, so the per-pair kernels of
`moe_mxfp4.py` read most experts more than once (1.7 times on average). Here the pairs are first sorted by expert
(`moe_align`, the generic path's kernel: pair order, and per distinct expert its start, length and id), and each CTA
works on one expert segment, up to 8 of its pairs at a time: the 8 columns of the `mma.sync m16n8k16` activation
operand, which the per-pair kernels fill with one token, here carry 8 different pairs of the same expert. The
dequantisation (the e2m1 code shifted into an fp16, scale per 32 codes) is the one of `moe_mxfp4.py`.

`moe_w13_grouped`: CTA (row block of 16 intermediate rows, segment): two mma row tiles (w1 rows j..j+7 in mma rows
0-7, the matching w3 rows in 8-15) per warp, the warps splitting K (the latent) in whole quads of 4 MX groups. The
weights come in 16-byte loads: lane t of a quad loads group t of the quad for its row, and two rounds of shuffles
(`quad_transpose`; none on `moe_mxfp4.quad_major` codes) leave it word t of each of the four groups, what the mma
fragment takes; the four scale bytes of a quad are one 32-bit load. (With one 4-byte load per lane and group, every
load instruction touched 8 rows for 16 bytes each, and the kernel ran at 1.25 TB/s against 2.4 now: bound by load
instructions, not bytes.) Staged (`grouped_staged`, the default) each lane instead copies those 16-byte slices of all
its quads into its own shared-memory slots with `cp.async` as soon as the segment's expert is known (one round trip
for the segment's length, start and expert), so the CTA's whole tile is in flight at once without holding registers
(v22's kernel held about one quad per lane and was bound by load latency at 2.0 TB/s). Each activation group is loaded
and converted to fp16 operands once for the two tiles. The warps add their partial sums through shared memory, one
thread per (row, pair) output; SiTU-GLU(h1, h3) -> act [pair, used] fp16.

`moe_w2_grouped`: CTA (512 latent rows, every G-th segment: `segment_ctas`), each warp four tiles of 16 rows over the
whole (short) K = used, its weights loaded the same way (whole quads by 16-byte loads, the two groups left at TP16 by
4-byte ones; staged, where the rows are whole quads, a CTA copies the next segment's rows into the other of two
shared-memory buffers while it works on the current one), the act operands converted once for the four tiles ->
routing weight x partial output per pair [pair, latent] fp32, summed over each token's k pairs afterwards (no atomics:
the result does not depend on the order in which CTAs finish). Segments past the number of distinct experts have
length 0. A w2 CTA counts its non-empty segments first (lane i loads the length, start and expert of its i-th one;
each segment takes them from lane i, and loads its first pairs during the segment before, `w2_ahead`); a w13 CTA row
counts them the same way from 512 pair slots on and works on its (at most two) one after the other, below that each
slot has a CTA row, and one that finds its segment empty exits at once (`w13_seg_div`)."""
from __future__ import annotations

import math
import os

import torch

from .cute_common import (HAVE_CUTE, compile_kernel, cute, cutlass, env_choice, env_flag, env_int, fake_like, launch,
                          signature, sm_count)
from .moe_mxfp4 import (GROUP, QUAD, ROWS13, WARPS, _words, check_expert_args, fits_int32_offsets, layout_groups,
                        quad_major_offset, quad_split, w2_scales)

COLS = 8  # pairs per mma tile (the n of m16n8k16)
ROWS2_CTA = 16 * WARPS  # latent rows per w2 CTA at one row tile per warp
DEFAULT_TILES = {"w13": 2, "w2": 4}  # measured fastest on the H200 (benchmarks/NOTES.md, v11)
SEG_CTAS_PER_SM = 8  # w2 CTAs per SM along the segments (`segment_ctas`; benchmarks/NOTES.md, v22)
STAGE_MODES = ("1", "0", "w13", "all")
W2_STAGE_BYTES = 110 * 1024  # shared memory of a staged w2 CTA's two segment buffers: 2 CTAs per SM (227 KB)


def grouped_tiles(kernel: str) -> int:
    """mma row tiles per warp of the "w13" or "w2" kernel, which share each activation group (loaded and converted
    once): `DEFAULT_TILES`, or KIMI_DECODE_GROUPED_TILES for A/B timing: "N" for both kernels or "N13,N2", each 1, 2
    or 4."""
    raw = os.environ.get("KIMI_DECODE_GROUPED_TILES")
    if raw is None:
        return DEFAULT_TILES[kernel]
    parts = raw.split(",")
    if len(parts) not in (1, 2) or any(p not in ("1", "2", "4") for p in parts):
        raise ValueError(f"KIMI_DECODE_GROUPED_TILES must be 1, 2 or 4, or two of them as w13,w2; got {raw!r}")
    return int(parts[0] if len(parts) == 1 or kernel == "w13" else parts[1])


def segment_ctas(pairs: int, row_blocks: int) -> int:
    """CTAs along the expert segments of the w2 kernel with `row_blocks` CTAs across its rows: each takes every G-th
    segment, up to 32 of them (one per lane), so G >= pairs / 32; and at least SEG_CTAS_PER_SM per SM over the whole
    grid. KIMI_DECODE_GROUPED_SEG_CTAS sets that number per SM for A/B timing; "0" launches one CTA per segment
    slot (`pairs`: the distinct experts are known only on the device, so most of them find an empty segment). The
    w13 kernel loops over at most a few segments per CTA row (`w13_seg_div`)."""
    per_sm = env_int("KIMI_DECODE_GROUPED_SEG_CTAS", SEG_CTAS_PER_SM, 0, 64, "CTAs per SM")
    if per_sm == 0:
        return pairs
    return min(pairs, max(-(-pairs // 32), -(-per_sm * sm_count() // row_blocks)))


def grouped_staged(kernel: str, used: int = 0) -> bool:
    """Whether the "w13" or "w2" kernel (rows of `used` intermediate values) stages its weights in shared memory with
    `cp.async`, by KIMI_DECODE_GROUPED_STAGE: "1" (the default) w13 always and w2 where its rows are whole quads of MX
    groups (TP8: 12 groups; at TP16's 6 staging measured slower, with the two groups after the quad as two 4-byte
    copies and as one 8-byte one, and even at 2 row tiles: benchmarks/NOTES.md v23), "all" both wherever w2 can
    (`MoEW2Grouped`), "w13" w13 only, "0" neither. w13: a CTA copies its whole weight tile as soon as it knows its
    expert, instead of loading each quad into registers as the mma loop reaches it. w2: a CTA copies the next
    segment's rows into the other of two buffers while it works on the current one."""
    raw = env_choice("KIMI_DECODE_GROUPED_STAGE", "1", STAGE_MODES)
    if kernel == "w13":
        return raw != "0"
    return raw == "all" or (raw == "1" and used // GROUP % QUAD == 0)


# quads per iteration of the staged grouped w13 kernel's mma loop: all 4 of a warp's, 1-3 us faster per layer at
# batch 64 than one on the H200, even at 8 and 16 (benchmarks/NOTES.md item 54)
W13_UNROLL = "4"


def w13_unroll() -> int:
    """Quads per iteration of the staged grouped w13 kernel's mma loop (KIMI_DECODE_GROUPED_W13_UNROLL: W13_UNROLL by
    default, or 1 or 2 for A/B). Shared memory holds the kernel at 3 CTAs per SM, so the registers unrolling may take
    cost no occupancy up to 96 per thread (4: 66 on the H200, by ncu)."""
    return int(env_choice("KIMI_DECODE_GROUPED_W13_UNROLL", W13_UNROLL, ("1", "2", "4")))


# segments per CTA row of the grouped w13 kernel, at most: 2 from 512 pair slots (batch 32 at top-16) on, 6 / 12 us
# faster per layer at batch 64 (TP16 / TP8) than one CTA row per slot (where ~8,700 of 12,288 CTAs at TP16 find
# their segment empty), even / 2.6 us faster at 512; 0.5-2 us slower at 128 and 256 slots (benchmarks/NOTES.md
# item 60)
W13_SEG_DIV = "auto"
W13_LOOP_FROM_PAIRS = 512


def w13_seg_div(pairs: int) -> int:
    """KIMI_DECODE_W13_SEG_DIV ("auto", the default: 2 from W13_LOOP_FROM_PAIRS pair slots, else 1; or 1, 2, 4 or 8
    for A/B): the grouped w13 kernel's grid covers the `pairs` segment slots with ceil(pairs / D) CTA rows, row y
    taking segments y, y + ceil(pairs / D), ... that are non-empty (a ballot over one load per lane, as the w2 kernel
    does), one after the other in the same staged buffers. With 1 every slot has its own CTA and the empty ones exit
    after their first load. The CTAs that take two segments come first in the grid (the non-empty segments are a
    prefix), so they start first."""
    raw = env_choice("KIMI_DECODE_W13_SEG_DIV", W13_SEG_DIV, ("auto", "1", "2", "4", "8"))
    if raw == "auto":
        return 2 if pairs >= W13_LOOP_FROM_PAIRS else 1
    return int(raw)


def w2_ahead() -> bool:
    """KIMI_DECODE_W2_AHEAD: whether the grouped w2 kernel takes its segments' table from lanes and loads each
    segment's first pairs during the segment before (`MoEW2Grouped`, "1", the default: measured 2.4-9.2 us faster per
    layer on the H200 at batches 16 and 64, most at TP8; benchmarks/NOTES.md, item 37), or loads both at the
    segment's start ("0", for A/B runs)."""
    return env_flag("KIMI_DECODE_W2_AHEAD", "1")


def _tiles(n: int, most: int) -> int:
    """The most row tiles per warp (up to `most`) that divide n tiles evenly."""
    return next(k for k in (4, 2, 1) if k <= most and n % k == 0)


if HAVE_CUTE:
    from cutlass import Float32, Int32

    from .cute_common import copy_async_16, copy_async_words, load4, mma_lanes, situ_glu
    from .moe_mxfp4 import (byte_scales, mma_operands, mx_scale_of, operand_mma, quad_exchange, quad_words, select_i32,
                            word_scales)

    def _row_words(gW: cute.Tensor, w: cute.Tensor, e, row, t, groups: int, qm: int):
        """Word t of every MX group of a row: whole quads as `quad_words`, the rest one 4-byte load per group (`qm`:
        the rows' groups when quad-major, else 0)."""
        words = []
        for q in range(groups // QUAD):
            words += quad_words(gW, e, row, q * QUAD, t, qm)
        for G in range(groups // QUAD * QUAD, groups):
            words.append(w[e, row, _word_col(G, t, qm)])
        return words

    def _word_col(G: int, t, qm: int):
        """Where word t of MX group G lies in a row of words (`qm`: the row's groups when quad-major, else 0)."""
        return quad_major_offset(G, t, qm) if qm else G * 4 + t

    def _row_scales(w_scale: cute.Tensor, e, row, groups: int, words: bool):
        """The fp32 scales of a row's groups, as functions to call where each is used (`word_scales`): one 32-bit
        load per 4 groups where `w_scale` is a word view, else one load per byte."""
        if not words:
            return byte_scales([w_scale[e, row, G] for G in range(groups)])
        ws = [w_scale[e, row, i] for i in range(-(-groups // QUAD))]
        return [f for i, word in enumerate(ws) for f in word_scales(word, min(QUAD, groups - QUAD * i))]

    def _group_acc(acc, k: int, wa, wb, bs, sa, sb, quad: bool) -> None:
        """acc[k], acc[k + 1] (rows a, columns 2t / 2t + 1) and acc[k + 2], acc[k + 3] (rows b) += one MX group's mma
        of words wa / wb (`quad`: from a quad-major copy, `operand_mma`) against operands bs, scaled by the rows' fp32
        scales, which `sa()` / `sb()` give after the mma is issued (`acc` a list or a register tensor; inlined where
        it is called)."""
        c = operand_mma(wa, wb, bs, quad)
        fa = sa()
        fb = sb()
        acc[k] = acc[k] + c[0] * fa
        acc[k + 1] = acc[k + 1] + c[1] * fa
        acc[k + 2] = acc[k + 2] + c[2] * fb
        acc[k + 3] = acc[k + 3] + c[3] * fb

    def _segments(seg_len: cute.Tensor, by, lane, stride: int, *more: cute.Tensor):
        """How many segments CTA row `by` works on (segments by, by + stride, ...): lane i loads the i-th one's
        length, and a ballot counts the non-empty ones, which come first since `moe_align` writes the distinct
        experts first and the rest with length 0. With tables `more` (the segments' start and expert: the
        look-ahead form), lane i also loads their i-th entries, in the same round trip, and the count comes with
        the lane's (length, *entries); the loop then takes them from lane i (`_from_lane`)."""
        P = seg_len.shape[0]
        s = by + lane * stride
        inside = s < P
        s = select_i32(inside, s, P - 1)
        mine = (seg_len[s], *(t[s] for t in more))
        n = cute.arch.popc(cute.arch.vote_ballot_sync(inside & (mine[0] > 0)))
        return (n, mine) if more else n

    def _from_lane(values, i):
        """The values lane i holds, in every lane."""
        return [cute.arch.shuffle_sync(v, offset=i) for v in values]

    def _tile_pairs(order: cute.Tensor, start, length, tile, g, t):
        """The pairs of tile `tile` of a segment this lane needs: its mma column g's (the act operands) and those of
        its two output columns 2t and 2t + 1 (columns past the segment read its last pair; an empty segment reads
        pair slot 0, unused)."""
        some = length > 0
        last = length - 1

        def at(c):
            return order[select_i32(some, start + select_i32(c < length, c, last), 0)]

        c0 = tile * COLS
        return at(c0 + g), at(c0 + 2 * t), at(c0 + 2 * t + 1)

    class MoEW13Grouped:
        """act[p, j] = SiTU-GLU(w1[e, j] . x_b, w3[e, j] . x_b) for every pair p = (b, slot) of expert e, j < used."""

        def __init__(self, latent: int, inter: int, used: int, topk: int, tiles: int, quad_major: int = 0,
                     stage: bool = False, x_operands: bool = False, unroll: int = 1, pairs: int = 0, seg_div: int = 1):
            """`w_scale` comes as int32 words (4 scale bytes each: latent / 32 is a multiple of 4). `quad_major`: the
            weights' groups per row when they come in `moe_mxfp4.quad_major` order, else 0. `stage`
            (`grouped_staged`): every lane copies the 16-byte weight slices it will read (all quads, both row tiles,
            w1 and w3) into its own slots of shared memory with `cp.async` once the segment's expert is known, and
            the four lanes of each row a quarter of its scale words, so the CTA's whole weight tile is in flight at
            once without holding registers; the mma loop, `unroll` quads per iteration (`w13_unroll`), reads them
            back. `x_operands`: the activations come as fp16 mma operands (`latent_operands`), used as loaded,
            instead of bf16 that every CTA converts (12 integer and conversion instructions per group and lane,
            repeated by each row block). `seg_div` > 1 (`w13_seg_div`, staged only): ceil(pairs / seg_div) CTA rows,
            each looping over its non-empty segments of the `pairs` slots."""
            self.I, self.used, self.topk = inter, used, topk
            self.seg_rows = -(-pairs // seg_div) if stage and seg_div > 1 else 0  # 0: one CTA row per slot
            self.unroll = unroll  # quads per iteration of the staged mma loop
            self.x_operands = x_operands
            self.qm = quad_major
            self.warps, self.per_warp = quad_split(latent)  # K over the warps in whole quads
            self.tiles = _tiles(used // ROWS13, tiles)
            self.stage = stage
            self.slots = self.per_warp * self.tiles * 2  # a lane's staged slices: (quad, tile, w1 / w3)
            self.red_shape = (2 * ROWS13, COLS, self.warps, self.tiles)  # the warps' partial sums, fp32

        def stage_bytes(self) -> int:
            """Shared memory of the staged weights and scale words per CTA (0 unstaged)."""
            return self.slots * (16 * 32 + 4 * ROWS13) * self.warps if self.stage else 0

        def smem_bytes(self) -> int:
            """Shared memory per CTA: the staged weights and scale words, and the reduction buffer."""
            return self.stage_bytes() + 4 * math.prod(self.red_shape)

        def _slot(self, it: int, r: int, h: int) -> int:
            return (it * self.tiles + r) * 2 + h

        @cute.jit
        def __call__(self, x: cute.Tensor, w: cute.Tensor, w_scale: cute.Tensor, order: cute.Tensor,
                     seg_start: cute.Tensor, seg_len: cute.Tensor, seg_expert: cute.Tensor, act: cute.Tensor,
                     stream):
            P = act.shape[0]
            gX = cute.zipped_divide(x, (1, 4))  # int32 pairs of bf16 (or fp16 operands): ((1,4), (B, L/8))
            gW = cute.zipped_divide(w, (1, 1, 4))  # one MX group (16 bytes) per tile: ((1,1,4), (E, 2I, L/32))
            rows = P
            if cutlass.const_expr(self.seg_rows > 0):
                rows = self.seg_rows
            self.kernel(gX, gW, w_scale, order, seg_start, seg_len, seg_expert, act).launch(
                grid=[self.used // (ROWS13 * self.tiles), rows, 1], block=[32 * self.warps, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, gX: cute.Tensor, gW: cute.Tensor, w_scale: cute.Tensor, order: cute.Tensor,
                   seg_start: cute.Tensor, seg_len: cute.Tensor, seg_expert: cute.Tensor, act: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, s, _ = cute.arch.block_idx()
            warp, lane, g, t = mma_lanes(tidx)
            j0 = bx * ROWS13 * self.tiles + g
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout(self.red_shape), 16)
            n_slots = self.slots if self.stage else 1
            n_warps = self.warps if self.stage else 1
            wbuf = smem.allocate_tensor(Int32, cute.make_layout(((1, 4), 32, n_slots, n_warps)), 16)
            sbuf = smem.allocate_tensor(Int32, cute.make_layout((ROWS13, n_slots, n_warps)), 16)
            if cutlass.const_expr(self.seg_rows > 0):
                n = _segments(seg_len, s, lane, self.seg_rows)  # this CTA row's non-empty segments
                for i in cutlass.range(n):
                    si = s + i * self.seg_rows  # the same in every lane: loads at a uniform address (an L1 hit)
                    self.segment(gX, gW, w_scale, order, act, red, wbuf, sbuf, seg_len[si], seg_start[si],
                                 seg_expert[si], bx, j0, tidx, warp, lane, g, t)
            else:
                length = seg_len[s]
                start = seg_start[s]
                e = seg_expert[s]
                # all three in the condition: they are then loaded together (one round trip) instead of start and
                # expert after the length test; neither is ever negative
                if (length > 0) & (start >= 0) & (e >= 0):
                    self.segment(gX, gW, w_scale, order, act, red, wbuf, sbuf, length, start, e, bx, j0, tidx, warp,
                                 lane, g, t)

        @cute.jit
        def segment(self, gX: cute.Tensor, gW: cute.Tensor, w_scale: cute.Tensor, order: cute.Tensor,
                    act: cute.Tensor, red: cute.Tensor, wbuf: cute.Tensor, sbuf: cute.Tensor, length, start, e, bx,
                    j0, tidx, warp, lane, g, t):
            """One non-empty segment (expert e, its pairs order[start:start + length]): the row block's weights
            staged (or loaded per quad), then each tile of 8 pairs' dot products, reduced over the warps through
            `red` and written as SiTU-GLU to act. Ends on a barrier, so the buffers may take the next segment."""
            if cutlass.const_expr(self.stage):
                self.stage_weights(gW, w_scale, wbuf, sbuf, e, j0, warp, lane, g, t)
            for tile in cutlass.range((length + COLS - 1) // COLS):
                col = tile * COLS + g  # this lane group's pair: mma column g
                if col >= length:  # past the segment: any pair of it, its column is not stored
                    col = length - 1
                b = order[start + col] // self.topk
                if cutlass.const_expr(self.stage):
                    acc = self.staged_sums(gX, wbuf, sbuf, b, warp, lane, g, t)
                else:
                    acc = [Float32(0.0) for _ in range(4 * self.tiles)]  # values, so registers
                    for it in cutlass.range_constexpr(self.per_warp):
                        G0 = (warp * self.per_warp + it) * QUAD
                        bs = []  # the quad's activations as fp16 operands, shared by the row tiles
                        for i in cutlass.range_constexpr(QUAD):
                            bs.append(self.operands(gX, b, G0 + i, t))
                        for r in cutlass.range_constexpr(self.tiles):
                            j = j0 + r * ROWS13
                            u1 = quad_words(gW, e, j, G0, t, self.qm)
                            u3 = quad_words(gW, e, self.I + j, G0, t, self.qm)
                            sw1 = w_scale[e, j, G0 // QUAD]  # the quad's four ue8m0 scale bytes
                            sw3 = w_scale[e, self.I + j, G0 // QUAD]
                            for i in cutlass.range_constexpr(QUAD):
                                _group_acc(acc, 4 * r, u1[i], u3[i], bs[i], lambda: mx_scale_of(sw1, i),
                                           lambda: mx_scale_of(sw3, i), self.qm != 0)
                for r in cutlass.range_constexpr(self.tiles):
                    red[g, 2 * t, warp, r] = acc[4 * r]
                    red[g, 2 * t + 1, warp, r] = acc[4 * r + 1]
                    red[ROWS13 + g, 2 * t, warp, r] = acc[4 * r + 2]
                    red[ROWS13 + g, 2 * t + 1, warp, r] = acc[4 * r + 3]
                cute.arch.barrier()
                for q in cutlass.range_constexpr(-(-ROWS13 * COLS * self.tiles // (32 * self.warps))):
                    i = q * 32 * self.warps + tidx  # one (tile, row, column) of the reduction per thread
                    if i < ROWS13 * COLS * self.tiles:
                        r = i // (ROWS13 * COLS)
                        row = i % (ROWS13 * COLS) // COLS
                        n = i % COLS
                        if tile * COLS + n < length:
                            h1 = Float32(0.0)
                            h3 = Float32(0.0)
                            for k in cutlass.range_constexpr(self.warps):
                                h1 = h1 + red[row, n, k, r]
                                h3 = h3 + red[ROWS13 + row, n, k, r]
                            act[order[start + tile * COLS + n], bx * ROWS13 * self.tiles + r * ROWS13 + row] = (
                                situ_glu(h1, h3).to(act.element_type))
                cute.arch.barrier()  # the next tile reuses `red`

        def operands(self, gX: cute.Tensor, b, G, t):
            """Token b's activations 8t..8t+7 of MX group G as the four fp16x2 mma operands (inlined where it is
            called): used as loaded with `x_operands`, else converted from bf16."""
            xs = load4(gX[(None, (b, G * 4 + t))])
            if self.x_operands:
                return [xs[0], xs[1], xs[2], xs[3]]
            return mma_operands([xs[0], xs[1], xs[2], xs[3]], True)

        def stage_weights(self, gW: cute.Tensor, w_scale: cute.Tensor, wbuf: cute.Tensor, sbuf: cute.Tensor, e, j0,
                          warp, lane, g, t):
            """The staged form's start: this lane's weight slices of every (quad, row tile, w1 / w3) slot (`_slot`)
            copied into its own slots of `wbuf`, and every 4th scale word of its row from slot t on into `sbuf`
            [row, slot, warp] (inlined where it is called)."""
            for it in range(self.per_warp):
                G0 = (warp * self.per_warp + it) * QUAD
                for r in range(self.tiles):
                    for h in range(2):
                        copy_async_16(gW[(None, (e, j0 + r * ROWS13 + h * self.I, G0 + t))],
                                      wbuf[(None, lane, self._slot(it, r, h), warp)])
            one = (1, 1, 1)
            gS, sS = cute.zipped_divide(w_scale, one), cute.zipped_divide(sbuf, one)
            for q in range(self.slots // 4):  # slots is a multiple of 4: per_warp quads x tiles x 2
                slot = 4 * q + t
                it = slot // (2 * self.tiles)
                r = slot // 2 % self.tiles
                h = slot % 2
                copy_async_words(gS[(None, (e, j0 + r * ROWS13 + h * self.I, warp * self.per_warp + it))],
                                 sS[(None, (g, slot, warp))])
            cute.arch.cp_async_commit_group()

        @cute.jit
        def staged_sums(self, gX: cute.Tensor, wbuf: cute.Tensor, sbuf: cute.Tensor, b, warp, lane, g, t):
            """The staged form's dot products for token b's activations: `unroll` quads per iteration of a loop the
            compiler keeps (the first waits for this lane's copies, then for the warp's, since the scale words
            come from the row's four lanes); returns the `4 * tiles` accumulators as the unstaged loop has them."""
            acc = cute.make_rmem_tensor((4 * self.tiles,), Float32)
            acc.fill(0.0)
            for it in cutlass.range(self.per_warp, unroll=self.unroll):
                G0 = (warp * self.per_warp + it) * QUAD
                bs = []
                for i in cutlass.range_constexpr(QUAD):
                    bs.append(self.operands(gX, b, G0 + i, t))
                cute.arch.cp_async_wait_group(0)  # nothing left after the first quad: no wait
                cute.arch.sync_warp()
                for r in cutlass.range_constexpr(self.tiles):
                    slot = self._slot(it, r, 0)
                    v1 = load4(wbuf[(None, lane, slot, warp)])
                    v3 = load4(wbuf[(None, lane, slot + 1, warp)])
                    u1 = quad_exchange([v1[0], v1[1], v1[2], v1[3]], t, self.qm)
                    u3 = quad_exchange([v3[0], v3[1], v3[2], v3[3]], t, self.qm)
                    sw1 = sbuf[g, slot, warp]
                    sw3 = sbuf[g, slot + 1, warp]
                    for i in cutlass.range_constexpr(QUAD):
                        _group_acc(acc, 4 * r, u1[i], u3[i], bs[i], lambda: mx_scale_of(sw1, i),
                                   lambda: mx_scale_of(sw3, i), self.qm != 0)
            return [acc[i] for i in range(4 * self.tiles)]

    class MoEW2Grouped:
        """out[p, r] = weight[p] * (w2[e, r, :used] . act[p, :used]) for every pair p of expert e."""

        def __init__(self, latent: int, used: int, topk: int, tiles: int, scale_words: bool, pairs: int,
                     quad_major: int = 0, stage: bool = False, ahead: bool = False):
            """`scale_words`: `w_scale` comes as int32 words (each row's scale bytes a multiple of 4); `quad_major`: as
            `MoEW13Grouped`'s; `pairs`: the segment slots (B x k), over `segment_ctas` CTAs along the segments, each
            looping over its share. `stage` (`grouped_staged`, with `scale_words`, on rows of whole quads of MX
            groups or quad-major ones with a last pair): each lane copies its words of the next segment's rows into
            one of two shared-memory buffers (`cp.async`: 16 bytes per quad of groups, 8 for the last pair; the four
            lanes of a row share its scale words) while the CTA works on the current segment from the other; the row
            tiles are then one per iteration of a loop the compiler keeps, and their number per warp the most of
            `tiles` whose buffers fit W2_STAGE_BYTES. `ahead` (`w2_ahead`): lane i holds the CTA's i-th segment's
            length, start and expert from the start, and each segment's first tile of pairs (the act operands' pair
            and the two output columns') is loaded during the segment before it, so a segment starts with its act
            and weight loads side by side instead of after two round trips (its table entry, then its pairs)."""
            self.topk = topk
            self.ahead = ahead
            self.qm = quad_major
            self.groups = used // GROUP
            self.quads = self.groups // QUAD  # 16-byte slices per row and lane
            self.rest = self.groups - self.quads * QUAD  # single words per row and lane after them
            self.pair_tail = bool(quad_major) and self.rest == 2  # lane t's 2 words side by side (`quad_major`)
            self.swords = -(-self.groups // QUAD)  # scale words per row
            self.scale_words = scale_words
            # staged rows are whole quads, or quad-major with a last pair of groups (8 bytes side by side per lane)
            self.stage = stage and scale_words and self.swords <= 4 and (self.rest == 0 or self.pair_tail)
            if self.stage:
                tiles = next((n for n in (4, 2, 1) if n <= tiles and self.stage_bytes(n) <= W2_STAGE_BYTES), 1)
            self.tiles = _tiles(latent // ROWS2_CTA, tiles)
            self.seg_ctas = segment_ctas(pairs, latent // (ROWS2_CTA * self.tiles))

        def stage_bytes(self, tiles: int | None = None) -> int:
            """Shared memory of the two segment buffers (weight words and scale words) at `tiles` row tiles per warp
            (this kernel's by default)."""
            tiles = self.tiles if tiles is None else tiles
            per_half = 32 * (16 * self.quads + 4 * self.rest) + ROWS13 * 4 * self.swords
            return 2 * tiles * 2 * per_half * WARPS

        @cute.jit
        def __call__(self, act: cute.Tensor, weights: cute.Tensor, w: cute.Tensor, w_scale: cute.Tensor,
                     order: cute.Tensor, seg_start: cute.Tensor, seg_len: cute.Tensor, seg_expert: cute.Tensor,
                     out: cute.Tensor, stream):
            L = out.shape[1]
            gA = cute.zipped_divide(act, (1, 4))  # int32 pairs of fp16: ((1,4), (P, used/8))
            gW = cute.zipped_divide(w, (1, 1, 4))  # one MX group (16 bytes) per tile
            self.kernel(gA, weights, w, gW, w_scale, order, seg_start, seg_len, seg_expert, out).launch(
                grid=[L // (ROWS2_CTA * self.tiles), self.seg_ctas, 1], block=[32 * WARPS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, gA: cute.Tensor, weights: cute.Tensor, w: cute.Tensor, gW: cute.Tensor,
                   w_scale: cute.Tensor, order: cute.Tensor, seg_start: cute.Tensor, seg_len: cute.Tensor,
                   seg_expert: cute.Tensor, out: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, by, _ = cute.arch.block_idx()
            warp, lane, g, t = mma_lanes(tidx)
            r0 = (bx * WARPS + warp) * 16 * self.tiles + g  # this warp's rows: tiles of 16 from here
            smem = cutlass.utils.SmemAllocator()
            on = self.stage
            halves = 2 * self.tiles if on else 1
            nb, nw = (2, WARPS) if on else (1, 1)
            qbuf = smem.allocate_tensor(Int32, cute.make_layout(((1, 4), 32, halves * max(self.quads, 1), nb, nw)), 16)
            pair = on and self.pair_tail
            rbuf = smem.allocate_tensor(Int32, cute.make_layout(
                ((1, 2), 32 if pair else 1, halves if pair else 1, nb if pair else 1, nw if pair else 1)), 16)
            sbuf = smem.allocate_tensor(Int32, cute.make_layout((ROWS13, halves * self.swords, nb, nw)), 16)
            if cutlass.const_expr(self.ahead):
                n, mine = _segments(seg_len, by, lane, self.seg_ctas, seg_start, seg_expert)
                first = _from_lane(mine, 0)
                pa, qa0, qa1 = _tile_pairs(order, first[1], first[0], 0, g, t)  # the next segment's first tile
                e_next = first[2]
            else:
                n = _segments(seg_len, by, lane, self.seg_ctas)  # this CTA's non-empty segments
            if cutlass.const_expr(on):
                if n > 0:
                    if cutlass.const_expr(self.ahead):
                        self.stage_rows(gW, w, w_scale, e_next, qbuf, rbuf, sbuf, 0, r0, lane, warp, g, t)
                    else:
                        self.stage_rows(gW, w, w_scale, seg_expert[by], qbuf, rbuf, sbuf, 0, r0, lane, warp, g, t)
                cute.arch.cp_async_commit_group()
            for i in cutlass.range(n):
                if cutlass.const_expr(self.ahead):
                    length, start, e = _from_lane(mine, i)
                    pf, qf0, qf1 = pa, qa0, qa1  # this segment's first tile, loaded during the one before
                    nxt = _from_lane(mine, select_i32(i + 1 < n, i + 1, i))
                    pa, qa0, qa1 = _tile_pairs(order, nxt[1], nxt[0], 0, g, t)
                    e_next = nxt[2]
                else:
                    s = by + i * self.seg_ctas
                    length = seg_len[s]
                    start = seg_start[s]
                    e = seg_expert[s]
                if cutlass.const_expr(on):
                    cute.arch.sync_warp()  # every lane is done with the buffer the next segment goes into
                    if i + 1 < n:
                        if cutlass.const_expr(self.ahead):
                            self.stage_rows(gW, w, w_scale, e_next, qbuf, rbuf, sbuf, (i + 1) % 2, r0, lane, warp, g,
                                            t)
                        else:
                            self.stage_rows(gW, w, w_scale, seg_expert[s + self.seg_ctas], qbuf, rbuf, sbuf,
                                            (i + 1) % 2, r0, lane, warp, g, t)
                    cute.arch.cp_async_commit_group()  # (an empty group for the last segment)
                if cutlass.const_expr(self.ahead):
                    self.pair_tile(gA, gW, w, w_scale, qbuf, rbuf, sbuf, i % 2, e, pf, (qf0, qf1), weights, order,
                                   out, start, length, 0, r0, lane, warp, g, t)
                    for tile in cutlass.range(1, (length + COLS - 1) // COLS):
                        pt, qt0, qt1 = _tile_pairs(order, start, length, tile, g, t)
                        self.pair_tile(gA, gW, w, w_scale, qbuf, rbuf, sbuf, i % 2, e, pt, (qt0, qt1), weights, order,
                                       out, start, length, tile, r0, lane, warp, g, t)
                else:
                    for tile in cutlass.range((length + COLS - 1) // COLS):
                        col = tile * COLS + g
                        if col >= length:
                            col = length - 1
                        p = order[start + col]
                        self.pair_tile(gA, gW, w, w_scale, qbuf, rbuf, sbuf, i % 2, e, p, None, weights, order, out,
                                       start, length, tile, r0, lane, warp, g, t)

        @cute.jit
        def pair_tile(self, gA: cute.Tensor, gW: cute.Tensor, w: cute.Tensor, w_scale: cute.Tensor, qbuf: cute.Tensor,
                      rbuf: cute.Tensor, sbuf: cute.Tensor, buf, e, p, qs, weights: cute.Tensor, order: cute.Tensor,
                      out: cute.Tensor, start, length, tile, r0, lane, warp, g, t):
            """One tile of 8 pairs of a segment of expert e: this lane's act operands (pair p, its mma column), the
            row tiles' dot products (from buffer `buf` staged, else loaded) and the routing-weighted outputs of its
            two columns, whose pairs `qs` gives where they were loaded ahead (else they are loaded here)."""
            bs = []  # the act operands of every group, as values (registers)
            for G in cutlass.range_constexpr(self.groups):
                xs = load4(gA[(None, (p, G * 4 + t))])
                bs.append(mma_operands([xs[0], xs[1], xs[2], xs[3]], False))
            if cutlass.const_expr(self.stage):
                cute.arch.cp_async_wait_group(1)  # all but the newest group: this segment's rows are in
                cute.arch.sync_warp()  # and the scale words the row's other lanes copied
                self.staged_tiles(qbuf, rbuf, sbuf, buf, bs, weights, order, out, start, length, tile, r0, lane,
                                  warp, g, t, qs)
            else:
                cols = None if qs is None else self.columns(qs, weights, length, tile, t)
                acc = [Float32(0.0) for _ in range(4 * self.tiles)]
                for r in cutlass.range_constexpr(self.tiles):
                    ra = r0 + 16 * r
                    wa = _row_words(gW, w, e, ra, t, self.groups, self.qm)
                    wb = _row_words(gW, w, e, ra + 8, t, self.groups, self.qm)
                    sa = _row_scales(w_scale, e, ra, self.groups, self.scale_words)
                    sb = _row_scales(w_scale, e, ra + 8, self.groups, self.scale_words)
                    for G in cutlass.range_constexpr(self.groups):
                        _group_acc(acc, 4 * r, wa[G], wb[G], bs[G], sa[G], sb[G], self.qm != 0)
                # this lane holds columns 2t and 2t + 1 of rows r0 + 16r and r0 + 16r + 8
                if cutlass.const_expr(qs is None):
                    for h in cutlass.range_constexpr(2):
                        n_ = tile * COLS + 2 * t + h
                        if n_ < length:
                            q = order[start + n_]
                            wt = weights[q // self.topk, q % self.topk]
                            for r in cutlass.range_constexpr(self.tiles):
                                out[q, r0 + 16 * r] = (wt * acc[4 * r + h]).to(out.element_type)
                                out[q, r0 + 16 * r + 8] = (wt * acc[4 * r + 2 + h]).to(out.element_type)
                else:
                    for h in cutlass.range_constexpr(2):
                        if cols[h][0]:  # (inside the segment, pair, routing weight)
                            for r in cutlass.range_constexpr(self.tiles):
                                out[cols[h][1], r0 + 16 * r] = (cols[h][2] * acc[4 * r + h]).to(out.element_type)
                                out[cols[h][1], r0 + 16 * r + 8] = (cols[h][2] * acc[4 * r + 2 + h]).to(
                                    out.element_type)

        def columns(self, qs, weights: cute.Tensor, length, tile, t):
            """This lane's two output columns 2t, 2t + 1 of a tile: (inside the segment, pair, routing weight) each,
            from their pairs `qs`."""
            return [(tile * COLS + 2 * t + h < length, qs[h], weights[qs[h] // self.topk, qs[h] % self.topk])
                    for h in range(2)]

        @cute.jit
        def stage_rows(self, gW: cute.Tensor, w: cute.Tensor, w_scale: cute.Tensor, e, qbuf: cute.Tensor,
                       rbuf: cute.Tensor, sbuf: cute.Tensor, buf, r0, lane, warp, g, t):
            """This lane's words of expert e's rows (each row tile's r0 + 16 r and r0 + 16 r + 8: row half v = 2 r +
            h) copied into buffer `buf`: the 16 bytes of quad q at qbuf[lane, v * quads + q], the two words of a last
            pair of groups (quad-major rows) at rbuf[lane, v] as one 8-byte copy, and scale word t of the row (lanes
            t < scale words) at sbuf[g, v * swords + t]."""
            one = (1, 1, 1)
            gw2, gs1 = cute.zipped_divide(w, (1, 1, 2)), cute.zipped_divide(w_scale, one)
            sb1 = cute.zipped_divide(sbuf, (1, 1, 1, 1))
            for r in cutlass.range_constexpr(self.tiles):
                for h in cutlass.range_constexpr(2):
                    row = r0 + 16 * r + 8 * h
                    v = 2 * r + h
                    for q in cutlass.range_constexpr(self.quads):
                        copy_async_16(gW[(None, (e, row, q * QUAD + t))],
                                      qbuf[(None, lane, v * self.quads + q, buf, warp)])
                    if cutlass.const_expr(self.pair_tail):
                        copy_async_words(gw2[(None, (e, row, _word_col(self.quads * QUAD, t, self.qm) // 2))],
                                         rbuf[(None, lane, v, buf, warp)], 2)
                    if t < self.swords:
                        copy_async_words(gs1[(None, (e, row, t))],
                                         sb1[(None, (g, v * self.swords + t, buf, warp))])

        @cute.jit
        def staged_tiles(self, qbuf: cute.Tensor, rbuf: cute.Tensor, sbuf: cute.Tensor, buf, bs, weights: cute.Tensor,
                         order: cute.Tensor, out: cute.Tensor, start, length, tile, r0, lane, warp, g, t, qs=None):
            """The staged form's row tiles for one tile of 8 pairs, one per iteration of a loop the compiler keeps:
            each reads its two row halves' words and scale words from buffer `buf` and stores its four outputs (for
            the pairs `qs` where given, else loaded here)."""
            if cutlass.const_expr(qs is None):
                q = []  # the pairs of this lane's two columns, their routing weights and whether they exist
                for h in cutlass.range_constexpr(2):
                    n_ = tile * COLS + 2 * t + h
                    inside = n_ < length
                    qq = order[start + select_i32(inside, n_, length - 1)]
                    q.append((inside, qq, weights[qq // self.topk, qq % self.topk]))
            else:
                q = self.columns(qs, weights, length, tile, t)
            for r in cutlass.range(self.tiles, unroll=1):
                wa = self.staged_row(qbuf, rbuf, buf, 2 * r, lane, warp, t)
                wb = self.staged_row(qbuf, rbuf, buf, 2 * r + 1, lane, warp, t)
                acc = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
                for G in cutlass.range_constexpr(self.groups):
                    _group_acc(acc, 0, wa[G], wb[G], bs[G],
                               lambda: mx_scale_of(sbuf[g, 2 * r * self.swords + G // QUAD, buf, warp], G % QUAD),
                               lambda: mx_scale_of(sbuf[g, (2 * r + 1) * self.swords + G // QUAD, buf, warp],
                                                   G % QUAD), self.qm != 0)
                for h in cutlass.range_constexpr(2):
                    if q[h][0]:  # (inside the segment, pair, routing weight)
                        out[q[h][1], r0 + 16 * r] = (q[h][2] * acc[h]).to(out.element_type)
                        out[q[h][1], r0 + 16 * r + 8] = (q[h][2] * acc[2 + h]).to(out.element_type)

        def staged_row(self, qbuf: cute.Tensor, rbuf: cute.Tensor, buf, v, lane, warp, t):
            """Word t of every MX group of row half v (`stage_rows`), from buffer `buf`, as `_row_words` gives them."""
            words = []
            for q in range(self.quads):
                x = load4(qbuf[(None, lane, v * self.quads + q, buf, warp)])
                words += quad_exchange([x[0], x[1], x[2], x[3]], t, self.qm)
            if self.pair_tail:
                x = load4(rbuf[(None, lane, v, buf, warp)])
                words += [x[0], x[1]]
            return words


def latent_operands(latent: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """latent bf16 [B, L] -> fp16 [B, L] in the order of the w13 kernel's mma operands (`moe_mxfp4.mma_operands`):
    every 8 values a0..a7 as a0 a4 a1 a5 a2 a6 a3 a7, each rounded as the kernels round (bf16 -> fp16, to nearest
    even). What `moe_align.moe_align`'s conversion CTAs write, in torch."""
    B, L = latent.shape
    ops = latent.view(B, L // 8, 2, 4).transpose(-1, -2).reshape(B, L).to(torch.float16)
    return ops if out is None else out.copy_(ops)


def _check(latent, ids, weights, w13, w13_scale, w2, w2_scale, used, align, act, pair_out, x_operands=False):
    """The per-pair kernels' checks (layouts, chaining, dtypes, contiguity, 32-bit offsets), then what grouping adds."""
    check_expert_args(latent, ids, w13, w13_scale, w2, w2_scale, used, act, pair_out,
                      torch.float16 if x_operands else torch.bfloat16, (torch.float32, torch.bfloat16))
    P, L = ids.numel(), latent.shape[1]
    if not fits_int32_offsets(pair_out):
        raise ValueError("grouped MoE MXFP4: a per-pair output of 2**31 bytes or more needs 64-bit offsets, which "
                         "these kernels do not use")
    if L % ROWS2_CTA:
        raise ValueError(f"grouped MoE MXFP4: latent width must be a multiple of {ROWS2_CTA}")
    if any(a.shape != (P,) or a.dtype != torch.int32 or not a.is_contiguous() for a in align):
        raise ValueError("grouped MoE MXFP4: the alignment must be four contiguous int32 [pairs]")
    if not weights.is_contiguous():
        raise ValueError("grouped MoE MXFP4: inputs must be contiguous")
    if pair_out.shape != (P, L):  # act's shape is `check_expert_args`'
        raise ValueError(f"grouped MoE MXFP4: the per-pair output must be [{P}, {L}]")


def kernel_args(latent, weights, w13, w13_scale, w2, w2_scale, align, act, pair_out):
    """The two kernels' tensors, as compiled and launched: codes, activations and (where rows allow) scales as int32
    words."""
    a13 = (_words(latent), _words(w13), _words(w13_scale), *align, act)
    a2 = (_words(act), weights, _words(w2), w2_scales(w2_scale), *align, pair_out)
    return a13, a2


def compile_grouped(latent, ids, weights, w13, w13_scale, w2, w2_scale, align, act, pair_out, used: int,
                    quad_major: bool = False, x_operands: bool = False):
    L, I, k = latent.shape[1], w13.shape[1] // 2, ids.shape[1]
    t13, t2 = grouped_tiles("w13"), grouped_tiles("w2")
    qm13, qm2 = layout_groups(w13, w2, quad_major)
    a13, a2 = kernel_args(latent, weights, w13, w13_scale, w2, w2_scale, align, act, pair_out)
    stage13, stage2 = grouped_staged("w13"), grouped_staged("w2", used)
    k13 = MoEW13Grouped(L, I, used, k, t13, qm13, stage13, x_operands, w13_unroll(), ids.numel(),
                        w13_seg_div(ids.numel()))
    f13 = compile_kernel(("moe_w13_grouped", used, t13, qm13, stage13, x_operands, k13.unroll, k13.seg_rows,
                          *signature(*a13)), k13, *(fake_like(t, align=16) for t in a13))
    ahead = w2_ahead()
    k2 = MoEW2Grouped(L, used, k, t2, a2[3].dtype == torch.int32, ids.numel(), qm2, stage2, ahead)
    f2 = compile_kernel(("moe_w2_grouped", used, k2.tiles, qm2, k2.seg_ctas, stage2, ahead, *signature(*a2)), k2,
                        *(fake_like(t, align=16) for t in a2))
    return f13, f2


def moe_mxfp4_grouped(latent, ids, weights, w13, w13_scale, w2, w2_scale, used: int, align, act=None,
                      pair_out=None, summed: bool = True, quad_major: bool = False, x_operands: bool = False):
    """Routed experts of one rank, each selected expert read once: latent [B, L] bf16, ids [B, k] int32, weights
    [B, k] fp32, `align` the four int32 [B*k] outputs of `moe_align(ids)` (order, segment start, length, expert)
    -> [B, L] fp32, the weighted sum over each token's k experts, or without `summed` the routing-weighted outputs
    per pair [B, k, L] (for a consumer that adds them itself, `rmsnorm.routed_norm`). `act` [B*k, used] fp16 and
    `pair_out` [B*k, L] fp32, or bf16 (each pair's output rounded once, half the bytes written and read back), may
    be given (overwritten). `quad_major`: w13 and w2 come in `moe_mxfp4.quad_major` order. `x_operands`: `latent`
    comes as fp16 mma operands (`latent_operands`), not bf16."""
    B, k = ids.shape
    L = latent.shape[1]
    act = act if act is not None else torch.empty(B * k, used, dtype=torch.float16, device=latent.device)
    pair_out = pair_out if pair_out is not None else torch.empty(B * k, L, dtype=torch.float32, device=latent.device)
    _check(latent, ids, weights, w13, w13_scale, w2, w2_scale, used, align, act, pair_out, x_operands)
    f13, f2 = compile_grouped(latent, ids, weights, w13, w13_scale, w2, w2_scale, align, act, pair_out, used,
                              quad_major, x_operands)
    a13, a2 = kernel_args(latent, weights, w13, w13_scale, w2, w2_scale, align, act, pair_out)
    launch(f13, *a13)
    launch(f2, *a2)
    return pair_out.view(B, k, L).sum(1, dtype=torch.float32) if summed else pair_out.view(B, k, L)
