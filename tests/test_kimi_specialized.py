"""latency_specialized on the CPU: it falls back to `auto` (and says so once), and its CuTe DSL kernels compile for
sm_90a with the cutlass-dsl version installed here (no GPU needed)."""
import contextlib
import importlib
import logging
from pathlib import Path

import pytest
import torch

from kimi_decode.backends import get_backend
from kimi_decode.config import shard
from kimi_decode.state import init_kda_state, init_residual
from kimi_decode.testing import BF16_TOL, check_layer, projection_shapes
from kimi_decode.weights import init_layer


def test_falls_back_to_auto_without_a_gpu(caplog, monkeypatch):
    from kimi_decode.backends import latency_specialized

    monkeypatch.setattr(latency_specialized, "_said", set())
    s = shard("tiny")
    backend = get_backend("latency_specialized", poison=True)
    with caplog.at_level(logging.WARNING):
        for layer in (1, 2):
            lw = init_layer(s, layer, seed=layer)
            check = check_layer(backend, lw, init_residual(s, 4, layer, seed=layer),
                                init_kda_state(s, 4, layer, seed=layer), s)
            check.assert_within(BF16_TOL)
    reasons = [r.getMessage() for r in caplog.records if "latency_specialized" in r.getMessage()]
    assert len(reasons) == 1 and ("no CUDA device" in reasons[0] or "cutlass-dsl" in reasons[0])


cute_common = pytest.importorskip("kimi_decode.kernels.cute_common")
needs_cute = pytest.mark.skipif(not cute_common.HAVE_CUTE, reason="nvidia-cutlass-dsl is not installed")


@pytest.fixture
def sm90a(monkeypatch):
    monkeypatch.setenv("KIMI_DECODE_CUTE_ARCH", "sm_90a")
    cute_common._cache.clear()
    yield
    cute_common._cache.clear()


@pytest.fixture(params=["0", "1"], ids=["plain", "pdl"])
def sm90a_pdl(request, sm90a, monkeypatch):
    """`sm90a`, once without PDL and once with it (the batch-1 kernels run under it by default)."""
    monkeypatch.setenv("KIMI_DECODE_PDL", request.param)


@needs_cute
@pytest.mark.parametrize("tp", [16, 8])
def test_gemv_compiles_for_sm90a(sm90a_pdl, tp):
    from kimi_decode.kernels.gemv import compile_gemv

    for n, k in projection_shapes(shard("k3", tp=tp)):
        for rows in (1, 8):
            w = torch.empty(n, k, dtype=torch.bfloat16)
            x = torch.empty(rows, k, dtype=torch.bfloat16)
            assert compile_gemv(w, x, torch.empty(rows, n, dtype=torch.bfloat16)) is not None
    w = torch.empty(7168, 3584, dtype=torch.bfloat16)
    assert compile_gemv(w, torch.empty(1, 3584, dtype=torch.bfloat16), torch.empty(1, 7168), accumulate=True)
    for rows in (1, 8):
        # the shared experts' gate/up with SiTU-GLU in the epilogue
        gate_up = torch.empty(2 * s_inter(tp), 7168, dtype=torch.bfloat16)
        assert compile_gemv(gate_up, torch.empty(rows, 7168, dtype=torch.bfloat16),
                            torch.empty(rows, s_inter(tp), dtype=torch.bfloat16), glu=True) is not None
        # the MoE tail on the expert kernel's bf16 scaled output: 1/rms per row in the epilogue
        assert compile_gemv(w, torch.empty(rows, 3584, dtype=torch.bfloat16), torch.empty(rows, 7168),
                            accumulate=True, addend=torch.empty(rows, 7168, dtype=torch.bfloat16),
                            row_scale=(torch.empty(rows, 224), 1e-5)) is not None


def _kda_args(s, batch: int) -> tuple:
    """`compile_kda_decode`'s tensors at shard `s`, the gate input f given (not f_b)."""
    h, D, d, bf = s.kda_heads, s.model.kda_head_dim, s.kda_dim, torch.bfloat16
    return (torch.empty(batch, s.kda_in_proj_rows, dtype=bf), torch.empty(batch, d, dtype=bf),
            torch.empty(batch, 3 * d, 3, dtype=bf), torch.empty(3 * d, 4), torch.empty(h), torch.empty(d),
            torch.empty(batch, h, D, D), torch.empty(D), torch.empty(batch, d, dtype=bf))


def _kda_cols_args(s, batch: int) -> tuple:
    """The same with f_b in the backend's column-major copy (applied inside the kernel, `f_col`)."""
    args = _kda_args(s, batch)
    return (args[0], torch.empty(s.model.kda_f_rank, s.kda_dim, dtype=torch.bfloat16).t(), *args[2:])


def _moe_args(s, batch: int) -> tuple:
    """`compile_moe`'s positional arguments at shard `s`."""
    m = s.model
    E, L, I, k = m.num_experts, m.moe_latent, s.expert_inter, m.top_k
    u8, bf = torch.uint8, torch.bfloat16
    return (torch.empty(batch, L, dtype=bf), torch.empty(batch, k, dtype=torch.int32), torch.empty(batch, k),
            torch.empty(E, 2 * I, L // 2, dtype=u8), torch.empty(E, 2 * I, L // 32, dtype=u8),
            torch.empty(E, L, I // 2, dtype=u8), torch.empty(E, L, I // 32, dtype=u8),
            torch.empty(batch * k, s.expert_inter_used, dtype=torch.float16), torch.empty(batch, L),
            torch.empty(batch, L // 16), s.expert_inter_used)


def _shared_args(s) -> tuple:
    """`compile_moe`'s `shared` at shard `s`, one token: the shared experts' gate/up weight [2 S, H], its input x
    [1, H], the SiTU-GLU activations [1, S], the down weight [H, S] and its output [1, H], bf16."""
    H, S, bf = s.model.hidden, s.shared_inter, torch.bfloat16
    return (torch.empty(2 * S, H, dtype=bf), torch.empty(1, H, dtype=bf), torch.empty(1, S, dtype=bf),
            torch.empty(H, S, dtype=bf), torch.empty(1, H, dtype=bf))


def _grouped_args(s, batch: int, w2_cols: int | None = None) -> list:
    """`compile_grouped`'s positional arguments at shard `s` (`w2_cols`: w2's bytes per row, else as stored)."""
    m = s.model
    E, L, I, k, P = m.num_experts, m.moe_latent, s.expert_inter, m.top_k, batch * m.top_k
    u8 = torch.uint8
    return [torch.empty(batch, L, dtype=torch.bfloat16), torch.empty(batch, k, dtype=torch.int32),
            torch.empty(batch, k), torch.empty(E, 2 * I, L // 2, dtype=u8), torch.empty(E, 2 * I, L // 32, dtype=u8),
            torch.empty(E, L, w2_cols or I // 2, dtype=u8), torch.empty(E, L, I // 32, dtype=u8),
            [torch.empty(P, dtype=torch.int32)] * 4, torch.empty(P, s.expert_inter_used, dtype=torch.float16),
            torch.empty(P, L), s.expert_inter_used]


@needs_cute
@pytest.mark.parametrize("tp, batch", [(16, 1), (8, 8), (1, 1), (8, 64)])
def test_kda_decode_compiles_for_sm90a(sm90a, tp, batch):
    from kimi_decode.kernels.kda_decode import compile_kda_decode

    s = shard("k3", tp=tp)
    d, bf = s.kda_dim, torch.bfloat16
    args = _kda_args(s, batch)
    assert compile_kda_decode(*args, b_col=s.kda_in_proj_layout["b"][0], eps=1e-5, lower_bound=-5.0) is not None
    fused = (args[0], torch.empty(d, s.model.kda_f_rank, dtype=bf), *args[2:])  # f_b applied inside the kernel
    assert compile_kda_decode(*fused, b_col=s.kda_in_proj_layout["b"][0], eps=1e-5, lower_bound=-5.0,
                              f_col=s.kda_in_proj_layout["f_a"][0]) is not None
    assert compile_kda_decode(*_kda_cols_args(s, batch), b_col=s.kda_in_proj_layout["b"][0], eps=1e-5,
                              lower_bound=-5.0, f_col=s.kda_in_proj_layout["f_a"][0]) is not None


@needs_cute
@pytest.mark.parametrize("split", [1, 2, 8])
def test_kda_decode_compiles_for_sm90a_at_each_thread_split(sm90a, monkeypatch, split):
    """The KDA kernel's other thread splits (KIMI_DECODE_KDA_SPLIT; 4 is compiled above): every gate form."""
    from kimi_decode.kernels.kda_decode import compile_kda_decode

    monkeypatch.setenv("KIMI_DECODE_KDA_SPLIT", str(split))
    s = shard("k3", tp=16)
    kw = dict(b_col=s.kda_in_proj_layout["b"][0], eps=1e-5, lower_bound=-5.0)
    assert compile_kda_decode(*_kda_args(s, 3), **kw) is not None
    assert compile_kda_decode(*_kda_cols_args(s, 3), **kw, f_col=s.kda_in_proj_layout["f_a"][0]) is not None


@needs_cute
@pytest.mark.parametrize("tp", [16, 8])
def test_kda_inputs_first_is_a_variant_of_its_own_for_sm90a(sm90a_pdl, monkeypatch, tp):
    """KIMI_DECODE_KDA_INPUTS_FIRST: "0" (the default) and "1" each compile a kernel of their own, with f_b applied in
    the kernel or the gate input given, at one thread group split and at the other (2 groups from 17 sequences on);
    other values are refused by name."""
    from kimi_decode.kernels.kda_decode import compile_kda_decode, inputs_first

    s = shard("k3", tp=tp)
    kw = dict(b_col=s.kda_in_proj_layout["b"][0], eps=1e-5, lower_bound=-5.0)
    fused = dict(kw, f_col=s.kda_in_proj_layout["f_a"][0])

    def compiled():
        return [compile_kda_decode(*_kda_cols_args(s, 1), **fused), compile_kda_decode(*_kda_args(s, 1), **kw),
                compile_kda_decode(*_kda_cols_args(s, 32), **fused)]

    monkeypatch.delenv("KIMI_DECODE_KDA_INPUTS_FIRST", raising=False)
    assert not inputs_first()
    base = compiled()
    monkeypatch.setenv("KIMI_DECODE_KDA_INPUTS_FIRST", "0")
    assert compiled() == base
    monkeypatch.setenv("KIMI_DECODE_KDA_INPUTS_FIRST", "1")
    first = compiled()
    assert all(f is not None for f in base + first) and not set(map(id, first)) & set(map(id, base))
    monkeypatch.setenv("KIMI_DECODE_KDA_INPUTS_FIRST", "yes")
    with pytest.raises(ValueError, match="KIMI_DECODE_KDA_INPUTS_FIRST must be one of 0, 1"):
        compile_kda_decode(*_kda_cols_args(s, 1), **fused)


def test_w2_early_loads_follow_the_token_count_under_auto(monkeypatch):
    from kimi_decode.kernels.moe_mxfp4 import w2_early

    monkeypatch.delenv("KIMI_DECODE_W2_EARLY", raising=False)
    assert w2_early(1) and not w2_early(8)
    monkeypatch.setenv("KIMI_DECODE_W2_EARLY", "1")
    assert w2_early(8)
    monkeypatch.setenv("KIMI_DECODE_W2_EARLY", "0")
    assert not w2_early(1)
    monkeypatch.setenv("KIMI_DECODE_W2_EARLY", "yes")
    with pytest.raises(ValueError, match="KIMI_DECODE_W2_EARLY"):
        w2_early(1)


def test_w2_chunk_under_auto_takes_the_widest_load_that_divides_the_row(monkeypatch):
    """auto: chunks of 4 MX groups (16-byte loads) on TP8's 12 groups per row, pairs on TP16's 6, words on an odd
    count; a forced chunk that does not divide the row, or that is not 1 / 2 / 4, is refused by name."""
    from kimi_decode.kernels.moe_mxfp4 import w2_chunk, w2_layout

    monkeypatch.delenv("KIMI_DECODE_W2_CHUNK", raising=False)
    assert (w2_chunk(384), w2_chunk(192), w2_chunk(96)) == (4, 2, 1)
    # scales as words only for chunks of 4 on rows of whole scale words (TP8: 12 bytes; 10 are not)
    assert w2_layout(384, torch.empty(4, 8, 12, dtype=torch.uint8)) == (4, True)
    assert w2_layout(384, torch.empty(4, 8, 10, dtype=torch.uint8)) == (4, False)
    assert w2_layout(192, torch.empty(4, 8, 8, dtype=torch.uint8)) == (2, False)
    monkeypatch.setenv("KIMI_DECODE_W2_CHUNK", "1")
    assert w2_chunk(384) == 1
    monkeypatch.setenv("KIMI_DECODE_W2_CHUNK", "4")
    with pytest.raises(ValueError, match="KIMI_DECODE_W2_CHUNK=4 does not divide the 6"):
        w2_chunk(192)
    monkeypatch.setenv("KIMI_DECODE_W2_CHUNK", "3")
    with pytest.raises(ValueError, match="KIMI_DECODE_W2_CHUNK"):
        w2_chunk(384)


def _run_ptx_bits(asm: str, regs: dict) -> dict:
    """A few integer PTX instructions (shl, shr, and, or, prmt, mul.hi and mad.lo by constants under 2**31, on 32-bit
    values) run on int64 tensors of words."""
    def val(x):
        x = x.strip()
        return regs[x] if x in regs else torch.tensor(int(x, 0), dtype=torch.int64)

    def prmt(a, b, sel):  # byte k of the result is byte (sel >> 4k) & 7 of {b, a}
        src = a | (b << 32)
        return sum(((src >> (8 * ((int(sel) >> (4 * k)) & 7))) & 0xFF) << (8 * k) for k in range(4))

    def small(b):  # a constant factor, so that products stay inside int64
        assert int(b) < 2**31
        return b

    ops = {"shl.b32": lambda a, n: (a << int(n)) & 0xFFFFFFFF, "shr.u32": lambda a, n: a >> int(n),
           "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b, "prmt.b32": prmt,
           "mul.hi.u32": lambda a, b: (a * small(b)) >> 32,
           "mad.lo.u32": lambda a, b, c: (a * small(b) + c) & 0xFFFFFFFF}
    for ins in filter(None, (i.strip() for i in asm.split(";"))):
        op, args = ins.split(None, 1)
        dst, *srcs = args.split(",")
        regs[dst.strip()] = ops[op](*(val(x) for x in srcs))
    return regs


@pytest.mark.parametrize("alu", ["0", "1"])
def test_mxfp4_dequant_ptx_gives_each_code_times_2_to_the_minus_14_as_fp16(monkeypatch, alu):
    """The expert kernels' e2m1 -> fp16 PTX (`_DEQUANT`, both `KIMI_DECODE_MX_ALU` forms), run bit for bit on random
    words: register k holds codes k (low half) and k + 4 (high half) of the word as fp16, each exactly its e2m1 value
    times 2**-14."""
    from kimi_decode.kernels.moe_mxfp4 import F16_SHIFT, _dequant
    from kimi_decode.quant import _e2m1_table

    monkeypatch.setenv("KIMI_DECODE_MX_ALU", alu)
    g = torch.Generator().manual_seed(7)
    words = torch.randint(0, 2**32, (4096,), generator=g, dtype=torch.int64)
    words[:16] = torch.arange(16) * 0x11111111  # every code in every place
    regs = _run_ptx_bits(_dequant("w", "h"), {"w": words, "z": torch.tensor(0, dtype=torch.int64)})
    table = _e2m1_table("cpu", torch.float64) * 2.0**-F16_SHIFT
    codes = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=1)
    for k in range(4):
        halves = torch.stack([regs[f"h{k}"] & 0xFFFF, regs[f"h{k}"] >> 16], dim=1).to(torch.int16)
        got = halves.view(torch.float16).double()
        want = table[codes[:, [k, k + 4]]]
        assert torch.equal(got, want), k


def test_mx_scale_multiply_add_ptx_gives_the_bits_of_the_shift_form():
    """`mx_scale_of`'s multiply-add PTX (`KIMI_DECODE_MX_ALU=1`), run bit for bit on random scale words: byte i's fp32
    bits are (byte + 14) << 23 as `mx_scale` makes them, for every byte value in every place."""
    from kimi_decode.kernels.moe_mxfp4 import F16_SHIFT, _scale_of_asm

    g = torch.Generator().manual_seed(8)
    words = torch.randint(0, 2**32, (4096,), generator=g, dtype=torch.int64)
    words[:256] = torch.arange(256) * 0x01010101  # every byte value in every place
    for i in range(4):
        got = _run_ptx_bits(_scale_of_asm(i, "w", "t"), {"w": words})["t"]
        assert torch.equal(got, (((words >> (8 * i)) & 0xFF) + F16_SHIFT << 23) & 0xFFFFFFFF), i


def test_pair_transpose_gives_each_lane_its_word_of_both_groups():
    """The w2 kernel's 8-byte form on 4 simulated lanes: lane t loaded words 2 (t % 2) and 2 (t % 2) + 1 of group
    t // 2 and must end with word t of groups 0 and 1."""
    from kimi_decode.kernels.moe_mxfp4 import pair_transpose

    g = torch.Generator().manual_seed(6)
    groups = torch.randint(-2**31, 2**31 - 1, (2, 4), generator=g, dtype=torch.int64)  # [group, word]
    lanes = torch.arange(4)
    v = [groups[lanes // 2, 2 * (lanes % 2) + h] for h in range(2)]
    got = pair_transpose(v, lanes, torch.where, lambda x, src: x[src])
    assert torch.equal(torch.stack(got, dim=1), groups.T)  # lane t, slot h: word t of group h


@pytest.mark.parametrize("raw", ["0", "9", "four"])
def test_w13_warps_outside_one_to_eight_are_refused_by_name(monkeypatch, raw):
    from kimi_decode.kernels.moe_mxfp4 import quad_split, w13_warps

    monkeypatch.setenv("KIMI_DECODE_W13_WARPS", raw)
    with pytest.raises(ValueError, match="KIMI_DECODE_W13_WARPS"):
        w13_warps(384, 1, 16)
    monkeypatch.setenv("KIMI_DECODE_W13_WARPS", "2")
    assert w13_warps(192, 1, 16) == 2 and quad_split(3584, 4) == (4, 7) and quad_split(3584) == (7, 4)


def test_w13_warps_under_auto_shrink_only_a_one_token_grid_past_one_wave(monkeypatch):
    """auto (132 SMs without a GPU): TP8 batch 1 (384 rows: 768 CTAs) on 4 warps; TP16 batch 1 (384 CTAs) and
    batch 8 on 7."""
    from kimi_decode.kernels.moe_mxfp4 import quad_split, w13_warps

    monkeypatch.delenv("KIMI_DECODE_W13_WARPS", raising=False)
    monkeypatch.setattr("kimi_decode.kernels.moe_mxfp4.sm_count", lambda device=None: 132)
    warps = {case: quad_split(3584, w13_warps(*case))[0] for case in [(384, 1, 16), (192, 1, 16), (384, 8, 16)]}
    assert warps == {(384, 1, 16): 4, (192, 1, 16): 7, (384, 8, 16): 7}


@pytest.mark.parametrize("raw", ["3", "0", "16", "two"])
def test_kda_split_that_does_not_fit_the_head_is_refused_by_name(monkeypatch, raw):
    from kimi_decode.kernels.kda_decode import kda_split

    monkeypatch.setenv("KIMI_DECODE_KDA_SPLIT", raw)
    with pytest.raises(ValueError, match="KIMI_DECODE_KDA_SPLIT"):
        kda_split(128, 128)
    monkeypatch.setenv("KIMI_DECODE_KDA_SPLIT", "8")
    assert kda_split(128, 128) == 8
    assert kda_split(128, 128, rows=64) == 8  # a count holds at every batch


@pytest.mark.parametrize("raw", [None, "auto"])
def test_kda_split_by_default_follows_the_sequences(monkeypatch, raw):
    """"auto" (the default): SPLIT thread groups per head below SPLIT_WIDE_FROM sequences, SPLIT_WIDE from there."""
    from kimi_decode.kernels.kda_decode import SPLIT, SPLIT_WIDE, SPLIT_WIDE_FROM, kda_split

    if raw is None:
        monkeypatch.delenv("KIMI_DECODE_KDA_SPLIT", raising=False)
    else:
        monkeypatch.setenv("KIMI_DECODE_KDA_SPLIT", raw)
    assert [kda_split(128, 128, rows) for rows in (1, 8, SPLIT_WIDE_FROM - 1, SPLIT_WIDE_FROM, 64)] == [
        SPLIT, SPLIT, SPLIT, SPLIT_WIDE, SPLIT_WIDE]
    assert kda_split(128, 128) == SPLIT


def test_pdl_follows_the_layer_under_auto_and_the_setting_otherwise(monkeypatch):
    """KIMI_DECODE_PDL=auto (the default): what the backend asked for the layer it runs, until the layer ends; "0" /
    "1": never / always; anything else is refused by name."""
    backend = get_backend("latency_specialized")
    monkeypatch.delenv("KIMI_DECODE_PDL", raising=False)
    try:
        cute_common.set_layer_pdl(True)
        assert cute_common.pdl_enabled()
        monkeypatch.setenv("KIMI_DECODE_PDL", "0")
        assert not cute_common.pdl_enabled()
        monkeypatch.setenv("KIMI_DECODE_PDL", "auto")
        backend.end_layer()
        assert not cute_common.pdl_enabled()
        monkeypatch.setenv("KIMI_DECODE_PDL", "1")
        assert cute_common.pdl_enabled()
        monkeypatch.setenv("KIMI_DECODE_PDL", "yes")
        with pytest.raises(ValueError, match="KIMI_DECODE_PDL must be one of auto, 0, 1, not 'yes'"):
            cute_common.pdl_enabled()
    finally:
        cute_common.set_layer_pdl(False)


def test_decode_layer_ends_the_layer_when_it_raises():
    from kimi_decode.backends.auto import AutoBackend
    from kimi_decode.model import decode_layer

    class Failing(AutoBackend):
        ended = 0

        def attn_res(self, *args, **kwargs):
            raise RuntimeError("boom")

        def end_layer(self):
            self.ended += 1

    s = shard("tiny")
    backend = Failing()
    with pytest.raises(RuntimeError, match="boom"):
        decode_layer(backend, init_layer(s, 1, seed=1), init_residual(s, 1, 1, seed=1), init_kda_state(s, 1, 1, seed=1),
                     s)
    assert backend.ended == 1


@needs_cute
@pytest.mark.parametrize("trigger", ["wait", "start"])
def test_kernels_compile_with_pdl_for_sm90a(sm90a, monkeypatch, trigger):
    """With PDL (KIMI_DECODE_PDL=1) the KDA kernel and the expert kernels compile, each trigger placement its own
    variant, apart from the kernels without PDL."""
    from kimi_decode.kernels.kda_decode import compile_kda_decode
    from kimi_decode.kernels.moe_mxfp4 import compile_moe

    s = shard("k3", tp=16)
    kda = (_kda_cols_args(s, 1),
           dict(b_col=s.kda_in_proj_layout["b"][0], eps=1e-5, lower_bound=-5.0, f_col=s.kda_in_proj_layout["f_a"][0]))
    moe = _moe_args(s, 1)
    plain = (compile_kda_decode(*kda[0], **kda[1]), *compile_moe(*moe))
    monkeypatch.setenv("KIMI_DECODE_PDL", "1")
    monkeypatch.setenv("KIMI_DECODE_PDL_TRIGGER", trigger)
    with_pdl = (compile_kda_decode(*kda[0], **kda[1]), *compile_moe(*moe))
    assert all(f is not None and f is not g for f, g in zip(with_pdl, plain))
    monkeypatch.setenv("KIMI_DECODE_KDA_TRIGGER", "late")  # the KDA kernel's trigger after its inputs are read
    late = compile_kda_decode(*kda[0], **kda[1])
    assert late is not None and late is not with_pdl[0]
    monkeypatch.delenv("KIMI_DECODE_KDA_TRIGGER")
    monkeypatch.setenv("KIMI_DECODE_PDL_TRIGGER", "early")
    with pytest.raises(ValueError, match="KIMI_DECODE_PDL_TRIGGER must be one of wait, start"):
        compile_kda_decode(*kda[0], **kda[1])


def test_pdl_skip_setting(monkeypatch):
    """KIMI_DECODE_PDL_SKIP: by default only the w13 kernel with the shared experts' gate/up CTAs launches without PDL
    (the plain w13 kernel does launch under it, measured faster in v38); a comma-separated list names others, ""
    none."""
    monkeypatch.delenv("KIMI_DECODE_PDL_SKIP", raising=False)
    assert cute_common.pdl_skipped() == {"moe_w13_act_shared"}
    monkeypatch.setenv("KIMI_DECODE_PDL_SKIP", "moe_w13_act,moe_w13_act_shared")
    assert cute_common.pdl_skipped() == {"moe_w13_act", "moe_w13_act_shared"}
    monkeypatch.setenv("KIMI_DECODE_PDL_SKIP", "")
    assert cute_common.pdl_skipped() == frozenset()


@pytest.mark.parametrize("raw", ["1", "66", "eight", ""])
def test_grouped_from_outside_two_to_65_is_refused_by_name(monkeypatch, raw):
    from kimi_decode.backends.latency_specialized import grouped_from

    monkeypatch.delenv("KIMI_DECODE_GROUPED_FROM", raising=False)
    # by default per shard: grouped from batch 8 on slices of 384 stored rows or more (TP8), else from 9 (TP16: 256)
    assert (grouped_from(), grouped_from(256), grouped_from(384), grouped_from(768)) == (9, 9, 8, 8)
    monkeypatch.setenv("KIMI_DECODE_GROUPED_FROM", "17")
    assert grouped_from(256) == grouped_from(384) == 17
    monkeypatch.setenv("KIMI_DECODE_GROUPED_FROM", raw)
    with pytest.raises(ValueError, match="KIMI_DECODE_GROUPED_FROM must be a batch in 2..65"):
        grouped_from()


def test_gemv_preload_setting_other_than_a_whole_number_is_refused_by_name(monkeypatch):
    from kimi_decode.kernels.gemv import PRELOAD, preload_setting

    monkeypatch.delenv("KIMI_DECODE_GEMV_PRELOAD", raising=False)
    assert preload_setting() == PRELOAD
    monkeypatch.setenv("KIMI_DECODE_GEMV_PRELOAD", "0")
    assert preload_setting() == 0
    for raw in ("-1", "four", ""):
        monkeypatch.setenv("KIMI_DECODE_GEMV_PRELOAD", raw)
        with pytest.raises(ValueError, match="KIMI_DECODE_GEMV_PRELOAD"):
            preload_setting()


@pytest.mark.parametrize("name, bad, good", [
    ("KIMI_DECODE_CUTE_ATTN_RES", "yes", "0"), ("KIMI_DECODE_OVERLAP", "2", "0"), ("KIMI_DECODE_SHARED_GLU", "on", "0"),
    ("KIMI_DECODE_FUSED_GATE", "", "0"), ("KIMI_DECODE_FUSED_ROUTER", "off", "0"), ("KIMI_DECODE_MOE_ENTRY", "no", "0"),
    ("KIMI_DECODE_FUSED_O_RES", "true", "0"), ("KIMI_DECODE_EXPERTS_ONE_KERNEL", "yes", "1"),
    ("KIMI_DECODE_SHARED_ONE_KERNEL", "2", "1"), ("KIMI_DECODE_TC_PLAIN", "cublas", "0"),
    ("KIMI_DECODE_SHARED_IN_EXPERTS", "always", "1"), ("KIMI_DECODE_SHARED_GLU_IN", "w2", "w13"),
    ("KIMI_DECODE_TC_MIN_ROWS", "0", "4"), ("KIMI_DECODE_TC_MAX_ROWS", "65", "3"),
    ("KIMI_DECODE_PREFETCH_MB", "lots", "12"), ("KIMI_DECODE_PREFETCH_MB", "-1", "0.5"),
])
def test_backend_settings_with_a_bad_value_are_refused_by_name(monkeypatch, name, bad, good):
    """A mistyped setting fails when the backend is built, naming the variable, instead of quietly running a
    configuration nobody asked for (before, anything but "0" turned most of these on)."""
    monkeypatch.setenv(name, good)
    get_backend("latency_specialized")
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        get_backend("latency_specialized")


def test_kernel_settings_with_a_bad_value_are_refused_by_name(monkeypatch):
    from kimi_decode.kernels.cute_common import env_flag, pdl_prefetch_iters
    from kimi_decode.kernels.moe_mxfp4 import rider_split

    monkeypatch.setenv("KIMI_DECODE_PDL_PREFETCH_ITERS", "4")
    assert pdl_prefetch_iters() == 4
    monkeypatch.setenv("KIMI_DECODE_PDL_PREFETCH_ITERS", "four")
    with pytest.raises(ValueError, match="KIMI_DECODE_PDL_PREFETCH_ITERS"):
        pdl_prefetch_iters()
    monkeypatch.delenv("KIMI_DECODE_SHARED_RIDER_SPLIT", raising=False)
    assert rider_split(10**6, 7) == 1  # many rows: one warp per row pair
    monkeypatch.setenv("KIMI_DECODE_SHARED_RIDER_SPLIT", "7")
    assert rider_split(10**6, 7) == 7
    for bad in ("3", "8", "seven"):  # not a divisor of the CTA's 7 warps
        monkeypatch.setenv("KIMI_DECODE_SHARED_RIDER_SPLIT", bad)
        with pytest.raises(ValueError, match="KIMI_DECODE_SHARED_RIDER_SPLIT"):
            rider_split(10**6, 7)
    monkeypatch.setenv("KIMI_DECODE_KDA_STATE_FIRST", "0")
    assert env_flag("KIMI_DECODE_KDA_STATE_FIRST", "1") is False
    monkeypatch.delenv("KIMI_DECODE_KDA_STATE_FIRST")
    assert env_flag("KIMI_DECODE_KDA_STATE_FIRST", "1") is True


@needs_cute
@pytest.mark.parametrize("name, bad, allowed", [("KIMI_DECODE_KDA_STATE_FIRST", "yes", "0, 1"),
                                                ("KIMI_DECODE_KDA_TRIGGER", "early", "wait, late"),
                                                ("KIMI_DECODE_GEMV_EPI_EARLY", "late", "0, 1")])
def test_kernel_switches_with_a_bad_value_are_refused_by_name_before_compiling(monkeypatch, name, bad, allowed):
    from kimi_decode.kernels.gemv import compile_gemv
    from kimi_decode.kernels.kda_decode import compile_kda_decode

    s = shard("k3", tp=16)
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name} must be one of {allowed}, not '{bad}'"):
        if name == "KIMI_DECODE_GEMV_EPI_EARLY":
            compile_gemv(torch.empty(7168, 3584, dtype=torch.bfloat16), torch.empty(1, 3584, dtype=torch.bfloat16),
                         torch.empty(1, 7168), accumulate=True)
        else:
            compile_kda_decode(*_kda_args(s, 1), b_col=s.kda_in_proj_layout["b"][0], eps=1e-5, lower_bound=-5.0)


@needs_cute
@pytest.mark.parametrize("preload", ["0", "2", "64"])
def test_gemv_preload_compiles_for_sm90a_into_shared_memory_copies(sm90a, monkeypatch, preload):
    """Under PDL the GEMV (plain, SiTU-GLU, accumulating with row scale) and the MoE entry compile with 0, 2 and
    more slices than a row has copied into shared memory before the wait; each setting its own variant."""
    from kimi_decode.kernels.gemv import PRELOAD, SmallBatchGemv, compile_gemv
    from kimi_decode.kernels.moe_entry import compile_moe_entry

    monkeypatch.setenv("KIMI_DECODE_PDL", "1")
    monkeypatch.delenv("KIMI_DECODE_GEMV_PRELOAD", raising=False)
    bf = torch.bfloat16
    base = compile_gemv(torch.empty(3216, 7168, dtype=bf), torch.empty(1, 7168, dtype=bf),
                        torch.empty(1, 3216, dtype=bf))
    monkeypatch.setenv("KIMI_DECODE_GEMV_PRELOAD", preload)
    fns = [compile_gemv(torch.empty(3216, 7168, dtype=bf), torch.empty(1, 7168, dtype=bf),
                        torch.empty(1, 3216, dtype=bf)),
           compile_gemv(torch.empty(768, 7168, dtype=bf), torch.empty(1, 7168, dtype=bf),
                        torch.empty(1, 384, dtype=bf), glu=True),
           compile_gemv(torch.empty(7168, 3584, dtype=bf), torch.empty(1, 3584, dtype=bf), torch.empty(1, 7168),
                        accumulate=True, addend=torch.empty(1, 7168, dtype=bf), row_scale=(torch.empty(1, 224), 1e-5)),
           compile_moe_entry(torch.empty(896, 7168, dtype=bf), torch.empty(1, 7168, dtype=bf), torch.empty(1, 896),
                             torch.empty(896), torch.empty(1, 16, dtype=torch.int32), torch.empty(1, 16),
                             torch.zeros(1, dtype=torch.int32), torch.empty(3584, 7168, dtype=bf),
                             torch.empty(1, 3584, dtype=bf), 2.5,
                             glu=(torch.empty(768, 7168, dtype=bf), torch.empty(1, 384, dtype=bf)))]
    assert all(f is not None for f in fns) and (fns[0] is base) == (preload == str(PRELOAD))
    op = SmallBatchGemv(1, 3216, 7168, False, False, preload=int(preload))
    op.pdl = True
    assert op.preloaded() == min(int(preload), 28)  # 28 slices of 256 per 7168-long row
    op.pdl = False
    assert op.preloaded() == 0


@needs_cute
def test_oproj_early_modes_fall_back_where_the_rows_do_not_fit(monkeypatch):
    """"smem" keeps all of a CTA's rows in shared memory at the TP16 / TP8 widths (768 / 1536: 84 / 168 KB) but
    not at TP1's 12288; an unknown mode is refused by name."""
    from kimi_decode.kernels.oproj_attn_res import OProjAttnRes, compile_oproj_attn_res

    widths = {K: OProjAttnRes(7168, K, 132, 4, 1, 1e-5, "smem").early for K in (768, 1536, 12288)}
    assert widths == {768: "smem", 1536: "smem", 12288: "1"}
    monkeypatch.setenv("KIMI_DECODE_OPROJ_EARLY", "yes")
    args = _attn_res_args(1, delta=True)
    with pytest.raises(ValueError, match="KIMI_DECODE_OPROJ_EARLY must be one of smem, 1, 0"):
        compile_oproj_attn_res(torch.empty(7168, 768, dtype=torch.bfloat16), torch.empty(1, 768, dtype=torch.bfloat16),
                               args[2], args[0], args[1], *args[3:], torch.zeros(1, dtype=torch.int32), n_blocks=4,
                               delta_mode=1, eps=1e-5, ctas=132)


@needs_cute
def test_oproj_split_form_needs_its_scratch(monkeypatch):
    """The split AttnRes form (the default) refuses a missing, too small or non-fp32 scratch, and an unknown form by
    name."""
    from kimi_decode.kernels.oproj_attn_res import compile_oproj_attn_res

    def call(parts):
        args = _attn_res_args(1, delta=True)
        compile_oproj_attn_res(torch.empty(7168, 768, dtype=torch.bfloat16), torch.empty(1, 768, dtype=torch.bfloat16),
                               args[2], args[0], args[1], *args[3:], torch.zeros(1, dtype=torch.int32), n_blocks=4,
                               delta_mode=1, eps=1e-5, ctas=132, parts=parts)

    from kimi_decode.kernels.oproj_attn_res import res_mode

    monkeypatch.delenv("KIMI_DECODE_OPROJ_RES", raising=False)
    assert res_mode() == "split"  # the default
    for bad in (None, torch.zeros(132 * 16 - 1), torch.zeros(132 * 16, dtype=torch.int32)):
        with pytest.raises(ValueError, match="needs `parts`"):
            call(bad)
    monkeypatch.setenv("KIMI_DECODE_OPROJ_RES", "first")
    with pytest.raises(ValueError, match="KIMI_DECODE_OPROJ_RES must be one of last, split"):
        call(torch.zeros(132 * 32))


@needs_cute
def test_gemv_with_the_norm_added_after_its_loop_compiles_for_sm90a(sm90a_pdl, monkeypatch):
    """KIMI_DECODE_GEMV_NORM_AFTER: "1" (the default) and "0" each a variant of the row-scaled GEMV (the batch-1 MoE
    tail); GEMVs without a row scale are the same kernel either way; other values are refused by name."""
    from kimi_decode.kernels.gemv import compile_gemv, norm_after

    bf = torch.bfloat16

    def tail():
        return compile_gemv(torch.empty(7168, 3584, dtype=bf), torch.empty(1, 3584, dtype=bf), torch.empty(1, 7168),
                            accumulate=True, addend=torch.empty(1, 7168, dtype=bf),
                            row_scale=(torch.empty(1, 224), 1e-5))

    def plain():
        return compile_gemv(torch.empty(3216, 7168, dtype=bf), torch.empty(1, 7168, dtype=bf),
                            torch.empty(1, 3216, dtype=bf))

    monkeypatch.delenv("KIMI_DECODE_GEMV_NORM_AFTER", raising=False)
    assert norm_after()
    base, base_plain = tail(), plain()
    monkeypatch.setenv("KIMI_DECODE_GEMV_NORM_AFTER", "1")
    assert tail() is base
    monkeypatch.setenv("KIMI_DECODE_GEMV_NORM_AFTER", "0")
    assert not norm_after() and tail() is not None and tail() is not base and plain() is base_plain
    monkeypatch.setenv("KIMI_DECODE_GEMV_NORM_AFTER", "yes")
    with pytest.raises(ValueError, match="KIMI_DECODE_GEMV_NORM_AFTER must be one of"):
        tail()


@needs_cute
def test_gemv_refuses_bad_shapes():
    from kimi_decode.kernels.gemv import gemv

    w = torch.empty(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows"):
        gemv(w, torch.empty(9, 64, dtype=torch.bfloat16), torch.empty(9, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="chain"):
        gemv(w, torch.empty(1, 32, dtype=torch.bfloat16), torch.empty(1, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fp32"):
        gemv(w, torch.empty(1, 64, dtype=torch.bfloat16), torch.empty(1, 16, dtype=torch.bfloat16), accumulate=True)




@needs_cute
@pytest.mark.parametrize("tp, batch, pad", [(16, 1, True), (8, 1, True), (8, 8, True), (16, 4, False),
                                            (16, 64, True)])
def test_moe_mxfp4_compiles_for_sm90a(sm90a, tp, batch, pad):
    from kimi_decode.kernels.moe_mxfp4 import compile_moe

    s = shard("k3", tp=tp, pad_experts=pad)
    m = s.model
    L = m.moe_latent
    bf = torch.bfloat16

    def compile_for(**kw):
        return compile_moe(*_moe_args(s, batch), **kw)

    f13, f2 = compile_for()
    assert f13 is not None and f2 is not None
    scaled = (torch.empty(L), torch.empty(batch, L, dtype=bf))
    _, f2s = compile_for(scaled=scaled)
    assert f2s is not None and f2s is not f2  # its own variant: the bf16 scaled output is written
    if batch <= 8:  # both stages in one kernel (KIMI_DECODE_EXPERTS_ONE_KERNEL=1)
        assert compile_for(scaled=scaled, counters=torch.zeros(2 + batch, dtype=torch.int32)) is not None
    if batch == 1:  # the shared experts' GEMVs in CTAs of their own in both kernels, or the down-projection only
        shared = _shared_args(s)
        f13s, f2h = compile_for(scaled=scaled, shared=shared)
        assert f13s is not None and f2h is not None
        f13r, f2r = compile_for(scaled=scaled, shared=shared, shared_act_ready=True)
        assert f2r is f2h and f13r is not f13s  # the w2 kernel with the down-projection CTAs, the plain w13


@needs_cute
@pytest.mark.parametrize("tp, batch, pad, chunk", [(16, 1, True, "1"), (16, 8, False, "2"), (8, 1, True, "1"),
                                                   (8, 8, True, "4")])
def test_moe_mxfp4_compiles_for_sm90a_at_each_w2_chunk(sm90a_pdl, monkeypatch, tp, batch, pad, chunk):
    """The w2 kernel's 4-, 8- and 16-byte weight loads, in the plain, shared-experts and one-kernel forms, under
    PDL."""
    from kimi_decode.kernels.moe_mxfp4 import compile_moe

    monkeypatch.setenv("KIMI_DECODE_W2_CHUNK", chunk)
    s = shard("k3", tp=tp, pad_experts=pad)
    L, bf = s.model.moe_latent, torch.bfloat16
    scaled = (torch.empty(L), torch.empty(batch, L, dtype=bf))
    assert all(f is not None for f in compile_moe(*_moe_args(s, batch), scaled=scaled))
    assert compile_moe(*_moe_args(s, batch), counters=torch.zeros(2 + batch, dtype=torch.int32)) is not None
    if batch == 1:
        shared = _shared_args(s)
        assert all(f is not None for f in compile_moe(*_moe_args(s, batch), scaled=scaled, shared=shared))


@needs_cute
@pytest.mark.parametrize("tp, batch", [(16, 1), (8, 1), (16, 8), (8, 3)])
def test_moe_mxfp4_compiles_for_sm90a_with_the_activations_converted_either_way(sm90a_pdl, monkeypatch, tp, batch):
    """The w13 kernels with the activation operands made once per warp in shared memory (the default) and per lane
    (KIMI_DECODE_W13_X_ONCE=0): the plain, one-kernel and shared-experts forms, each its own compiled variant."""
    from kimi_decode.kernels.moe_mxfp4 import compile_moe

    s = shard("k3", tp=tp, pad_experts=True)
    args = _moe_args(s, batch)
    f13, _ = compile_moe(*args)
    monkeypatch.setenv("KIMI_DECODE_W13_X_ONCE", "0")
    g13, _ = compile_moe(*args)
    assert g13 is not f13  # the other form
    assert compile_moe(*args, counters=torch.zeros(2 + batch, dtype=torch.int32)) is not None
    if batch == 1:
        shared = _shared_args(s)
        assert all(f is not None for f in compile_moe(*args, shared=shared))


@needs_cute
@pytest.mark.parametrize("tp", [16, 8])
def test_moe_w2_with_the_shared_down_rows_side_by_side_compiles_for_sm90a(sm90a_pdl, monkeypatch, tp):
    """The w2 kernel's shared down-projection CTAs at 16, 8 and 4 lanes per row: each its own variant, with 2, 4 and
    8 rows per warp (so 2, 4 and 8 times fewer CTAs)."""
    from kimi_decode.kernels.moe_mxfp4 import MoEW2SumShared, compile_moe

    s = shard("k3", tp=tp, pad_experts=True)
    L, H, S = s.model.moe_latent, s.model.hidden, s_inter(tp)
    shared = _shared_args(s)
    seen = set()
    for lanes in ("32", "16", "8", "4"):
        monkeypatch.setenv("KIMI_DECODE_SHARED_DOWN_LANES", lanes)
        _, f2 = compile_moe(*_moe_args(s, 1), shared=shared, shared_act_ready=True)
        assert f2 is not None and f2 not in seen
        seen.add(f2)
        op = MoEW2SumShared(s.expert_inter_used, s.model.top_k, False, L, H, S, row_lanes=int(lanes))
        assert op.n_shared == -(-H // (op.warps * (32 // int(lanes))))


@needs_cute
@pytest.mark.parametrize("tp, batch", [(16, 1), (8, 1), (8, 8)])
def test_moe_w13_with_its_first_quads_loaded_early_compiles_for_sm90a(sm90a_pdl, monkeypatch, tp, batch):
    """KIMI_DECODE_W13_FIRST: a variant of the w13 kernel per count ("all" is the count of a warp's quads, the same
    kernel); "0" is the kernel without it; the default, auto, is "all" where a warp has more than 4 quads at one
    token (TP8: the 4-warp split, 7 quads) and "0" elsewhere; other values are refused by name."""
    from kimi_decode.kernels.moe_mxfp4 import compile_moe, quad_split, w13_first, w13_warps

    s = shard("k3", tp=tp, pad_experts=True)
    args = _moe_args(s, batch)
    quads = quad_split(s.model.moe_latent, w13_warps(s.expert_inter_used, batch, s.model.top_k))[1]
    assert quads == (7 if (tp, batch) == (8, 1) else 4)
    monkeypatch.setenv("KIMI_DECODE_W13_FIRST", "0")
    f13, _ = compile_moe(*args)
    kernels = {}
    for first in ("1", "2", "all"):
        monkeypatch.setenv("KIMI_DECODE_W13_FIRST", first)
        kernels[first], _ = compile_moe(*args)
        assert kernels[first] is not None and kernels[first] is not f13
    assert len({id(k) for k in kernels.values()}) == 3
    monkeypatch.setenv("KIMI_DECODE_W13_FIRST", "4")  # every quad where a warp has 4 (TP8 at one token: 7)
    assert (compile_moe(*args)[0] is kernels["all"]) == (quads == 4)
    for default in (None, "auto"):
        if default is None:
            monkeypatch.delenv("KIMI_DECODE_W13_FIRST", raising=False)
        else:
            monkeypatch.setenv("KIMI_DECODE_W13_FIRST", default)
        assert w13_first(batch, quads) == (64 if quads > 4 else 0)
        assert compile_moe(*args)[0] is (kernels["all"] if quads > 4 else f13)
    assert w13_first(8, 7) == 0 and w13_first(1, 4) == 0  # above one token, or 4 quads a warp: none
    for bad in ("5", "two", ""):
        monkeypatch.setenv("KIMI_DECODE_W13_FIRST", bad)
        with pytest.raises(ValueError, match="KIMI_DECODE_W13_FIRST must be one of"):
            compile_moe(*args)


@needs_cute
@pytest.mark.parametrize("tp", [16, 8])
def test_moe_w2_with_its_ids_and_scales_before_its_wait_compiles_for_sm90a(sm90a_pdl, monkeypatch, tp):
    """KIMI_DECODE_W2_PRE_WAIT: a variant of the batch-1 w2 kernel per setting, plain and with the shared experts'
    down-projection CTAs; the default, auto, is "scales" where every item's weight words come before the wait (TP16)
    and "weights" (the kernel as before) where some come after it (TP8); other values are refused by name."""
    from kimi_decode.kernels.moe_mxfp4 import MoEW2Sum, compile_moe, w2_chunk, w2_pre_wait

    s = shard("k3", tp=tp, pad_experts=True)
    shared = _shared_args(s)
    monkeypatch.delenv("KIMI_DECODE_W2_PRE_WAIT", raising=False)
    assert w2_pre_wait() == "auto"
    used, chunk = s.expert_inter_used, w2_chunk(s.expert_inter_used)
    op = MoEW2Sum(used, s.model.top_k, chunk=chunk, scale_words=chunk == 4)
    assert (op.per_warp <= op.early_items) == (tp == 16)
    assert op.pre_wait == ("scales" if tp == 16 else "weights")
    seen = set()
    for pre in ("auto", "weights", "ids", "scales", "all"):
        monkeypatch.setenv("KIMI_DECODE_W2_PRE_WAIT", pre)
        for f in (compile_moe(*_moe_args(s, 1))[1],
                  compile_moe(*_moe_args(s, 1), shared=shared, shared_act_ready=True)[1]):
            assert f is not None and id(f) not in seen
            seen.add(id(f))
    assert len(seen) == 10
    for bad in ("0", "scale", ""):
        monkeypatch.setenv("KIMI_DECODE_W2_PRE_WAIT", bad)
        with pytest.raises(ValueError, match="KIMI_DECODE_W2_PRE_WAIT must be one of"):
            compile_moe(*_moe_args(s, 1))
    with pytest.raises(ValueError, match="pre_wait must be one of"):
        MoEW2Sum(used, s.model.top_k, pre_wait="early")


@needs_cute
@pytest.mark.parametrize("tp, batch", [(16, 1), (8, 1), (8, 8)])
def test_moe_w13_with_its_weights_asked_of_l2_compiles_for_sm90a(sm90a_pdl, monkeypatch, tp, batch):
    """KIMI_DECODE_W13_PREFETCH=1: the w13 kernel's own variant, plain and (at one token) with the shared experts'
    gate/up CTAs; "0" (the default) is the kernel without it; other values are refused by name."""
    from kimi_decode.kernels.moe_mxfp4 import compile_moe, w13_prefetch

    s = shard("k3", tp=tp, pad_experts=True)
    args = _moe_args(s, batch)
    monkeypatch.delenv("KIMI_DECODE_W13_PREFETCH", raising=False)
    assert not w13_prefetch()
    f13, _ = compile_moe(*args)
    monkeypatch.setenv("KIMI_DECODE_W13_PREFETCH", "1")
    g13, _ = compile_moe(*args)
    assert g13 is not None and g13 is not f13
    if batch == 1:
        shared = _shared_args(s)
        assert all(f is not None for f in compile_moe(*args, shared=shared))
    monkeypatch.setenv("KIMI_DECODE_W13_PREFETCH", "yes")
    with pytest.raises(ValueError, match="KIMI_DECODE_W13_PREFETCH must be one of 0, 1"):
        compile_moe(*args)


def test_shared_down_lanes_setting(monkeypatch):
    """KIMI_DECODE_SHARED_DOWN_LANES: 8 lanes per row under auto, the value given otherwise; others refused."""
    from kimi_decode.kernels.moe_mxfp4 import shared_down_lanes

    monkeypatch.delenv("KIMI_DECODE_SHARED_DOWN_LANES", raising=False)
    assert shared_down_lanes() == 8
    monkeypatch.setenv("KIMI_DECODE_SHARED_DOWN_LANES", "32")
    assert shared_down_lanes() == 32
    monkeypatch.setenv("KIMI_DECODE_SHARED_DOWN_LANES", "2")
    with pytest.raises(ValueError, match="KIMI_DECODE_SHARED_DOWN_LANES must be one of auto, 32, 16, 8, 4"):
        shared_down_lanes()


def test_w13_activation_setting(monkeypatch):
    """KIMI_DECODE_W13_X_ONCE: once per warp at every batch under auto (and "1"), per lane with "0"; other values are
    refused by name."""
    from kimi_decode.kernels.moe_mxfp4 import w13_x_once

    monkeypatch.delenv("KIMI_DECODE_W13_X_ONCE", raising=False)
    assert [w13_x_once(b) for b in (1, 2, 8)] == [True, True, True]
    monkeypatch.setenv("KIMI_DECODE_W13_X_ONCE", "1")
    assert w13_x_once(1)
    monkeypatch.setenv("KIMI_DECODE_W13_X_ONCE", "0")
    assert not w13_x_once(1) and not w13_x_once(8)
    monkeypatch.setenv("KIMI_DECODE_W13_X_ONCE", "yes")
    with pytest.raises(ValueError, match="KIMI_DECODE_W13_X_ONCE"):
        w13_x_once(1)


def test_moe_mxfp4_refuses_shared_experts_that_do_not_chain():
    from kimi_decode.kernels.moe_mxfp4 import _check_shared

    bf = torch.bfloat16
    ok = (torch.empty(768, 7168, dtype=bf), torch.empty(1, 7168, dtype=bf), torch.empty(1, 384, dtype=bf),
          torch.empty(7168, 384, dtype=bf), torch.empty(1, 7168, dtype=bf))
    _check_shared(ok, 1)
    with pytest.raises(ValueError, match="batch 1"):
        _check_shared(ok, 2)
    with pytest.raises(ValueError, match="batch 1"):
        _check_shared((ok[0], ok[1], ok[2], torch.empty(7168, 768, dtype=bf), ok[4]), 1)
    with pytest.raises(ValueError, match="bf16"):
        _check_shared((*ok[:4], torch.empty(1, 7168)), 1)


@needs_cute
@pytest.mark.parametrize("tp", [16, 8])
def test_shared_mlp_compiles_for_sm90a(sm90a, tp):
    from kimi_decode.kernels.shared_mlp import compile_shared_mlp

    bf = torch.bfloat16
    inter = s_inter(tp)
    assert compile_shared_mlp(torch.empty(2 * inter, 7168, dtype=bf), torch.empty(1, 7168, dtype=bf),
                              torch.empty(1, inter, dtype=bf), torch.empty(7168, inter, dtype=bf),
                              torch.empty(1, 7168, dtype=bf), torch.zeros(3, dtype=torch.int32)) is not None


def test_shared_mlp_refuses_bad_shapes():
    from kimi_decode.kernels.shared_mlp import _check

    bf = torch.bfloat16
    ok = (torch.empty(768, 7168, dtype=bf), torch.empty(1, 7168, dtype=bf), torch.empty(1, 384, dtype=bf),
          torch.empty(7168, 384, dtype=bf), torch.empty(1, 7168, dtype=bf), torch.zeros(3, dtype=torch.int32))
    _check(*ok)
    for i, bad in ((1, torch.empty(2, 7168, dtype=bf)), (3, torch.empty(7168, 768, dtype=bf)),
                   (4, torch.empty(1, 7168)), (5, torch.zeros(2, dtype=torch.int32))):
        with pytest.raises(ValueError, match="shared_mlp"):
            _check(*ok[:i], bad, *ok[i + 1:])


@needs_cute
def test_norm_weight_first_is_a_variant_of_its_own_for_sm90a(sm90a, monkeypatch):
    """KIMI_DECODE_NORM_W_FIRST: the row norm, both routed norm forms and the w2 expert kernels that write the norm's
    scaled input compile with the weight loaded first and as before; "auto", the default, takes the first at one
    token and the second above it, "1" and "0" the one they name at every batch; other values are refused by
    name."""
    from kimi_decode.kernels import cute_common as cc
    from kimi_decode.kernels.moe_mxfp4 import compile_moe
    from kimi_decode.kernels.cute_common import norm_weight_first
    from kimi_decode.kernels.rmsnorm import RMSNormRows, RoutedNorm, RoutedNormSplit, routed_norm_scratch

    L = shard("k3", tp=16).model.moe_latent
    x, xs, w = torch.empty(8, L), torch.empty(8 * 16, L), torch.empty(L)
    out, res, add = torch.empty(8, L, dtype=torch.bfloat16), torch.empty(8, 7168), torch.empty(8, 7168,
                                                                                                  dtype=torch.bfloat16)
    counters, parts = routed_norm_scratch(L, torch.device("cpu"))
    args = ((x, w, out), (xs, w, out, res, add), (xs, w, out, res, add, counters, parts))
    for first in (False, True):
        ops = (RMSNormRows(L, 1e-5, first), RoutedNorm(L, 1e-5, 16, 7168, first),
               RoutedNormSplit(L, 1e-5, 16, 7168, 64, first))
        assert all(op.w_first == first for op in ops)
        assert all(cc.compile_kernel(("norm_w_first", first, i), op, *(cc.fake_like(t, align=16 if t is xs else 4)
                                                                       for t in a)) is not None
                   for i, (op, a) in enumerate(zip(ops, args)))

    def w2_kernels(batch):  # the per-pair w2 kernel writing the norm's scaled input: plain, with the shared experts
        s = shard("k3", tp=8)
        a = _moe_args(s, batch)
        scaled = (torch.empty(L), torch.empty(batch, L, dtype=torch.bfloat16))
        shared = _shared_args(s) if batch == 1 else None
        return [compile_moe(*a, scaled=scaled)[1], compile_moe(*a, scaled=scaled, shared=shared)[1] if shared
                else None, compile_moe(*a)[1]]

    picked, one, two = {}, {}, {}  # the w2 kernels at one and at two tokens, per setting
    for setting in ("auto", "0", "1"):
        monkeypatch.setenv("KIMI_DECODE_NORM_W_FIRST", setting)
        picked[setting] = [norm_weight_first(b) for b in (1, 2, 8, 64)]
        one[setting], two[setting] = w2_kernels(1), w2_kernels(2)
        assert all(f is not None for f in one[setting]) and two[setting][0] is not None
    monkeypatch.delenv("KIMI_DECODE_NORM_W_FIRST")
    assert [norm_weight_first(b) for b in (1, 2, 8, 64)] == picked["auto"]  # the default
    assert picked == {"auto": [True, False, False, False], "0": [False] * 4, "1": [True] * 4}
    # auto is "1" at one token and "0" above; the two forms are variants of their own where the kernel writes the
    # scaled input, the same kernel where it does not
    assert one["auto"] == one["1"] and two["auto"][0] is two["0"][0] and two["1"][0] is not two["0"][0]
    assert one["0"][0] is not one["1"][0] and one["0"][1] is not one["1"][1] and one["0"][2] is one["1"][2]
    monkeypatch.setenv("KIMI_DECODE_NORM_W_FIRST", "yes")
    with pytest.raises(ValueError, match="KIMI_DECODE_NORM_W_FIRST must be one of auto, 0, 1"):
        norm_weight_first(1)


@needs_cute
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_rmsnorm_compiles_for_sm90a(sm90a, batch):
    from kimi_decode.kernels import cute_common as cc
    from kimi_decode.kernels.rmsnorm import RMSNormRows, rmsnorm_rows

    m = shard("k3", tp=16).model
    x, out = torch.empty(batch, m.moe_latent), torch.empty(batch, m.moe_latent, dtype=torch.bfloat16)
    assert cc.compile_kernel(("n", batch), RMSNormRows(m.moe_latent, 1e-5),
                             *(cc.fake_like(t, align=4) for t in (x, torch.empty(m.moe_latent), out))) is not None
    with pytest.raises(ValueError, match="bf16 out"):
        rmsnorm_rows(x, torch.empty(m.moe_latent), torch.empty(batch, m.moe_latent), 1e-5)


@needs_cute
@pytest.mark.parametrize("split, dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)],
                         ids=["one-cta", "split", "one-cta-bf16"])
@pytest.mark.parametrize("batch, k", [(9, 16), (16, 16), (64, 16), (4, 1), (8, 1)])
@pytest.mark.parametrize("hidden", [0, 7168], ids=["norm", "norm+residual"])
def test_routed_norm_compiles_for_sm90a(sm90a, batch, k, hidden, split, dtype):
    """Both forms at the decode path's grouped batches (K3's 16 per-pair parts per token) and on a routed sum (k = 1,
    the MoE tail on cuBLAS above the tensor-core rows), with and without the residual: one CTA per token
    (`RoutedNorm`, also on bf16 pairs, `KIMI_DECODE_PAIRS_BF16=1`: a variant of its own, 8-byte loads) and several
    meeting on a counter (`RoutedNormSplit`, with its scratch)."""
    from kimi_decode.kernels import cute_common as cc
    from kimi_decode.kernels.rmsnorm import RoutedNorm, RoutedNormSplit, routed_norm_scratch

    m = shard("k3", tp=16).model
    x = torch.empty(batch * k, m.moe_latent, dtype=dtype)
    out = torch.empty(batch, m.moe_latent, dtype=torch.bfloat16)
    res, add = (torch.empty(batch, hidden), torch.empty(batch, hidden, dtype=torch.bfloat16)) if hidden else (out, out)
    tensors = [x, torch.empty(m.moe_latent), out, res, add]
    if split:
        counters, parts = routed_norm_scratch(m.moe_latent, torch.device("cpu"))
        op = RoutedNormSplit(m.moe_latent, 1e-5, k, hidden, counters.numel() // 2)
        tensors += [counters, parts]
    else:
        op = RoutedNorm(m.moe_latent, 1e-5, k, hidden)
    assert cc.compile_kernel(("rn", split, dtype, batch, k, hidden), op,
                             *(cc.fake_like(t, align=16 if t is x else 4) for t in tensors)) is not None


def test_routed_norm_split_scratch_fits_the_rows_it_serves():
    """`routed_norm_scratch` holds two counters per token and a part per CTA for the largest decode batch, and the
    split form spreads a 3584-wide row over 7 CTAs of 128 threads (a 16-byte group each)."""
    from kimi_decode.kernels.rmsnorm import SPLIT_MAX_ROWS, routed_norm_scratch, split_ctas

    counters, parts = routed_norm_scratch(3584, torch.device("cpu"))
    assert split_ctas(3584) == 7 and split_ctas(128) == 1 and split_ctas(1028) == 3
    assert counters.dtype == torch.int32 and counters.numel() == 2 * SPLIT_MAX_ROWS and not counters.any()
    assert parts.dtype == torch.float32 and parts.numel() == 7 * SPLIT_MAX_ROWS


@pytest.mark.parametrize("bad, match", [
    (dict(split=(torch.zeros(4, dtype=torch.int32), torch.zeros(7 * 4))), "split must be"),
    (dict(split=(torch.zeros(8), torch.zeros(7 * 4))), "split must be"),
    (dict(split=(torch.zeros(8, dtype=torch.int32), torch.zeros(7 * 3))), "split must be"),
    (dict(split=(torch.zeros(8, dtype=torch.int32), torch.zeros(7 * 4)), dtype=torch.bfloat16), "takes fp32 pairs"),
    (dict(split=None, dtype=torch.float16), "fp32 or bf16 pairs"),
])
def test_routed_norm_refuses_scratch_too_small_or_pairs_of_the_wrong_type(bad, match):
    from kimi_decode.kernels.rmsnorm import routed_norm

    with pytest.raises(ValueError, match=match):
        routed_norm(torch.empty(4, 16, 3584, dtype=bad.get("dtype", torch.float32)), torch.empty(3584),
                    torch.empty(4, 3584, dtype=torch.bfloat16), 1e-5, split=bad["split"])


@pytest.mark.parametrize("name, setting", [("KIMI_DECODE_PAIRS_BF16", "pairs_bf16"),
                                           ("KIMI_DECODE_ROUTED_NORM_SPLIT", "routed_norm_split")])
def test_off_by_default_tail_settings_are_validated(monkeypatch, name, setting):
    """The MoE tail's measured-and-off switches: off unset, on at "1", and any other value refused by name."""
    from kimi_decode.backends import latency_specialized

    read = getattr(latency_specialized, setting)
    assert not read()
    monkeypatch.setenv(name, "1")
    assert read()
    monkeypatch.setenv(name, "yes")
    with pytest.raises(Exception, match=name):
        read()


@pytest.mark.parametrize("bad, match", [
    (dict(pairs=torch.empty(4, 3584)), "pairs \\[B, k, W\\]"),
    (dict(out=torch.empty(4, 3584)), "bf16 out"),
    (dict(pairs=torch.empty(4, 16, 3582), weight=torch.empty(3582), out=torch.empty(4, 3582, dtype=torch.bfloat16)),
     "multiple of 4"),
    (dict(out=torch.empty(5, 3584, dtype=torch.bfloat16)), "out \\[B, W\\]"),
    (dict(residual=(torch.empty(4, 7168), torch.empty(4, 7168))), "residual"),
    (dict(residual=(torch.empty(3, 7168), torch.empty(3, 7168, dtype=torch.bfloat16))), "residual"),
])
def test_routed_norm_refuses_what_it_cannot_take(bad, match):
    from kimi_decode.kernels.rmsnorm import routed_norm

    args = dict(pairs=torch.empty(4, 16, 3584), weight=torch.empty(3584),
                out=torch.empty(4, 3584, dtype=torch.bfloat16), residual=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        routed_norm(args["pairs"], args["weight"], args["out"], 1e-5, residual=args["residual"])


def test_routed_norm_setting_is_validated(monkeypatch):
    from kimi_decode.backends.latency_specialized import routed_norm_on

    assert routed_norm_on()
    monkeypatch.setenv("KIMI_DECODE_ROUTED_NORM", "0")
    assert not routed_norm_on()
    monkeypatch.setenv("KIMI_DECODE_ROUTED_NORM", "yes")
    with pytest.raises(ValueError, match="KIMI_DECODE_ROUTED_NORM"):
        routed_norm_on()


def test_gemv_split_k_only_for_few_rows():
    from kimi_decode.kernels.gemv import WARPS, split_for

    assert split_for(896, 7168) == WARPS  # router: 4 warps per row
    assert split_for(768, 7168) == WARPS  # shared experts' gate/up
    assert split_for(3216, 7168) == 1 and split_for(7168, 3584) == 1  # enough rows already
    assert split_for(768, 128) == 1  # f_b: K too short to split


# every projection shape of the TP16 and TP8 shards once (the replicated ones are the same at both)
TC_SHAPES = sorted(set(projection_shapes(shard("k3", tp=16))) | set(projection_shapes(shard("k3", tp=8))))


@needs_cute
@pytest.mark.parametrize("n, k", TC_SHAPES)
@pytest.mark.parametrize("kernel, rows", [("gemm_tc", (2, 9, 64)), ("gemm_wgmma", (17, 40, 64))])
def test_split_k_projection_compiles_for_sm90a(sm90a, n, k, kernel, rows):
    """The two split-K tensor-core projections (`mma.sync`, and the warpgroup mma above 16 rows) on every projection
    shape, storing bf16 and accumulating into fp32 with an addend."""
    from kimi_decode.kernels.gemm_tc import workspace  # both kernels' partial sums

    mod = importlib.import_module(f"kimi_decode.kernels.{kernel}")
    compile_fn, plan_fn = ((mod.compile_projection, mod.plan_for) if kernel == "gemm_tc"
                           else (mod.compile_wgmma_projection, mod.wgmma_plan_for))
    for m in rows:
        plan = plan_fn(m, n, k)
        w, x = torch.empty(n, k, dtype=torch.bfloat16), torch.empty(m, k, dtype=torch.bfloat16)
        counters = torch.zeros(plan.groups, dtype=torch.int32)
        ws = workspace(plan, w.device)
        assert compile_fn(w, x, torch.empty(m, n, dtype=torch.bfloat16), ws, counters)[0] is not None
        assert compile_fn(w, x, torch.empty(m, n), ws, counters, accumulate=True,
                          addend=torch.empty(m, n, dtype=torch.bfloat16))[0] is not None


@needs_cute
@pytest.mark.parametrize("tp", [16, 8])
def test_wgmma_glu_projection_compiles_for_sm90a(sm90a, tp):
    """The warpgroup-mma projection with the SiTU-GLU epilogue (KIMI_DECODE_SHARED_GLU=all) on the shared experts'
    gate/up shape, at the rows the warpgroup mma takes that projection by default (2 to 32) and at 64."""
    from kimi_decode.kernels.gemm_tc import workspace
    from kimi_decode.kernels.gemm_wgmma import compile_wgmma_projection, wgmma_plan_for

    s = shard("k3", tp=tp)
    n, k = 2 * s.shared_inter, s.model.hidden
    w = torch.empty(n, k, dtype=torch.bfloat16)
    for m in (2, 8, 17, 64):
        plan = wgmma_plan_for(m, n, k, glu=True)
        assert plan.glu and plan.n_out == n // 2
        fn, args = compile_wgmma_projection(w, torch.empty(m, k, dtype=torch.bfloat16),
                                            torch.empty(m, n // 2, dtype=torch.bfloat16), workspace(plan, w.device),
                                            torch.zeros(plan.groups, dtype=torch.int32), glu=True)
        assert fn is not None and args[2].shape == (m, n // 2)


@needs_cute
def test_tensor_core_moe_tail_compiles_for_sm90a(sm90a):
    from kimi_decode.kernels.gemm_tc import compile_projection, plan_for, workspace

    w = torch.empty(7168, 3584, dtype=torch.bfloat16)  # the MoE tail with the RMSNorm's 1/rms per row
    plan = plan_for(8, 7168, 3584)
    assert compile_projection(w, torch.empty(8, 3584, dtype=torch.bfloat16), torch.empty(8, 7168),
                              workspace(plan, w.device), torch.zeros(plan.groups, dtype=torch.int32),
                              accumulate=True, addend=torch.empty(8, 7168, dtype=torch.bfloat16),
                              row_scale=(torch.empty(8, 224), 1e-5))[0] is not None


def test_kernel_modules_import_names_not_sibling_modules():
    """cutlass-dsl 4.3.5 (the H200 machine's) re-runs a kernel module's imports when it preprocesses a kernel and
    turns `from . import name` into an import of the module `<package>.None`, so every kernel of that module fails to
    compile there: the kernel modules import names (`from .gemm_tc import x`) only."""
    import ast

    kernels = Path(__file__).resolve().parent.parent / "kimi_decode" / "kernels"
    bad = [f"{path.name}:{node.lineno}" for path in sorted(kernels.glob("*.py"))
           for node in ast.walk(ast.parse(path.read_text()))
           if isinstance(node, ast.ImportFrom) and node.module is None]
    assert not bad, f"`from . import` in kernel modules: {bad}"


@pytest.mark.parametrize("rows", [2, 17, 33, 64])
def test_wgmma_plan_fills_the_sms_within_its_limits(rows):
    """Every projection shape: one warpgroup, splits that fill the 132 SMs with about one CTA each (a cluster of at
    most 8, every split with work), 8 stages where the CTAs fit one wave, else 6, within the shared-memory limit; at
    64 rows the tilings that were fastest in NOTES item 113's sweep."""
    from kimi_decode.kernels.gemm_wgmma import KS, MAX_SPLITS, SMEM_LIMIT, wgmma_plan_for

    for tp in (16, 8):
        for n, k in projection_shapes(shard("k3", tp=tp)):
            p = wgmma_plan_for(rows, n, k, 132)
            assert p.wgs == 1 and p.smem_bytes <= SMEM_LIMIT, (n, k, p.key())
            assert 1 <= p.splits <= MAX_SPLITS  # a row group's splits are one cluster
            assert (p.splits - 1) * p.per_split < k // KS <= p.splits * p.per_split  # every split has work
            assert p.groups * 64 >= n > (p.groups - 1) * 64
            if p.splits < min(MAX_SPLITS, k // KS):  # one split more would overfill the SMs more than this underfills
                assert p.ctas + p.groups - 132 >= 132 - p.ctas, (n, k, p.key())
            assert p.stages == (8 if p.ctas <= 132 else 6)
            assert p.owned == -(-rows // p.splits) * 64  # each CTA finishes every splits-th token
            assert p.cols == 8 * -(-rows // 8) and p.cols % 8 == 0 and p.cols <= 64
    fastest = {(3216, 7168): (3, 6), (7168, 768): (1, 8), (896, 7168): (8, 8), (768, 7168): (8, 8)}  # TP16
    for (n, k), (splits, stages) in fastest.items():
        assert wgmma_plan_for(64, n, k, 132).key()[4:6] == (splits, stages)


def test_wgmma_plan_refuses_a_pipeline_of_one_stage_and_clusters_past_8():
    from kimi_decode.kernels.gemm_wgmma import WgmmaPlan

    with pytest.raises(ValueError, match="2 stages"):
        WgmmaPlan(64, 7168, 3584, 1, 2, stages=1)
    with pytest.raises(ValueError, match="1 to 8 CTAs"):
        WgmmaPlan(64, 7168, 3584, 1, 9)
    assert WgmmaPlan(64, 896, 7168, 1, 8).splits == 8


@needs_cute
def test_wgmma_projection_refuses_bad_shapes():
    from kimi_decode.kernels.gemm_wgmma import WgmmaPlan, project_wgmma

    w, c = torch.empty(64, 256, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="rows"):
        project_wgmma(w, torch.empty(65, 256, dtype=torch.bfloat16), torch.empty(65, 64), c)
    with pytest.raises(ValueError, match="multiple of 64"):
        project_wgmma(torch.empty(64, 224, dtype=torch.bfloat16), torch.empty(32, 224, dtype=torch.bfloat16),
                      torch.empty(32, 64), c)
    with pytest.raises(ValueError, match="chain"):
        project_wgmma(w, torch.empty(32, 128, dtype=torch.bfloat16), torch.empty(32, 64), c)
    with pytest.raises(ValueError, match="fp32 y"):
        project_wgmma(w, torch.empty(32, 256, dtype=torch.bfloat16), torch.empty(32, 64, dtype=torch.bfloat16), c,
                      accumulate=True)
    with pytest.raises(ValueError, match="counters"):
        project_wgmma(w, torch.empty(32, 256, dtype=torch.bfloat16), torch.empty(32, 64), c.float())
    with pytest.raises(ValueError, match="not for this shape"):
        project_wgmma(w, torch.empty(32, 256, dtype=torch.bfloat16), torch.empty(32, 64), c,
                      plan=WgmmaPlan(64, 64, 256, 1, 1))
    x = torch.empty(8, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="SiTU-GLU epilogue needs N a multiple of 64"):  # 48 gate and 48 up rows
        project_wgmma(torch.empty(96, 256, dtype=torch.bfloat16), x, torch.empty(8, 48, dtype=torch.bfloat16), c,
                      glu=True)
    with pytest.raises(ValueError, match="SiTU-GLU epilogue takes"):
        project_wgmma(w, x, torch.empty(8, 32), c, glu=True)  # an fp32 y
    with pytest.raises(ValueError, match="chain"):
        project_wgmma(w, x, torch.empty(8, 64, dtype=torch.bfloat16), c, glu=True)  # y must be [M, N / 2]
    with pytest.raises(ValueError, match="does not match glu"):
        project_wgmma(w, x, torch.empty(8, 64, dtype=torch.bfloat16), c, plan=WgmmaPlan(8, 64, 256, 1, 1, glu=True))


@needs_cute
@pytest.mark.parametrize("n, k", TC_SHAPES)
def test_row_tile_projection_compiles_for_sm90a(sm90a, n, k):
    from kimi_decode.kernels.gemm_tc_rows import compile_rows_projection

    w = torch.empty(n, k, dtype=torch.bfloat16)
    for rows in (2, 8, 16):
        x = torch.empty(rows, k, dtype=torch.bfloat16)
        assert compile_rows_projection(w, x, torch.empty(rows, n, dtype=torch.bfloat16))[0] is not None
        if rows != 16:
            assert compile_rows_projection(w, x, torch.empty(rows, n), accumulate=True,
                                           addend=torch.empty(rows, n, dtype=torch.bfloat16))[0] is not None
    if (n, k) == (7168, 3584):  # the MoE tail with the RMSNorm's 1/rms per row
        for rows in (4, 8):
            assert compile_rows_projection(w, torch.empty(rows, k, dtype=torch.bfloat16), torch.empty(rows, n),
                                           accumulate=True, addend=torch.empty(rows, n, dtype=torch.bfloat16),
                                           row_scale=(torch.empty(rows, 224), 1e-5))[0] is not None


@needs_cute
def test_router_projection_on_its_own_plan_compiles_for_sm90a(sm90a):
    """The router projection as the backend runs it from 2 to 16 rows: fp32 logits on a plan of ROUTER_WARPS warps
    per CTA."""
    from kimi_decode.backends.latency_specialized import ROUTER_WARPS
    from kimi_decode.kernels.gemm_tc_rows import compile_rows_projection, rows_plan_for

    w = torch.empty(896, 7168, dtype=torch.bfloat16)
    for rows in (2, 8, 16):
        plan = rows_plan_for(rows, 896, 7168, ROUTER_WARPS)
        assert plan.warps == ROUTER_WARPS
        x = torch.empty(rows, 7168, dtype=torch.bfloat16)
        assert compile_rows_projection(w, x, torch.empty(rows, 896), plan=plan)[0] is not None


@pytest.mark.parametrize("rows", [2, 8, 16])
def test_row_tile_plan_splits_k_evenly_within_its_limits(rows):
    from kimi_decode.kernels.gemm_tc_rows import (CHUNK, DEFAULT_WARPS, GRID_WARPS, MAX_PIPE, MAX_PIPE_LOADS,
                                                  rows_plan_for)

    for tp in (16, 8):
        for n, k in projection_shapes(shard("k3", tp=tp)):
            p = rows_plan_for(rows, n, k)
            assert p.warps * p.per_warp * CHUNK == k and p.per_warp % p.pipe == 0, (n, k, p.key())
            assert p.warps <= DEFAULT_WARPS and p.pipe <= MAX_PIPE and p.pipe * (2 + p.tiles) <= MAX_PIPE_LOADS
            assert p.ctas * 16 == n and p.cols >= rows
            if k >= 3584:  # the big streams: enough warps in the grid (or 16 per CTA), several chunks in flight
                assert p.ctas * p.warps >= GRID_WARPS or p.warps == DEFAULT_WARPS, (n, k, p.key())
                assert p.pipe >= 2 and (p.warps == 4 or p.ctas * p.warps // 2 < GRID_WARPS), (n, k, p.key())


def test_row_tile_plan_refuses_uneven_splits():
    from kimi_decode.kernels.gemm_tc_rows import RowsPlan

    with pytest.raises(ValueError, match="split"):
        RowsPlan(8, 7168, 3584, 5, 1)
    with pytest.raises(ValueError, match="in flight"):
        RowsPlan(8, 7168, 3584, 16, 2)


@needs_cute
def test_row_tile_projection_refuses_bad_shapes():
    from kimi_decode.kernels.gemm_tc_rows import RowsPlan, project_rows

    w = torch.empty(64, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows"):
        project_rows(w, torch.empty(1, 256, dtype=torch.bfloat16), torch.empty(1, 64))
    with pytest.raises(ValueError, match="rows"):
        project_rows(w, torch.empty(17, 256, dtype=torch.bfloat16), torch.empty(17, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        project_rows(torch.empty(64, 248, dtype=torch.bfloat16), torch.empty(4, 248, dtype=torch.bfloat16),
                     torch.empty(4, 64))
    with pytest.raises(ValueError, match="of 16"):
        project_rows(torch.empty(72, 256, dtype=torch.bfloat16), torch.empty(4, 256, dtype=torch.bfloat16),
                     torch.empty(4, 72))
    with pytest.raises(ValueError, match="chain"):
        project_rows(w, torch.empty(4, 128, dtype=torch.bfloat16), torch.empty(4, 64))
    with pytest.raises(ValueError, match="fp32 y"):
        project_rows(w, torch.empty(4, 256, dtype=torch.bfloat16), torch.empty(4, 64, dtype=torch.bfloat16),
                     accumulate=True)
    with pytest.raises(ValueError, match="16-byte"):
        project_rows(w, torch.empty(4, 260, dtype=torch.bfloat16)[:, 2:258], torch.empty(4, 64))
    with pytest.raises(ValueError, match="not for this shape"):
        project_rows(w, torch.empty(4, 256, dtype=torch.bfloat16), torch.empty(4, 64),
                     plan=RowsPlan(8, 64, 256, 4, 2))


@pytest.mark.parametrize("rows", [2, 8, 16, 64])
def test_tensor_core_plan_fills_one_wave_within_its_limits(rows):
    from kimi_decode.kernels.gemm_tc import GROUP_PARTIALS_LIMIT, PARTIALS_LIMIT, SMEM_LIMIT, _stride, plan_for

    for tp in (16, 8):
        for n, k in projection_shapes(shard("k3", tp=tp)):
            p = plan_for(rows, n, k, 132)
            assert p.ctas <= p.per_sm * 132 and p.smem_bytes <= SMEM_LIMIT, (n, k, p.key())
            assert (p.splits - 1) * p.per_split < p.chunks <= p.splits * p.per_split  # every split has work
            assert p.groups * 32 * p.warps >= n
            assert p.partial_bytes <= PARTIALS_LIMIT * n * k * 2
            assert p.partial_bytes // p.groups <= GROUP_PARTIALS_LIMIT or rows == 64
            if rows <= 16 and n * k >= 3584 * 7168:  # the big streams: at least 12 warps per SM streaming
                assert p.ctas * p.warps >= 12 * 132, (n, k, p.key())
    # the staged token rows are 64 bytes off a 128-byte multiple (quarter-warp reads in distinct banks)
    for per_split in (1, 2, 7, 8, 45):
        assert (_stride(per_split) * 4) % 128 == 64


@needs_cute
def test_tensor_core_projection_refuses_bad_shapes():
    from kimi_decode.kernels.gemm_tc import project

    w, c = torch.empty(64, 256, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="rows"):
        project(w, torch.empty(1, 256, dtype=torch.bfloat16), torch.empty(1, 64), c)
    with pytest.raises(ValueError, match="rows"):
        project(w, torch.empty(65, 256, dtype=torch.bfloat16), torch.empty(65, 64), c)
    with pytest.raises(ValueError, match="multiple of 32"):
        project(torch.empty(64, 248, dtype=torch.bfloat16), torch.empty(4, 248, dtype=torch.bfloat16),
                torch.empty(4, 64), c)
    with pytest.raises(ValueError, match="chain"):
        project(w, torch.empty(4, 128, dtype=torch.bfloat16), torch.empty(4, 64), c)
    with pytest.raises(ValueError, match="fp32 y"):
        project(w, torch.empty(4, 256, dtype=torch.bfloat16), torch.empty(4, 64, dtype=torch.bfloat16), c,
                accumulate=True)
    with pytest.raises(ValueError, match="16-byte"):
        project(w, torch.empty(4, 260, dtype=torch.bfloat16)[:, 2:258], torch.empty(4, 64), c)


def s_inter(tp: int) -> int:
    return shard("k3", tp=tp).shared_inter


def test_gemv_glu_refuses_what_it_cannot_combine():
    from kimi_decode.kernels.gemv import gemv

    w = torch.empty(768, 7168, dtype=torch.bfloat16)
    x = torch.empty(1, 7168, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="SiTU-GLU"):
        gemv(w, x, torch.empty(1, 384), glu=True)  # fp32 y
    with pytest.raises(ValueError, match="SiTU-GLU"):
        gemv(w, x, torch.empty(1, 384), accumulate=True, glu=True)
    with pytest.raises(ValueError, match="do not chain"):
        gemv(w, x, torch.empty(1, 768, dtype=torch.bfloat16), glu=True)  # y must have half the rows


def test_gemv_addend_needs_accumulate():
    from kimi_decode.kernels.gemv import gemv

    w = torch.empty(16, 64, dtype=torch.bfloat16)
    x = torch.empty(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="addend"):
        gemv(w, x, torch.empty(1, 16), addend=torch.empty(1, 16, dtype=torch.bfloat16))


# (n_blocks, commit, delta_mode, use_partial) as decode_layer calls AttnRes: a layer's first call (delta_mode 0; commit
# only on a block-starting layer, and then without the partial; layer 0 without either), its second call (the
# attention output added to, or starting, the partial)
ATTN_RES_FLAGS = [(1, False, 0, False), (1, False, 2, True), (2, True, 0, False), (2, False, 2, True),
                  (3, False, 0, True), (3, False, 1, True), (8, True, 0, False), (8, False, 1, True)]


def _attn_res_args(batch, hidden=7168, num_blocks=8, delta=True, blocks=None):
    bf = torch.bfloat16
    return (torch.empty(batch, num_blocks, hidden) if blocks is None else blocks, torch.empty(batch, hidden),
            torch.empty(batch, hidden, dtype=bf) if delta else None, torch.empty(hidden), torch.empty(hidden),
            torch.empty(hidden), torch.empty(batch, hidden, dtype=bf))


@needs_cute
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_attn_res_compiles_for_sm90a(sm90a_pdl, batch):
    from kimi_decode.kernels.attn_res import compile_attn_res

    for n_blocks, commit, delta_mode, use_partial in ATTN_RES_FLAGS:
        fn, _ = compile_attn_res(*_attn_res_args(batch, delta=delta_mode > 0), n_blocks=n_blocks, commit=commit,
                                 delta_mode=delta_mode, use_partial=use_partial, eps=1e-5)
        assert fn is not None
    # a strided view of a larger block buffer, and the tiny model's width
    view = torch.empty(batch, 10, 7168)[:, 1:9]
    assert compile_attn_res(*_attn_res_args(batch, blocks=view), n_blocks=4, commit=True, delta_mode=1,
                            use_partial=True, eps=1e-5)[0] is not None
    assert compile_attn_res(*_attn_res_args(batch, hidden=256, num_blocks=3), n_blocks=2, commit=False,
                            delta_mode=1, use_partial=True, eps=1e-5)[0] is not None


@needs_cute
def test_attn_res_loads_first_is_a_variant_of_its_own(sm90a_pdl, monkeypatch):
    """KIMI_DECODE_ATTN_RES_LOADS_FIRST: "1" (the default) and "0" compile apart, in the AttnRes kernel and in the
    output projection's "last" form, which runs its body ("split" does not, so it is the same kernel either way);
    other values are refused by name."""
    from kimi_decode.kernels.attn_res import compile_attn_res, loads_first
    from kimi_decode.kernels.oproj_attn_res import compile_oproj_attn_res

    flags = dict(n_blocks=3, commit=False, delta_mode=1, use_partial=True, eps=1e-5)

    def oproj(res):
        monkeypatch.setenv("KIMI_DECODE_OPROJ_RES", res)
        args = _attn_res_args(1, delta=True, num_blocks=15)
        return compile_oproj_attn_res(torch.empty(7168, 1536, dtype=torch.bfloat16),
                                      torch.empty(1, 1536, dtype=torch.bfloat16), args[2], args[0], args[1],
                                      *args[3:], torch.zeros(1, dtype=torch.int32), n_blocks=4, delta_mode=1,
                                      eps=1e-5, ctas=132, parts=torch.zeros(132 * 32))[0]

    monkeypatch.setenv("KIMI_DECODE_ATTN_RES_LOADS_FIRST", "0")
    assert not loads_first()
    base = [compile_attn_res(*_attn_res_args(1, delta=True), **flags)[0],
            compile_attn_res(*_attn_res_args(1, delta=False), n_blocks=2, commit=True, delta_mode=0,
                             use_partial=False, eps=1e-5)[0], oproj("last"), oproj("split")]
    monkeypatch.delenv("KIMI_DECODE_ATTN_RES_LOADS_FIRST")
    assert loads_first()
    new = [compile_attn_res(*_attn_res_args(1, delta=True), **flags)[0],
           compile_attn_res(*_attn_res_args(1, delta=False), n_blocks=2, commit=True, delta_mode=0,
                            use_partial=False, eps=1e-5)[0], oproj("last"), oproj("split")]
    assert all(f is not None for f in base + new)
    assert all(a is not b for a, b in zip(base[:3], new[:3])) and base[3] is new[3]
    monkeypatch.setenv("KIMI_DECODE_ATTN_RES_LOADS_FIRST", "yes")
    with pytest.raises(ValueError, match="KIMI_DECODE_ATTN_RES_LOADS_FIRST must be one of 0, 1"):
        compile_attn_res(*_attn_res_args(1, delta=True), **flags)


@needs_cute
def test_attn_res_reads_blocks_before_the_wait_as_a_variant_of_its_own(sm90a, monkeypatch):
    """KIMI_DECODE_ATTN_RES_EARLY: "1" (the default) reads the committed blocks before the wait under PDL, "0" after
    it; the two compile apart, and other values are refused by name."""
    from kimi_decode.kernels.attn_res import compile_attn_res

    monkeypatch.setenv("KIMI_DECODE_PDL", "1")
    flags = dict(n_blocks=3, commit=False, delta_mode=1, use_partial=True, eps=1e-5)
    monkeypatch.delenv("KIMI_DECODE_ATTN_RES_EARLY", raising=False)
    early, _ = compile_attn_res(*_attn_res_args(1, delta=True), **flags)
    monkeypatch.setenv("KIMI_DECODE_ATTN_RES_EARLY", "0")
    late, _ = compile_attn_res(*_attn_res_args(1, delta=True), **flags)
    assert early is not None and late is not None and early is not late
    monkeypatch.setenv("KIMI_DECODE_ATTN_RES_EARLY", "yes")
    with pytest.raises(ValueError, match="KIMI_DECODE_ATTN_RES_EARLY"):
        compile_attn_res(*_attn_res_args(1, delta=True), **flags)


@needs_cute
def test_attn_res_refuses_bad_arguments():
    from kimi_decode.kernels.attn_res import attn_res

    def call(*args, n_blocks=2, commit=False, delta_mode=1, use_partial=True):
        attn_res(*args, n_blocks=n_blocks, commit=commit, delta_mode=delta_mode, use_partial=use_partial, eps=1e-5)

    good = _attn_res_args(2, hidden=256)
    blocks, partial, delta, q, kn, inorm, out = good
    with pytest.raises(ValueError, match="fp32 blocks"):
        call(blocks.double(), partial, delta, q, kn, inorm, out)
    with pytest.raises(ValueError, match="bf16 out"):
        call(blocks, partial, delta, q, kn, inorm, out.float())
    with pytest.raises(ValueError, match="delta"):
        call(blocks, partial, delta.float(), q, kn, inorm, out)
    with pytest.raises(ValueError, match="delta"):
        call(blocks, partial, None, q, kn, inorm, out)
    with pytest.raises(ValueError, match="query"):
        call(blocks, partial, delta, q[:128], kn, inorm, out)
    with pytest.raises(ValueError, match="key_norm"):
        call(blocks, partial, delta, q, kn.bfloat16(), inorm, out)
    with pytest.raises(ValueError, match="do not match"):
        call(blocks[:1], partial, delta, q, kn, inorm, out)
    with pytest.raises(ValueError, match="out"):
        call(blocks, partial, delta, q, kn, inorm, out[:1])
    with pytest.raises(ValueError, match="n_blocks"):
        call(*good, n_blocks=9)
    with pytest.raises(ValueError, match="n_blocks"):
        call(*good, n_blocks=0, commit=True, delta_mode=0, use_partial=False)
    with pytest.raises(ValueError, match="use_partial"):
        call(*good, use_partial=False)
    with pytest.raises(ValueError, match="delta_mode"):
        call(*good, delta_mode=3)
    with pytest.raises(ValueError, match="contiguous"):
        call(torch.empty(2, 256, 8).transpose(1, 2), partial, delta, q, kn, inorm, out)
    with pytest.raises(ValueError, match="aligned"):
        call(blocks, torch.empty(2 * 256 + 1)[1:].view(2, 256), delta, q, kn, inorm, out)
    with pytest.raises(ValueError, match="CUDA"):  # good arguments, but on the CPU
        call(*good)


def test_moe_mxfp4_refuses_tensors_past_32_bit_offsets():
    from kimi_decode.kernels import moe_mxfp4 as M

    m = shard("k3", tp=1).model
    tp1 = shard("k3", tp=1)
    E, L, I = m.num_experts, m.moe_latent, tp1.expert_inter
    meta = dict(dtype=torch.uint8, device="meta")
    w13, w2 = torch.empty(E, 2 * I, L // 2, **meta), torch.empty(E, L, I // 2, **meta)
    assert not M.fits_int32_offsets(w13, w2)  # a TP1 shard: 9.9e9 bytes of w13
    s8 = shard("k3", tp=8)
    assert M.fits_int32_offsets(torch.empty(E, 2 * s8.expert_inter, L // 2, **meta),
                                torch.empty(E, L, s8.expert_inter // 2, **meta))
    with pytest.raises(ValueError, match="64-bit offsets"):
        M.check_expert_args(torch.empty(1, L, dtype=torch.bfloat16), torch.empty(1, m.top_k, dtype=torch.int32), w13,
                 torch.empty(E, 2 * I, L // 32, **meta), w2, torch.empty(E, L, I // 32, **meta), I,
                 torch.empty(m.top_k, I, dtype=torch.float16), torch.empty(1, L))


def test_moe_mxfp4_refuses_activations_of_another_width_than_the_used_rows():
    """act must be [pairs, used]: the w2 kernel's chunks and its scale view are chosen from `used`."""
    from kimi_decode.kernels import moe_mxfp4 as M

    s = shard("k3", tp=16)
    m, used = s.model, s.expert_inter_used
    args = list(_moe_args(s, 1))
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in args]
    latent, ids, weights, w13, w13_scale, w2, w2_scale, act, out = meta[:9]
    M.check_expert_args(latent, ids, w13, w13_scale, w2, w2_scale, used, act, out)
    for bad in (torch.empty(m.top_k, used + 32, dtype=torch.float16, device="meta"),
                torch.empty(m.top_k + 1, used, dtype=torch.float16, device="meta")):
        with pytest.raises(ValueError, match=f"act must be \\[{m.top_k}, {used}\\]"):
            M.check_expert_args(latent, ids, w13, w13_scale, w2, w2_scale, used, bad, out)


def _moe_on_meta(tp: int, latent: int | None = None):
    """A K3 MoE block's tensors at a shard's real shapes (or another latent width), on the meta device (no memory)."""
    from kimi_decode.weights import MoEWeights

    s = shard("k3", tp=tp)
    m = s.model
    E, H, I, Is, g = m.num_experts, m.hidden, s.expert_inter, s.shared_inter, m.mxfp4_group
    L = latent or m.moe_latent
    u8, meta = torch.uint8, "meta"
    return MoEWeights(
        router=torch.empty(E, H, device=meta), router_bias=torch.empty(E, device=meta),
        down=torch.empty(L, H, device=meta), w13=torch.empty(E, 2 * I, L // 2, dtype=u8, device=meta),
        w13_scale=torch.empty(E, 2 * I, L // g, dtype=u8, device=meta),
        w2=torch.empty(E, L, I // 2, dtype=u8, device=meta), w2_scale=torch.empty(E, L, I // g, dtype=u8, device=meta),
        latent_norm=torch.empty(L, device=meta), up=torch.empty(H, L, device=meta),
        shared_gate_up=torch.empty(2 * Is, H, device=meta), shared_down=torch.empty(H, Is, device=meta))


@pytest.mark.parametrize("tp, batch, reduced, env, want", [
    # (attn, mlp, experts, attn_res, fused norm)
    (16, 1, False, None, (True, True, True, True, True)),
    (16, 8, False, None, (True, True, True, True, True)),  # per-pair experts: the norm in the w2 kernel
    (8, 7, False, None, (True, True, True, True, True)),
    (8, 8, False, None, (True, True, True, True, False)),  # TP8's slices run grouped from batch 8 (`grouped_from`)
    (16, 8, True, None, (True, True, True, True, False)),  # an all-reduce between the experts and the tail
    (16, 64, False, None, (True, True, True, True, False)),  # grouped experts: the RMSNorm before the tail
    (16, 64, False, "0", (True, True, True, False, False)),  # KIMI_DECODE_CUTE_ATTN_RES=0: Triton AttnRes
    (16, 65, False, None, (False, False, False, True, False)),  # past the decode path's 64 rows: AttnRes only
    (1, 1, False, None, (True, False, False, True, False)),  # TP1 expert tensors need 64-bit offsets
])
def test_kernel_selection_per_layer(monkeypatch, caplog, tp, batch, reduced, env, want):
    """Which stages take the CuTe kernels, for a KDA + MoE layer on a (pretend) GPU with cutlass-dsl."""
    from types import SimpleNamespace

    from kimi_decode.backends import latency_specialized
    from kimi_decode.config import KDA

    monkeypatch.setattr(latency_specialized, "_said", set())
    monkeypatch.setattr(latency_specialized.cute_common, "HAVE_CUTE", True)
    if env is not None:
        monkeypatch.setenv("KIMI_DECODE_CUTE_ATTN_RES", env)
    backend = get_backend("latency_specialized")
    lw = SimpleNamespace(attn_res=SimpleNamespace(query=SimpleNamespace(is_cuda=True)), attn_kind=KDA,
                         mlp=_moe_on_meta(tp))
    with caplog.at_level(logging.WARNING):
        backend.begin_layer(lw, batch, reduced=reduced)
    got = (backend._attn_fast, backend._mlp_fast, backend._experts_fast, backend._res_fast, backend._fused_norm)
    assert got == want
    said = " ".join(r.getMessage() for r in caplog.records)
    assert ("64-bit" in said or "32 bits" in said) == (tp == 1)
    assert (f"batch {batch} > 64" in said) == (batch > 64)
    assert ("run on cuBLAS" in said) == (16 < batch <= 64)  # from 2 to 16 rows: the row-tile projection


ALL_WGMMA = ("in_proj", "f_b", "o_proj", "router", "latent_down", "latent_up", "shared_gate_up", "shared_down")


@pytest.mark.parametrize("env, rows, want", [
    ("0", 64, ()), ("0", 32, ()), (None, 64, ()), (None, 32, ALL_WGMMA), ("auto", 17, ALL_WGMMA), ("auto", 33, ()),
    ("1", 64, ALL_WGMMA), ("router,shared_gate_up", 64, ("router", "shared_gate_up")),
    ("latent_up", 40, ("latent_up",)),
])
def test_wgmma_projections_by_name(monkeypatch, caplog, env, rows, want):
    """KIMI_DECODE_WGMMA puts the projections it names (or all: "1" up to 64 rows, "auto", the default, up to 32) on
    the warpgroup-mma projection from 17 rows, the rest on cuBLAS, and the fallback message names those on cuBLAS; at
    2-16 rows "auto" puts all but f_b on it, the others leave them all to the row tiles."""
    from types import SimpleNamespace

    from kimi_decode.backends import latency_specialized
    from kimi_decode.config import KDA

    monkeypatch.setattr(latency_specialized, "_said", set())
    monkeypatch.setattr(latency_specialized.cute_common, "HAVE_CUTE", True)
    if env is None:
        monkeypatch.delenv("KIMI_DECODE_WGMMA", raising=False)
    else:
        monkeypatch.setenv("KIMI_DECODE_WGMMA", env)
    backend = get_backend("latency_specialized")
    lw = SimpleNamespace(attn_res=SimpleNamespace(query=SimpleNamespace(is_cuda=True)), attn_kind=KDA,
                         mlp=_moe_on_meta(16))
    with caplog.at_level(logging.WARNING):
        backend.begin_layer(lw, rows)
    names = latency_specialized.WGMMA_PROJECTIONS
    assert names == ALL_WGMMA
    assert tuple(n for n in names if backend._wgmma_rows(rows, n)) == want
    assert tuple(n for n in names if not backend._plain_on_cublas(rows, n)) == want
    assert not any(backend._wgmma_rows(r, n) for r in (1, 65) for n in names)
    for r in (2, 8, 12, 16):
        below = ALL_WGMMA[:1] + ALL_WGMMA[2:] if env in (None, "auto") else ()
        assert tuple(n for n in names if backend._wgmma_rows(r, n)) == below
    assert not any(backend._plain_on_cublas(16, n) for n in names)
    said = " ".join(r.getMessage() for r in caplog.records)
    listed = said.split("run on cuBLAS: ")[1].split(" (")[0].split(", ") if "run on cuBLAS" in said else []
    assert listed == [n for n in names if n not in want]


@pytest.mark.parametrize("value", ["2", "router,experts", "", "Router"])
def test_wgmma_setting_refuses_unknown_names(monkeypatch, value):
    from kimi_decode.backends.latency_specialized import wgmma_setting

    monkeypatch.setenv("KIMI_DECODE_WGMMA", value)
    with pytest.raises(ValueError, match="KIMI_DECODE_WGMMA must be auto, 0, 1 or some of in_proj"):
        wgmma_setting()


@pytest.mark.parametrize("value", ["1", "66", "x", ""])
def test_wgmma_min_rows_refuses_values_off_its_range(monkeypatch, value):
    monkeypatch.setenv("KIMI_DECODE_WGMMA_MIN_ROWS", value)
    with pytest.raises(ValueError, match="KIMI_DECODE_WGMMA_MIN_ROWS must be rows in 2..65"):
        get_backend("latency_specialized")


def test_expert_kernels_fall_back_for_a_latent_width_off_their_quads(monkeypatch, caplog):
    """The expert kernels split the latent into quads of 4 MX groups (128 values): another width runs auto's experts
    (and the MoE tail that goes with them), saying so once."""
    from types import SimpleNamespace

    from kimi_decode.backends import latency_specialized
    from kimi_decode.config import KDA

    monkeypatch.setattr(latency_specialized, "_said", set())
    monkeypatch.setattr(latency_specialized.cute_common, "HAVE_CUTE", True)
    backend = get_backend("latency_specialized")
    lw = SimpleNamespace(attn_res=SimpleNamespace(query=SimpleNamespace(is_cuda=True)), attn_kind=KDA,
                         mlp=_moe_on_meta(16, latent=3584 - 32))
    with caplog.at_level(logging.WARNING):
        backend.begin_layer(lw, 1, reduced=False)
    assert not backend._experts_fast and not backend._mlp_fast
    assert "multiple of 128" in " ".join(r.getMessage() for r in caplog.records)


@needs_cute
@pytest.mark.parametrize("stage", ["1", "0", "all"], ids=["staged", "unstaged", "all_staged"])
@pytest.mark.parametrize("tp, batch, pad", [(16, 64, True), (8, 64, True), (16, 9, False), (8, 32, True)])
def test_moe_mxfp4_grouped_compiles_for_sm90a(sm90a, monkeypatch, tp, batch, pad, stage):
    from kimi_decode.kernels.moe_mxfp4_grouped import compile_grouped

    monkeypatch.setenv("KIMI_DECODE_GROUPED_STAGE", stage)
    f13, f2 = compile_grouped(*_grouped_args(shard("k3", tp=tp, pad_experts=pad), batch))
    assert f13 is not None and f2 is not None


@needs_cute
@pytest.mark.parametrize("stage", ["1", "all"], ids=["staged", "all_staged"])
@pytest.mark.parametrize("tp", [16, 8])
def test_moe_mxfp4_grouped_with_bf16_pair_outputs_compiles_for_sm90a(sm90a, monkeypatch, tp, stage):
    """`KIMI_DECODE_PAIRS_BF16=1`'s w2 kernel: the per-pair outputs stored as bf16, a variant of its own, staged
    (TP8's whole quads) and not."""
    from kimi_decode.kernels.moe_mxfp4_grouped import compile_grouped

    monkeypatch.setenv("KIMI_DECODE_GROUPED_STAGE", stage)
    args = _grouped_args(shard("k3", tp=tp), 64)
    f13, f2 = compile_grouped(*args)
    args[9] = torch.empty(args[9].shape, dtype=torch.bfloat16)
    g13, g2 = compile_grouped(*args)
    assert g13 is f13 and g2 is not None and g2 is not f2


def test_grouped_experts_take_fp32_or_bf16_pair_outputs_only():
    from kimi_decode.kernels.moe_mxfp4_grouped import _check

    args = _grouped_args(shard("k3", tp=16), 16)
    latent, ids, weights, w13, w13s, w2, w2s, align, act, pair_out, used = args
    _check(latent, ids, weights, w13, w13s, w2, w2s, used, align, act, pair_out.bfloat16())
    with pytest.raises(ValueError, match="out fp32 or bf16 expected"):
        _check(latent, ids, weights, w13, w13s, w2, w2s, used, align, act, pair_out.half())


@needs_cute
@pytest.mark.parametrize("quad", [True, False], ids=["quad_major", "natural"])
def test_expert_kernels_on_compact_w2_rows_with_padded_scales_compile_for_sm90a(sm90a, monkeypatch, quad):
    """KIMI_DECODE_W2_COMPACT=1's form (the default) at TP16: w2 codes of the 6 used MX groups per row (96 bytes)
    beside the padded shard's scales (8 bytes per row, read as int32 words): the per-pair kernels at 1 and 8 tokens
    (w2 a variant of its own, also with the fused norm's scaled output) and the grouped ones at 64, w2 staged
    ("all") and not."""
    from kimi_decode.kernels.moe_mxfp4 import compile_moe
    from kimi_decode.kernels.moe_mxfp4_grouped import compile_grouped

    s = shard("k3", tp=16)
    m = s.model
    L, used = m.moe_latent, s.expert_inter_used
    for batch in (1, 8):
        args = list(_moe_args(s, batch))
        padded = compile_moe(*args, quad_major=quad)
        args[5] = torch.empty(m.num_experts, L, used // 2, dtype=torch.uint8)  # w2, its used columns only
        compact = compile_moe(*args, quad_major=quad)
        assert compact[0] is padded[0] and compact[1] is not None and compact[1] is not padded[1]
        scaled = compile_moe(*args, quad_major=quad,
                             scaled=(torch.empty(L), torch.empty(batch, L, dtype=torch.bfloat16)))
        assert scaled[1] is not None
    for stage in ("1", "all"):
        monkeypatch.setenv("KIMI_DECODE_GROUPED_STAGE", stage)
        f13, f2 = compile_grouped(*_grouped_args(s, 64, w2_cols=used // 2), quad_major=quad)
        assert f13 is not None and f2 is not None


@needs_cute
@pytest.mark.parametrize("tp, batch, pad, stage, ahead", [(16, 64, True, "1", "1"), (8, 64, True, "1", "1"),
                                                          (16, 9, False, "1", "1"), (16, 64, True, "all", "1"),
                                                          (8, 64, True, "1", "0"), (16, 64, True, "all", "0")])
def test_moe_w2_grouped_with_its_pairs_loaded_ahead_or_not_compiles_for_sm90a(sm90a, monkeypatch, tp, batch, pad, stage,
                                                                              ahead):
    """KIMI_DECODE_W2_AHEAD: the w2 kernel with its segment table in lanes and its pairs loaded a segment ahead ("1",
    the default) and with both loaded at each segment's start ("0"), unstaged (TP16 at "1") and staged (TP8; TP16's
    quad-major rows at "all"), on both layouts; the compiled form is the one asked for (the cache key's flag)."""
    from kimi_decode.kernels.moe_mxfp4_grouped import compile_grouped

    monkeypatch.setenv("KIMI_DECODE_GROUPED_STAGE", stage)
    monkeypatch.setenv("KIMI_DECODE_W2_AHEAD", ahead)
    args = _grouped_args(shard("k3", tp=tp, pad_experts=pad), batch)
    for quad in (False, True):
        f13, f2 = compile_grouped(*args, quad_major=quad)
        assert f13 is not None and f2 is not None
    w2_keys = [key for key in cute_common._cache if key[0] == "moe_w2_grouped"]
    assert len(w2_keys) == 2 and all(key[6] is (ahead == "1") for key in w2_keys)  # (.., stage, ahead, ..)


@pytest.mark.parametrize("raw", ["2", "yes", ""])
@pytest.mark.parametrize("name, where, default", [("KIMI_DECODE_W2_AHEAD", "moe_mxfp4_grouped.w2_ahead", True),
                                                  ("KIMI_DECODE_MX_ALU", "cute_common.mx_alu", False)])
def test_on_off_settings_refused_by_name(monkeypatch, name, where, default, raw):
    """The kernels' "0" / "1" switches: the default when unset, each value, and anything else refused by name."""
    module, fn = where.split(".")
    setting = getattr(importlib.import_module(f"kimi_decode.kernels.{module}"), fn)
    monkeypatch.delenv(name, raising=False)
    assert setting() is default
    for value in ("0", "1"):
        monkeypatch.setenv(name, value)
        assert setting() is (value == "1")
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        setting()


@needs_cute
@pytest.mark.parametrize("tp, batch, pad, chunk", [(16, 1, True, "auto"), (8, 8, True, "4"), (16, 3, False, "2")])
def test_expert_kernels_with_their_integer_work_off_the_alu_pipe_compile_for_sm90a(sm90a_pdl, monkeypatch, tp, batch,
                                                                                  pad, chunk):
    """KIMI_DECODE_MX_ALU=1: every MXFP4 expert kernel with the dequantisation's shift as a `mul.hi` and the scale
    bytes taken out by a mask and a `mad`: the per-pair kernels (two-kernel, one-kernel and shared-experts forms,
    scale words and single bytes, w2 chunks of 4 / 2 groups) and the grouped ones (staged and not, both layouts), as
    variants of their own (the compile key carries the setting)."""
    from kimi_decode.kernels.moe_mxfp4 import compile_moe
    from kimi_decode.kernels.moe_mxfp4_grouped import compile_grouped

    monkeypatch.setenv("KIMI_DECODE_W2_CHUNK", chunk)
    s = shard("k3", tp=tp, pad_experts=pad)
    L, bf = s.model.moe_latent, torch.bfloat16
    scaled = (torch.empty(L), torch.empty(batch, L, dtype=bf))
    alu = compile_moe(*_moe_args(s, batch), scaled=scaled, quad_major=True)
    monkeypatch.setenv("KIMI_DECODE_MX_ALU", "1")
    for quad in (False, True):
        fns = compile_moe(*_moe_args(s, batch), scaled=scaled, quad_major=quad)
        assert all(f is not None for f in fns)
        assert compile_moe(*_moe_args(s, batch), counters=torch.zeros(2 + batch, dtype=torch.int32),
                           quad_major=quad) is not None
    assert all(f is not g for f, g in zip(fns, alu))
    if batch == 1:
        shared = _shared_args(s)
        assert all(f is not None for f in compile_moe(*_moe_args(s, batch), scaled=scaled, shared=shared,
                                                      quad_major=True))
    for stage in ("1", "all"):
        monkeypatch.setenv("KIMI_DECODE_GROUPED_STAGE", stage)
        for quad in (False, True):
            assert all(f is not None for f in compile_grouped(*_grouped_args(s, 64), quad_major=quad))
    # the compile key ends with (mx_alu(), mx_packed())
    grouped = [key for key in cute_common._cache if key[0].startswith("moe_w") and "grouped" in key[0]]
    assert grouped and all(key[-2] is True for key in grouped)


@needs_cute
@pytest.mark.parametrize("tp, batch, pad, chunk", [(16, 1, True, "auto"), (16, 8, False, "2"), (8, 8, True, "4"),
                                                   (8, 1, True, "1"), (16, 3, False, "auto")])
def test_moe_mxfp4_on_quad_major_codes_compiles_for_sm90a(sm90a_pdl, monkeypatch, tp, batch, pad, chunk):
    """The per-pair kernels on `quad_major` codes, variants of their own, at each w2 load width: two-kernel,
    one-kernel and shared-experts forms."""
    from kimi_decode.kernels.moe_mxfp4 import compile_moe

    monkeypatch.setenv("KIMI_DECODE_W2_CHUNK", chunk)
    s = shard("k3", tp=tp, pad_experts=pad)
    L, bf = s.model.moe_latent, torch.bfloat16
    scaled = (torch.empty(L), torch.empty(batch, L, dtype=bf))
    natural = compile_moe(*_moe_args(s, batch), scaled=scaled)
    quad = compile_moe(*_moe_args(s, batch), scaled=scaled, quad_major=True)
    assert all(f is not None for f in quad) and quad[0] is not natural[0] and quad[1] is not natural[1]
    assert compile_moe(*_moe_args(s, batch), counters=torch.zeros(2 + batch, dtype=torch.int32),
                       quad_major=True) is not None
    if batch == 1:
        shared = _shared_args(s)
        for ready in (False, True):
            assert all(f is not None for f in compile_moe(*_moe_args(s, batch), scaled=scaled, shared=shared,
                                                          shared_act_ready=ready, quad_major=True))


@needs_cute
@pytest.mark.parametrize("tp, batch, pad", [(16, 64, True), (8, 64, True), (16, 9, False)])
def test_moe_mxfp4_grouped_on_quad_major_codes_compiles_for_sm90a(sm90a, tp, batch, pad):
    from kimi_decode.kernels.moe_mxfp4_grouped import compile_grouped

    args = _grouped_args(shard("k3", tp=tp, pad_experts=pad), batch)
    natural, quad = compile_grouped(*args), compile_grouped(*args, quad_major=True)
    assert all(f is not None for f in quad) and quad[0] is not natural[0] and quad[1] is not natural[1]


def test_moe_mxfp4_grouped_refuses_bad_shapes():
    from kimi_decode.kernels.moe_mxfp4_grouped import moe_mxfp4_grouped

    s = shard("k3", tp=16)
    m = s.model
    E, L, I, k = m.num_experts, m.moe_latent, s.expert_inter, m.top_k
    u8 = torch.uint8
    w13, w13s = torch.empty(E, 2 * I, L // 2, dtype=u8), torch.empty(E, 2 * I, L // 32, dtype=u8)
    w2, w2s = torch.empty(E, L, I // 2, dtype=u8), torch.empty(E, L, I // 32, dtype=u8)
    ids = torch.zeros(16, k, dtype=torch.int32)
    align = [torch.empty(16 * k, dtype=torch.int32)] * 4
    with pytest.raises(ValueError, match="latent bf16"):
        moe_mxfp4_grouped(torch.empty(16, L), ids, torch.empty(16, k), w13, w13s, w2, w2s, s.expert_inter_used, align)
    with pytest.raises(ValueError, match="alignment"):
        moe_mxfp4_grouped(torch.empty(16, L, dtype=torch.bfloat16), ids, torch.empty(16, k), w13, w13s, w2, w2s,
                          s.expert_inter_used, align[:3] + [torch.empty(5, dtype=torch.int32)])


@needs_cute
@pytest.mark.parametrize("batch, experts", [(9, 896), (64, 896), (64, 2048)])
def test_counting_alignment_compiles_for_sm90a(sm90a_pdl, batch, experts):
    """`kernels/moe_align.py` with and without the latent's operands (one and two experts per scan thread; and 6
    pairs, not a multiple of 4), and the grouped w13 kernel that takes them."""
    from kimi_decode.kernels.moe_align import MoEAlign
    from kimi_decode.kernels.moe_mxfp4_grouped import compile_grouped

    six = [torch.empty(6, dtype=torch.int32) for _ in range(5)]
    args = (*six, six[0].view(1, 6), six[0].view(1, 6))
    assert cute_common.compile_kernel(("moe_align", 40, 0, *cute_common.signature(*args)), MoEAlign(6, 40, 0),
                                      *(cute_common.fake_like(t, align=4) for t in args)) is not None
    P, L = batch * 16, 3584
    ids, outs = torch.empty(P, dtype=torch.int32), [torch.empty(P, dtype=torch.int32) for _ in range(4)]
    lat, ops = torch.empty(batch, L, dtype=torch.bfloat16), torch.empty(batch, L, dtype=torch.float16)
    for units, x, xo in ((0, ids.view(1, P), ids.view(1, P)), (batch * L // 8, lat.view(torch.int32),
                                                                 ops.view(torch.int32))):
        args = (ids, *outs, x, xo)
        fake = [cute_common.fake_like(t, align=16 if t.dim() == 2 and units else 4) for t in args]
        assert cute_common.compile_kernel(("moe_align", experts, units, *cute_common.signature(*args)),
                                          MoEAlign(P, experts, units), *fake) is not None
    s = shard("k3", tp=16)
    m = s.model
    E, I, k = m.num_experts, s.expert_inter, m.top_k
    u8 = torch.uint8
    grouped = (torch.empty(batch, k, dtype=torch.int32), torch.empty(batch, k), torch.empty(E, 2 * I, L // 2, dtype=u8),
               torch.empty(E, 2 * I, L // 32, dtype=u8), torch.empty(E, L, I // 2, dtype=u8),
               torch.empty(E, L, I // 32, dtype=u8), outs, torch.empty(P, s.expert_inter_used, dtype=torch.float16),
               torch.empty(P, L), s.expert_inter_used)
    plain = compile_grouped(lat, *grouped, quad_major=True)
    with_ops = compile_grouped(ops, *grouped, quad_major=True, x_operands=True)
    assert with_ops[0] is not None and with_ops[0] is not plain[0] and with_ops[1] is plain[1]


def test_latent_operands_pair_each_value_with_the_one_four_after_it():
    """The w13 kernel's operand order: in every 8 values, (a0, a4), (a1, a5), (a2, a6), (a3, a7), rounded to fp16
    as the kernel's conversion rounds (through fp32, to nearest even)."""
    from kimi_decode.kernels.moe_mxfp4_grouped import latent_operands

    g = torch.Generator().manual_seed(3)
    latent = (torch.randn(3, 64, generator=g) * 100).bfloat16()
    got = latent_operands(latent)
    assert got.dtype == torch.float16 and got.shape == latent.shape
    for c in range(64):
        u, i = divmod(c, 8)
        src = 8 * u + i // 2 + 4 * (i % 2)
        assert torch.equal(got[:, c], latent[:, src].float().half())
    out = torch.empty_like(got)
    assert latent_operands(latent, out) is out and torch.equal(out, got)


def test_counting_alignment_refuses_what_it_cannot_sort():
    from kimi_decode.kernels.moe_align import moe_align

    i32 = torch.int32
    outs = [torch.empty(16, dtype=i32) for _ in range(4)]
    with pytest.raises(ValueError, match="1 to 1024 pairs"):
        moe_align(torch.zeros(1025, dtype=i32), *[torch.empty(1025, dtype=i32) for _ in range(4)], experts=896)
    with pytest.raises(ValueError, match="1 to 8192 experts"):
        moe_align(torch.zeros(16, dtype=i32), *outs, experts=10000)
    with pytest.raises(ValueError, match="int32"):
        moe_align(torch.zeros(16, dtype=torch.int64), *outs, experts=896)
    with pytest.raises(ValueError, match="go together"):
        moe_align(torch.zeros(16, dtype=i32), *outs, experts=896, latent=torch.empty(1, 3584, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="latent bf16 and operands fp16"):
        moe_align(torch.zeros(16, dtype=i32), *outs, experts=896, latent=torch.empty(1, 3584),
                  operands=torch.empty(1, 3584, dtype=torch.float16))


@pytest.mark.parametrize("raw", ["2", "triton", ""])
def test_grouped_align_setting_refused_by_name(monkeypatch, raw):
    from kimi_decode.backends.latency_specialized import grouped_align

    monkeypatch.delenv("KIMI_DECODE_GROUPED_ALIGN", raising=False)
    assert grouped_align() == "1"
    for value in ("1", "align", "0"):
        monkeypatch.setenv("KIMI_DECODE_GROUPED_ALIGN", value)
        assert grouped_align() == value
    monkeypatch.setenv("KIMI_DECODE_GROUPED_ALIGN", raw)
    with pytest.raises(ValueError, match="KIMI_DECODE_GROUPED_ALIGN"):
        grouped_align()


def test_quad_transpose_gives_each_lane_its_word_of_all_four_groups():
    """The expert kernels' word exchange, run on 4 simulated lanes (a tensor over lanes; a shuffle reads lane ^ d):
    lane t loaded the 4 words of group t and must end with word t of groups 0..3, for every word value (random
    bits)."""
    from kimi_decode.kernels.moe_mxfp4 import quad_transpose

    g = torch.Generator().manual_seed(5)
    words = torch.randint(-2**31, 2**31 - 1, (4, 4), generator=g, dtype=torch.int64)  # [lane = group, word]
    lanes = torch.arange(4)
    got = quad_transpose([words[:, i] for i in range(4)], lanes, torch.where, lambda x, d: x[lanes ^ d])
    assert torch.equal(torch.stack(got, dim=1), words.T)  # lane t, slot i: word t of group i


@pytest.mark.parametrize("raw", ["2", "yes", "w2", ""])
def test_grouped_stage_setting_refused_by_name(monkeypatch, raw):
    from kimi_decode.kernels.moe_mxfp4_grouped import grouped_staged

    monkeypatch.delenv("KIMI_DECODE_GROUPED_STAGE", raising=False)
    # the default: w13 always, w2 on rows of whole quads of MX groups (TP8's 384 values, not TP16's 192)
    assert grouped_staged("w13") and grouped_staged("w2", 384) and not grouped_staged("w2", 192)
    for value, w13, w2 in (("0", False, False), ("w13", True, False), ("all", True, True)):
        monkeypatch.setenv("KIMI_DECODE_GROUPED_STAGE", value)
        assert (grouped_staged("w13"), grouped_staged("w2", 192), grouped_staged("w2", 384)) == (w13, w2, w2)
    monkeypatch.setenv("KIMI_DECODE_GROUPED_STAGE", raw)
    with pytest.raises(ValueError, match="KIMI_DECODE_GROUPED_STAGE"):
        grouped_staged("w13")


@needs_cute
def test_staged_grouped_kernels_fit_their_ctas_per_sm_in_shared_memory():
    """Staged, the w13 kernel's shared memory (weights, scale words, reduction buffer) leaves room for the 3 CTAs
    per SM its registers allow under cutlass-dsl 4.3.5, and the w2 kernel's two segment buffers for 2 (227 KB per
    SM on the H100 / H200): at TP16 with 4 row tiles per warp, at TP8 with 2 (quad-major rows, as the layer runs
    them). w2 does not stage without scale words (TP16 rows not padded), nor on TP16's natural rows, whose two groups
    after the quad are not side by side per lane."""
    from kimi_decode.kernels.moe_mxfp4_grouped import COLS, MoEW2Grouped, MoEW13Grouped

    for tp, tiles2 in ((16, 4), (8, 2)):
        s = shard("k3", tp=tp, pad_experts=True)
        L, used, k = s.model.moe_latent, s.expert_inter_used, s.model.top_k
        k13 = MoEW13Grouped(L, s.expert_inter, used, k, 2, 0, True)
        assert k13.stage_bytes() > 0 and 3 * k13.smem_bytes() <= 227 * 1024
        assert k13.smem_bytes() - k13.stage_bytes() == 2 * 8 * COLS * k13.warps * k13.tiles * 4  # the reduction
        k2 = MoEW2Grouped(L, used, k, 4, True, 64 * k, s.expert_inter // 32, True)
        assert k2.stage and k2.tiles == tiles2 and 0 < 2 * k2.stage_bytes() <= 227 * 1024
    assert not MoEW2Grouped(L, 192, k, 4, False, 64 * k, 6, True).stage
    assert not MoEW2Grouped(L, 192, k, 4, True, 64 * k, 0, True).stage
    assert MoEW2Grouped(L, 384, k, 4, True, 64 * k, 0, True).stage


@needs_cute
@pytest.mark.parametrize("tp, batch, pad", [(16, 64, True), (8, 64, True), (16, 9, False)])
def test_grouped_w13_over_several_segments_compiles_for_sm90a(sm90a, monkeypatch, tp, batch, pad):
    """KIMI_DECODE_W13_SEG_DIV 1 / 2 / 4 / 8: the grouped w13 kernel on one CTA row per segment slot (1) or on
    ceil(P / D) CTA rows that loop over their segments, a variant each (the w2 kernel unchanged); "auto", the
    default, is 2 from 512 pair slots on (batch 64 here) and 1 below (batch 9); other values are refused by name."""
    from kimi_decode.kernels.moe_mxfp4_grouped import MoEW13Grouped, compile_grouped

    args = _grouped_args(shard("k3", tp=tp, pad_experts=pad), batch)
    monkeypatch.delenv("KIMI_DECODE_W13_SEG_DIV", raising=False)
    default = compile_grouped(*args, quad_major=True)
    by_div = {}
    for d in ("1", "2", "4", "8"):
        monkeypatch.setenv("KIMI_DECODE_W13_SEG_DIV", d)
        f13, f2 = compile_grouped(*args, quad_major=True)
        assert f13 is not None and id(f13) not in {id(f) for f in by_div.values()} and f2 is default[1]
        by_div[d] = f13
    assert default[0] is by_div["2" if batch * 16 >= 512 else "1"]
    monkeypatch.setenv("KIMI_DECODE_GROUPED_STAGE", "0")  # unstaged the rows do not loop: one kernel for every D
    unstaged = compile_grouped(*args, quad_major=True)[0]
    monkeypatch.setenv("KIMI_DECODE_W13_SEG_DIV", "1")
    assert compile_grouped(*args, quad_major=True)[0] is unstaged
    monkeypatch.delenv("KIMI_DECODE_GROUPED_STAGE")
    monkeypatch.setenv("KIMI_DECODE_W13_SEG_DIV", "3")
    with pytest.raises(ValueError, match="KIMI_DECODE_W13_SEG_DIV must be one of auto, 1, 2, 4, 8"):
        compile_grouped(*args)
    # the rows cover every slot with one lane each; unstaged, or at 1, one row per slot
    P = batch * 16
    for d in (2, 4, 8):
        rows = MoEW13Grouped(3584, 256, 192, 16, 2, 0, True, pairs=P, seg_div=d).seg_rows
        assert rows == -(-P // d) and 32 * rows >= P
    assert MoEW13Grouped(3584, 256, 192, 16, 2, 0, False, pairs=P, seg_div=4).seg_rows == 0
    assert MoEW13Grouped(3584, 256, 192, 16, 2, 0, True, pairs=P, seg_div=1).seg_rows == 0


@needs_cute
@pytest.mark.parametrize("tp, batch, pad", [(16, 64, True), (8, 64, True), (16, 9, False)])
def test_grouped_w13_unrolled_compiles_for_sm90a(sm90a, monkeypatch, tp, batch, pad):
    """KIMI_DECODE_GROUPED_W13_UNROLL 1 / 2 / 4: the staged w13 kernel's mma loop over 1, 2 or all 4 of a warp's
    quads per iteration, a variant each (the w2 kernel unchanged), 4 by default; other counts are refused by name."""
    from kimi_decode.kernels.moe_mxfp4_grouped import compile_grouped

    args = _grouped_args(shard("k3", tp=tp, pad_experts=pad), batch)
    monkeypatch.delenv("KIMI_DECODE_GROUPED_W13_UNROLL", raising=False)
    default = compile_grouped(*args, quad_major=True)
    monkeypatch.setenv("KIMI_DECODE_GROUPED_W13_UNROLL", "1")
    one = compile_grouped(*args, quad_major=True)
    seen = {id(one[0])}
    for u in ("2", "4"):
        monkeypatch.setenv("KIMI_DECODE_GROUPED_W13_UNROLL", u)
        f13, f2 = compile_grouped(*args, quad_major=True)
        assert f13 is not None and id(f13) not in seen and f2 is one[1]
        seen.add(id(f13))
    assert f13 is default[0]  # 4, the default
    monkeypatch.setenv("KIMI_DECODE_GROUPED_W13_UNROLL", "3")
    with pytest.raises(ValueError, match="KIMI_DECODE_GROUPED_W13_UNROLL must be one of 1, 2, 4"):
        compile_grouped(*args)


@needs_cute
@pytest.mark.parametrize("tp, pad", [(16, True), (16, False), (8, True)])
def test_expert_kernels_on_packed_codes_compile_for_sm90a(sm90a_pdl, monkeypatch, tp, pad):
    """KIMI_DECODE_MX_PACKED "1" (the default) / "0": the per-pair (batches 1 and 8; at one token with the shared
    experts inside) and grouped (batch 64) kernels on quad-major codes, a variant each per setting."""
    from kimi_decode.kernels.moe_mxfp4 import compile_moe
    from kimi_decode.kernels.moe_mxfp4_grouped import compile_grouped

    s = shard("k3", tp=tp, pad_experts=pad)
    L, bf = s.model.moe_latent, torch.bfloat16
    shared = _shared_args(s)
    seen = set()
    for setting in ("0", "1"):
        monkeypatch.setenv("KIMI_DECODE_MX_PACKED", setting)
        fns = [*compile_grouped(*_grouped_args(s, 64), quad_major=True)]
        for batch in (1, 8):
            fns += compile_moe(*_moe_args(s, batch), scaled=(torch.empty(L), torch.empty(batch, L, dtype=bf)),
                               quad_major=True)
        fns += compile_moe(*_moe_args(s, 1), scaled=(torch.empty(L), torch.empty(1, L, dtype=bf)), shared=shared,
                           shared_act_ready=True, quad_major=True)
        assert all(f is not None for f in fns) and not seen & {id(f) for f in fns}
        seen |= {id(f) for f in fns}


def test_segment_ctas_cover_every_segment_in_at_most_32_per_cta(monkeypatch):
    from kimi_decode.kernels.moe_mxfp4_grouped import SEG_CTAS_PER_SM, segment_ctas

    monkeypatch.setattr("kimi_decode.kernels.moe_mxfp4_grouped.sm_count", lambda: 132)
    monkeypatch.delenv("KIMI_DECODE_GROUPED_SEG_CTAS", raising=False)
    assert SEG_CTAS_PER_SM == 8
    assert segment_ctas(1024, 7) == 151  # 8 x 132 / 7 row blocks (K3's latent: 3584 rows of 512 per CTA)
    assert segment_ctas(144, 7) == 144  # never more CTAs than segment slots
    monkeypatch.setenv("KIMI_DECODE_GROUPED_SEG_CTAS", "1")
    assert segment_ctas(1024, 7) == 32  # a lane per segment: at least 1024 / 32
    assert segment_ctas(144, 24) == 6
    for pairs in (144, 999, 1024):
        for rows in (7, 12, 24):
            g = segment_ctas(pairs, rows)
            assert 32 * g >= pairs and g <= pairs
    monkeypatch.setenv("KIMI_DECODE_GROUPED_SEG_CTAS", "0")
    assert segment_ctas(1024, 12) == 1024  # one CTA per segment slot
    for raw in ("65", "-1", "x", ""):
        monkeypatch.setenv("KIMI_DECODE_GROUPED_SEG_CTAS", raw)
        with pytest.raises(ValueError, match="KIMI_DECODE_GROUPED_SEG_CTAS must be CTAs per SM in 0..64"):
            segment_ctas(1024, 12)


def test_grouped_tiles_switch_is_checked(monkeypatch):
    from kimi_decode.kernels.moe_mxfp4_grouped import grouped_tiles

    assert (grouped_tiles("w13"), grouped_tiles("w2")) == (2, 4)
    monkeypatch.setenv("KIMI_DECODE_GROUPED_TILES", "1")
    assert (grouped_tiles("w13"), grouped_tiles("w2")) == (1, 1)
    monkeypatch.setenv("KIMI_DECODE_GROUPED_TILES", "1,4")
    assert (grouped_tiles("w13"), grouped_tiles("w2")) == (1, 4)
    monkeypatch.setenv("KIMI_DECODE_GROUPED_TILES", "3")
    with pytest.raises(ValueError, match="1, 2 or 4"):
        grouped_tiles("w2")


def test_prefetch_view_takes_whole_chunks_of_the_first_bytes():
    from kimi_decode.kernels.prefetch import CHUNK, prefetch_view

    w = torch.arange(3 * CHUNK + 100, dtype=torch.uint8)
    v = prefetch_view(w, 2 * CHUNK + 5)
    assert v.shape == (2, CHUNK) and v.data_ptr() == w.data_ptr() and torch.equal(v.reshape(-1), w[: 2 * CHUNK])
    assert prefetch_view(w, 10**9).shape == (3, CHUNK)  # never past the tensor
    assert prefetch_view(w, CHUNK - 1) is None
    with pytest.raises(ValueError, match="contiguous"):
        prefetch_view(torch.empty(64, 64 * 1024, dtype=torch.uint8)[:, ::2], CHUNK)


@needs_cute
def test_prefetch_compiles_for_sm90a(sm90a):
    from kimi_decode.kernels.prefetch import compile_prefetch, prefetch_view

    m = shard("k3", tp=16).model
    for mb in (1, 24, 200):  # fewer chunks than threads, a few per thread, all of a 51 MB weight
        assert compile_prefetch(prefetch_view(torch.empty(m.moe_latent, m.hidden, dtype=torch.bfloat16),
                                              mb << 20)) is not None


@pytest.mark.parametrize("env, overlap, prefetch, fused_gate", [
    ({}, True, 0, True),  # the defaults (benchmarks/NOTES.md, v5-v7, v12)
    ({"KIMI_DECODE_OVERLAP": "0"}, False, 0, True),
    ({"KIMI_DECODE_PREFETCH_MB": "24", "KIMI_DECODE_FUSED_GATE": "0"}, True, 24 << 20, False),
])
def test_moe_block_fork_and_the_measured_off_switches(monkeypatch, env, overlap, prefetch, fused_gate):
    """The MoE block forks by default; L2 prefetch is off unless asked for, f_b inside the KDA kernel on unless
    switched off; a dense (non-MoE) layer never forks."""
    from types import SimpleNamespace

    from kimi_decode.backends import latency_specialized
    from kimi_decode.config import KDA

    monkeypatch.setattr(latency_specialized.cute_common, "HAVE_CUTE", True)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    backend = get_backend("latency_specialized")
    lw = SimpleNamespace(attn_res=SimpleNamespace(query=SimpleNamespace(is_cuda=True)), attn_kind=KDA,
                         mlp=_moe_on_meta(16))
    monkeypatch.setitem(latency_specialized.cute_common._pdl_mode, "layer", False)
    backend.begin_layer(lw, 1)
    assert (backend._overlap, backend._prefetch_bytes, backend._fused_gate) == (overlap, prefetch, fused_gate)
    # batch 1: PDL, the router inside the latent down-projection's kernel, the shared experts inside the expert kernels
    assert backend._moe_entry and backend._shared_riders and latency_specialized.cute_common.pdl_enabled()
    backend.begin_layer(lw, 2)
    assert not (backend._moe_entry or backend._shared_riders or latency_specialized.cute_common.pdl_enabled())
    tp8 = SimpleNamespace(attn_res=lw.attn_res, attn_kind=KDA, mlp=_moe_on_meta(8))
    backend.begin_layer(tp8, 1)  # under PDL the TP8 layer stays on one stream too
    assert backend._moe_entry and backend._shared_riders
    monkeypatch.setenv("KIMI_DECODE_PDL", "0")  # without it TP8's shared experts (twice the rows) fork
    backend.begin_layer(tp8, 1)
    assert backend._moe_entry and not backend._shared_riders
    monkeypatch.delenv("KIMI_DECODE_PDL")
    backend.end_layer()
    assert not latency_specialized.cute_common.pdl_enabled()
    backend.begin_layer(SimpleNamespace(attn_res=lw.attn_res, attn_kind=KDA, mlp=object()), 1)
    assert not backend._overlap


def _router_args(rows, E=896, K=7168, k=16):
    return (torch.empty(E, K, dtype=torch.bfloat16), torch.empty(rows, K, dtype=torch.bfloat16),
            torch.empty(rows, E), torch.empty(E), torch.empty(rows, k, dtype=torch.int32), torch.empty(rows, k),
            torch.zeros(1, dtype=torch.int32))


@needs_cute
@pytest.mark.parametrize("form", ["shuffle", "redux"])
def test_moe_entry_compiles_for_sm90a(sm90a_pdl, monkeypatch, form):
    from kimi_decode.kernels.moe_entry import compile_moe_entry

    monkeypatch.setenv("KIMI_DECODE_TOPK_FORM", form)  # how the router's last CTA finds each warp's top k

    for E, K, k, L in ((896, 7168, 16, 3584), (200, 512, 8, 384)):
        bf = torch.bfloat16
        latent = (torch.empty(L, K, dtype=bf), torch.empty(1, L, dtype=bf))
        assert compile_moe_entry(*_router_args(1, E, K, k), *latent, 2.5) is not None
        for S in (384, 768):  # with the shared experts' gate/up GEMV (TP16, TP8)
            glu = (torch.empty(2 * S, K, dtype=bf), torch.empty(1, S, dtype=bf))
            assert compile_moe_entry(*_router_args(1, E, K, k), *latent, 2.5, glu=glu) is not None
    # with the selected experts' w13 rows asked of L2 (TP16's padded shard, TP8), with and without the gate/up part
    flags = torch.zeros(2, dtype=torch.int32)
    latent = (torch.empty(3584, 7168, dtype=bf), torch.empty(1, 3584, dtype=bf))
    for I, used, S in ((256, 192, 384), (384, 384, 768), (384, 384, 0)):
        glu = (torch.empty(2 * S, 7168, dtype=bf), torch.empty(1, S, dtype=bf)) if S else None
        prefetch = (torch.empty(896, 2 * I, 1792, dtype=torch.uint8), flags, used)
        plain = compile_moe_entry(*_router_args(1, 896, 7168, 16), *latent, 2.5, glu=glu)
        assert compile_moe_entry(*_router_args(1, 896, 7168, 16), *latent, 2.5, glu=glu,
                                 prefetch=prefetch) not in (None, plain)


def test_moe_entry_prefetch_layout_and_checks():
    """The prefetch's chunk counts of K3's w13 (TP16's padded shard, TP8), None where the rows are not whole 4 KB
    chunks, and codes or flags the kernel cannot take refused by name."""
    from kimi_decode.kernels.moe_entry import _check, prefetch_layout

    u8, bf = torch.uint8, torch.bfloat16
    assert prefetch_layout(torch.empty(896, 512, 1792, dtype=u8), 192) == (84, 112, 224)
    assert prefetch_layout(torch.empty(896, 768, 1792, dtype=u8), 384) == (168, 168, 336)
    assert prefetch_layout(torch.empty(8, 512, 1792, dtype=u8), 100) is None  # 100 rows: 43.75 chunks
    args = (*_router_args(1), torch.empty(3584, 7168, dtype=bf), torch.empty(1, 3584, dtype=bf))
    flags = torch.zeros(2, dtype=torch.int32)
    for bad in ((torch.empty(8, 512, 1792, dtype=u8), flags, 100), (torch.empty(8, 512, 1792), flags, 192),
                (torch.empty(8, 512, 1792, dtype=u8), torch.zeros(1, dtype=torch.int32), 192)):
        with pytest.raises(ValueError, match="prefetch"):
            _check(*args, prefetch=bad)


def test_moe_entry_refuses_a_down_projection_that_does_not_chain():
    from kimi_decode.kernels.moe_entry import _check

    bf = torch.bfloat16
    with pytest.raises(ValueError, match="down-projection"):
        _check(*_router_args(1), torch.empty(3584, 4096, dtype=bf), torch.empty(1, 3584, dtype=bf))
    with pytest.raises(ValueError, match="down-projection"):
        _check(*_router_args(1), torch.empty(3584, 7168, dtype=bf), torch.empty(1, 3584))


@pytest.mark.parametrize("groups", [2, 4, 6, 8, 12, 112])
def test_quad_major_puts_each_lanes_words_side_by_side_and_inverts(groups):
    """`quad_major`: word t of group G lands where `quad_major_offset` says (4t + c in a quad, 2t + c in a last
    pair), so lane t's words of a chunk are one contiguous load; `inverse` gives the natural rows back."""
    from kimi_decode.kernels.moe_mxfp4 import quad_major, quad_major_offset

    w = torch.randint(0, 256, (3, 5, 16 * groups), dtype=torch.uint8)
    q = quad_major(w, packed=False)
    assert q.shape == w.shape and q.dtype == w.dtype and not torch.equal(q, w)
    assert torch.equal(quad_major(q, inverse=True, packed=False), w)
    nat, moved = w.view(torch.int32), q.view(torch.int32)
    places = [quad_major_offset(G, t, groups) for G in range(groups) for t in range(4)]
    assert sorted(places) == list(range(4 * groups))  # a permutation of each row's words
    for G in range(groups):
        for t in range(4):
            assert torch.equal(moved[..., quad_major_offset(G, t, groups)], nat[..., 4 * G + t])
    for c in range(0, groups - groups % 4, 4):  # lane t's 16 bytes of quad c // 4: word t of its four groups
        for t in range(4):
            assert [quad_major_offset(c + i, t, groups) for i in range(4)] == list(range(4 * c + 4 * t, 4 * c + 4 * t + 4))


def _run_dequant_ptx(template: str, w: int) -> list[int]:
    """The four 32-bit registers h0..h3 that a `moe_mxfp4` dequantisation template computes from word `w`, by
    interpreting its PTX (the few integer instructions it uses, on unsigned 32-bit values)."""
    import re

    M = 0xFFFFFFFF
    regs = {"w": w, "z": 0}

    def val(x: str) -> int:
        x = x.strip()
        return int(x, 16) & M if x.startswith("0x") else int(x) if x.isdigit() else regs[x]

    def prmt(a: int, b: int, sel: int) -> int:
        pool = (a | b << 32).to_bytes(8, "little")
        return int.from_bytes(bytes(pool[sel >> 4 * i & 7] for i in range(4)), "little")

    ops = {"and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b, "shl.b32": lambda a, b: a << b & M,
           "shr.u32": lambda a, b: a >> b, "mul.hi.u32": lambda a, b: a * b >> 32, "prmt.b32": prmt}
    for ins in re.findall(r"([a-z0-9.]+) ([^;]+);", template.format(w="w", h="h", shr="shr.u32 t1, w, 3")):
        op, args = ins[0], [a.strip() for a in ins[1].split(",")]
        regs[args[0]] = ops[op](*(val(a) for a in args[1:]))
    return [regs[f"h{i}"] for i in range(4)]


def test_packed_dequantisation_gives_every_code_its_value():
    """`_DEQUANT_PACKED` on a word of packed codes (`quad_major`'s byte packing) gives the same four fp16x2 registers
    as `_DEQUANT` on the natural word, and each fp16 is its e2m1 code's value x 2**-14: codes (i, i + 4) in h_i,
    for words covering every byte value in each of the four byte places."""
    import numpy as np

    from kimi_decode.kernels.moe_mxfp4 import _DEQUANT, _DEQUANT_PACKED, _pack_bytes
    from kimi_decode.quant import E2M1_VALUES

    for b in range(256):
        for place in range(4):
            w = (b << 8 * place) | (((b * 37 + 11) & 0xFF) << 8 * ((place + 1) % 4))
            nat = torch.tensor(list(w.to_bytes(4, "little")), dtype=torch.uint8)
            packed = int.from_bytes(bytes(_pack_bytes(nat, inverse=False).tolist()), "little")
            h = _run_dequant_ptx(_DEQUANT, w)
            assert _run_dequant_ptx(_DEQUANT_PACKED, packed) == h
            halves = np.array(h, dtype=np.uint32).view(np.float16).astype(np.float64)  # h0.lo, h0.hi, h1.lo, ...
            codes = [w >> 4 * i & 0xF for i in range(8)]
            want = [(-1 if c & 8 else 1) * E2M1_VALUES[c & 7] * 2.0 ** -14 for c in codes]
            assert list(halves) == [want[i + 4 * j] for i in range(4) for j in range(2)]


@pytest.mark.parametrize("groups", [4, 6, 12, 112])
def test_quad_major_packs_each_bytes_codes_and_inverts(monkeypatch, groups):
    """`quad_major(packed=True)`: the quad-major words with every byte through `_pack_bytes` (a permutation of the
    256 byte values); `inverse` gives the natural rows back; `packed=None` follows KIMI_DECODE_MX_PACKED ("1" by
    default); other values of it are refused by name."""
    from kimi_decode.kernels.moe_mxfp4 import _pack_bytes, quad_major

    every = torch.arange(256, dtype=torch.uint8)
    assert sorted(_pack_bytes(every, inverse=False).tolist()) == list(range(256))
    assert torch.equal(_pack_bytes(_pack_bytes(every, inverse=False), inverse=True), every)
    w = torch.randint(0, 256, (3, 5, 16 * groups), dtype=torch.uint8)
    q = quad_major(w, packed=True)
    assert torch.equal(q, _pack_bytes(quad_major(w, packed=False), inverse=False))
    assert torch.equal(quad_major(q, inverse=True, packed=True), w)
    monkeypatch.delenv("KIMI_DECODE_MX_PACKED", raising=False)
    assert torch.equal(quad_major(w), q)  # packed by default
    monkeypatch.setenv("KIMI_DECODE_MX_PACKED", "0")
    assert torch.equal(quad_major(w), quad_major(w, packed=False))
    monkeypatch.setenv("KIMI_DECODE_MX_PACKED", "codes")
    with pytest.raises(ValueError, match="KIMI_DECODE_MX_PACKED must be one of 0, 1"):
        quad_major(w)


def test_quad_major_refuses_odd_groups_and_other_dtypes():
    from kimi_decode.kernels.moe_mxfp4 import quad_major

    with pytest.raises(ValueError, match="even number"):
        quad_major(torch.zeros(2, 48, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        quad_major(torch.zeros(2, 64, dtype=torch.int32))


def test_expert_codes_are_quad_major_copies_made_once_unless_switched_off(monkeypatch):
    """The backend gives the expert kernels `quad_major` copies of w13 and w2, made once per weight;
    KIMI_DECODE_QUAD_MAJOR=0 (or rows of an odd number of groups) the natural rows."""
    from types import SimpleNamespace

    from kimi_decode.kernels.moe_mxfp4 import quad_major

    w = SimpleNamespace(w13=torch.randint(0, 256, (4, 6, 64), dtype=torch.uint8),
                        w2=torch.randint(0, 256, (4, 8, 96), dtype=torch.uint8))
    backend = get_backend("latency_specialized")
    w13, w2, quad = backend._expert_codes(w, 192)
    assert quad and torch.equal(w13, quad_major(w.w13)) and torch.equal(w2, quad_major(w.w2))
    assert backend._expert_codes(w, 192)[0] is w13
    odd = SimpleNamespace(w13=w.w13, w2=torch.zeros(4, 8, 48, dtype=torch.uint8))
    assert backend._expert_codes(odd, 96) == (odd.w13, odd.w2, False)
    monkeypatch.setenv("KIMI_DECODE_QUAD_MAJOR", "0")
    assert get_backend("latency_specialized")._expert_codes(w, 192) == (w.w13, w.w2, False)
    monkeypatch.setenv("KIMI_DECODE_QUAD_MAJOR", "2")
    with pytest.raises(ValueError, match="KIMI_DECODE_QUAD_MAJOR"):
        get_backend("latency_specialized")


@pytest.mark.parametrize("compact", ["1", "0"])
def test_w2_codes_copy_drops_a_padded_shards_zero_columns_when_compact(monkeypatch, compact):
    """KIMI_DECODE_W2_COMPACT=1 (the default): the quad-major w2 copy of a padded shard (rows of 8 MX groups, 6 used:
    TP16) keeps only the used columns, so rows are 96 bytes, not 128; the same copy on a second call; an unpadded
    shard (all columns used) and "0" keep the stored width. w13 is the same either way."""
    from types import SimpleNamespace

    from kimi_decode.kernels.moe_mxfp4 import quad_major

    monkeypatch.setenv("KIMI_DECODE_W2_COMPACT", compact)
    if compact == "1":  # the default
        monkeypatch.delenv("KIMI_DECODE_W2_COMPACT")
    w = SimpleNamespace(w13=torch.randint(0, 256, (4, 6, 64), dtype=torch.uint8),
                        w2=torch.randint(0, 256, (4, 8, 128), dtype=torch.uint8))
    backend = get_backend("latency_specialized")
    w13, w2, quad = backend._expert_codes(w, 192)
    assert quad and torch.equal(w13, quad_major(w.w13))
    if compact == "1":
        assert w2.shape == (4, 8, 96) and w2.is_contiguous()
        assert torch.equal(w2, quad_major(w.w2[..., :96].contiguous()))
        assert torch.equal(quad_major(w2, inverse=True), w.w2[..., :96])  # the used columns, unchanged
    else:
        assert torch.equal(w2, quad_major(w.w2))
    assert backend._expert_codes(w, 192)[1] is w2
    assert torch.equal(backend._expert_codes(w, 256)[1], quad_major(w.w2))  # every column used: nothing to drop


def test_f_b_column_copy_is_made_once_outside_captures_and_dropped_with_its_weight(monkeypatch):
    """The KDA kernel's column-major f_b: one copy per weight, holding f_b's values; none is made inside a CUDA-graph
    capture (the f_b GEMV then runs); the cache entry goes when the weight does."""
    import gc

    backend = get_backend("latency_specialized")
    f_b = torch.randn(768, 128).bfloat16()
    cols = backend._f_b_columns(f_b)
    assert cols.shape == f_b.shape and cols.t().is_contiguous() and torch.equal(cols, f_b)
    assert backend._f_b_columns(f_b) is cols
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    other = torch.randn(768, 128).bfloat16()
    assert backend._f_b_columns(other) is None
    assert backend._f_b_columns(f_b) is cols  # made before the capture: used in it
    del f_b, cols
    gc.collect()
    assert [len(made) for made in backend._copies.values()] == [0]


def test_weight_copies_go_with_the_backend_without_the_cycle_collector(no_cycle_collector):
    """A backend's weight copies (here f_b's columns) are freed when the backend goes, with the cycle collector off:
    nothing refers back to the backend, so a benchmark that makes one slice after another does not hold the copies
    of the ones before it (GiBs per slice) until a collection happens to run."""
    import weakref

    f_b = torch.randn(768, 128).bfloat16()
    backend = get_backend("latency_specialized")
    cols = weakref.ref(backend._f_b_columns(f_b))
    assert cols() is not None
    del backend
    assert cols() is None


@needs_cute
@pytest.mark.parametrize("form", ["shuffle", "redux"])
@pytest.mark.parametrize("rows", [1, 8])
def test_router_topk_compiles_for_sm90a(sm90a, monkeypatch, form, rows):
    from kimi_decode.kernels.router_topk import compile_router_topk, topk_form

    monkeypatch.setenv("KIMI_DECODE_TOPK_FORM", form)
    assert topk_form() == form

    assert compile_router_topk(*_router_args(rows), 2.5) is not None
    # an expert count that is not a multiple of the 128 threads (some threads hold fewer scores)
    assert compile_router_topk(*_router_args(rows, E=200, K=512, k=8), 1.0) is not None


@needs_cute
def test_router_topk_refuses_what_it_cannot_route():
    from kimi_decode.kernels.router_topk import compile_router_topk

    w, x, logits, bias, ids, weights, counter = _router_args(1)
    with pytest.raises(ValueError, match="1..8 rows"):
        compile_router_topk(w, torch.empty(9, 7168, dtype=torch.bfloat16), logits, bias, ids, weights, counter, 1.0)
    with pytest.raises(ValueError, match="top-k of 1..32"):
        compile_router_topk(w, x, logits, bias, torch.empty(1, 33, dtype=torch.int32), torch.empty(1, 33), counter,
                            1.0)
    with pytest.raises(ValueError, match="counter"):
        compile_router_topk(w, x, logits, bias, ids, weights, torch.zeros(2, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="logits"):
        compile_router_topk(w, x, torch.empty(1, 896, dtype=torch.bfloat16), bias, ids, weights, counter, 1.0)


@needs_cute
@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("early, res", [("smem", "last"), ("1", "last"), ("0", "last"), ("1", "split"),
                                        ("smem", "split")])
def test_oproj_attn_res_compiles_for_sm90a(sm90a_pdl, monkeypatch, tp, early, res):
    from kimi_decode.kernels.oproj_attn_res import compile_oproj_attn_res

    monkeypatch.setenv("KIMI_DECODE_OPROJ_EARLY", early)
    monkeypatch.setenv("KIMI_DECODE_OPROJ_RES", res)
    s = shard("k3", tp=tp)
    H, K = s.model.hidden, s.kda_dim
    for n_blocks, delta_mode in ((0, 2), (4, 1), (15, 1)):
        args = _attn_res_args(1, delta=True, num_blocks=15)  # blocks, partial, delta, query, key_norm, input_norm, out
        fn, cargs = compile_oproj_attn_res(torch.empty(H, K, dtype=torch.bfloat16),
                                           torch.empty(1, K, dtype=torch.bfloat16), args[2], args[0], args[1],
                                           *args[3:], torch.zeros(1, dtype=torch.int32), n_blocks=n_blocks,
                                           delta_mode=delta_mode, eps=1e-5, ctas=132, parts=torch.zeros(132 * 32))
        assert fn is not None
        # the score sums' scratch: a [ctas, P] view in the split form, the partial standing in otherwise
        width = {0: 2, 4: 16, 15: 32}[n_blocks]  # a dot and a sum of squares per candidate, to a power of two
        assert cargs[-1].shape == ((132, width) if res == "split" else (1, H))
    with pytest.raises(ValueError, match="one sequence"):
        args = _attn_res_args(2, delta=True)
        compile_oproj_attn_res(torch.empty(H, K, dtype=torch.bfloat16), torch.empty(2, K, dtype=torch.bfloat16),
                               args[2], args[0], args[1], *args[3:], torch.zeros(1, dtype=torch.int32), n_blocks=4,
                               delta_mode=1, eps=1e-5, ctas=132)


@needs_cute
@pytest.mark.parametrize("tp", [16, 8])
def test_oproj_attn_res_with_its_later_rows_ahead_compiles_for_sm90a(sm90a_pdl, monkeypatch, tp):
    """KIMI_DECODE_OPROJ_REST: "ahead" (the default) and "loop" each a variant of their own; "ahead" applies where
    the first pass's rows are in registers and there is more than one pass; other values are refused by name."""
    from kimi_decode.kernels.oproj_attn_res import OProjAttnRes, compile_oproj_attn_res, rest_mode

    s = shard("k3", tp=tp)
    H, K = s.model.hidden, s.kda_dim

    def compiled():
        args = _attn_res_args(1, delta=True, num_blocks=15)
        return compile_oproj_attn_res(torch.empty(H, K, dtype=torch.bfloat16), torch.empty(1, K, dtype=torch.bfloat16),
                                      args[2], args[0], args[1], *args[3:], torch.zeros(1, dtype=torch.int32),
                                      n_blocks=4, delta_mode=1, eps=1e-5, ctas=132, parts=torch.zeros(132 * 32))[0]

    monkeypatch.delenv("KIMI_DECODE_OPROJ_REST", raising=False)
    assert rest_mode() == "ahead"
    base = compiled()
    monkeypatch.setenv("KIMI_DECODE_OPROJ_REST", "ahead")
    assert compiled() is base
    monkeypatch.setenv("KIMI_DECODE_OPROJ_REST", "loop")
    loop = compiled()
    assert loop is not None and loop is not base
    op = OProjAttnRes(H, K, 132, 4, 1, 1e-5, early="1", split=True, rest="ahead")
    op.pdl = True
    assert op.rest_ahead() and op.rows_pre == 4  # 7168 rows over 132 x 14 warps: 4 rows, two passes
    assert not OProjAttnRes(H, K, 132, 4, 1, 1e-5, early="0", split=True, rest="ahead").rest_ahead()
    assert not OProjAttnRes(H, K, 1024, 4, 1, 1e-5, early="1", split=True, rest="ahead").rest_ahead()  # one pass
    monkeypatch.setenv("KIMI_DECODE_OPROJ_REST", "early")
    with pytest.raises(ValueError, match="KIMI_DECODE_OPROJ_REST must be one of"):
        compiled()


@needs_cute
@pytest.mark.parametrize("form", ["shuffle", "redux"])
@pytest.mark.parametrize("rows", [2, 8, 64])
def test_route_topk_compiles_for_sm90a(sm90a, monkeypatch, form, rows):
    from kimi_decode.kernels.router_topk import compile_route_topk

    monkeypatch.setenv("KIMI_DECODE_TOPK_FORM", form)

    _, _, logits, bias, ids, weights, _ = _router_args(rows)
    assert compile_route_topk(logits, bias, ids, weights, 2.5) is not None
    _, _, logits, bias, ids, weights, _ = _router_args(rows, E=200, K=512, k=8)  # E not a multiple of 128
    assert compile_route_topk(logits, bias, ids, weights, 1.0) is not None


@needs_cute
def test_route_topk_refuses_what_it_cannot_route(monkeypatch):
    from kimi_decode.kernels.router_topk import compile_route_topk, topk_form

    monkeypatch.setenv("KIMI_DECODE_TOPK_FORM", "sorted")
    with pytest.raises(ValueError, match="KIMI_DECODE_TOPK_FORM"):
        topk_form()
    monkeypatch.delenv("KIMI_DECODE_TOPK_FORM")

    _, _, logits, bias, ids, weights, _ = _router_args(8)
    with pytest.raises(ValueError, match="top-k of 1..32"):
        compile_route_topk(logits, bias, torch.empty(8, 33, dtype=torch.int32), torch.empty(8, 33), 1.0)
    with pytest.raises(ValueError, match="logits must be"):
        compile_route_topk(logits.bfloat16(), bias, ids, weights, 1.0)
    with pytest.raises(ValueError, match="ids must be"):
        compile_route_topk(logits, bias, ids[:4], weights, 1.0)
    with pytest.raises(ValueError, match="rows"):
        compile_route_topk(logits[0], bias, ids, weights, 1.0)


@pytest.mark.parametrize("rows, env, want", [
    (1, {}, "fused"), (2, {}, "route"), (8, {}, "route"), (16, {}, "route"), (17, {}, "route"), (64, {}, "route"),
    (8, {"KIMI_DECODE_CUTE_TOPK": "0"}, "triton"), (1, {"KIMI_DECODE_FUSED_ROUTER": "0"}, "route"),
    (1, {"KIMI_DECODE_FUSED_ROUTER": "0", "KIMI_DECODE_CUTE_TOPK": "0"}, "triton"),
    (16, {"KIMI_DECODE_CUTE_TOPK": "16"}, "route"), (17, {"KIMI_DECODE_CUTE_TOPK": "16"}, "triton"),
    (64, {"KIMI_DECODE_CUTE_TOPK": "16"}, "triton"), (1, {"KIMI_DECODE_CUTE_TOPK": "16"}, "fused"),
])
def test_router_kernel_by_rows(monkeypatch, rows, env, want):
    """One row: the router projection with the top-k in its last CTA; from 2 rows the projection, then `route_topk`
    on its logits (one CTA per row); with KIMI_DECODE_CUTE_TOPK=16 the generic path's Triton top-k above 16 rows, with
    0 above one row."""
    from types import SimpleNamespace

    from kimi_decode.kernels import router_topk

    backend, calls = _dispatch_spy(monkeypatch, env)
    monkeypatch.setattr(router_topk, "router_topk", lambda *a, **kw: calls.append("fused"))
    monkeypatch.setattr(router_topk, "route_topk", lambda logits, *a, **kw: calls.append("route"))
    if want == "triton":
        pytest.importorskip("triton")
        from kimi_decode.kernels import triton_kernels

        monkeypatch.setattr(triton_kernels, "route_topk", lambda logits, *a, **kw: calls.append("triton"))
    monkeypatch.setattr(backend, "_use_triton", lambda t: True)
    backend._mlp_fast, backend._moe_entry = True, False
    E, H = 32, 64
    bf, meta = torch.bfloat16, "meta"  # no memory (and cuBLAS's fp32-out product above 16 rows exists there)
    w = SimpleNamespace(router=torch.empty(E, H, dtype=bf, device=meta), router_bias=torch.empty(E, device=meta))
    sh = SimpleNamespace(model=SimpleNamespace(top_k=4, routed_scaling=1.0))
    ids, weights = backend.router(torch.empty(rows, H, dtype=bf, device=meta), w, sh, layer=1)
    assert calls[-1] == want and ids.shape == weights.shape == (rows, 4)
    assert backend.last_routes[1] is ids


@pytest.mark.parametrize("setting, forked, deferred", [
    ("0", True, False), ("latent", True, True),
    ("latent", False, False),  # not forked (the shared experts on the main stream anyway): nothing to defer
])
def test_shared_after_launches_the_shared_experts_after_the_latent_down_projection(monkeypatch, setting, forked,
                                                                                  deferred):
    """KIMI_DECODE_SHARED_AFTER=latent: above batch 1 the forked shared experts are not launched where the model
    calls them; once the latent down-projection is launched, their stream waits for an event after it and their
    three kernels run there, writing the output tensor handed back at the call. With "0" they launch at once.
    (KIMI_DECODE_WGMMA=0: the projections on the row tiles.)"""
    from kimi_decode.kernels import gemm_tc_rows

    monkeypatch.setenv("KIMI_DECODE_WGMMA", "0")
    backend, calls, spy = _shared_branch_spy(monkeypatch, setting, forked)
    outs = []
    monkeypatch.setattr(gemm_tc_rows, "project_rows", lambda w, x, y, **kw: calls.append("rows") or outs.append(y) or y)
    x, w = torch.zeros(8, 64, dtype=torch.bfloat16), spy.w
    shared = backend.shared_experts(x, w)
    assert shared.shape == (8, 64)
    assert calls == ([] if deferred else ["rows", "glu", "rows"])
    calls.clear()
    backend.latent_down(x, w)
    if deferred:
        assert calls == ["rows", "event", "rows", "glu", "rows"]  # latent, its event, then the shared experts
        assert spy.waited == spy.events and spy.entered == [spy.side] and outs[-1] is shared
    else:
        assert calls == ["rows"] and spy.waited == [] and spy.entered == []
    calls.clear()
    backend.join("shared")  # nothing left to launch
    assert calls == []


@pytest.mark.parametrize("setting, rows, deferred", [
    ("latent", 4, True), ("auto", 2, True), ("auto", 16, True), ("auto", 64, True), ("0", 8, False), ("0", 64, False),
])
def test_shared_after_launches_deferred_shared_experts_at_their_join(monkeypatch, setting, rows, deferred):
    """By default (auto) the forked shared experts are deferred from SHARED_AFTER_MIN_ROWS (2) rows on. Deferred
    shared experts whose layer ran no latent down-projection (another path took it) launch at the join of their
    branch, so their output is always written."""
    backend, calls, spy = _shared_branch_spy(monkeypatch, setting, forked=True)
    monkeypatch.setattr(torch, "mm", lambda a, b, out=None: calls.append("cublas") or out)
    kernel = "wgmma" if rows <= 32 else "cublas"  # auto: the warpgroup mma from 2 rows
    shared = backend.shared_experts(torch.zeros(rows, 64, dtype=torch.bfloat16), spy.w)
    assert shared.shape == (rows, 64)
    assert calls == ([] if deferred else [kernel, "glu", kernel])
    calls.clear()
    backend.join("shared")
    assert calls == (["event", kernel, "glu", kernel] if deferred else []) and "shared" not in backend._open
    assert spy.waited == spy.events and spy.entered == ([spy.side] if deferred else [])


@pytest.mark.parametrize("rows, env, gate_rows, want", [
    (2, {}, 128, ["wgmma+glu", "wgmma"]), (8, {}, 128, ["wgmma+glu", "wgmma"]), (32, {}, 128, ["wgmma+glu", "wgmma"]),
    (64, {"KIMI_DECODE_WGMMA": "1"}, 128, ["wgmma+glu", "wgmma"]),
    (8, {"KIMI_DECODE_SHARED_GLU": None}, 128, ["wgmma+glu", "wgmma"]),  # the default
    (16, {"KIMI_DECODE_SHARED_GLU": None}, 128, ["wgmma+glu", "wgmma"]),
    (8, {"KIMI_DECODE_SHARED_GLU": "0"}, 128, ["wgmma", "glu", "wgmma"]),
    (8, {"KIMI_DECODE_SHARED_GLU": "1"}, 128, ["wgmma", "glu", "wgmma"]),
    (8, {}, 96, ["wgmma", "glu", "wgmma"]),  # 48 gate rows: no whole row group of 32 gate and 32 up rows
    (8, {"KIMI_DECODE_WGMMA": "0"}, 128, ["rows", "glu", "rows"]),
    (8, {"KIMI_DECODE_WGMMA": "in_proj"}, 128, ["rows", "glu", "rows"]),
    (24, {"KIMI_DECODE_WGMMA": "shared_gate_up"}, 128, ["wgmma+glu", "cublas"]),
    (8, {"KIMI_DECODE_TC_PLAIN": "0"}, 128, ["cublas", "glu", "cublas"]),
    (33, {}, 128, ["cublas", "glu", "cublas"]),
    (3, {"KIMI_DECODE_TC_MIN_ROWS": "4"}, 128, ["gemv", "glu", "gemv"]),  # below the tensor cores: the GEMV
])
def test_shared_experts_take_the_situ_glu_into_the_wgmma_epilogue(monkeypatch, rows, env, gate_rows, want):
    """With KIMI_DECODE_SHARED_GLU=all (the default; set unless a case sets or unsets it), where the shared experts'
    gate/up runs on the warpgroup mma and its rows split into whole row groups, the SiTU-GLU is that projection's
    epilogue (two kernels: gate/up with SiTU-GLU, down); "1" and "0", the other kernels and rows that do not split
    keep it a kernel of its own."""
    monkeypatch.setenv("KIMI_DECODE_SHARED_GLU", "all")
    for k, v in env.items():
        if v is None:
            monkeypatch.delenv(k)
        else:
            monkeypatch.setenv(k, v)
    backend, calls, spy = _shared_branch_spy(monkeypatch, "0", forked=False)
    spy.w.shared_gate_up = torch.zeros(gate_rows, 64, dtype=torch.bfloat16)
    spy.w.shared_down = torch.zeros(64, gate_rows // 2, dtype=torch.bfloat16)
    out = backend.shared_experts(torch.zeros(rows, 64, dtype=torch.bfloat16), spy.w)
    assert calls == want and out.shape == (rows, 64)


def _shared_branch_spy(monkeypatch, setting, forked):
    """A `_dispatch_spy` backend at KIMI_DECODE_SHARED_AFTER=`setting`, with the shared branch open (`forked`) on a
    stand-in stream, SiTU-GLU recorded as "glu", and CUDA events and streams replaced by recorders: `spy.events` (each
    recorded event; "event" in the calls too), `spy.waited` (the events the branch's stream waited for),
    `spy.entered` (the streams entered), `spy.side` (that stream), `spy.w` (shared expert and down weights)."""
    from types import SimpleNamespace

    backend, calls = _dispatch_spy(monkeypatch, {"KIMI_DECODE_SHARED_AFTER": setting})
    spy = SimpleNamespace(events=[], waited=[], entered=[])

    class Event:
        def record(self):
            spy.events.append(self)
            calls.append("event")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: spy.entered.append(s) or contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(wait_stream=lambda s: None))
    monkeypatch.setattr(backend, "situ_glu", lambda h: calls.append("glu") or h[:, : h.shape[1] // 2])
    backend._mlp_fast = True
    spy.side = SimpleNamespace(wait_event=spy.waited.append, device="cpu")
    if forked:
        backend._open["shared"] = spy.side
    spy.w = SimpleNamespace(shared_gate_up=torch.zeros(48, 64, dtype=torch.bfloat16),
                            shared_down=torch.zeros(64, 24, dtype=torch.bfloat16),
                            down=torch.zeros(32, 64, dtype=torch.bfloat16))
    return backend, calls, spy


@pytest.mark.parametrize("env, rows, want", [
    ({}, 8, 16), ({"KIMI_DECODE_ROUTER_WARPS": "0"}, 8, None), ({"KIMI_DECODE_ROUTER_WARPS": "4"}, 2, 4),
    ({"KIMI_DECODE_ROUTER_WARPS": "16"}, 1, "gemv"),  # one row: the GEMV, which has no such plan
])
def test_router_warps_sets_the_router_projections_plan(monkeypatch, env, rows, want):
    """The router projection on the row tiles takes a plan of ROUTER_WARPS (16) warps per CTA, or as many as
    KIMI_DECODE_ROUTER_WARPS says (the other projections keep theirs); with 0 the plan is the row tiles' own
    (KIMI_DECODE_WGMMA=0: by default the warpgroup mma takes the router from 2 rows)."""
    from types import SimpleNamespace

    from kimi_decode.kernels import gemm_tc_rows

    backend, calls = _dispatch_spy(monkeypatch, {"KIMI_DECODE_WGMMA": "0", **env})
    plans = []
    monkeypatch.setattr(gemm_tc_rows, "project_rows", lambda w, x, y, plan=None, **kw: plans.append(plan) or y)
    backend._mlp_fast = True
    w = SimpleNamespace(router=torch.zeros(896, 7168, dtype=torch.bfloat16))
    backend.router_logits(torch.zeros(rows, 7168, dtype=torch.bfloat16), w)
    if want == "gemv":
        assert calls == ["gemv"] and plans == []
        return
    assert len(plans) == 1
    assert (plans[0] is None) if want is None else (plans[0].warps == want and plans[0].key()[:3] == (rows, 896, 7168))
    backend._gemv(torch.zeros(rows, 7168, dtype=torch.bfloat16), torch.zeros(3584, 7168, dtype=torch.bfloat16),
                  "latent_down")
    assert plans[1] is None  # the latent down-projection: its own plan


def test_router_warps_refuses_a_count_out_of_range(monkeypatch):
    monkeypatch.setenv("KIMI_DECODE_ROUTER_WARPS", "32")
    with pytest.raises(ValueError, match="KIMI_DECODE_ROUTER_WARPS"):
        get_backend("latency_specialized")


def _dispatch_spy(monkeypatch, env):
    """A latency_specialized backend whose projection kernels only record which one was called."""
    from kimi_decode.kernels import gemm_tc, gemm_tc_rows, gemm_wgmma, gemv, rmsnorm

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls = []
    monkeypatch.setattr(gemv, "gemv", lambda w, x, y, **kw: calls.append("gemv") or y)
    monkeypatch.setattr(gemm_tc, "project", lambda w, x, y, counters, **kw: calls.append("tc") or y)
    monkeypatch.setattr(gemm_wgmma, "project_wgmma",
                        lambda w, x, y, counters, **kw: calls.append("wgmma+glu" if kw.get("glu") else "wgmma") or y)
    monkeypatch.setattr(gemm_tc_rows, "project_rows", lambda w, x, y, **kw: calls.append("rows") or y)
    monkeypatch.setattr(rmsnorm, "rmsnorm_rows", lambda x, w, out, eps: out)
    monkeypatch.setattr(rmsnorm, "routed_norm", lambda pairs, w, out, eps, **kw: calls.append("norm") or out)
    monkeypatch.setattr(torch, "addmm", lambda c, a, b, **kw: calls.append("cublas") or c)
    backend = get_backend("latency_specialized")
    monkeypatch.setattr(backend, "linear", lambda x, w: calls.append("cublas") or x @ w.T)
    monkeypatch.setattr(backend, "_tc_counters", lambda device: None)
    return backend, calls


@pytest.mark.parametrize("rows, env, want", [
    (1, {}, "gemv"), (2, {}, "wgmma"), (8, {}, "wgmma"), (11, {}, "wgmma"), (16, {}, "wgmma"),
    (17, {}, "wgmma"), (32, {}, "wgmma"), (16, {"KIMI_DECODE_WGMMA": "0"}, "rows"),
    (2, {"KIMI_DECODE_WGMMA": "0"}, "rows"),
    (8, {"KIMI_DECODE_WGMMA_MIN_ROWS": "12"}, "rows"), (12, {"KIMI_DECODE_WGMMA_MIN_ROWS": "12"}, "wgmma"),
    (33, {}, "cublas"), (64, {}, "cublas"), (17, {"KIMI_DECODE_WGMMA": "0"}, "cublas"),
    (4, {"KIMI_DECODE_TC_PLAIN": "0"}, "cublas"), (2, {"KIMI_DECODE_TC_PLAIN": "0"}, "cublas"),
    (8, {"KIMI_DECODE_TC_FORM": "split", "KIMI_DECODE_WGMMA": "0"}, "tc"),
    (16, {"KIMI_DECODE_TC_FORM": "split", "KIMI_DECODE_WGMMA": "0"}, "tc"),
    (9, {"KIMI_DECODE_TC_MAX_ROWS": "8", "KIMI_DECODE_WGMMA": "0"}, "cublas"),
    (9, {"KIMI_DECODE_TC_MAX_ROWS": "8"}, "wgmma"), (3, {"KIMI_DECODE_TC_MIN_ROWS": "4"}, "gemv"),
    (32, {"KIMI_DECODE_TC_MAX_ROWS": "64", "KIMI_DECODE_WGMMA": "0"}, "tc"),  # past the row tiles' 16: split-K
    (17, {"KIMI_DECODE_WGMMA": "1"}, "wgmma"), (64, {"KIMI_DECODE_WGMMA": "1"}, "wgmma"),
    (16, {"KIMI_DECODE_WGMMA": "1"}, "rows"), (9, {"KIMI_DECODE_WGMMA": "1", "KIMI_DECODE_TC_MAX_ROWS": "8"}, "wgmma"),
    (32, {"KIMI_DECODE_WGMMA": "1", "KIMI_DECODE_TC_PLAIN": "0"}, "cublas"),
    (32, {"KIMI_DECODE_WGMMA": "router,in_proj"}, "wgmma"), (32, {"KIMI_DECODE_WGMMA": "router"}, "cublas"),
    (8, {"KIMI_DECODE_WGMMA_MIN_ROWS": "2"}, "wgmma"), (2, {"KIMI_DECODE_WGMMA_MIN_ROWS": "2"}, "wgmma"),
    (1, {"KIMI_DECODE_WGMMA_MIN_ROWS": "2"}, "gemv"), (8, {"KIMI_DECODE_WGMMA_MIN_ROWS": "9"}, "rows"),
    (8, {"KIMI_DECODE_WGMMA_MIN_ROWS": "2", "KIMI_DECODE_WGMMA": "router"}, "rows"),
    (8, {"KIMI_DECODE_WGMMA_MIN_ROWS": "2", "KIMI_DECODE_WGMMA": "1"}, "wgmma"),
    (8, {"KIMI_DECODE_WGMMA_MIN_ROWS": "2", "KIMI_DECODE_WGMMA": "in_proj"}, "wgmma"),
    (17, {"KIMI_DECODE_WGMMA_MIN_ROWS": "20"}, "cublas"),
])
def test_plain_projection_kernel_by_rows(monkeypatch, rows, env, want):
    """One row on the GEMV, 2 to 32 on the warpgroup mma, above on cuBLAS; the A/B switches put them on the row
    tiles or cuBLAS (KIMI_DECODE_WGMMA=0, KIMI_DECODE_TC_PLAIN=0), the split-K kernel
    (KIMI_DECODE_TC_FORM=split) or, up to 64 rows, the warpgroup mma (KIMI_DECODE_WGMMA=1, or naming this
    projection) and move the row counts (KIMI_DECODE_WGMMA_MIN_ROWS: the warpgroup mma from that many rows, before
    the row tiles)."""
    backend, calls = _dispatch_spy(monkeypatch, env)
    x, w = torch.zeros(rows, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    backend._gemv(x, w, "in_proj")
    assert calls == [want]


@pytest.mark.parametrize("rows, fused_norm, env, want", [
    (1, True, {}, ["gemv"]), (2, True, {}, ["wgmma"]), (8, True, {}, ["wgmma"]), (16, False, {}, ["wgmma"]),
    (11, False, {}, ["wgmma"]), (12, True, {}, ["wgmma"]), (8, True, {"KIMI_DECODE_WGMMA": "0"}, ["rows"]),
    (11, False, {"KIMI_DECODE_WGMMA_MIN_ROWS": "12"}, ["rows"]),
    (17, False, {}, ["norm", "wgmma"]), (32, False, {}, ["norm", "wgmma"]), (33, False, {}, ["norm", "cublas"]),
    (64, False, {}, ["norm", "cublas"]), (4, False, {}, ["wgmma"]), (17, False, {"KIMI_DECODE_WGMMA": "0"},
                                                                   ["norm", "cublas"]),
    (8, True, {"KIMI_DECODE_TC_FORM": "split", "KIMI_DECODE_WGMMA": "0"}, ["tc"]),
    (16, False, {"KIMI_DECODE_TC_FORM": "split", "KIMI_DECODE_WGMMA": "0"}, ["tc"]),
    (8, False, {"KIMI_DECODE_TC_MAX_ROWS": "3", "KIMI_DECODE_WGMMA": "0"}, ["norm", "cublas"]),
    (3, True, {"KIMI_DECODE_TC_MIN_ROWS": "4"}, ["gemv"]),
    (17, False, {"KIMI_DECODE_WGMMA": "1"}, ["norm", "wgmma"]),
    (64, False, {"KIMI_DECODE_WGMMA": "1"}, ["norm", "wgmma"]),
    (8, True, {"KIMI_DECODE_WGMMA": "1", "KIMI_DECODE_TC_MAX_ROWS": "4"}, ["wgmma"]),
    (8, True, {"KIMI_DECODE_WGMMA_MIN_ROWS": "2"}, ["wgmma"]),
    (8, False, {"KIMI_DECODE_WGMMA_MIN_ROWS": "2"}, ["wgmma"]),
    (8, True, {"KIMI_DECODE_WGMMA_MIN_ROWS": "2", "KIMI_DECODE_WGMMA": "1"}, ["wgmma"]),
    (8, True, {"KIMI_DECODE_WGMMA_MIN_ROWS": "2", "KIMI_DECODE_WGMMA": "latent_up"}, ["wgmma"]),
])
def test_moe_tail_kernel_by_rows(monkeypatch, rows, fused_norm, env, want):
    """The MoE tail on our kernels up to 32 rows: one projection with the norm scale, accumulate and add in its
    epilogue (the warpgroup mma from 2 rows; the row tiles with KIMI_DECODE_WGMMA=0 or below its MIN_ROWS; the
    grouped experts' per-pair outputs go through the routed norm first); above, the routed norm, which adds the
    shared output into the residual, and one cuBLAS GEMM. KIMI_DECODE_WGMMA=1: up to 64 rows the routed norm, then
    the warpgroup-mma projection adding it and the shared output into the residual; KIMI_DECODE_WGMMA_MIN_ROWS or
    KIMI_DECODE_TC_MAX_ROWS below 8: at 8 rows the warpgroup mma with the norm scale in its epilogue too."""
    from types import SimpleNamespace

    backend, calls = _dispatch_spy(monkeypatch, env)
    backend._mlp_fast, backend._fused_norm = True, fused_norm
    L, H = 64, 32
    backend._scaled = torch.zeros(rows, L, dtype=torch.bfloat16)
    backend._ssq = torch.zeros(rows, L // 16)
    w = SimpleNamespace(up=torch.zeros(H, L, dtype=torch.bfloat16), latent_norm=torch.ones(L))
    res = SimpleNamespace(partial=torch.zeros(rows, H))
    sh = SimpleNamespace(model=SimpleNamespace(rms_eps=1e-5, moe_latent=L))
    backend.moe_tail(torch.zeros(rows, L), torch.zeros(rows, H, dtype=torch.bfloat16), w, res, sh)
    assert calls == want


@pytest.mark.parametrize("env, rows, want", [
    ({}, 64, "cublaslt"), ({"KIMI_DECODE_CUBLAS_LIB": "cublas"}, 64, "default"),
    ({"KIMI_DECODE_CUBLAS_LIB": "cublaslt"}, 64, "cublaslt"), ({"KIMI_DECODE_CUBLAS_LIB": "cublaslt"}, 33, "cublaslt"),
    ({"KIMI_DECODE_CUBLAS_LIB": "cublaslt"}, 16, None),  # the row-tile kernel: no cuBLAS call at all
])
def test_cublas_lib_sets_the_library_of_the_cublas_projections_only(monkeypatch, env, rows, want):
    """KIMI_DECODE_CUBLAS_LIB=cublaslt (the default) sets torch's preferred BLAS library around each projection that
    goes to cuBLAS (above the tensor-core rows), and puts back the one before afterwards; "cublas" leaves it alone."""
    from kimi_decode.backends.latency_specialized import cublas_library

    calls, seen, current = [], [], ["default"]

    def preferred(backend=None):
        if backend is not None:
            calls.append(backend)
            current[0] = backend
        return current[0]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    monkeypatch.setattr(torch, "mm", lambda *a, **kw: seen.append(current[0]) or torch.zeros(1))
    backend, _ = _dispatch_spy(monkeypatch, env)
    backend._blas_lib = cublas_library()  # as `begin_layer` reads it
    backend._gemv(torch.zeros(rows, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16), "router",
                  torch.float32)
    assert seen == ([] if want is None else [want])
    assert calls == ([want, "default"] if want == "cublaslt" else [])
    assert current[0] == "default"


def test_cublas_lib_restores_the_library_when_the_gemm_fails(monkeypatch):
    from kimi_decode.backends.latency_specialized import blas_library

    current = ["default"]
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library",
                        lambda backend=None: current.__setitem__(0, backend) if backend else current[0])
    with pytest.raises(RuntimeError, match="boom"):
        with blas_library("cublaslt"):
            assert current[0] == "cublaslt"
            raise RuntimeError("boom")
    assert current[0] == "default"


def test_cublas_lib_refuses_an_unknown_library(monkeypatch):
    from kimi_decode.backends.latency_specialized import cublas_library

    monkeypatch.setenv("KIMI_DECODE_CUBLAS_LIB", "rocblas")
    with pytest.raises(ValueError, match="KIMI_DECODE_CUBLAS_LIB"):
        cublas_library()
