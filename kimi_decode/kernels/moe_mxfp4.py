"""Routed experts at small batch with MXFP4 weights dequantised in registers, in two kernels and no padding.

`moe_w13_act`: for each (token, selected expert) pair and each intermediate row j, the w1 and w3 rows against the
token's latent vector, then SiTU-GLU(h1, h3) -> act (fp16). `moe_w2_sum`: for each token and latent row r, the sum
over the token's k experts of routing weight x (w2 row r . act): the weighted sum over experts happens in registers,
so there is no per-expert output and no reduction kernel.

The arithmetic runs on tensor cores (`mma.sync m16n8k16`, fp16 operands, fp32 accumulation), which turns the
dequantisation into a few integer operations per code: the e2m1 code (sign, 2-bit exponent, 1-bit mantissa) shifted
into an fp16's sign, exponent and mantissa fields is the code's value times 2**-14, exactly (code 1, value 0.5, lands
on the fp16 subnormal 2**-15). The 2**14 is folded into the group's ue8m0 scale, applied in fp32 once per 32 codes.

Layout of one warp's work: a tile of 16 weight rows by one MX group (32 codes). Lane (g, t) = (lane // 4, lane % 4)
holds the 4-byte word t of the group's 16 bytes for rows g and g + 8, which holds codes 8t..8t+7; mma k-slots are
assigned so that those eight codes pair with activations 8t..8t+7 of the same lane (the dot product does not care
about the order of k). `moe_w13_act` (and the grouped kernels) load 16 bytes per lane, group t of four consecutive
groups, and exchange words within each quad of lanes (`quad_transpose`), since a 4-byte load per lane touches 8 rows
for 16 bytes each and bounds the kernel by load instructions. On codes in quad-major order (`quad_major`: each row's
quads of groups stored as a 4 x 4 transpose of words) the same 16-byte load brings lane t word t of the four groups
directly, and no words are exchanged (every kernel here takes either layout, `quad_major=`); the quad-major copy also
moves each byte's two codes into fields that a 9-instruction dequantisation reads, instead of 11 (`mx_packed`,
`_DEQUANT_PACKED`). `moe_w2_sum`, whose rows are short (6 groups at TP16, 12 at TP8), loads chunks of 4 groups the
same way where they divide the row, else pairs (8 bytes per lane, `pair_transpose`), else the word itself
(`w2_chunk`). The warps of a CTA split the K groups between them and add their partial sums through shared memory.
The activation operand carries the same token in all 8 mma columns, so column 0 (lanes with t = 0) holds the result.
Only the expert rows the math needs are read: padded intermediate rows (TP16 stores 256, uses 192) are skipped."""
from __future__ import annotations

import os

import torch

from .cute_common import (HAVE_CUTE, compile_kernel, cute, cutlass, env_choice, env_flag, env_int, fake_like, launch,
                          mx_alu, mx_packed, norm_weight_first, signature, sm_count)

if HAVE_CUTE:
    from .cute_common import (count_done, last_cta, load4, mma_lanes, pdl_launch_dependents, pdl_reads_ahead,
                              pdl_wait, prefetch_l2, situ_glu, take_ticket, wait_count)
    from .gemv import SmallBatchGemv

GROUP = 32  # codes per MX group = 16 bytes = 4 words
WARPS = 8  # K slices per CTA
ROWS13 = 8  # intermediate rows per w13 CTA (w1 rows in mma rows 0-7, the matching w3 rows in 8-15)
ROWS2 = 16  # latent rows per w2 CTA
QUAD = 4  # MX groups per 16-byte weight load (`quad_words`)
# weight word pairs (rows ra and rb of one MX group) a w2 warp loads before its activations (in `MoEExperts`, before
# the wait for them): 14 is all of a TP16 warp's (16 experts x 6 groups over 7 warps) at 72 registers; all of TP8's
# 28 would need 252. With chunks of C groups per load (`w2_chunk`) that is 14 // C chunks.
W2_EARLY_ITEMS = 14
F16_SHIFT = 14  # fp16 value of a shifted code = e2m1 value * 2**-14

# e2m1 codes of one 32-bit word (8 codes, code i in bits 4i..4i+3) -> four fp16x2 registers holding the codes
# (i, i + 4) for i = 0..3, each as value * 2**-14: its magnitude bits at fp16 bits 9-11 (lo) / 25-27 (hi), its sign at
# 15 / 31, every other bit 0. Each byte of the word holds an even code (low nibble) and an odd one (high nibble); two
# masks and shifts put every even code's fields, then every odd code's, at the bit places an fp16's high byte wants
# (magnitude in bits 1-3, sign in bit 7), and a byte permute (`prmt`, zero bytes from z) moves two of those bytes into
# the high bytes of each fp16 pair: 11 instructions per word, bit-for-bit the values of the 20 of shifts and masks
# per register this replaced. ptxas makes the left shifts multiplies (the FMA pipe) and the rest, 9 per word, runs on
# the ALU pipe; {shr} is the odd codes' right shift by 3, a shift (ALU) or, with `mx_alu()`, the high word of a
# multiply by 2**29 (`mul.hi`, which ptxas keeps as a multiply: 8 ALU instructions per word).
_DEQUANT = """
    shl.b32 t0, {w}, 1;  and.b32 t0, t0, 0x0E0E0E0E;  shl.b32 t1, {w}, 4;  and.b32 t1, t1, 0x80808080;  or.b32 t0, t0, t1;
    {shr};  and.b32 t1, t1, 0x0E0E0E0E;  and.b32 t2, {w}, 0x80808080;  or.b32 t1, t1, t2;
    prmt.b32 {h}0, t0, z, 0x2404;  prmt.b32 {h}2, t0, z, 0x3414;  prmt.b32 {h}1, t1, z, 0x2404;  prmt.b32 {h}3, t1, z, 0x3414;
"""


# The same on packed codes (`quad_major` with `mx_packed()`): each byte holds its even code's sign in bit 7 and
# magnitude in bits 1-3, where an fp16's high byte wants them, and its odd code's magnitude in bits 4-6 and sign in
# bit 0. One mask then gives every even code's fields, and two shifts and two masks every odd code's: 9 instructions
# per word (8 on the ALU pipe, the left shift a multiply) against 11.
_DEQUANT_PACKED = """
    and.b32 t0, {w}, 0x8E8E8E8E;
    shr.u32 t1, {w}, 3;  and.b32 t1, t1, 0x0E0E0E0E;  shl.b32 t2, {w}, 7;  and.b32 t2, t2, 0x80808080;  or.b32 t1, t1, t2;
    prmt.b32 {h}0, t0, z, 0x2404;  prmt.b32 {h}2, t0, z, 0x3414;  prmt.b32 {h}1, t1, z, 0x2404;  prmt.b32 {h}3, t1, z, 0x3414;
"""


def _dequant(w: str, h: str, quad: bool = False) -> str:
    """`_DEQUANT` of word `w` into registers h0..h3, in the form `mx_alu()` asks for; `_DEQUANT_PACKED` where the
    word holds packed codes (`quad`: it comes from a `quad_major` copy, which packs them under `mx_packed()`)."""
    if quad and mx_packed():
        return _DEQUANT_PACKED.format(w=w, h=h)
    shr = f"mul.hi.u32 t1, {w}, 0x20000000" if mx_alu() else f"shr.u32 t1, {w}, 3"
    return _DEQUANT.format(w=w, h=h, shr=shr)


def _scale_of_asm(i: int, word: str = "$1", out: str = "t") -> str:
    """PTX of `mx_scale_of`'s multiply-add form: the fp32 bits of ue8m0 byte i of `word` times 2**14, into `out`."""
    pick = (f"and.b32 {out}, {word}, 0xFF", f"and.b32 {out}, {word}, 0xFF00", f"and.b32 {out}, {word}, 0xFF0000",
            f"mul.hi.u32 {out}, {word}, 0x100")[i]
    return f"{pick}; mad.lo.u32 {out}, {out}, {(1 << 23, 1 << 15, 1 << 7, 1 << 23)[i]}, {F16_SHIFT << 23};"


# Activations 8t..8t+7 as four 32-bit registers of pairs (x0,x1) (x2,x3) (x4,x5) (x6,x7) -> the fp16x2 operands
# (x0,x4) (x1,x5) (x2,x6) (x3,x7), matching the dequantised codes. From bf16 pairs: widen to fp32, round to fp16.
_B_FROM_BF16 = """
    shl.b32 f0, {x0}, 16; and.b32 f1, {x0}, 0xFFFF0000; shl.b32 f2, {x1}, 16; and.b32 f3, {x1}, 0xFFFF0000;
    shl.b32 f4, {x2}, 16; and.b32 f5, {x2}, 0xFFFF0000; shl.b32 f6, {x3}, 16; and.b32 f7, {x3}, 0xFFFF0000;
    cvt.rn.f16x2.f32 {b0}, f4, f0; cvt.rn.f16x2.f32 {b1}, f5, f1;
    cvt.rn.f16x2.f32 {b2}, f6, f2; cvt.rn.f16x2.f32 {b3}, f7, f3;
"""
_B_FROM_F16 = """
    prmt.b32 {b0}, {x0}, {x2}, 0x5410; prmt.b32 {b1}, {x0}, {x2}, 0x7632;
    prmt.b32 {b2}, {x1}, {x3}, 0x5410; prmt.b32 {b3}, {x1}, {x3}, 0x7632;
"""


def _b_operands(bf16_activations: bool, x: int, b: str) -> str:
    """The activation conversion with inputs $x..$x+3 and outputs b+"0".."3" (registers or operand numbers)."""
    names = {f"x{i}": f"${x + i}" for i in range(4)} | {f"b{i}": f"{b}{i}" for i in range(4)}
    return (_B_FROM_BF16 if bf16_activations else _B_FROM_F16).format(**names)


_MMA_PAIR = (" mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {e0, e1, e2, e3}, {ha0, hb0, ha1, hb1}, {b0, b1},"
             " {z, z, z, z};\n"
             " mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {ha2, hb2, ha3, hb3}, {b2, b3},"
             " {e0, e1, e2, e3};\n}")
_MMA_REGS = "{\n .reg .b32 t0, t1, t2, ha<4>, hb<4>, f<8>, b<4>, z, e<4>;\n mov.b32 z, 0;\n"


def _group_mma_asm(bf16_activations: bool, quad: bool = False) -> str:
    """PTX of one 16-row x 32-code group: $4 / $5 the words of rows g / g + 8 (`quad`: see `_dequant`), $6..$9 the
    activations; outputs $0..$3 the fp32 accumulator fragment (c0, c1: row g; c2, c3: row g + 8), unscaled."""
    return (_MMA_REGS + _dequant("$4", "ha", quad) + _dequant("$5", "hb", quad)
            + _b_operands(bf16_activations, 6, "b") + _MMA_PAIR)


def _operand_mma_asm(quad: bool = False) -> str:
    """`_group_mma_asm` with the activations already in operand form ($6..$9, from `_operands_asm`): kernels that
    use one activation group against several weight tiles convert it once."""
    return (_MMA_REGS + _dequant("$4", "ha", quad) + _dequant("$5", "hb", quad)
            + " mov.b32 b0, $6; mov.b32 b1, $7; mov.b32 b2, $8; mov.b32 b3, $9;\n" + _MMA_PAIR)


def _operands_asm(bf16_activations: bool) -> str:
    """Activations $4..$7 (as loaded) -> the four fp16x2 operand registers $0..$3 of `_operand_mma_asm`."""
    return "{\n .reg .b32 f<8>;\n" + _b_operands(bf16_activations, 4, "$") + "}"


def quad_split(latent: int, max_warps: int = WARPS) -> tuple[int, int]:
    """K = `latent` values in whole quads of MX groups over the most warps (up to `max_warps`) that take equal slices:
    (warps, quads per warp); K3: 28 quads, 7 warps of 4 (at most 4 warps: 4 of 7). Equal slices keep every group
    free of a per-warp condition, so the accumulators stay in registers."""
    quads = latent // (GROUP * QUAD)
    warps = next(n for n in range(max_warps, 0, -1) if quads % n == 0)
    return warps, quads // warps


def quad_transpose(v, t, select, bfly):
    """Lane t of a quad (t = lane % 4) holds v, the four words of MX group t of four consecutive groups (one 16-byte
    load); returns word t of groups 0..3, the layout the mma fragments take. Two butterfly rounds, over lanes t ^ 1
    and t ^ 2, each lane keeping two words and sending two, then a reorder: 4 shuffles and 16 selects.
    `select(c, a, b)` is c ? a : b and `bfly(x, d)` the x of lane t ^ d: the kernel's select and shuffle, or in the
    tests torch's over four simulated lanes."""
    b = (t & 1) != 0
    c = (t & 2) != 0
    k0, k1 = select(b, v[1], v[0]), select(b, v[3], v[2])  # own group, the words whose bit 0 is b
    r0, r1 = bfly(select(b, v[0], v[1]), 1), bfly(select(b, v[2], v[3]), 1)  # the same words of group t ^ 1
    p0, p1 = select(c, k1, k0), select(c, r1, r0)  # word t of groups t and t ^ 1
    q0, q1 = bfly(select(c, k0, k1), 2), bfly(select(c, r0, r1), 2)  # word t of groups t ^ 2 and t ^ 3
    plo, phi = select(b, p1, p0), select(b, p0, p1)
    qlo, qhi = select(b, q1, q0), select(b, q0, q1)
    return [select(c, qlo, plo), select(c, qhi, phi), select(c, plo, qlo), select(c, phi, qhi)]


def pair_transpose(v, t, select, fetch):
    """Lane t of a quad holds v, words 2 (t % 2) and 2 (t % 2) + 1 of MX group t // 2 of two consecutive groups (one
    8-byte load); returns word t of groups 0 and 1. Word t of group h sits in lane 2 h + t // 2, as its word t % 2:
    4 shuffles and 2 selects. `fetch(x, s)` is the x of quad lane s (a tensor of lanes in the tests)."""
    odd = (t & 1) != 0
    src = t >> 1
    out = []
    for h in range(2):
        lo, hi = fetch(v[0], src + 2 * h), fetch(v[1], src + 2 * h)
        out.append(select(odd, hi, lo))
    return out


def quad_major_fits(w: torch.Tensor) -> bool:
    """Whether `quad_major` takes these codes: uint8, an even number of 16-byte MX groups per row."""
    return w.dtype == torch.uint8 and w.shape[-1] % (2 * 16) == 0


def _pack_bytes(b: torch.Tensor, inverse: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each byte's two e2m1 codes (even code in bits 0-3, odd code in bits 4-7, sign bits 3 / 7) moved into the fields
    `_DEQUANT_PACKED` reads: the even code's sign to bit 7 and magnitude to bits 1-3, the odd code's sign to bit 0
    (its magnitude stays in bits 4-6); `inverse` moves them back. uint8 in, uint8 out (into `out`, which may be `b`
    itself), a slice at a time so that a layer's experts need no more than a slice of scratch memory."""
    out = torch.empty_like(b) if out is None else out
    src, dst = b.reshape(-1), out.view(-1)
    for i in range(0, src.numel(), 1 << 24):
        x = src[i:i + (1 << 24)]
        if inverse:
            y = ((x & 0x80) >> 4) | ((x & 0x0E) >> 1) | ((x & 0x01) << 7) | (x & 0x70)
        else:
            y = ((x & 0x08) << 4) | ((x & 0x07) << 1) | ((x & 0x80) >> 7) | (x & 0x70)
        dst[i:i + (1 << 24)] = y
    return out


def quad_major(w: torch.Tensor, inverse: bool = False, packed: bool | None = None) -> torch.Tensor:
    """MXFP4 codes [..., row bytes] (uint8, 16 bytes per MX group, an even number of groups per row) in the order in
    which the expert kernels' lanes read them without exchanging words: within each quad of 4 groups (64 bytes) of
    a row, word t of group c moves to word 4t + c (a 4 x 4 transpose of words), in a row's last pair of groups (when
    the groups are not a multiple of 4) to 2t + c. Lane t of a quad then finds word t of every group of a chunk
    side by side, what `quad_transpose` / `pair_transpose` assemble from natural rows. With `packed` (None:
    `mx_packed()`) each byte's two codes also move into the fields the packed dequantisation reads (`_pack_bytes`).
    A new tensor; `inverse` gives back the natural order. Made once per weight, outside the step
    (`latency_specialized`)."""
    if not quad_major_fits(w):
        raise ValueError("quad_major: uint8 MXFP4 codes with an even number of 16-byte groups per row expected")
    packed = mx_packed() if packed is None else packed
    if packed and inverse:
        w = _pack_bytes(w, inverse=True)
    groups = w.shape[-1] // 16
    full = groups // QUAD * QUAD
    words = w.contiguous().view(torch.int32).reshape(-1, groups * 4)
    rows = words.shape[0]
    out = torch.empty_like(words)
    if full:
        out[:, :full * 4] = words[:, :full * 4].reshape(rows, full // QUAD, 4, 4).transpose(-1, -2).reshape(rows, -1)
    if full < groups:
        n = groups - full
        tail = words[:, full * 4:].reshape(rows, *((4, n) if inverse else (n, 4)))
        out[:, full * 4:] = tail.transpose(-1, -2).reshape(rows, -1)
    out = out.view(torch.uint8).view(w.shape)
    return _pack_bytes(out, inverse=False, out=out) if packed and not inverse else out


def quad_major_offset(G, t, groups: int, select=None):
    """Where word t of MX group G lies in a quad-major row of `groups` groups (`quad_major`), in words. For a traced
    G in a row whose groups are not a multiple of 4, `select(c, a, b)` (c ? a : b) picks the chunk's width."""
    full = groups // QUAD * QUAD
    if full == groups:
        n = QUAD
    elif select is None:
        n = QUAD if G < full else groups - full
    else:
        n = select(G < full, QUAD, groups - full)
    return (G >> 2) * 16 + n * t + (G & 3)


if HAVE_CUTE:
    from cutlass import Float32, Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    def group_mma_fragment(wa, wb, xs, bf16_activations: bool, quad: bool = False):
        """The whole accumulator fragment of one MX group, before its scale: (row g, column 2t), (row g, 2t + 1),
        (row g + 8, 2t), (row g + 8, 2t + 1), column n being the activations of the lanes with lane // 4 = n."""
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.f32(), T.f32(), T.f32(), T.f32()]),
            [Int32(wa).ir_value(), Int32(wb).ir_value()] + [Int32(x).ir_value() for x in xs],
            _group_mma_asm(bf16_activations, quad), "=f,=f,=f,=f,r,r,r,r,r,r", has_side_effects=False,
            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        return tuple(Float32(llvm.extractvalue(T.f32(), res, [i])) for i in range(4))

    def mma_operands(xs, bf16_activations: bool):
        """One MX group's activations as loaded (four 32-bit words) -> the fp16x2 operands of `operand_mma`."""
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.i32(), T.i32(), T.i32(), T.i32()]), [Int32(x).ir_value() for x in xs],
            _operands_asm(bf16_activations), "=r,=r,=r,=r,r,r,r,r", has_side_effects=False, is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT)
        return [Int32(llvm.extractvalue(T.i32(), res, [i])) for i in range(4)]

    def store_operands(src: cute.Tensor, dst: cute.Tensor) -> None:
        """Eight bf16 activations (`src`, four int32 words) -> their four fp16x2 mma operands (`mma_operands`) into
        `dst` (four int32 words, shared or global memory; a plain function, inlined where it is called)."""
        xs = load4(src)
        ops = mma_operands([xs[0], xs[1], xs[2], xs[3]], True)
        r = cute.make_rmem_tensor_like(dst)
        for i in range(4):
            r[i] = ops[i]
        cute.autovec_copy(r, dst)

    def operand_mma(wa, wb, bs, quad: bool = False):
        """`group_mma_fragment` on operands from `mma_operands` (`quad`: the words come from a `quad_major` copy)."""
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.f32(), T.f32(), T.f32(), T.f32()]),
            [Int32(wa).ir_value(), Int32(wb).ir_value()] + [Int32(b).ir_value() for b in bs],
            _operand_mma_asm(quad), "=f,=f,=f,=f,r,r,r,r,r,r", has_side_effects=False, is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT)
        return tuple(Float32(llvm.extractvalue(T.f32(), res, [i])) for i in range(4))

    def select_i32(c, a, b):
        """c ? a : b on 32-bit integers (a select, not a branch)."""
        return Int32(cutlass.select_(c, Int32(a), Int32(b)))

    def _bfly(x, d):
        return cute.arch.shuffle_sync_bfly(x, offset=d)

    def byte_of(word, i: int):
        return (word >> (8 * i)) & 0xFF

    def quad_words(gW: cute.Tensor, e, row, G0, t, qm: int = 0):
        """Word t of MX groups G0..G0+3 of one weight row, from one 16-byte load per lane: in natural rows group G0 +
        t, then exchanged in the quad of lanes; in quad-major rows (`qm`, see `chunk_load`) the same 16 bytes hold
        them already."""
        return quad_exchange(chunk_load(gW, e, row, G0, t, QUAD, qm), t, qm)

    def quad_exchange(v, t, qm: int = 0):
        """Lane t's 16 bytes of a quad of MX groups, as loaded (global or shared memory) -> word t of each of the
        four groups: exchanged in the quad of lanes on natural rows, as they are on quad-major ones (`qm`)."""
        return v if qm else quad_transpose(v, t, select_i32, _bfly)

    def chunk_load(gW: cute.Tensor, e, row, G0, t, chunk: int, qm: int = 0):
        """Lane t's share of MX groups G0..G0+chunk-1 of one weight row, as loaded: `gW` is the row words divided
        into tiles of `chunk` words (`chunk_view`). Natural rows: 4: group G0 + t (16 bytes); 2: half t % 2 of group
        G0 + t // 2 (8 bytes); 1: word t of group G0. Quad-major rows (`quad_major`; `qm` their groups per row, 0
        for natural ones): word t of each of the chunk's groups, side by side (G0 a multiple of `chunk`)."""
        if chunk == 1:
            return [gW[e, row, quad_major_offset(G0, t, qm, select_i32) if qm else G0 * 4 + t]]
        if chunk == 2:
            v = load4(gW[(None, (e, row, quad_major_offset(G0, t, qm, select_i32) >> 1 if qm
                                      else (G0 + (t >> 1)) * 2 + (t & 1)))])
            return [v[0], v[1]]
        v = load4(gW[(None, (e, row, G0 + t))])  # the same 16 bytes in both layouts
        return [v[0], v[1], v[2], v[3]]

    def chunk_words(v, t, lane, chunk: int, qm: int = 0):
        """`chunk_load`'s words -> word t of each of the chunk's groups (what the mma fragment takes)."""
        if chunk == 1 or qm:
            return v
        if chunk == 2:
            base = lane - t
            return pair_transpose(v, t, select_i32, lambda x, src: cute.arch.shuffle_sync(x, offset=base + src))
        return quad_transpose(v, t, select_i32, _bfly)

    def chunk_view(w: cute.Tensor, chunk: int):
        """`w` (int32 words [E, rows, words]) divided for `chunk_load`."""
        return w if chunk == 1 else cute.zipped_divide(w, (1, 1, chunk))

    def _group_mma(wa, wb, xs, bf16_activations: bool, quad: bool = False):
        """(row g, row g + 8) partial dot products of one MX group, before its scale (every column holds the same
        token: column 0 is read)."""
        c = group_mma_fragment(wa, wb, xs, bf16_activations, quad)
        return c[0], c[2]

    def mx_scale(s):
        """2**(s - 127) * 2**14 as fp32, built from its bits (s is a ue8m0 byte, 0..254)."""
        return Float32(llvm.inline_asm(T.f32(), [Int32(s).ir_value()],
                                       "{\n .reg .b32 t;\n add.u32 t, $1, %d;\n shl.b32 $0, t, 23;\n}" % F16_SHIFT,
                                       "=f,r", has_side_effects=False, is_align_stack=False,
                                       asm_dialect=llvm.AsmDialect.AD_ATT))

    def mx_scale_of(word, i: int):
        """`mx_scale(byte_of(word, i))`: with `mx_alu()` as one mask (a `mul.hi` for the top byte, i = 3) and one
        `mad` that shifts the byte into an fp32's exponent field and adds the 14: `(word & 0xFF << 8i) * 2**(23 - 8i)
        + 14 * 2**23`, the same bits as `(byte + 14) << 23`."""
        if not mx_alu():
            return mx_scale(byte_of(word, i))
        asm = "{\n .reg .b32 t;\n %s\n mov.b32 $0, t;\n}" % _scale_of_asm(i)
        return Float32(llvm.inline_asm(T.f32(), [Int32(word).ir_value()], asm, "=f,r", has_side_effects=False,
                                       is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))

    def byte_scales(scale_bytes):
        """The fp32 scales of ue8m0 bytes, as functions to call where each is used (`mx_scale`)."""
        return [lambda b=b: mx_scale(b) for b in scale_bytes]

    def word_scales(word, n: int = QUAD):
        """The fp32 scales of a scale word's first n bytes, as functions to call where each is used: `mx_scale_of`;
        in the ALU form the bytes are taken out of the word here and converted at the call."""
        if mx_alu():
            return [lambda i=i: mx_scale_of(word, i) for i in range(n)]
        return byte_scales([byte_of(word, i) for i in range(n)])

    class MoEW13Act:
        """act[p, j] = SiTU-GLU(w1[e_p, j] . x_p, w3[e_p, j] . x_p) for j < used."""

        def __init__(self, latent: int, inter: int, used: int, topk: int, max_warps: int = WARPS,
                     x_once: bool = False, prefetch: bool = False, quad_major: int = 0, first: int = 0):
            """`w_scale` comes as int32 words (4 scale bytes each); K is split over up to `max_warps` warps in whole
            quads (`quad_split`), read with 16-byte loads (`quad_words`). `x_once` (`w13_x_once`): each warp turns
            its slice of the token's activations into mma operands once, into shared memory (`stage_x`), instead of
            every lane converting its 8 activations of every group (8 lanes of a warp hold the same ones).
            `prefetch` (`w13_prefetch`): once the expert id is known, each lane asks L2 for its slices of all of the
            warp's quads, so that their loads, which ptxas places after the activations' staging (the first) and the
            previous quad's mma (the others), find them there or on their way. `quad_major`: the weights' groups per
            row when they come in `quad_major` order (then no word exchange), 0 for natural rows. `first`
            (`w13_first`): the quads of each warp whose weight words and scales are loaded before the activations'
            staging, so that they are on their way beside the activations instead of after them (ptxas keeps that
            order; the others are loaded as the mma loop reaches them)."""
            self.I, self.used, self.topk = inter, used, topk
            self.qm = quad_major
            self.prefetch = prefetch
            self.warps, self.per_warp = quad_split(latent, max_warps)
            self.x_once = x_once
            self.units = self.per_warp * QUAD * 4  # a warp's (group, t) operand units of 16 bytes
            self.first = min(first, self.per_warp)

        def alloc_x(self, smem):
            """The shared-memory operand buffer `tile` takes: [4 words, units of every warp] (a stand-in of one unit
            when the activations are converted in registers)."""
            n = self.units * self.warps if self.x_once else 1
            return smem.allocate_tensor(Int32, cute.make_layout((4, n)), 16)

        @cute.jit
        def stage_x(self, gX: cute.Tensor, xbuf: cute.Tensor, b, warp, lane):
            """Unit u = 4 i + t of this warp: activations 8t..8t+7 of its group i, as the four fp16x2 operands of
            `operand_mma`, lane u % 32 converting units u, u + 32, ...; then a warp barrier (each warp reads only
            its own units)."""
            Gw = warp * (self.per_warp * QUAD)
            for r in cutlass.range_constexpr(-(-self.units // 32)):
                u = lane + 32 * r
                if cutlass.const_expr((r + 1) * 32 <= self.units):
                    self._stage_unit(gX, xbuf, b, Gw, warp * self.units + u, u)
                else:
                    if u < self.units:
                        self._stage_unit(gX, xbuf, b, Gw, warp * self.units + u, u)
            cute.arch.sync_warp()

        @cute.jit
        def _stage_unit(self, gX: cute.Tensor, xbuf: cute.Tensor, b, Gw, slot, u):
            store_operands(gX[(None, (b, (Gw + u // 4) * 4 + u % 4))], xbuf[None, slot])

        @cute.jit
        def __call__(self, x: cute.Tensor, ids: cute.Tensor, w: cute.Tensor, w_scale: cute.Tensor,
                     act: cute.Tensor, stream):
            P = act.shape[0]
            gX = cute.zipped_divide(x, (1, 4))  # int32 pairs of bf16: ((1,4), (B, L/8))
            gW = cute.zipped_divide(w, (1, 1, 4))  # one MX group (16 bytes) per tile: ((1,1,4), (E, 2I, L/32))
            self.kernel(gX, ids, gW, w_scale, act).launch(
                grid=[self.used // ROWS13, P, 1], block=[32 * self.warps, 1, 1], stream=stream, use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gX: cute.Tensor, ids: cute.Tensor, gW: cute.Tensor, w_scale: cute.Tensor,
                   act: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, p, _ = cute.arch.block_idx()
            pdl_launch_dependents(self.pdl)
            pdl_wait(self.pdl)
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((2 * ROWS13, self.warps)), 16)
            xbuf = self.alloc_x(smem)
            self.tile(gX, ids, gW, w_scale, act, red, xbuf, bx, p, tidx)

        @cute.jit
        def tile(self, gX: cute.Tensor, ids: cute.Tensor, gW: cute.Tensor, w_scale: cute.Tensor, act: cute.Tensor,
                 red: cute.Tensor, xbuf: cute.Tensor, bx, p, tidx):
            """Intermediate rows bx * ROWS13 .. of pair p: the whole kernel but for its shared memory, `red`
            [2 ROWS13, warps] fp32 and `xbuf` (`alloc_x`) (`MoEExperts` runs it as its first stage)."""
            warp, lane, g, t = mma_lanes(tidx)
            j = bx * ROWS13 + g
            b = p // self.topk
            e = ids[b, p % self.topk]
            if cutlass.const_expr(self.prefetch):
                for it in cutlass.range_constexpr(self.per_warp):
                    G0 = (warp * self.per_warp + it) * QUAD
                    prefetch_l2(gW[(None, (e, j, G0 + t))])
                    prefetch_l2(gW[(None, (e, self.I + j, G0 + t))])
            early = [self.quad_weights(gW, w_scale, e, j, warp, it, t) for it in range(self.first)]
            if cutlass.const_expr(self.x_once):
                self.stage_x(gX, xbuf, b, warp, lane)
            acc1 = Float32(0.0)
            acc3 = Float32(0.0)
            for it in cutlass.range_constexpr(self.per_warp):
                G0 = (warp * self.per_warp + it) * QUAD
                u1, u3, sw1, sw3 = self.quad_weights(gW, w_scale, e, j, warp, it, t, early)
                for i in cutlass.range_constexpr(QUAD):
                    if cutlass.const_expr(self.x_once):
                        bs = load4(xbuf[None, warp * self.units + (it * QUAD + i) * 4 + t])
                        c = operand_mma(u1[i], u3[i], [bs[0], bs[1], bs[2], bs[3]], self.qm != 0)
                        d1, d3 = c[0], c[2]
                    else:
                        xs = load4(gX[(None, (b, (G0 + i) * 4 + t))])
                        d1, d3 = _group_mma(u1[i], u3[i], [xs[0], xs[1], xs[2], xs[3]], True, self.qm != 0)
                    acc1 = acc1 + d1 * mx_scale_of(sw1, i)
                    acc3 = acc3 + d3 * mx_scale_of(sw3, i)
            if t == 0:
                red[g, warp] = acc1
                red[ROWS13 + g, warp] = acc3
            cute.arch.barrier()
            if warp == 0 and t == 0:
                h1 = Float32(0.0)
                h3 = Float32(0.0)
                for i in cutlass.range_constexpr(self.warps):
                    h1 = h1 + red[g, i]
                    h3 = h3 + red[ROWS13 + g, i]
                act[p, j] = situ_glu(h1, h3).to(act.element_type)

        def quad_weights(self, gW: cute.Tensor, w_scale: cute.Tensor, e, j, warp, it: int, t, loaded=()):
            """Quad `it` of this warp for row j: the w1 and w3 words (`quad_words`) and their four scale bytes each,
            or `loaded[it]` where those were loaded already (a plain function, inlined where it is called)."""
            if it < len(loaded):
                return loaded[it]
            G0 = (warp * self.per_warp + it) * QUAD
            return (quad_words(gW, e, j, G0, t, self.qm), quad_words(gW, e, self.I + j, G0, t, self.qm),
                    w_scale[e, j, G0 // QUAD], w_scale[e, self.I + j, G0 // QUAD])

    class MoEW2Sum:
        """out[b, r] = sum_j weight[b, j] * (w2[e_bj, r, :used] . act[b*k + j, :used]); with `scaled`, also
        scaled[b, r] = bf16(out[b, r] * norm_w[r]), the RMSNorm's input times its weight (the row's 1/rms is
        applied by the consumer, from the partial sums of squares). Each warp loads the weight words of all its
        (expert, group) items before the first activation: in `MoEExperts` the wait for the activations goes in
        between."""

        def __init__(self, used: int, topk: int, scaled: bool = False, warps: int = WARPS, early: bool = True,
                     chunk: int = 1, scale_words: bool = False, quad_major: int = 0, pre_wait: str = "auto",
                     norm_first: bool = False):
            """A warp's items are (expert slot, `chunk` consecutive MX groups), each row's chunk one load per lane
            (`chunk_load`: 4, 8 or 16 bytes); with `scale_words` (chunk 4) `w_scale` comes as int32 words and a
            chunk's four scale bytes are one load. `quad_major`: as `MoEW13Act`'s. `pre_wait` (`w2_pre_wait`): what
            else the warp does before the PDL wait where its first weight words come before it (`early`).
            `norm_first` (`norm_weight_first`): with `scaled`, the norm weight loaded with the tile's first loads."""
            if pre_wait not in W2_PRE_WAIT:
                raise ValueError(f"MoEW2Sum: pre_wait must be one of {', '.join(W2_PRE_WAIT)}, not {pre_wait!r}")
            self.topk = topk
            self.qm = quad_major
            self.scaled = scaled
            self.norm_first = scaled and norm_first
            self.warps = warps
            # under PDL, the weight words loaded before the wait: with the wait between them and the rest the kernel
            # takes 138 registers against 62 (TP8, sm_90a), so 1 CTA per SM instead of 4, which costs more than the
            # early loads save once the grid is several waves (at TP8 batch 8: 89 against 54 us, NOTES v15)
            self.early = early
            self.groups = used // GROUP
            self.chunk = chunk
            self.scale_words = scale_words and chunk == QUAD
            self.chunks = self.groups // chunk
            self.items = topk * self.chunks
            self.per_warp = -(-self.items // warps)
            self.early_items = W2_EARLY_ITEMS // chunk
            if pre_wait == "auto":  # the scales ahead where no weight word is left for after the wait
                pre_wait = "scales" if self.per_warp <= self.early_items else "weights"
            self.pre_wait = pre_wait

        def scales(self, w_scale: cute.Tensor, e, row, G0):
            """The fp32 scales of one row's chunk from group G0, as functions to call where each is used
            (`word_scales`): one word load with `scale_words`, else a byte each."""
            if self.scale_words:
                word = w_scale[e, row, G0 // QUAD]
                return word_scales(word)
            return byte_scales([w_scale[e, row, G0 + i] for i in range(self.chunk)])

        @cute.jit
        def __call__(self, act: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, w: cute.Tensor,
                     w_scale: cute.Tensor, out: cute.Tensor, ssq: cute.Tensor, norm_w: cute.Tensor,
                     scaled: cute.Tensor, stream):
            B, L = out.shape
            gA = cute.zipped_divide(act, (1, 4))  # int32 pairs of fp16: ((1,4), (P, used/8))
            self.kernel(gA, ids, weights, w, w_scale, out, ssq, norm_w, scaled).launch(
                grid=[L // ROWS2, B, 1], block=[32 * self.warps, 1, 1], stream=stream, use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gA: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, w: cute.Tensor,
                   w_scale: cute.Tensor, out: cute.Tensor, ssq: cute.Tensor, norm_w: cute.Tensor,
                   scaled: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, b, _ = cute.arch.block_idx()
            pdl_launch_dependents(self.pdl)
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((ROWS2, self.warps)), 16)
            self.tile(gA, ids, weights, w, w_scale, out, ssq, norm_w, scaled, red, bx, b, tidx, ssq, -1)

        @cute.jit
        def tile(self, gA: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, w: cute.Tensor,
                 w_scale: cute.Tensor, out: cute.Tensor, ssq: cute.Tensor, norm_w: cute.Tensor,
                 scaled: cute.Tensor, red: cute.Tensor, bx, b, tidx, counter: cute.Tensor, target: cutlass.Constexpr):
            """Latent rows bx * ROWS2 .. of token b (`red`: [ROWS2, warps] fp32 of shared memory). With `target` >=
            0 the CTA waits, after its weight loads, until counter[2 + b] reaches it (the token's act is written);
            with -1 it waits for the previous kernel (PDL): after the weight loads where what kernels two back wrote
            (the ids) may be read before the wait and `early` is set (`w2_early`), else first."""
            late = target < 0 and self.pdl and pdl_reads_ahead() and self.early
            if cutlass.const_expr(target < 0 and not late):
                pdl_wait(self.pdl)
            warp, lane, g, t = mma_lanes(tidx)
            ra = bx * ROWS2 + g
            rb = ra + ROWS2 // 2
            # `norm_first` (KIMI_DECODE_NORM_W_FIRST): the norm weight at the tile's rows now, not after the output
            # stores (each may alias it as far as the compiler knows: two round trips at the kernel's end)
            nwa = Float32(0.0)
            nwb = Float32(0.0)
            if cutlass.const_expr(self.norm_first):
                nwa = norm_w[ra]
                nwb = norm_w[rb]
            C = self.chunk
            gW = chunk_view(w, C)
            g16 = chunk_view(w, QUAD)  # the rows in 16-byte tiles (whole MX groups), for the L2 requests
            # per item: its expert slot k, first group G0, whether it is one, row ra's and rb's loads, expert id
            items = []
            pre = self.pre_wait if late else "weights"
            for it in cutlass.range_constexpr(self.per_warp):
                item = warp * self.per_warp + it
                valid = item < self.items  # the last warp's last items may lie past the end: weight 0
                item = select_i32(valid, item, self.items - 1)
                k = item // self.chunks
                G0 = item % self.chunks * C
                e = ids[b, k]
                va = vb = None
                if cutlass.const_expr(it < self.early_items):
                    va, vb = chunk_load(gW, e, ra, G0, t, C, self.qm), chunk_load(gW, e, rb, G0, t, C, self.qm)
                elif cutlass.const_expr(pre == "all"):  # the line of the chunk's first group, per row
                    prefetch_l2(g16[(None, (e, ra, G0))])
                    prefetch_l2(g16[(None, (e, rb, G0))])
                if cutlass.const_expr(pre in ("scales", "all")):
                    prefetch_l2(w_scale[e, ra, None])
                    prefetch_l2(w_scale[e, rb, None])
                items.append((k, G0, valid, va, vb, e))
            if cutlass.const_expr(target >= 0):
                wait_count(counter, 2 + b, target, tidx)
            if cutlass.const_expr(late):
                pdl_wait(True)
            acc_a = Float32(0.0)
            acc_b = Float32(0.0)
            for k, G0, valid, va, vb, e_early in items:
                e = ids[b, k] if pre == "weights" else e_early
                if cutlass.const_expr(va is None):
                    va, vb = chunk_load(gW, e, ra, G0, t, C, self.qm), chunk_load(gW, e, rb, G0, t, C, self.qm)
                wa, wb = chunk_words(va, t, lane, C, self.qm), chunk_words(vb, t, lane, C, self.qm)
                wt = Float32(cutlass.select_(valid, weights[b, k], Float32(0.0)))
                ka, kb = self.scales(w_scale, e, ra, G0), self.scales(w_scale, e, rb, G0)
                for i in cutlass.range_constexpr(C):
                    xs = load4(gA[(None, (b * self.topk + k, (G0 + i) * 4 + t))])
                    da, db = _group_mma(wa[i], wb[i], [xs[0], xs[1], xs[2], xs[3]], False, self.qm != 0)
                    acc_a = acc_a + da * (wt * ka[i]())
                    acc_b = acc_b + db * (wt * kb[i]())
            if t == 0:
                red[g, warp] = acc_a
                red[ROWS2 // 2 + g, warp] = acc_b
            cute.arch.barrier()
            if warp == 0:
                sa = Float32(0.0)
                sb = Float32(0.0)
                if t == 0:
                    for i in cutlass.range_constexpr(self.warps):
                        sa = sa + red[g, i]
                        sb = sb + red[ROWS2 // 2 + g, i]
                    out[b, ra] = sa
                    out[b, rb] = sb
                    if cutlass.const_expr(self.norm_first):
                        scaled[b, ra] = (sa * nwa).to(scaled.element_type)
                        scaled[b, rb] = (sb * nwb).to(scaled.element_type)
                    elif cutlass.const_expr(self.scaled):
                        scaled[b, ra] = (sa * norm_w[ra]).to(scaled.element_type)
                        scaled[b, rb] = (sb * norm_w[rb]).to(scaled.element_type)
                # this tile's share of the row's sum of squares, for the RMSNorm that follows
                q = cute.arch.warp_reduction(sa * sa + sb * sb, lambda x, y: x + y)
                if lane == 0:
                    ssq[b, bx] = q

    class MoEW13ActShared(MoEW13Act):
        """`MoEW13Act` with the shared experts' gate/up GEMV (SiTU-GLU epilogue, `gemv.SmallBatchGemv`, one row
        pair per warp) in CTAs of its own at the front of the grid: at batch 1 the shared experts then need no
        kernel (and no stream) of their own; their weight stream fills the bandwidth the latency-bound expert CTAs
        leave."""

        def __init__(self, latent: int, inter: int, used: int, topk: int, hidden: int, shared_inter: int,
                     split: int = 1, x_once: bool = False, prefetch: bool = False, quad_major: int = 0):
            super().__init__(latent, inter, used, topk, x_once=x_once, prefetch=prefetch, quad_major=quad_major)
            self.shared = SmallBatchGemv(1, shared_inter, hidden, accumulate=False, addend=False, glu=True,
                                         warps=self.warps, split=split)
            self.tiles = used // ROWS13
            self.n_shared = -(-shared_inter // self.shared.rows)
            self.S = shared_inter

        @cute.jit
        def __call__(self, x: cute.Tensor, ids: cute.Tensor, w: cute.Tensor, w_scale: cute.Tensor,
                     act: cute.Tensor, gate_up: cute.Tensor, hx: cute.Tensor, s_act: cute.Tensor, stream):
            self.shared.pdl = self.pdl
            P = act.shape[0]
            gX = cute.zipped_divide(x, (1, 4))
            gW = cute.zipped_divide(w, (1, 1, 4))
            gGU = cute.zipped_divide(gate_up, (1, 8))
            gH = cute.zipped_divide(hx, (1, 8))
            self.kernel(gX, ids, gW, w_scale, act, gGU, gH, s_act).launch(
                grid=[self.n_shared + self.tiles * P, 1, 1], block=[32 * self.warps, 1, 1], stream=stream,
                use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gX: cute.Tensor, ids: cute.Tensor, gW: cute.Tensor, w_scale: cute.Tensor,
                   act: cute.Tensor, gGU: cute.Tensor, gH: cute.Tensor, s_act: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((2 * ROWS13, self.warps)), 16)
            pre = self.shared.allocate_preload(smem)
            xbuf = self.alloc_x(smem)
            if bidx < self.n_shared:
                self.shared.project(gGU, gH, s_act, s_act, s_act, Int32(self.S), red, tidx, bidx, pre)
            else:
                pdl_launch_dependents(self.pdl)
                pdl_wait(self.pdl)
                q = bidx - self.n_shared
                self.tile(gX, ids, gW, w_scale, act, red, xbuf, q % self.tiles, q // self.tiles, tidx)

    class MoEW2SumShared(MoEW2Sum):
        """`MoEW2Sum` with the shared experts' down-projection (`gemv.SmallBatchGemv`, `row_lanes` lanes per row:
        32 // row_lanes rows per warp) in CTAs of its own after the expert CTAs (batch 1)."""

        def __init__(self, used: int, topk: int, scaled: bool, latent: int, hidden: int, shared_inter: int,
                     early: bool = True, chunk: int = 1, scale_words: bool = False, row_lanes: int = 32,
                     quad_major: int = 0, pre_wait: str = "auto", norm_first: bool = False):
            super().__init__(used, topk, scaled, early=early, chunk=chunk, scale_words=scale_words,
                             quad_major=quad_major, pre_wait=pre_wait, norm_first=norm_first)
            self.shared = SmallBatchGemv(1, hidden, shared_inter, accumulate=False, addend=False, warps=self.warps,
                                         row_lanes=row_lanes)
            self.tiles = latent // ROWS2
            self.H = hidden
            self.n_shared = -(-hidden // self.shared.rows)

        @cute.jit
        def __call__(self, act: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, w: cute.Tensor,
                     w_scale: cute.Tensor, out: cute.Tensor, ssq: cute.Tensor, norm_w: cute.Tensor,
                     scaled: cute.Tensor, down: cute.Tensor, s_act: cute.Tensor, s_out: cute.Tensor, stream):
            self.shared.pdl = self.pdl
            gA = cute.zipped_divide(act, (1, 4))
            gD = cute.zipped_divide(down, (1, 8))
            gS = cute.zipped_divide(s_act, (1, 8))
            self.kernel(gA, ids, weights, w, w_scale, out, ssq, norm_w, scaled, gD, gS, s_out).launch(
                grid=[self.tiles + self.n_shared, 1, 1], block=[32 * self.warps, 1, 1], stream=stream,
                use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gA: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, w: cute.Tensor,
                   w_scale: cute.Tensor, out: cute.Tensor, ssq: cute.Tensor, norm_w: cute.Tensor,
                   scaled: cute.Tensor, gD: cute.Tensor, gS: cute.Tensor, s_out: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((ROWS2, self.warps)), 16)
            pre = self.shared.allocate_preload(smem)
            if bidx < self.tiles:
                pdl_launch_dependents(self.pdl)
                self.tile(gA, ids, weights, w, w_scale, out, ssq, norm_w, scaled, red, bidx, 0, tidx, ssq, -1)
            else:
                self.shared.project(gD, gS, s_out, s_out, s_out, Int32(self.H), red, tidx, bidx - self.tiles, pre)

    class MoEExperts:
        """Both stages in one kernel (`moe_mxfp4` with `counters`): the w13 CTAs (tickets in pair order), then the
        w2 CTAs (tickets in token order), which load their weights and then wait for their token's act
        (`cute_common.take_ticket`): no kernel boundary between the two, and the w2 weight loads overlap the w13
        stage. counter[2 + b] counts token b's finished w13 CTAs, counter[1] the finished w2 CTAs."""

        def __init__(self, latent: int, inter: int, used: int, topk: int, batch: int, scaled: bool,
                     chunk: int = 1, scale_words: bool = False, x_once: bool = False, qm: tuple[int, int] = (0, 0),
                     norm_first: bool = False):
            self.w13 = MoEW13Act(latent, inter, used, topk, x_once=x_once, quad_major=qm[0])
            self.w2 = MoEW2Sum(used, topk, scaled, warps=self.w13.warps, chunk=chunk, scale_words=scale_words,
                               quad_major=qm[1], norm_first=norm_first)
            self.B, self.topk = batch, topk
            self.tiles13, self.tiles2 = used // ROWS13, latent // ROWS2
            self.n13, self.n2 = self.tiles13 * batch * topk, self.tiles2 * batch

        @cute.jit
        def __call__(self, x: cute.Tensor, ids: cute.Tensor, w13: cute.Tensor, w13_scale: cute.Tensor,
                     act: cute.Tensor, act_words: cute.Tensor, weights: cute.Tensor, w2: cute.Tensor,
                     w2_scale: cute.Tensor, out: cute.Tensor, ssq: cute.Tensor, norm_w: cute.Tensor,
                     scaled: cute.Tensor, counter: cute.Tensor, stream):
            self.w13.pdl = self.w2.pdl = self.pdl
            gX = cute.zipped_divide(x, (1, 4))
            gW = cute.zipped_divide(w13, (1, 1, 4))
            gA = cute.zipped_divide(act_words, (1, 4))  # act as the w2 stage reads it: int32 pairs of fp16
            self.kernel(gX, ids, gW, w13_scale, act, gA, weights, w2, w2_scale, out, ssq, norm_w, scaled,
                        counter).launch(grid=[self.n13 + self.n2, 1, 1], block=[32 * self.w13.warps, 1, 1],
                                        stream=stream, use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gX: cute.Tensor, ids: cute.Tensor, gW: cute.Tensor, w13_scale: cute.Tensor,
                   act: cute.Tensor, gA: cute.Tensor, weights: cute.Tensor, w2: cute.Tensor, w2_scale: cute.Tensor,
                   out: cute.Tensor, ssq: cute.Tensor, norm_w: cute.Tensor, scaled: cute.Tensor,
                   counter: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            pdl_launch_dependents(self.pdl)
            pdl_wait(self.pdl)
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((ROWS2, self.w13.warps)), 16)
            slot = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            xbuf = self.w13.alloc_x(smem)
            ticket = take_ticket(counter, slot, tidx)
            if ticket < self.n13:
                p = ticket // self.tiles13
                self.w13.tile(gX, ids, gW, w13_scale, act, red, xbuf, ticket % self.tiles13, p, tidx)
                count_done(counter, 2 + p // self.topk, tidx)
            else:
                q = ticket - self.n13
                self.w2.tile(gA, ids, weights, w2, w2_scale, out, ssq, norm_w, scaled, red, q % self.tiles2,
                             q // self.tiles2, tidx, counter, self.tiles13 * self.topk)
                if last_cta(counter, flag, tidx, self.n2, 1) != 0:
                    if tidx == 0:
                        counter[0] = Int32(0)
                        for b in cutlass.range_constexpr(self.B):
                            counter[2 + b] = Int32(0)


INDEX_LIMIT = 2**31  # the kernels index with 32-bit integers


def fits_int32_offsets(*tensors: torch.Tensor) -> bool:
    """Whether every byte of every tensor is reachable with 32-bit offsets (the expert tensors of a TP1 shard, 9.9e9
    bytes for w13, are not; those of TP8 and TP16 shards are)."""
    return all(t.numel() * t.element_size() < INDEX_LIMIT for t in tensors)


def check_expert_args(latent, ids, w13, w13_scale, w2, w2_scale, used, act, out, latent_dtype=torch.bfloat16,
                      out_dtypes=(torch.float32,)):
    """The expert kernels' argument checks (shared with the grouped kernels, `out` being theirs per pair, which may
    be bf16, and their `latent` fp16 when it comes as mma operands)."""
    if not fits_int32_offsets(w13, w13_scale, w2, w2_scale, act):
        raise ValueError("MoE MXFP4: expert tensors of 2**31 bytes or more need 64-bit offsets, which these kernels "
                         "do not use")
    E, two_i, half_l = w13.shape
    L = latent.shape[1]
    if L != 2 * half_l or L % (GROUP * QUAD) or used % GROUP or used > two_i // 2:
        raise ValueError("MoE MXFP4: the latent width must be a multiple of 128, the expert slice of 32, and they "
                         "must chain")
    if w2.shape[:2] != (E, L) or 2 * w2.shape[2] < used:
        raise ValueError(f"MoE MXFP4: w2 {tuple(w2.shape)} does not chain with w13 {tuple(w13.shape)}")
    if ids.dtype != torch.int32 or ids.shape[0] != latent.shape[0]:
        raise ValueError("MoE MXFP4: ids must be int32 [batch, top_k]")
    if latent.dtype != latent_dtype or act.dtype != torch.float16 or out.dtype not in out_dtypes:
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
        outs = " or ".join(names[d] for d in out_dtypes)
        raise ValueError(f"MoE MXFP4: latent {names[latent_dtype]}, act fp16 and out {outs} expected")
    if act.shape != (ids.numel(), used):  # the w2 kernel's chunks and scale view follow `used`
        raise ValueError(f"MoE MXFP4: act must be [{ids.numel()}, {used}] (pairs, used expert rows)")
    for t in (latent, ids, w13, w13_scale, w2, w2_scale, act, out):
        if not t.is_contiguous():
            raise ValueError("MoE MXFP4: inputs must be contiguous")


def _words(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as int32 words along the last dimension (4 MXFP4 bytes, 2 bf16 / fp16 values)."""
    return t.view(torch.int32)


def w2_scales(w2_scale: torch.Tensor) -> torch.Tensor:
    """w2's scales as int32 words where each row's bytes are a multiple of 4 (TP16 padded, TP8), else as bytes."""
    return _words(w2_scale) if w2_scale.shape[-1] % 4 == 0 else w2_scale


def w2_chunk(used: int) -> int:
    """MX groups per weight load in the per-pair w2 kernel (`KIMI_DECODE_W2_CHUNK`: "auto", the default, or 1, 2,
    4): 4 (16-byte loads) where a row's used groups are a multiple of 4 (TP8: 12), else 2 (8 bytes; TP16: 6), else
    1 (4 bytes, one word per lane and group: the form before chunks). A chunk that does not divide them is refused."""
    groups = used // GROUP
    raw = env_choice("KIMI_DECODE_W2_CHUNK", "auto", ("auto", "1", "2", "4"))
    if raw == "auto":
        return next(c for c in (QUAD, 2, 1) if groups % c == 0)
    if groups % int(raw):
        raise ValueError(f"KIMI_DECODE_W2_CHUNK={raw} does not divide the {groups} MX groups of a w2 row")
    return int(raw)


def w2_layout(used: int, w2_scale: torch.Tensor) -> tuple[int, bool]:
    """(`w2_chunk`, whether the w2 kernel reads its scales as int32 words: chunks of 4 on rows of whole words)."""
    chunk = w2_chunk(used)
    return chunk, chunk == QUAD and w2_scale.shape[-1] % 4 == 0


def _w2_args(act, ids, weights, w2, w2_scale, out, ssq, scaled):
    """The w2 kernel's tensors (the scales as words where `w2_layout` says so); without `scaled` = (norm_w, bf16
    out), `out` stands in for both (never read)."""
    norm_w, scaled_out = scaled if scaled is not None else (out[0], out)
    scales = w2_scales(w2_scale) if w2_layout(act.shape[1], w2_scale)[1] else w2_scale
    return (_words(act), ids, weights, _words(w2), scales, out, ssq, norm_w, scaled_out)


def _w13_args(latent, ids, w13, w13_scale, act):
    """The w13 kernel's tensors, as compiled and launched: the codes and the scales as int32 words."""
    return (_words(latent), ids, _words(w13), _words(w13_scale), act)


def _chained_args(latent, ids, weights, w13, w13_scale, w2, w2_scale, act, out, ssq, scaled, counters):
    """`MoEExperts`' tensors: the w13 kernel's, then the w2 kernel's, then the counters."""
    act_words, _, *rest = _w2_args(act, ids, weights, w2, w2_scale, out, ssq, scaled)
    return (*_w13_args(latent, ids, w13, w13_scale, act), act_words, *rest, counters)


W13_SMALL_WARPS = 4  # warps of the w13 kernel where its 7-warp grid would not fit one wave at one token
W13_CTAS_PER_SM = 5  # 7-warp w13 CTAs the H200's register file holds per SM (48 registers; ncu, NOTES v15)


def w13_warps(used: int, tokens: int, topk: int) -> int:
    """At most how many warps split K in the w13 kernel (`KIMI_DECODE_W13_WARPS`: "auto", the default, or 1 to
    WARPS). auto: W13_SMALL_WARPS at one token where the CTAs of the 7-warp split would be more than one
    wave (TP8: 768 CTAs for 660 places; measured 1.3 us faster there, but 3.5 to 5.8 us slower at TP16 and at batch
    8), else WARPS."""
    raw = env_choice("KIMI_DECODE_W13_WARPS", "auto", ("auto", *(str(n) for n in range(1, WARPS + 1))))
    if raw == "auto":
        ctas = used // ROWS13 * tokens * topk
        return W13_SMALL_WARPS if tokens == 1 and ctas > W13_CTAS_PER_SM * sm_count() else WARPS
    return int(raw)


def w13_x_once(tokens: int) -> bool:
    """Whether the w13 kernel's warps convert the activations to mma operands once, through shared memory
    (`MoEW13Act.stage_x`), rather than every lane each of its groups' (`KIMI_DECODE_W13_X_ONCE`: "auto", the default,
    at every batch; "1" / "0": always / never). On the H200 (NOTES, v18) once per warp was faster at both shards,
    batch 8 by 4 / 8 us per layer (TP16 / TP8), where the kernel is bound by its integer pipe, and batch 1 by 0.3 /
    1.6 us."""
    raw = env_choice("KIMI_DECODE_W13_X_ONCE", "auto", ("auto", "0", "1"))
    return raw != "0"


def w13_prefetch() -> bool:
    """Whether the per-pair w13 kernel asks L2 for each lane's quads once the expert id is known
    (`KIMI_DECODE_W13_PREFETCH`: "0", the default, or "1"). On the H200 (NOTES, v19) "1" was slower: the kernel's
    own time 9.0 -> 9.8 us at TP16 and 12.7 -> 15.8 at TP8, batch 1."""
    return env_flag("KIMI_DECODE_W13_PREFETCH", "0")


def w13_first(tokens: int, quads: int) -> int:
    """How many of its quads of MX groups a per-pair w13 warp loads before the activations' staging
    (`KIMI_DECODE_W13_FIRST`: "auto", the default, "0" .. "4", or "all"; capped at the warp's `quads`). In the SASS of
    "0" the first weight loads issue only once the activations are in shared memory (their round trip, then the
    conversion, then the weights'); with "2" two quads issue beside the activations at the same registers; "all"
    every quad (87 registers at TP16, 126 at TP8 under cutlass-dsl 4.8.1). auto: all at one token where a warp has
    more than QUAD quads (the 4-warp split, `w13_warps`: TP8), else none. On the H200 "all" was 0.8-1.4 us faster
    per layer there, in three runs; with 4 quads per warp (TP16 at one token, every shard above it) it was even or
    up to 2 us slower at one token and 3-8 us slower at batch 8 (benchmarks/NOTES.md, items 36, 71 and 72)."""
    raw = env_choice("KIMI_DECODE_W13_FIRST", "auto", ("auto", "0", "1", "2", "3", "4", "all"))
    if raw == "auto":
        return 64 if tokens == 1 and quads > QUAD else 0
    return 64 if raw == "all" else int(raw)


SHARED_DOWN_LANES = ("32", "16", "8", "4")


def shared_down_lanes() -> int:
    """Lanes per output row of the shared experts' down-projection CTAs in the w2 kernel
    (`KIMI_DECODE_SHARED_DOWN_LANES`: "auto", the default, or 32 / 16 / 8 / 4; a row of K = the shared intermediate
    width is K / 8 16-byte slices). auto: 8, four rows per warp, each lane 6 (TP16) or 12 (TP8) slices of a row;
    on the H200 (NOTES, v19) 0.7 / 1.0 us per layer faster than one row per warp at TP16 / TP8, and even with 4
    lanes per row."""
    raw = env_choice("KIMI_DECODE_SHARED_DOWN_LANES", "auto", ("auto", *SHARED_DOWN_LANES))
    return 8 if raw == "auto" else int(raw)


def w2_early(tokens: int) -> bool:
    """Whether the w2 kernel, under PDL, loads its first weight words before the wait (`KIMI_DECODE_W2_EARLY`:
    "auto", the default, at one token; "1" / "0": always / never)."""
    raw = env_choice("KIMI_DECODE_W2_EARLY", "auto", ("auto", "0", "1"))
    return tokens == 1 if raw == "auto" else raw == "1"


W2_PRE_WAIT = ("auto", "weights", "ids", "scales", "all")


def w2_pre_wait() -> str:
    """What the batch-1 w2 kernel's warps do before their PDL wait besides loading their first weight words
    (`w2_early`), by KIMI_DECODE_W2_PRE_WAIT: "weights" nothing else; "ids" keep the expert ids they load there for
    the items after the wait (instead of loading them again: the entry kernel, two kernels back, wrote them);
    "scales" that, and ask L2 for each item's scale rows, so that the scales after the wait come from L2 and their
    addresses do not wait for an id load; "all" that, and ask L2 for the items whose weight words are loaded after
    the wait. "auto" (the default): "scales" where every item's weight words come before the wait (TP16: 6 items per
    warp), else "weights" (TP8: 3 of 6 after it). On the H200 "scales" was 0.2-0.6 us per KDA layer faster at TP16
    and even at TP8, where its registers cost the kernel a CTA per SM (benchmarks/NOTES.md item 77)."""
    return env_choice("KIMI_DECODE_W2_PRE_WAIT", "auto", W2_PRE_WAIT)


def layout_groups(w13: torch.Tensor, w2: torch.Tensor, quad_major: bool) -> tuple[int, int]:
    """The kernels' `quad_major` arguments for w13 and w2: their MX groups per row when the codes come in
    `quad_major` order, else 0 (natural rows)."""
    if not quad_major:
        return 0, 0
    if not quad_major_fits(w2):
        raise ValueError("MoE MXFP4: quad-major w2 rows need an even number of MX groups")
    return w13.shape[-1] // 16, w2.shape[-1] // 16


def compile_moe(latent, ids, weights, w13, w13_scale, w2, w2_scale, act, out, ssq, used: int, scaled=None,
                counters=None, shared=None, shared_act_ready: bool = False, quad_major: bool = False):
    L, I, (B, k) = latent.shape[1], w13.shape[1] // 2, ids.shape
    early, x_once, pf = w2_early(B), w13_x_once(B), w13_prefetch()
    qm13, qm2 = layout_groups(w13, w2, quad_major)
    w2_args = _w2_args(act, ids, weights, w2, w2_scale, out, ssq, scaled)
    chunk, scale_words = w2_chunk(used), w2_args[4].dtype == torch.int32  # the scale view the kernel is given
    norm_first = scaled is not None and norm_weight_first(B)  # the w2 kernels' `norm_first`

    def plain_w13():
        a13 = _w13_args(latent, ids, w13, w13_scale, act)
        cap = w13_warps(used, B, k)
        op = MoEW13Act(L, I, used, k, cap, x_once, pf, qm13, w13_first(B, quad_split(L, cap)[1]))  # "all": a count
        return compile_kernel(("moe_w13_act", used, cap, x_once, pf, qm13, op.first, *signature(*a13)), op,
                              *(fake_like(t, align=16) for t in a13))

    if shared is not None:  # the shared experts' GEMVs ride along (gate/up in w13's unless done already, down in w2's)
        gate_up, hx, s_act, down, s_out = shared
        H, S = hx.shape[1], s_act.shape[1]
        if shared_act_ready:
            f13 = plain_w13()
        else:
            a13 = (*_w13_args(latent, ids, w13, w13_scale, act), gate_up, hx, s_act)
            split = rider_split(S, quad_split(L)[0])
            f13 = compile_kernel(("moe_w13_act_shared", used, split, x_once, pf, qm13, *signature(*a13)),
                                 MoEW13ActShared(L, I, used, k, H, S, split, x_once, pf, qm13),
                                 *(fake_like(t, align=16) for t in a13))
        a2 = (*w2_args, down, s_act, s_out)
        lanes, pre = shared_down_lanes(), w2_pre_wait()
        f2 = compile_kernel(("moe_w2_sum_shared", used, scaled is not None, early, chunk, lanes, qm2, pre,
                             norm_first, *signature(*a2)),
                            MoEW2SumShared(used, k, scaled is not None, L, H, S, early, chunk, scale_words, lanes,
                                           qm2, pre, norm_first),
                            *(fake_like(t, align=16) for t in a2))
        return f13, f2
    if counters is not None:
        args = _chained_args(latent, ids, weights, w13, w13_scale, w2, w2_scale, act, out, ssq, scaled, counters)
        op = MoEExperts(L, I, used, k, B, scaled is not None, chunk, scale_words, x_once, (qm13, qm2), norm_first)
        return compile_kernel(("moe_experts", used, scaled is not None, chunk, x_once, qm13, qm2, norm_first,
                               *signature(*args)),
                              op,
                              *(fake_like(t, align=4 if t is counters else 16) for t in args))
    pre = w2_pre_wait()
    f2 = compile_kernel(("moe_w2_sum", used, scaled is not None, early, chunk, qm2, pre, norm_first,
                         *signature(*w2_args)),
                        MoEW2Sum(used, k, scaled is not None, early=early, chunk=chunk, scale_words=scale_words,
                                 quad_major=qm2, pre_wait=pre, norm_first=norm_first),
                        *(fake_like(t, align=16) for t in w2_args))
    return plain_w13(), f2


def few_shared_rows(shared_inter: int) -> bool:
    """Whether one warp per shared-expert (gate, up) row pair leaves under 4 such warps per SM (TP16's 384 pairs;
    TP8 has 768)."""
    return shared_inter < 4 * sm_count()


def rider_split(shared_inter: int, warps: int) -> int:
    """Warps per (gate, up) row pair for the shared experts' CTAs in the w13 kernel: all of a CTA's warps (split-K)
    with few row pairs (`few_shared_rows`), else one (`KIMI_DECODE_SHARED_RIDER_SPLIT` sets it, a divisor of the
    CTA's warps, for A/B). On the H200 at TP16 batch 1, 7 against 1: 96.3 against 100.0 us per KDA layer."""
    if os.environ.get("KIMI_DECODE_SHARED_RIDER_SPLIT"):
        split = env_int("KIMI_DECODE_SHARED_RIDER_SPLIT", 1, 1, warps, "warps per row pair")
        if warps % split:
            raise ValueError(f"KIMI_DECODE_SHARED_RIDER_SPLIT must divide the CTA's {warps} warps, not {split}")
        return split
    return warps if few_shared_rows(shared_inter) else 1


def _check_shared(shared, B: int) -> None:
    gate_up, hx, s_act, down, s_out = shared
    H, S = hx.shape[1], s_act.shape[1]
    if B != 1 or hx.shape[0] != 1 or gate_up.shape != (2 * S, H) or down.shape != (H, S) or s_out.shape != (1, H):
        raise ValueError("MoE MXFP4: the shared experts ride along at batch 1 only, with gate/up [2S, H], down "
                         "[H, S], x [1, H], act [1, S] and out [1, H]")
    if any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in shared) or H % 8 or S % 8:
        raise ValueError("MoE MXFP4: the shared experts' tensors must be contiguous bf16, widths a multiple of 8")


def moe_mxfp4(latent, ids, weights, w13, w13_scale, w2, w2_scale, used: int, act=None, out=None, ssq=None,
              scaled=None, counters=None, shared=None, shared_act_ready: bool = False, quad_major: bool = False):
    """Routed experts of one rank: latent [B, L] bf16, ids [B, k] int32, weights [B, k] fp32 -> out [B, L] fp32
    (the weighted sum over the k experts, before any cross-rank reduction). `used` is the expert slice without
    padding. `act` [B*k, used] fp16, `out` and `ssq` may be given (their contents are overwritten); `ssq`
    [B, L / 16] fp32 receives partial sums of squares of `out` (their row sum is sum(out**2), for a fused RMSNorm).
    `scaled=(norm_w, y)`, norm_w fp32 [L] and y bf16 [B, L]: also y = bf16(out * norm_w), the input of an
    up-projection that applies the RMSNorm's 1/rms per row (`gemv(..., row_scale=(ssq, eps))`). With `counters`,
    int32 [2 + B] at 0 (left at 0) that no other kernel uses at the same time: both stages in one kernel
    (`MoEExperts`), else two. `shared=(gate_up, x, act, down, out)` at batch 1 (bf16: x [1, H], act [1, S], out
    [1, H]): the shared experts as well, out = down @ SiTU-GLU(x @ gate_up.T), their GEMVs in CTAs of their own in
    the two expert kernels (not with `counters`); with `shared_act_ready` their act is already computed (by
    `moe_entry`) and only the down-projection rides along, in the w2 kernel. `quad_major`: w13 and w2 come in
    `quad_major` order (the kernels then load each lane's words without exchanging them)."""
    B, k = ids.shape
    L = latent.shape[1]
    act = act if act is not None else torch.empty(B * k, used, dtype=torch.float16, device=latent.device)
    out = out if out is not None else torch.empty(B, L, dtype=torch.float32, device=latent.device)
    ssq = ssq if ssq is not None else torch.empty(B, L // ROWS2, dtype=torch.float32, device=latent.device)
    check_expert_args(latent, ids, w13, w13_scale, w2, w2_scale, used, act, out)
    if ssq.shape != (B, L // ROWS2) or ssq.dtype != torch.float32 or not ssq.is_contiguous():
        raise ValueError(f"MoE MXFP4: ssq must be fp32 [{B}, {L // ROWS2}]")
    if scaled is not None:
        norm_w, y = scaled
        if (norm_w.shape != (L,) or norm_w.dtype != torch.float32 or not norm_w.is_contiguous()
                or y.shape != (B, L) or y.dtype != torch.bfloat16 or not y.is_contiguous()):
            raise ValueError(f"MoE MXFP4: scaled output needs an fp32 [{L}] norm weight and a bf16 [{B}, {L}] tensor")
    if shared is not None:
        if counters is not None:
            raise ValueError("MoE MXFP4: the shared experts ride along in the two-kernel form only")
        _check_shared(shared, B)
        f13, f2 = compile_moe(latent, ids, weights, w13, w13_scale, w2, w2_scale, act, out, ssq, used, scaled,
                              shared=shared, shared_act_ready=shared_act_ready, quad_major=quad_major)
        gate_up, hx, s_act, down, s_out = shared
        launch(f13, *_w13_args(latent, ids, w13, w13_scale, act), *(() if shared_act_ready else (gate_up, hx, s_act)))
        launch(f2, *_w2_args(act, ids, weights, w2, w2_scale, out, ssq, scaled), down, s_act, s_out)
        return out
    if counters is not None:
        if counters.dtype != torch.int32 or counters.dim() != 1 or counters.shape[0] < 2 + B:
            raise ValueError(f"MoE MXFP4: the one-kernel experts need int32 counters [>= {2 + B}]")
        counters = counters[:2 + B]
        fn = compile_moe(latent, ids, weights, w13, w13_scale, w2, w2_scale, act, out, ssq, used, scaled, counters,
                         quad_major=quad_major)
        launch(fn, *_chained_args(latent, ids, weights, w13, w13_scale, w2, w2_scale, act, out, ssq, scaled, counters),
               align=lambda t: 4 if t is counters else 16)
        return out
    f13, f2 = compile_moe(latent, ids, weights, w13, w13_scale, w2, w2_scale, act, out, ssq, used, scaled,
                          quad_major=quad_major)
    launch(f13, *_w13_args(latent, ids, w13, w13_scale, act))
    launch(f2, *_w2_args(act, ids, weights, w2, w2_scale, out, ssq, scaled))
    return out
