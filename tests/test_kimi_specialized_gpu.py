"""latency_specialized on the GPU: each CuTe DSL kernel against the float64 reference on fresh random inputs (outputs
poisoned first), and whole layers at the TP16 / TP8 shard shapes."""
import pytest
import torch

from kimi_decode import reference as R
from kimi_decode.backends import get_backend
from kimi_decode.config import shard
from kimi_decode.state import init_kda_state
from kimi_decode.testing import BF16_TOL, check_layer, layer_case, projection_shapes, rel_err
from kimi_decode.weights import init_layer

pytestmark = pytest.mark.gpu


def eager_then_graphed(run, reset, check, times: int = 2) -> None:
    """`run` eagerly `times` times, then captured in a CUDA graph and replayed `times` times, `reset` (poisoning the
    outputs) before and `check` after each run: kernels whose last CTAs reset their counters must replay as they are."""
    for _ in range(times):
        reset()
        run()
        check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(times):
        reset()
        graph.replay()
        check()


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("kernel, rows", [("gemv", 1), ("gemv", 3), ("gemv", 8), ("tc", 2), ("tc", 9), ("tc", 33),
                                          ("tc", 64), ("rows", 2), ("rows", 5), ("rows", 8), ("rows", 16),
                                          ("wgmma", 9), ("wgmma", 17), ("wgmma", 40), ("wgmma", 64)])
def test_projection_matches_float64(tp, kernel, rows):
    """The CUDA-core GEMV and the tensor-core projections (split-K, the row tiles with K over a CTA's warps, and the
    warpgroup mma's split-K pipeline) on every projection shape, stored as bf16 and fp32 and accumulated into fp32
    with an addend, against float64 (outputs poisoned); the split-K kernels' completion counters are back at 0
    after each launch (their row groups reset them)."""
    from kimi_decode.kernels.gemm_tc import project
    from kimi_decode.kernels.gemm_tc_rows import project_rows
    from kimi_decode.kernels.gemm_wgmma import project_wgmma
    from kimi_decode.kernels.gemv import gemv

    counters = torch.zeros(256, dtype=torch.int32, device="cuda")
    run = {"gemv": gemv, "rows": project_rows,
           "tc": lambda w, x, y, **kw: project(w, x, y, counters, **kw),
           "wgmma": lambda w, x, y, **kw: project_wgmma(w, x, y, counters, **kw)}[kernel]
    g = torch.Generator(device="cuda").manual_seed(900 + tp * 100 + rows)
    for n, k in projection_shapes(shard("k3", tp=tp)):
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
        want = x.double() @ w.double().T
        for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-4)):
            y = torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")
            run(w, x, y)
            assert rel_err(y, want) < tol, (n, k, dtype)
        y0 = torch.randn(rows, n, device="cuda", generator=g)
        add = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
        y = y0.clone()
        run(w, x, y, accumulate=True, addend=add)
        assert rel_err(y, y0.double() + want + add.double()) < 1e-4, (n, k)
        assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("tp", [16, 8, 1])
@pytest.mark.parametrize("batch", [1, 3, 8, 64])
@pytest.mark.parametrize("fused_gate", [False, "rows", "cols"])
def test_kda_decode_matches_float64(tp, batch, fused_gate):
    """The fused KDA kernel against float64; `fused_gate`: it also applies f_b to the input projection's f_a columns
    (f_col) instead of taking the gate input f, f_b as stored ("rows") or as the backend's column-major copy."""
    _check_kda_decode(tp, batch, fused_gate)


@pytest.mark.parametrize("tp, batch", [(16, 1), (8, 8)])
def test_kda_decode_with_the_state_loaded_after_the_conv_matches_float64(monkeypatch, tp, batch):
    """The A/B form of the KDA kernel (KIMI_DECODE_KDA_STATE_FIRST=0): the state column loaded after the conv."""
    monkeypatch.setenv("KIMI_DECODE_KDA_STATE_FIRST", "0")
    _check_kda_decode(tp, batch, "cols")


@pytest.mark.parametrize("tp, batch, fused_gate", [(16, 1, "cols"), (8, 1, "cols"), (8, 8, "rows"), (8, 64, "cols"),
                                                   (16, 32, False), (8, 8, False), (1, 3, "rows")])
def test_kda_decode_with_its_inputs_first_matches_float64(monkeypatch, tp, batch, fused_gate):
    """KIMI_DECODE_KDA_INPUTS_FIRST=1: every value of the input projection's output a thread reads loaded right after
    the wait (both conv parts' inputs at 2 thread groups, from 17 sequences on; the gate's f_a words, dotted with f_b
    at once, or the gate input f)."""
    monkeypatch.setenv("KIMI_DECODE_KDA_INPUTS_FIRST", "1")
    _check_kda_decode(tp, batch, fused_gate)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_specialized_layer_with_the_kda_inputs_first_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_KDA_INPUTS_FIRST=1 in whole layers (under PDL at batch 1)."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_KDA_INPUTS_FIRST", "1", tp, batch, 5320)


@pytest.mark.parametrize("split", [1, 2, 4, 8])
@pytest.mark.parametrize("tp, batch, fused_gate", [(16, 1, "cols"), (8, 8, "rows"), (1, 3, False), (8, 64, "cols"),
                                                   (16, 32, False)])
def test_kda_decode_at_each_thread_split_matches_float64(monkeypatch, split, tp, batch, fused_gate):
    """The KDA kernel at each thread split per head (KIMI_DECODE_KDA_SPLIT; the defaults, 4 below 17 sequences and 2
    from there, are also tested above)."""
    monkeypatch.setenv("KIMI_DECODE_KDA_SPLIT", str(split))
    _check_kda_decode(tp, batch, fused_gate)


def _check_kda_decode(tp, batch, fused_gate):
    from kimi_decode.kernels.kda_decode import kda_decode

    s = shard("k3", tp=tp)
    seed = 7 * tp + batch + 100 * bool(fused_gate) + 200 * (fused_gate == "cols")
    lw = init_layer(s, 1, seed=seed, device="cuda")
    state = init_kda_state(s, batch, 1, seed=seed, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    y = torch.randn(batch, s.kda_in_proj_rows, device="cuda", generator=g).bfloat16()
    a, b = s.kda_in_proj_layout["f_a"]
    f = R.linear(y[:, a:b], lw.attn.f_b) if fused_gate else torch.randn(batch, s.kda_dim, device="cuda",
                                                                           generator=g).bfloat16()
    want_o, want_state = R.kda_core(y, f, lw.attn, state, s)
    st = state.clone()
    out = torch.full((batch, s.kda_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
    m = s.model
    f_b = lw.attn.f_b.t().contiguous().t() if fused_gate == "cols" else lw.attn.f_b
    kda_decode(y, f_b if fused_gate else f, st.conv, lw.attn.conv, lw.attn.A_log, lw.attn.dt_bias,
               st.recurrent, lw.attn.o_norm, out, b_col=s.kda_in_proj_layout["b"][0], eps=m.rms_eps,
               lower_bound=m.kda_gate_lower_bound, f_col=a if fused_gate else None)
    torch.cuda.synchronize()
    errs = {"o": rel_err(out, want_o), "S": rel_err(st.recurrent, want_state.recurrent),
            "conv": rel_err(st.conv, want_state.conv)}
    print(tp, batch, fused_gate, errs)
    assert max(errs.values()) < BF16_TOL, errs


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("layer", [1, 3])
@pytest.mark.parametrize("batch", [1, 8, 16, 64])
def test_specialized_layer_matches_reference(tp, layer, batch):
    s = shard("k3", tp=tp)
    lw, res, state = layer_case(s, layer, batch, seed=1000 + 100 * tp + 10 * layer + batch, device="cuda")
    check = check_layer(get_backend("latency_specialized", poison=True), lw, res, state, s)
    print(tp, layer, batch, check.errors)
    check.assert_within(BF16_TOL)


def _layer_matches_with(monkeypatch, name: str, value: str, tp: int, batch: int, seed: int) -> None:
    """Layer 1 at shard `tp` and `batch` with the setting `name`=`value` against the float64 reference (outputs
    poisoned)."""
    monkeypatch.setenv(name, value)
    s = shard("k3", tp=tp)
    lw, res, state = layer_case(s, 1, batch, seed=seed + tp + batch, device="cuda")
    check_layer(get_backend("latency_specialized", poison=True), lw, res, state, s).assert_within(BF16_TOL)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [2, 8])
def test_specialized_layer_with_grouped_experts_at_small_batch_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_GROUPED_FROM=2: the experts grouped by expert from 2 tokens on, with the MoE tail's norm as its
    own kernel (the per-pair kernels' fused norm goes with them)."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_GROUPED_FROM", "2", tp, batch, 3100)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [16, 64])
def test_specialized_layer_with_bf16_pair_outputs_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_PAIRS_BF16=1: the grouped w2 kernel's per-pair outputs in bf16 for the MoE tail's norm."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_PAIRS_BF16", "1", tp, batch, 3500)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch, most", [(4, "3"), (8, "3"), (16, "16")])
def test_specialized_layer_with_the_moe_tail_switch_moved_matches_reference(monkeypatch, tp, batch, most):
    """KIMI_DECODE_TC_MAX_ROWS moved: below the batch, the MoE tail on the per-pair experts' routed sum (batches 4 and
    8: no fused norm in the expert kernel) as the routed norm (which also adds the shared output into the residual)
    and one cuBLAS GEMM, as the default runs it above 8 rows; at 16, the grouped experts' per-pair outputs normalised
    and then the tensor-core projection (KIMI_DECODE_WGMMA=0: none on the warpgroup mma)."""
    monkeypatch.setenv("KIMI_DECODE_WGMMA", "0")
    _layer_matches_with(monkeypatch, "KIMI_DECODE_TC_MAX_ROWS", most, tp, batch, 3450)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_specialized_layer_on_natural_expert_rows_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_QUAD_MAJOR=0: the expert kernels on the natural rows (words exchanged between lanes), as A/B runs
    time it."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_QUAD_MAJOR", "0", tp, batch, 3300)


@pytest.mark.parametrize("first", ["2", "all"])
@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [1, 8])
def test_specialized_layer_with_the_first_w13_quads_loaded_early_matches_reference(monkeypatch, first, tp, batch):
    """KIMI_DECODE_W13_FIRST: the per-pair w13 kernel's first quads (or all) loaded beside the activations."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_W13_FIRST", first, tp, batch, 3600)


@pytest.mark.parametrize("batch", [1, 8, 16, 64])
def test_specialized_layer_with_w2_rows_of_their_stored_width_matches_reference(monkeypatch, batch):
    """KIMI_DECODE_W2_COMPACT=0 at TP16 (the padded shard): the expert kernels on w2 rows as stored, zero columns
    included, per-pair (batches 1, 8) and grouped (16, 64); the default (the used columns only) runs in the layer
    tests above."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_W2_COMPACT", "0", 16, batch, 3200)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [16, 64])
def test_specialized_layer_with_the_w2_pairs_loaded_at_each_segment_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_W2_AHEAD=0: the grouped w2 kernel's pairs loaded at each segment's start, in a whole layer (the
    default, one segment ahead, runs in the layer tests above)."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_W2_AHEAD", "0", tp, batch, 3400)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [16, 64])
def test_specialized_layer_with_the_routed_norm_split_over_ctas_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_ROUTED_NORM_SPLIT=1: the MoE tail's norm of the grouped experts' pairs on several CTAs per token,
    on the tensor-core tail (batch 16) and with the residual update inside (batch 64)."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_ROUTED_NORM_SPLIT", "1", tp, batch, 3700)


@pytest.mark.parametrize("tp", [16, 8])
def test_specialized_layer_with_the_experts_asked_of_l2_by_the_entry_kernel_matches_reference(monkeypatch, tp):
    """KIMI_DECODE_ENTRY_PREFETCH=1: at batch 1 the entry kernel's down-projection CTAs ask L2 for the selected
    experts' w13 rows (`moe_entry`'s prefetch), in a whole layer."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_ENTRY_PREFETCH", "1", tp, 1, 3800)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_specialized_layer_with_the_expert_integer_work_off_the_alu_pipe_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_MX_ALU=1 in whole layers: the per-pair expert kernels (batches 1, 8) and the grouped ones (64)."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_MX_ALU", "1", tp, batch, 3700)


@pytest.mark.parametrize("how", ["1", "align"])
@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [16, 64])
def test_specialized_layer_with_the_counting_alignment_matches_reference(monkeypatch, how, tp, batch):
    """KIMI_DECODE_GROUPED_ALIGN: the grouped experts' pairs counted into place by the CuTe alignment kernel, with
    ("1") and without ("align") the latent written as the w13 kernel's fp16 operands."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_GROUPED_ALIGN", how, tp, batch, 3500)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [16, 24])
def test_specialized_layer_with_per_pair_experts_above_batch_8_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_GROUPED_FROM=65: the per-pair expert kernels at any batch, with the fused norm tail up to 16 rows
    and the generic tail above."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_GROUPED_FROM", "65", tp, batch, 3400)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [16, 64])
def test_specialized_layer_with_the_reduce_then_norm_tail_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_ROUTED_NORM=0: the grouped experts' pairs summed before the MoE tail, and the tail of before
    (the norm kernel and the projection up to 16 rows, the generic tail above), as A/B runs time it."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_ROUTED_NORM", "0", tp, batch, 3200)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [1, 8])
def test_specialized_layer_without_overlap_matches_reference(monkeypatch, tp, batch):
    """The MoE block's router and shared experts in order on one stream (KIMI_DECODE_OVERLAP=0), as A/B timing runs
    it: the same results as the forked block."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_OVERLAP", "0", tp, batch, 3000)


def test_prefetch_leaves_the_weights_as_they_are():
    from kimi_decode.kernels.prefetch import prefetch_weights

    w = torch.randn(3584, 7168, device="cuda").bfloat16()
    before = w.clone()
    prefetch_weights(w, 24 << 20)
    torch.cuda.synchronize()
    assert torch.equal(w, before)


@pytest.mark.parametrize("mb", ["0", "48"])
def test_specialized_layer_with_other_prefetch_sizes_matches_reference(monkeypatch, mb):
    monkeypatch.setenv("KIMI_DECODE_PREFETCH_MB", mb)
    s = shard("k3", tp=16)
    lw, res, state = layer_case(s, 1, 1, seed=4000 + int(mb), device="cuda")
    check_layer(get_backend("latency_specialized", poison=True), lw, res, state, s).assert_within(BF16_TOL)


@pytest.mark.parametrize("tp", [16, 8])
def test_forked_moe_block_replays_in_a_graph_like_eager(tp):
    """The forked MoE block captured in a CUDA graph (fork and join across three streams) gives the eager step's
    result, step after step."""
    _check_graph_replays_like_eager(tp)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch, trigger, w2_early", [(1, "wait", "auto"), (8, "wait", "auto"), (1, "start", "auto"),
                                                      (8, "wait", "1")])
def test_specialized_layer_with_pdl_matches_reference(monkeypatch, tp, batch, trigger, w2_early):
    """Programmatic dependent launch on (KIMI_DECODE_PDL=1), each kernel letting the next launch after its own wait
    (the KDA kernel then loads state and weights before its wait, the w2 expert kernel its weights at batch 1, or at
    any batch with KIMI_DECODE_W2_EARLY=1) or at its start."""
    monkeypatch.setenv("KIMI_DECODE_PDL", "1")
    monkeypatch.setenv("KIMI_DECODE_PDL_TRIGGER", trigger)
    monkeypatch.setenv("KIMI_DECODE_W2_EARLY", w2_early)
    s = shard("k3", tp=tp)
    lw, res, state = layer_case(s, 1, batch, seed=5000 + tp + batch + len(trigger) + 7 * len(w2_early), device="cuda")
    check_layer(get_backend("latency_specialized", poison=True), lw, res, state, s).assert_within(BF16_TOL)


@pytest.mark.parametrize("pre", ["ids", "scales", "all"])
@pytest.mark.parametrize("tp", [16, 8])
def test_specialized_layer_with_the_w2_ids_and_scales_before_its_wait_matches_reference(monkeypatch, pre, tp):
    """KIMI_DECODE_W2_PRE_WAIT at one token under PDL: the w2 kernel keeps the expert ids it loads before its wait, and
    asks L2 for its scale rows ("scales") and its later items' weights ("all") there."""
    monkeypatch.setenv("KIMI_DECODE_PDL", "1")
    _layer_matches_with(monkeypatch, "KIMI_DECODE_W2_PRE_WAIT", pre, tp, 1, 5100 + len(pre))


@pytest.mark.parametrize("tp", [16, 8])
def test_w2_ids_and_scales_before_its_wait_replay_in_a_graph_like_eager(monkeypatch, tp):
    """KIMI_DECODE_W2_PRE_WAIT=all under PDL: graph replays give the eager steps' results."""
    monkeypatch.setenv("KIMI_DECODE_PDL", "1")
    monkeypatch.setenv("KIMI_DECODE_W2_PRE_WAIT", "all")
    _check_graph_replays_like_eager(tp)


@pytest.mark.parametrize("tp", [16, 8])
def test_pdl_steps_replay_in_a_graph_like_eager(monkeypatch, tp):
    """With PDL the graph's kernels overlap their neighbours: replays still give the eager steps' results."""
    monkeypatch.setenv("KIMI_DECODE_PDL", "1")
    _check_graph_replays_like_eager(tp)


@pytest.mark.parametrize("tp, batch", [(16, 2), (8, 8), (16, 8), (8, 16), (16, 64)])
def test_specialized_layer_with_the_shared_experts_after_the_latent_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_SHARED_AFTER=latent: the forked shared experts start once the latent down-projection is done."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_SHARED_AFTER", "latent", tp, batch, 3800)


@pytest.mark.parametrize("shared_after", ["0", "latent"])
@pytest.mark.parametrize("tp, batch", [(16, 2), (8, 8), (16, 8), (8, 16)])
def test_specialized_layer_with_the_router_on_more_warps_matches_reference(monkeypatch, shared_after, tp, batch):
    """KIMI_DECODE_ROUTER_WARPS=16 (the default, set here so that the test keeps it if the default moves): the router
    projection on row-tile CTAs of 16 warps, with the shared experts at the fork or after the latent
    (KIMI_DECODE_WGMMA=0: the row tiles at 16 rows too)."""
    monkeypatch.setenv("KIMI_DECODE_SHARED_AFTER", shared_after)
    monkeypatch.setenv("KIMI_DECODE_WGMMA", "0")
    _layer_matches_with(monkeypatch, "KIMI_DECODE_ROUTER_WARPS", "16", tp, batch, 3900 + len(shared_after))


@pytest.mark.parametrize("tp, batch", [(16, 8), (8, 64)])
def test_shared_experts_after_the_latent_replay_in_a_graph_like_eager(monkeypatch, tp, batch):
    """The shared experts' edge from the latent down-projection across the forked streams, in a captured graph:
    replays give the eager steps' results."""
    monkeypatch.setenv("KIMI_DECODE_SHARED_AFTER", "latent")
    _check_graph_replays_like_eager(tp, batch)


def _check_graph_replays_like_eager(tp, batch=1):
    from kimi_decode.slice import DecodeSlice

    eager = DecodeSlice(backend="latency_specialized", tp=tp, batch=batch, first_layer=1, num_layers=2, context=256)
    graphed = DecodeSlice(backend="latency_specialized", tp=tp, batch=batch, first_layer=1, num_layers=2,
                          context=256)
    graphed.capture(warmup=1)
    eager.step()  # the capture's warm-up advanced the graphed slice's states by one step
    for _ in range(3):
        eager.step()
        graphed.replay()
        # above one row, kernels that add across CTAs may sum in another order: a stale or unwritten buffer is off
        # by far more than that
        assert rel_err(graphed.res.partial, eager.res.partial.double()) < (1e-6 if batch == 1 else 1e-4)


@pytest.mark.parametrize("tp, pad", [(16, True), (16, False), (8, True)])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_moe_mxfp4_one_kernel_matches_float64_and_replays(tp, pad, batch, quad: bool = False):
    """Both expert stages in one kernel (the w2 CTAs wait for their token's w13 CTAs) against float64, outputs
    poisoned, eagerly twice and replayed twice in a CUDA graph; the counters are back at 0 after every run."""
    from kimi_decode.kernels.moe_mxfp4 import moe_mxfp4

    s = shard("k3", tp=tp, pad_experts=pad)
    m = s.model
    seed = 41 * tp + batch + pad
    w = init_layer(s, 1, seed=seed, device="cuda").mlp
    g = torch.Generator(device="cuda").manual_seed(seed)
    latent = torch.randn(batch, m.moe_latent, device="cuda", generator=g).bfloat16()
    ids = torch.topk(torch.rand(batch, m.num_experts, device="cuda", generator=g), m.top_k, dim=-1).indices.int()
    weights = torch.softmax(torch.randn(batch, m.top_k, device="cuda", generator=g), dim=-1)
    norm_w = 1 + 0.1 * torch.randn(m.moe_latent, device="cuda", generator=g)
    out = torch.empty(batch, m.moe_latent, device="cuda")
    act = torch.empty(batch * m.top_k, s.expert_inter_used, dtype=torch.float16, device="cuda")
    ssq = torch.empty(batch, m.moe_latent // 16, device="cuda")
    scaled = torch.empty(batch, m.moe_latent, dtype=torch.bfloat16, device="cuda")
    counters = torch.zeros(10, dtype=torch.int32, device="cuda")
    want = R.routed_experts(latent.double(), ids.long(), weights.double(), w, s)

    w13, w2 = _codes(w, quad)

    def run():
        moe_mxfp4(latent, ids, weights, w13, w.w13_scale, w2, w.w2_scale, s.expert_inter_used, act=act, out=out,
                  ssq=ssq, scaled=(norm_w, scaled), counters=counters, quad_major=quad)

    def check():
        torch.cuda.synchronize()
        assert rel_err(out, want) < BF16_TOL
        assert rel_err(scaled, want * norm_w.double()) < BF16_TOL
        assert rel_err(ssq.sum(-1), out.double().pow(2).sum(-1)) < 1e-5
        assert int(counters.abs().sum()) == 0

    def poison():
        for t in (out, act, ssq, scaled):
            t.fill_(float("nan"))

    eager_then_graphed(run, poison, check)


@pytest.mark.parametrize("tp, pad", [(16, True), (16, False), (8, True)])
@pytest.mark.parametrize("act_ready", [False, True])
def test_moe_mxfp4_with_the_shared_experts_inside_matches_float64(tp, pad, act_ready, quad: bool = False):
    """Batch 1: the two expert kernels with the shared experts' gate/up (SiTU-GLU) and down GEMVs in CTAs of their
    own, both outputs against float64, poisoned first; `act_ready`: the gate/up was done before (by the entry
    kernel, here torch) and only the down-projection rides along."""
    from kimi_decode.kernels.moe_mxfp4 import moe_mxfp4

    s = shard("k3", tp=tp, pad_experts=pad)
    m = s.model
    w = init_layer(s, 1, seed=70 + tp + pad, device="cuda").mlp
    g = torch.Generator(device="cuda").manual_seed(80 + tp + pad)
    latent = torch.randn(1, m.moe_latent, device="cuda", generator=g).bfloat16()
    x = torch.randn(1, m.hidden, device="cuda", generator=g).bfloat16()
    ids = torch.topk(torch.rand(1, m.num_experts, device="cuda", generator=g), m.top_k, dim=-1).indices.int()
    weights = torch.softmax(torch.randn(1, m.top_k, device="cuda", generator=g), dim=-1)
    S = w.shared_down.shape[1]
    out = torch.full((1, m.moe_latent), float("nan"), device="cuda")
    s_act = torch.full((1, S), float("nan"), dtype=torch.bfloat16, device="cuda")
    s_out = torch.full((1, m.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    a = R.situ_glu(*(x.double() @ w.shared_gate_up.double().T).chunk(2, dim=-1))
    if act_ready:
        s_act.copy_(a)
    w13, w2 = _codes(w, quad)
    moe_mxfp4(latent, ids, weights, w13, w.w13_scale, w2, w.w2_scale, s.expert_inter_used, out=out,
              shared=(w.shared_gate_up, x, s_act, w.shared_down, s_out), shared_act_ready=act_ready, quad_major=quad)
    torch.cuda.synchronize()
    assert rel_err(out, R.routed_experts(latent.double(), ids.long(), weights.double(), w, s)) < BF16_TOL
    assert rel_err(s_act, a) < 1e-2
    assert rel_err(s_out, a @ w.shared_down.double().T) < BF16_TOL


@pytest.mark.parametrize("lanes", ["32", "16", "4"])
@pytest.mark.parametrize("tp", [16, 8])
def test_moe_mxfp4_with_the_shared_down_rows_side_by_side_matches_float64(monkeypatch, lanes, tp):
    """The shared experts' down-projection CTAs in the w2 kernel with 32 // lanes rows side by side in each warp
    (KIMI_DECODE_SHARED_DOWN_LANES; the default 8 runs in the test this calls), also with the gate/up in the w13
    kernel's CTAs."""
    monkeypatch.setenv("KIMI_DECODE_SHARED_DOWN_LANES", lanes)
    test_moe_mxfp4_with_the_shared_experts_inside_matches_float64(tp, True, True)
    test_moe_mxfp4_with_the_shared_experts_inside_matches_float64(tp, False, False)


@pytest.mark.parametrize("tp", [16, 8])
def test_shared_mlp_matches_float64_and_replays(tp):
    """The shared experts' two GEMVs as one two-stage kernel against float64 (SiTU-GLU between them), outputs
    poisoned, eagerly and in a CUDA graph; the counters are back at 0."""
    from kimi_decode.kernels.shared_mlp import shared_mlp

    s = shard("k3", tp=tp)
    w = init_layer(s, 1, seed=50 + tp, device="cuda").mlp
    g = torch.Generator(device="cuda").manual_seed(60 + tp)
    x = torch.randn(1, s.model.hidden, device="cuda", generator=g).bfloat16()
    act = torch.empty(1, w.shared_down.shape[1], dtype=torch.bfloat16, device="cuda")
    out = torch.empty(1, s.model.hidden, dtype=torch.bfloat16, device="cuda")
    counters = torch.zeros(3, dtype=torch.int32, device="cuda")
    a = R.situ_glu(*(x.double() @ w.shared_gate_up.double().T).chunk(2, dim=-1))
    want = a @ w.shared_down.double().T

    def run():
        shared_mlp(w.shared_gate_up, x, act, w.shared_down, out, counters)

    def check():
        torch.cuda.synchronize()
        assert rel_err(act, a) < 1e-2
        assert rel_err(out, want) < BF16_TOL
        assert int(counters.abs().sum()) == 0

    def poison():
        act.fill_(float("nan"))
        out.fill_(float("nan"))

    eager_then_graphed(run, poison, check, times=3)


@pytest.mark.parametrize("tp, pad", [(16, True), (16, False), (8, True)])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_moe_mxfp4_matches_float64(tp, pad, batch):
    _check_moe_mxfp4(tp, pad, batch)


@pytest.mark.parametrize("warps", ["4", "2"])
@pytest.mark.parametrize("tp, batch", [(8, 1), (16, 8)])
def test_moe_mxfp4_with_fewer_w13_warps_matches_float64(monkeypatch, warps, tp, batch):
    """The w13 kernel with K split over fewer warps (KIMI_DECODE_W13_WARPS): 4 of 7 quads or 2 of 14 per warp."""
    monkeypatch.setenv("KIMI_DECODE_W13_WARPS", warps)
    _check_moe_mxfp4(tp, True, batch)


@pytest.mark.parametrize("tp, batch", [(16, 1), (8, 1), (16, 8), (8, 3)])
def test_moe_mxfp4_with_the_w13_weights_asked_of_l2_first_matches_float64(monkeypatch, tp, batch):
    """The w13 kernel with each lane's quads asked of L2 once the expert id is known (KIMI_DECODE_W13_PREFETCH=1),
    in the two-kernel form and, at one token, with the shared experts' GEMVs in the expert kernels."""
    monkeypatch.setenv("KIMI_DECODE_W13_PREFETCH", "1")
    _check_moe_mxfp4(tp, True, batch)
    if batch == 1:
        test_moe_mxfp4_with_the_shared_experts_inside_matches_float64(tp, True, False)


@pytest.mark.parametrize("first", ["1", "2", "all"])
@pytest.mark.parametrize("tp, batch", [(16, 1), (8, 1), (16, 8), (8, 3)])
def test_moe_mxfp4_with_the_first_w13_quads_loaded_early_matches_float64(monkeypatch, first, tp, batch):
    """The w13 kernel with the weights of its warps' first quads (or all of them) loaded before the activations'
    staging (KIMI_DECODE_W13_FIRST), on both layouts; the shared experts' forms keep their own kernels."""
    monkeypatch.setenv("KIMI_DECODE_W13_FIRST", first)
    _check_moe_mxfp4(tp, True, batch)
    _check_moe_mxfp4(tp, True, batch, quad=True)


@pytest.mark.parametrize("x_once", ["0", "1"])
@pytest.mark.parametrize("tp, batch", [(16, 1), (8, 1), (8, 3), (16, 8), (8, 8)])
def test_moe_mxfp4_with_the_w13_activations_converted_once_or_per_lane_matches_float64(monkeypatch, x_once, tp,
                                                                                      batch):
    """The w13 kernel's activation operands made once per warp in shared memory, or by every lane
    (KIMI_DECODE_W13_X_ONCE), in the two-kernel and one-kernel forms and, at one token, with the shared experts'
    GEMVs in the expert kernels."""
    monkeypatch.setenv("KIMI_DECODE_W13_X_ONCE", x_once)
    _check_moe_mxfp4(tp, True, batch)
    test_moe_mxfp4_one_kernel_matches_float64_and_replays(tp, True, batch)
    if batch == 1:
        test_moe_mxfp4_with_the_shared_experts_inside_matches_float64(tp, True, False)


@pytest.mark.parametrize("tp, pad, batch, chunk", [(16, True, 1, "1"), (16, False, 8, "2"), (8, True, 1, "1"),
                                                   (8, True, 8, "4"), (16, True, 8, "1")])
def test_moe_mxfp4_at_each_w2_chunk_matches_float64(monkeypatch, tp, pad, batch, chunk):
    """The w2 kernel with 4-, 8- and 16-byte weight loads (KIMI_DECODE_W2_CHUNK)."""
    monkeypatch.setenv("KIMI_DECODE_W2_CHUNK", chunk)
    _check_moe_mxfp4(tp, pad, batch)


def _codes(w, quad: bool, used: int | None = None):
    """The expert codes (w13, w2) as the kernels are given them: natural rows, or `quad_major` copies; with `used`,
    w2's rows cut to their used columns (the backend's `KIMI_DECODE_W2_COMPACT` copy; the scales stay padded)."""
    from kimi_decode.kernels.moe_mxfp4 import quad_major

    w2 = w.w2 if used is None else w.w2[..., :used // 2].contiguous()
    return (quad_major(w.w13), quad_major(w2)) if quad else (w.w13, w2)


@pytest.mark.parametrize("tp, pad, batch, chunk", [(16, True, 1, "auto"), (16, False, 1, "auto"),
                                                   (8, True, 1, "auto"), (16, True, 8, "auto"),
                                                   (16, False, 8, "auto"), (8, True, 8, "auto"), (8, True, 3, "auto"),
                                                   (16, True, 8, "1"), (16, False, 8, "1"), (8, True, 1, "2")])
def test_moe_mxfp4_on_quad_major_codes_matches_float64(monkeypatch, tp, pad, batch, chunk):
    """The per-pair kernels reading `quad_major` codes (each lane's words side by side, no exchange): two-kernel
    form at every w2 load width (16, 8, 4 bytes; TP16 unpadded: rows of 6 groups, the last pair of them transposed
    as a pair), the one-kernel form and, at one token, the shared experts inside."""
    monkeypatch.setenv("KIMI_DECODE_W2_CHUNK", chunk)
    _check_moe_mxfp4(tp, pad, batch, quad=True)
    if chunk == "auto":
        test_moe_mxfp4_one_kernel_matches_float64_and_replays(tp, pad, batch, quad=True)
        if batch == 1:
            test_moe_mxfp4_with_the_shared_experts_inside_matches_float64(tp, pad, False, quad=True)
            test_moe_mxfp4_with_the_shared_experts_inside_matches_float64(tp, pad, True, quad=True)


def _check_moe_mxfp4(tp, pad, batch, quad: bool = False, compact: bool = False):
    from kimi_decode.kernels.moe_mxfp4 import moe_mxfp4

    s = shard("k3", tp=tp, pad_experts=pad)
    seed = 31 * tp + batch + pad
    w = init_layer(s, 1, seed=seed, device="cuda").mlp
    g = torch.Generator(device="cuda").manual_seed(seed)
    latent = torch.randn(batch, s.model.moe_latent, device="cuda", generator=g).bfloat16()
    scores = torch.rand(batch, s.model.num_experts, device="cuda", generator=g)
    ids = torch.topk(scores, s.model.top_k, dim=-1).indices.int()
    weights = torch.softmax(torch.randn(batch, s.model.top_k, device="cuda", generator=g), dim=-1)
    out = torch.full((batch, s.model.moe_latent), float("nan"), device="cuda")
    act = torch.full((batch * s.model.top_k, s.expert_inter_used), float("nan"), dtype=torch.float16, device="cuda")
    ssq = torch.full((batch, s.model.moe_latent // 16), float("nan"), device="cuda")
    w13, w2 = _codes(w, quad, s.expert_inter_used if compact else None)
    moe_mxfp4(latent, ids, weights, w13, w.w13_scale, w2, w.w2_scale, s.expert_inter_used, act=act, out=out,
              ssq=ssq, quad_major=quad)
    want = R.routed_experts(latent.double(), ids.long(), weights.double(), w, s)
    assert rel_err(out, want) < BF16_TOL
    assert rel_err(ssq.sum(-1), out.double().pow(2).sum(-1)) < 1e-5
    # the variant that also writes bf16(out * norm weight) for the MoE tail
    norm_w = 1 + 0.1 * torch.randn(s.model.moe_latent, device="cuda", generator=g)
    scaled = torch.full((batch, s.model.moe_latent), float("nan"), dtype=torch.bfloat16, device="cuda")
    out.fill_(float("nan"))
    moe_mxfp4(latent, ids, weights, w13, w.w13_scale, w2, w.w2_scale, s.expert_inter_used, act=act, out=out,
              ssq=ssq, scaled=(norm_w, scaled), quad_major=quad)
    assert rel_err(out, want) < BF16_TOL
    assert rel_err(scaled, want * norm_w.double()) < BF16_TOL


@pytest.mark.parametrize("quad", [False, True], ids=["natural", "quad_major"])
@pytest.mark.parametrize("tp, pad", [(16, True), (16, False), (8, True)])
@pytest.mark.parametrize("batch, same", [(9, False), (64, False), (64, True), (33, True)])
def test_moe_mxfp4_grouped_matches_float64(tp, pad, batch, same, quad, how="triton", compact=False,
                                          pair_dtype=torch.float32):
    """Experts read once per step for all their pairs; `same`: every token picks the same 16 experts, so each
    segment holds the whole batch (several tiles of 8 pairs, the last one partial at batch 33); on natural rows and
    on `quad_major` codes. `how`: the pairs sorted by the Triton kernel, or counted by the CuTe one ("align"), which
    also writes the latent as the w13 kernel's fp16 operands ("operands")."""
    from kimi_decode.kernels import moe_align as cute_align
    from kimi_decode.kernels.moe_mxfp4_grouped import moe_mxfp4_grouped
    from kimi_decode.kernels.triton_kernels import moe_align

    s = shard("k3", tp=tp, pad_experts=pad)
    m = s.model
    seed = 77 * tp + batch + pad + 3 * same
    w = init_layer(s, 1, seed=seed, device="cuda").mlp
    g = torch.Generator(device="cuda").manual_seed(seed)
    latent = torch.randn(batch, m.moe_latent, device="cuda", generator=g).bfloat16()
    scores = torch.rand(1 if same else batch, m.num_experts, device="cuda", generator=g).expand(batch, -1)
    ids = torch.topk(scores, m.top_k, dim=-1).indices.int().contiguous()
    weights = torch.softmax(torch.randn(batch, m.top_k, device="cuda", generator=g), dim=-1)
    P = batch * m.top_k
    align = [torch.full((P,), -1, dtype=torch.int32, device="cuda") for _ in range(4)]
    x = latent
    if how == "triton":
        moe_align(ids.reshape(-1), *align)
    else:
        x = torch.full_like(latent, float("nan"), dtype=torch.float16) if how == "operands" else None
        cute_align.moe_align(ids.reshape(-1), *align, experts=m.num_experts, latent=latent if x is not None else None,
                             operands=x)
        x = latent if x is None else x
    act = torch.full((P, s.expert_inter_used), float("nan"), dtype=torch.float16, device="cuda")
    pair_out = torch.full((P, m.moe_latent), float("nan"), device="cuda", dtype=pair_dtype)
    w13, w2 = _codes(w, quad, s.expert_inter_used if compact else None)
    out = moe_mxfp4_grouped(x, ids, weights, w13, w.w13_scale, w2, w.w2_scale, s.expert_inter_used, align,
                            act=act, pair_out=pair_out, quad_major=quad, x_operands=how == "operands")
    want = R.routed_experts(latent.double(), ids.long(), weights.double(), w, s)
    assert not act.isnan().any() and not pair_out.isnan().any()
    assert rel_err(out, want) < BF16_TOL


@pytest.mark.parametrize("tp, pad", [(16, True), (8, True)])
@pytest.mark.parametrize("batch, same", [(16, False), (64, False), (33, True)])
def test_moe_mxfp4_grouped_with_bf16_pair_outputs_matches_float64(tp, pad, batch, same):
    """`KIMI_DECODE_PAIRS_BF16=1`'s w2 kernel: the per-pair outputs stored as bf16 (poisoned first), summed in fp32,
    against float64, on `quad_major` codes after the CuTe alignment with the fp16 operands, as the backend runs it."""
    test_moe_mxfp4_grouped_matches_float64(tp, pad, batch, same, True, "operands", pair_dtype=torch.bfloat16)


@pytest.mark.parametrize("how", ["align", "operands"])
@pytest.mark.parametrize("tp, pad", [(16, True), (16, False), (8, True)])
@pytest.mark.parametrize("batch, same", [(9, False), (64, False), (33, True)])
def test_moe_mxfp4_grouped_on_the_counting_alignment_matches_float64(tp, pad, batch, same, how):
    """The grouped kernels after the CuTe alignment (`kernels/moe_align.py`), with the bf16 latent and with its fp16
    operand form (the w13 kernel's `x_operands`), on `quad_major` codes as the backend runs them."""
    test_moe_mxfp4_grouped_matches_float64(tp, pad, batch, same, True, how)


@pytest.mark.parametrize("batch, experts, spread, k", [(9, 896, "uniform", 16), (16, 896, "uniform", 16),
                                                       (64, 896, "uniform", 16), (64, 896, "same", 16),
                                                       (33, 896, "few", 16), (1, 896, "uniform", 16),
                                                       (64, 2048, "uniform", 16), (40, 100, "few", 16),
                                                       (3, 40, "uniform", 2)])
def test_counting_alignment_is_the_stable_sort_and_writes_the_operands(batch, experts, spread, k):
    """`kernels/moe_align.py` against the Triton sort on the same ids, outputs poisoned: the same pair order, and the
    same start, length and expert per segment; the slots past the distinct experts all 0; the latent's operands equal
    `latent_operands` bit for bit. Uniform routing, every token on the same 16 experts, and on a few (`few`: ids
    drawn from 20, so segments of up to the batch); 2,048 experts (two per scan thread) and 100 (fewer than the
    pairs); 6 pairs (top-2 of 3 tokens); eagerly and replayed in a CUDA graph."""
    from kimi_decode.kernels.moe_align import moe_align as cute_align
    from kimi_decode.kernels.moe_mxfp4_grouped import latent_operands
    from kimi_decode.kernels.triton_kernels import moe_align

    g = torch.Generator(device="cuda").manual_seed(batch * 7 + experts)
    pool = 20 if spread == "few" else experts
    rows = 1 if spread == "same" else batch
    ids = torch.rand(rows, pool, device="cuda", generator=g).topk(k, dim=-1).indices.int().expand(batch, -1)
    ids = ids.contiguous().reshape(-1)
    P = ids.numel()
    want = [torch.empty(P, dtype=torch.int32, device="cuda") for _ in range(4)]
    moe_align(ids, *want)
    n = int((want[2] > 0).sum())
    assert n == int(ids.unique().numel())
    latent = torch.randn(batch, 3584, device="cuda", generator=g).bfloat16()
    got = [torch.empty(P, dtype=torch.int32, device="cuda") for _ in range(4)]
    ops = torch.empty(batch, 3584, dtype=torch.float16, device="cuda")

    def reset():
        for t in got:
            t.fill_(-7)
        ops.fill_(float("nan"))

    def check():
        assert torch.equal(got[0], want[0])
        for t, u in zip(got[1:], want[1:]):
            assert torch.equal(t[:n], u[:n])
            assert not t[n:].any()
        assert torch.equal(ops.view(torch.int16), latent_operands(latent).view(torch.int16))

    eager_then_graphed(lambda: cute_align(ids, *got, experts=experts, latent=latent, operands=ops), reset, check)
    reset()  # the alignment alone: the operands are not touched
    cute_align(ids, *got, experts=experts)
    assert torch.equal(got[0], want[0]) and ops.isnan().all()


@pytest.mark.parametrize("tiles", ["1", "4", "1,4"])
@pytest.mark.parametrize("tp, pad", [(16, True), (16, False), (8, True)])
def test_moe_mxfp4_grouped_on_quad_major_codes_at_each_tile_count_matches_float64(monkeypatch, tiles, tp, pad):
    """The grouped kernels on `quad_major` codes with 1 / 4 row tiles per warp (KIMI_DECODE_GROUPED_TILES; the
    default 2 / 4 runs in the test this calls)."""
    monkeypatch.setenv("KIMI_DECODE_GROUPED_TILES", tiles)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 64, False, True)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 33, True, True)


@pytest.mark.parametrize("seg_ctas", ["0", "1"])
@pytest.mark.parametrize("tp, pad", [(16, True), (8, True)])
def test_moe_mxfp4_grouped_segment_grid_matches_float64(monkeypatch, seg_ctas, tp, pad):
    """KIMI_DECODE_GROUPED_SEG_CTAS (the w2 kernel's CTAs along the segments): one CTA per segment slot ("0"), and
    as few as a lane per segment allows ("1": at batch 64, 32 segment slots per CTA, about 19 of them non-empty;
    the default, 8 per SM, runs in the tests this calls)."""
    monkeypatch.setenv("KIMI_DECODE_GROUPED_SEG_CTAS", seg_ctas)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 64, False, True)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 33, True, True)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 9, False, False)


@pytest.mark.parametrize("unroll", ["1", "2"])
@pytest.mark.parametrize("tp, pad", [(16, True), (16, False), (8, True)])
def test_moe_mxfp4_grouped_w13_unrolled_matches_float64(monkeypatch, tp, pad, unroll):
    """KIMI_DECODE_GROUPED_W13_UNROLL: the staged w13 kernel's mma loop over 1 or 2 quads per iteration (4, the
    default, runs in the tests above), against float64 with act and the pair outputs poisoned: ~300 distinct experts
    (batch 64, fp16 operands from the CuTe alignment), every token on the same 16 (batch 33), batch 9 on natural
    rows."""
    monkeypatch.setenv("KIMI_DECODE_GROUPED_W13_UNROLL", unroll)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 64, False, True, "operands")
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 33, True, True)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 9, False, False)


@pytest.mark.parametrize("unroll", ["1", "2"])
@pytest.mark.parametrize("tp, batch", [(16, 64), (8, 8)])
def test_specialized_layer_with_the_grouped_w13_unrolled_matches_reference(monkeypatch, tp, batch, unroll):
    _layer_matches_with(monkeypatch, "KIMI_DECODE_GROUPED_W13_UNROLL", unroll, tp, batch, 4300 + int(unroll))


@pytest.mark.parametrize("div", ["1", "8"])
@pytest.mark.parametrize("tp, pad", [(16, True), (16, False), (8, True)])
def test_moe_mxfp4_grouped_w13_over_several_segments_matches_float64(monkeypatch, tp, pad, div):
    """KIMI_DECODE_W13_SEG_DIV: the grouped w13 kernel on ceil(P / D) CTA rows, each looping over its non-empty
    segments in the same staged buffers ("auto", the default, runs 2 at batch 64 and 33 in the tests this calls). At
    batch 64 with 8 a row takes 2-3 of the ~300 segments, so a segment's weights go into buffers the one before has
    just used; with 1 every slot has its own CTA row. Batch 33 (16 distinct experts) leaves most rows empty; batch 9
    on natural rows. act and the pair outputs poisoned, against float64."""
    monkeypatch.setenv("KIMI_DECODE_W13_SEG_DIV", div)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 64, False, True, "operands")
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 33, True, True)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 9, False, False)


@pytest.mark.parametrize("tp, batch", [(16, 64), (8, 8), (8, 64)])
def test_specialized_layer_with_the_grouped_w13_over_several_segments_matches_reference(monkeypatch, tp, batch):
    """Whole layers with every segment slot on its own w13 CTA row (1; "auto" loops from batch 32) and with 4."""
    for div in ("1", "4"):
        _layer_matches_with(monkeypatch, "KIMI_DECODE_W13_SEG_DIV", div, tp, batch, 4400 + batch + int(div))


@pytest.mark.parametrize("tp, pad", [(16, True), (16, False), (8, True)])
def test_moe_mxfp4_on_unpacked_quad_major_codes_matches_float64(monkeypatch, tp, pad):
    """KIMI_DECODE_MX_PACKED=0: the expert kernels on quad-major codes as stored, dequantised in 11 instructions per
    word (the default, packed codes in 9, runs in the tests above), against float64 with their outputs poisoned:
    the per-pair kernels at 1, 3 and 8 tokens (at one token also with the shared experts inside), and the grouped
    ones at ~300 distinct experts (batch 64, fp16 operands from the CuTe alignment) and every token on the same 16
    (batch 33)."""
    monkeypatch.setenv("KIMI_DECODE_MX_PACKED", "0")
    for batch in (1, 3, 8):
        _check_moe_mxfp4(tp, pad, batch, quad=True)
    test_moe_mxfp4_with_the_shared_experts_inside_matches_float64(tp, pad, True, quad=True)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 64, False, True, "operands")
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 33, True, True)


@pytest.mark.parametrize("tp, batch", [(16, 1), (8, 1), (16, 8), (8, 64)])
def test_specialized_layer_on_unpacked_codes_matches_reference(monkeypatch, tp, batch):
    _layer_matches_with(monkeypatch, "KIMI_DECODE_MX_PACKED", "0", tp, batch, 4400)


@pytest.mark.parametrize("stage", ["0", "all"])
@pytest.mark.parametrize("tp, pad", [(16, True), (8, True), (16, False)])
def test_moe_mxfp4_grouped_staging_settings_match_float64(monkeypatch, tp, pad, stage):
    """KIMI_DECODE_GROUPED_STAGE=0: both grouped kernels loading their weights into registers as their mma loops
    reach them; "all": both staged, w2 also on TP16's quad-major rows of 6 groups (one 8-byte copy for the two after
    the quad; natural TP16 rows do not stage); on both layouts (the default runs in the tests above)."""
    monkeypatch.setenv("KIMI_DECODE_GROUPED_STAGE", stage)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 64, False, True)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 33, True, False)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 9, False, True)


@pytest.mark.parametrize("stage", ["1", "0", "all"])
@pytest.mark.parametrize("tp, pad", [(16, True), (8, True), (16, False)])
@pytest.mark.parametrize("ahead", ["1", "0"])
def test_moe_mxfp4_grouped_w2_with_its_pairs_loaded_ahead_or_not_matches_float64(monkeypatch, tp, pad, stage, ahead):
    """KIMI_DECODE_W2_AHEAD=1 (the default): the grouped w2 kernel's segment table held in lanes and each segment's
    first pairs loaded during the segment before; "0" both loaded at the segment's start. Staged and not, on both
    layouts: segments of one tile, of several (every token on the same experts, the last tile partial at batch
    33), a CTA per segment slot (most CTAs with no segment) and 32 segment slots per CTA (the whole lane table)."""
    monkeypatch.setenv("KIMI_DECODE_W2_AHEAD", ahead)
    monkeypatch.setenv("KIMI_DECODE_GROUPED_STAGE", stage)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 64, False, True)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 33, True, False)
    test_moe_mxfp4_grouped_matches_float64(tp, pad, 9, False, True, "operands")
    for seg_ctas in ("0", "1"):
        monkeypatch.setenv("KIMI_DECODE_GROUPED_SEG_CTAS", seg_ctas)
        test_moe_mxfp4_grouped_matches_float64(tp, pad, 64, False, True)
        test_moe_mxfp4_grouped_matches_float64(tp, pad, 33, True, True)


@pytest.mark.parametrize("tp, pad", [(16, True), (8, True), (16, False)])
def test_expert_kernels_with_their_integer_work_off_the_alu_pipe_match_float64(monkeypatch, tp, pad):
    """KIMI_DECODE_MX_ALU=1 (the dequantisation's shift as a `mul.hi`, the scale bytes by a mask and a `mad`): the
    per-pair kernels at 1, 3 and 8 tokens on both layouts and the grouped ones at 64, 33 (every token on the same
    experts) and 9, w2 staged ("all") and not."""
    monkeypatch.setenv("KIMI_DECODE_MX_ALU", "1")
    for batch in (1, 3, 8):
        for quad in (False, True):
            _check_moe_mxfp4(tp, pad, batch, quad)
    for stage in ("1", "all"):
        monkeypatch.setenv("KIMI_DECODE_GROUPED_STAGE", stage)
        test_moe_mxfp4_grouped_matches_float64(tp, pad, 64, False, True)
        test_moe_mxfp4_grouped_matches_float64(tp, pad, 33, True, False)
        test_moe_mxfp4_grouped_matches_float64(tp, pad, 9, False, True, "operands")


@pytest.mark.parametrize("quad", [True, False], ids=["quad_major", "natural"])
def test_expert_kernels_on_w2_rows_cut_to_their_used_columns_match_float64(monkeypatch, quad):
    """TP16's padded shard (w2 rows of 128 bytes, 96 used) with w2's codes cut to the used columns and its scales
    left padded (`KIMI_DECODE_W2_COMPACT=1`): the per-pair kernels at 1, 3 and 8 tokens, the grouped ones at 9, 64
    and 33 (every token on the same experts), staged w2 ("all") and not."""
    for batch in (1, 3, 8):
        _check_moe_mxfp4(16, True, batch, quad, compact=True)
    for stage in ("1", "all"):
        monkeypatch.setenv("KIMI_DECODE_GROUPED_STAGE", stage)
        test_moe_mxfp4_grouped_matches_float64(16, True, 9, False, quad, "operands", compact=True)
        test_moe_mxfp4_grouped_matches_float64(16, True, 64, False, quad, compact=True)
        test_moe_mxfp4_grouped_matches_float64(16, True, 33, True, quad, compact=True)


@pytest.mark.parametrize("kernel, rows", [("tc", 4), ("tc", 17), ("tc", 64), ("rows", 2), ("rows", 8), ("rows", 13),
                                          ("wgmma", 17), ("wgmma", 64)])
def test_tensor_core_projection_row_scale_and_graph_replay(kernel, rows):
    """The MoE tail's form (1/rms per row from partial sums of squares, addend, accumulate) in a CUDA graph replayed
    twice: the residual gets the update twice, the counters stay at 0, and a strided input (f_b's slice of the
    in_proj output) is read as such; for every tensor-core projection."""
    from kimi_decode.kernels import gemm_tc, gemm_tc_rows, gemm_wgmma

    def project(w, x, y, counters, **kw):
        if kernel == "rows":
            return gemm_tc_rows.project_rows(w, x, y, **kw)
        if kernel == "wgmma":
            return gemm_wgmma.project_wgmma(w, x, y, counters, **kw)
        return gemm_tc.project(w, x, y, counters, **kw)

    g = torch.Generator(device="cuda").manual_seed(950 + rows)
    w, xs, ssq, add, y0, want = _moe_tail_case(rows, g)
    counters = torch.zeros(256, dtype=torch.int32, device="cuda")
    y = y0.clone()
    project(w, xs, y, counters, accumulate=True, addend=add, row_scale=(ssq, 1e-5))  # compile outside the capture
    y.copy_(y0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        project(w, xs, y, counters, accumulate=True, addend=add, row_scale=(ssq, 1e-5))
    y.copy_(y0)
    graph.replay()
    graph.replay()
    assert rel_err(y - y0, 2 * want) < BF16_TOL
    assert int(counters.abs().sum()) == 0
    wide = torch.randn(rows, 3216, device="cuda", generator=g).bfloat16()
    f_b = torch.randn(768, 128, device="cuda", generator=g).bfloat16()
    out = torch.full((rows, 768), float("nan"), dtype=torch.bfloat16, device="cuda")
    project(f_b, wide[:, 1536:1664], out, counters)
    assert rel_err(out, wide[:, 1536:1664].double() @ f_b.double().T) < 1e-2


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("epi_early", ["1", "0"])
def test_gemv_addend_matches_float64(monkeypatch, tp, rows, epi_early):
    """y += x @ W.T + addend, y and the addend read before the weight loop or (KIMI_DECODE_GEMV_EPI_EARLY=0) after."""
    from kimi_decode.kernels.gemv import gemv

    monkeypatch.setenv("KIMI_DECODE_GEMV_EPI_EARLY", epi_early)

    g = torch.Generator(device="cuda").manual_seed(500 + tp + rows)
    s = shard("k3", tp=tp)
    n, k = s.model.hidden, s.model.moe_latent  # the latent up-projection with the shared experts' output
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    add = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    y0 = torch.randn(rows, n, device="cuda", generator=g)
    y = y0.clone()
    gemv(w, x, y, accumulate=True, addend=add)
    assert rel_err(y, y0.double() + x.double() @ w.double().T + add.double()) < 1e-4


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_rmsnorm_rows_matches_float64(batch):
    from kimi_decode.kernels.rmsnorm import rmsnorm_rows

    g = torch.Generator(device="cuda").manual_seed(700 + batch)
    L = shard("k3", tp=16).model.moe_latent
    x = torch.randn(batch, L, device="cuda", generator=g) * 5
    w = 1 + 0.1 * torch.randn(L, device="cuda", generator=g)
    out = torch.full((batch, L), float("nan"), dtype=torch.bfloat16, device="cuda")
    rmsnorm_rows(x, w, out, 1e-5)
    xd = x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert rel_err(out, want) < 1e-2


@pytest.mark.parametrize("batch, k, width", [(9, 16, 3584), (16, 16, 3584), (64, 16, 3584), (5, 3, 128),
                                             (2, 1, 132)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "norm+residual"])
def test_routed_norm_matches_float64(batch, k, width, with_residual):
    """The MoE tail's norm of the grouped experts' per-pair outputs: the k pair rows of each token summed, RMSNorm
    times its weight, bf16 (poisoned first), and with a residual the shared output added into it (other width), against
    float64. At every width some of the 1024 threads hold no 16-byte group of the row (896 groups at 3584, 32 and 33
    at 128 and 132), and the residual's 7176 / 264 / 272 columns end partway through the threads' last pass."""
    from kimi_decode.kernels.rmsnorm import routed_norm

    g = torch.Generator(device="cuda").manual_seed(800 + batch + k + width)
    pairs = torch.randn(batch, k, width, device="cuda", generator=g) * 3
    w = 1 + 0.1 * torch.randn(width, device="cuda", generator=g)
    out = torch.full((batch, width), float("nan"), dtype=torch.bfloat16, device="cuda")
    H = 2 * width + 8
    res = torch.randn(batch, H, device="cuda", generator=g)
    add = torch.randn(batch, H, device="cuda", generator=g).to(torch.bfloat16)
    res0 = res.clone()
    routed_norm(pairs, w, out, 1e-5, residual=(res, add) if with_residual else None)
    _check_routed_norm(pairs, w, out, res, res0, add, with_residual)


@pytest.mark.parametrize("batch, k", [(16, 16), (64, 16)])
def test_routed_norm_on_bf16_pairs_matches_float64(batch, k):
    """bf16 per-pair outputs (`KIMI_DECODE_PAIRS_BF16=1`), summed in fp32, with the residual, against float64 of the
    same bf16 values."""
    from kimi_decode.kernels.rmsnorm import routed_norm

    g = torch.Generator(device="cuda").manual_seed(850 + batch + k)
    pairs = (torch.randn(batch, k, 3584, device="cuda", generator=g) * 3).bfloat16()
    w = 1 + 0.1 * torch.randn(3584, device="cuda", generator=g)
    out = torch.full((batch, 3584), float("nan"), dtype=torch.bfloat16, device="cuda")
    res = torch.randn(batch, 7168, device="cuda", generator=g)
    add = torch.randn(batch, 7168, device="cuda", generator=g).to(torch.bfloat16)
    res0 = res.clone()
    routed_norm(pairs, w, out, 1e-5, residual=(res, add))
    _check_routed_norm(pairs, w, out, res, res0, add, True)


@pytest.mark.parametrize("batch, k, width", [(9, 16, 3584), (64, 16, 3584), (5, 3, 128), (2, 1, 132)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "norm+residual"])
def test_norm_kernels_with_the_weight_first_match_float64(monkeypatch, batch, k, width, with_residual):
    """KIMI_DECODE_NORM_W_FIRST=1 (the norm weight loaded before the first store): the routed norm in both forms, and
    the row norm, as the tests above (widths whose last groups and rows fall partway through the threads)."""
    monkeypatch.setenv("KIMI_DECODE_NORM_W_FIRST", "1")
    test_routed_norm_matches_float64(batch, k, width, with_residual)
    test_routed_norm_split_over_ctas_matches_float64_and_replays(batch, k, width, with_residual)
    if not with_residual:
        test_rmsnorm_rows_matches_float64(batch)


@pytest.mark.parametrize("tp, pad, batch, setting", [(16, True, 1, "1"), (8, True, 1, "1"), (16, False, 3, "1"),
                                                     (8, True, 8, "1"), (16, True, 1, "0"), (8, False, 1, "0")])
def test_moe_w2_with_the_norm_weight_first_matches_float64(monkeypatch, tp, pad, batch, setting):
    """KIMI_DECODE_NORM_W_FIRST in the per-pair w2 kernels that write the norm's scaled input: "1" (the norm weight
    loaded before their stores) above one token, where "auto", the default, does not take it, and "0" at one token,
    where it does; the two-kernel and the one-kernel forms, as the tests above."""
    monkeypatch.setenv("KIMI_DECODE_NORM_W_FIRST", setting)
    _check_moe_mxfp4(tp, pad, batch)
    test_moe_mxfp4_one_kernel_matches_float64_and_replays(tp, pad, batch)


@pytest.mark.parametrize("tp, batch", [(16, 1), (8, 1), (16, 8), (16, 16), (16, 64), (8, 8), (8, 64)])
def test_specialized_layer_with_the_norm_weight_first_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_NORM_W_FIRST=1 in whole layers: at batch 1 (the w2 kernel with the shared experts' down-projection,
    under PDL) and TP16 batch 8 the per-pair w2 kernel writing the norm's scaled input; above, where the grouped
    experts' pairs go through the routed norm (on the tensor-core tail, and with the residual update inside at batch
    64)."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_NORM_W_FIRST", "1", tp, batch, 5340)


@pytest.mark.parametrize("tp", [16, 8])
def test_specialized_layer_with_the_norm_weight_beside_its_stores_matches_reference(monkeypatch, tp):
    """KIMI_DECODE_NORM_W_FIRST=0 in whole batch-1 layers, where "auto", the default, loads the norm weight first."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_NORM_W_FIRST", "0", tp, 1, 5350)


def _check_routed_norm(pairs, w, out, res, res0, add, with_residual: bool) -> None:
    """`routed_norm`'s output against float64 (none of it left poisoned), and the residual updated by the addend, or
    left as it was (`res0`)."""
    torch.cuda.synchronize()
    x = pairs.double().sum(1)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert not out.isnan().any()
    assert rel_err(out, want) < 1e-2
    if with_residual:
        assert rel_err(res, res0.double() + add.double()) < 1e-6
    else:
        assert torch.equal(res, res0)


@pytest.mark.parametrize("batch, k, width", [(9, 16, 3584), (16, 16, 3584), (64, 16, 3584), (5, 3, 128),
                                             (3, 2, 1028)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "norm+residual"])
def test_routed_norm_split_over_ctas_matches_float64_and_replays(batch, k, width, with_residual):
    """The split form (`routed_norm(..., split=)`: `split_ctas` CTAs per token meeting on a counter) against float64
    with poisoned outputs, then twice more replayed in one CUDA graph on new inputs: the counters are back at 0 after
    every run and the second replay's result is right (a counter left behind would let a CTA read parts too early).
    Width 1028 is 257 groups: three CTAs per token, the last with one group; 128 is one CTA; the residual's columns
    (2 W + 8) end partway through a CTA's share."""
    from kimi_decode.kernels.rmsnorm import routed_norm, routed_norm_scratch, split_ctas

    g = torch.Generator(device="cuda").manual_seed(900 + batch + k + width)
    split = routed_norm_scratch(width, torch.device("cuda"))
    H = 2 * width + 8
    pairs = torch.empty(batch, k, width, device="cuda")
    w = 1 + 0.1 * torch.randn(width, device="cuda", generator=g)
    res = torch.empty(batch, H, device="cuda")
    add = torch.empty(batch, H, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(batch, width, dtype=torch.bfloat16, device="cuda")

    def fresh():
        pairs.copy_(torch.randn(batch, k, width, device="cuda", generator=g) * 3)
        res.copy_(torch.randn(batch, H, device="cuda", generator=g))
        add.copy_(torch.randn(batch, H, device="cuda", generator=g))
        out.fill_(float("nan"))
        return res.clone()

    def run():
        routed_norm(pairs, w, out, 1e-5, residual=(res, add) if with_residual else None, split=split)

    def check(res0):
        _check_routed_norm(pairs, w, out, res, res0, add, with_residual)
        assert not split[0].any(), "counters left behind"

    res0 = fresh()
    run()
    check(res0)
    assert split_ctas(width) == -(-width // 512)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(2):
        res0 = fresh()
        graph.replay()
        check(res0)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gemv_glu_epilogue_matches_float64(tp, rows):
    """The shared experts' gate/up projection with SiTU-GLU in the epilogue, against float64 (output poisoned)."""
    from kimi_decode.kernels.gemv import gemv

    s = shard("k3", tp=tp)
    g = torch.Generator(device="cuda").manual_seed(800 + tp + rows)
    n, k = s.shared_inter, s.model.hidden
    w = (torch.randn(2 * n, k, device="cuda", generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    y = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemv(w, x, y, glu=True)
    h = x.double() @ w.double().T
    assert rel_err(y, R.situ_glu(h[:, :n], h[:, n:])) < BF16_TOL


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("rows, splits", [(2, None), (8, None), (8, 1), (17, None), (64, None), (64, 3)])
def test_wgmma_glu_epilogue_matches_float64(tp, rows, splits):
    """The shared experts' gate/up on the warpgroup mma with SiTU-GLU in the epilogue (each row group's gate rows and
    the same up rows), at the plan's splits (8 / 6 CTAs per cluster at TP16 / TP8) or those given, against float64
    (output poisoned), eagerly and replayed in a CUDA graph."""
    from kimi_decode.kernels.gemm_wgmma import WgmmaPlan, project_wgmma

    s = shard("k3", tp=tp)
    g = torch.Generator(device="cuda").manual_seed(1700 + tp + rows)
    n, k = s.shared_inter, s.model.hidden
    w = (torch.randn(2 * n, k, device="cuda", generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    y = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    h = x.double() @ w.double().T
    want = R.situ_glu(h[:, :n], h[:, n:])
    plan = WgmmaPlan(rows, 2 * n, k, 1, splits, 4, glu=True) if splits else None
    counters = torch.zeros(64, dtype=torch.int32, device="cuda")

    def check():
        assert rel_err(y, want) < BF16_TOL

    eager_then_graphed(lambda: project_wgmma(w, x, y, counters, plan=plan, glu=True), lambda: y.fill_(float("nan")),
                       check)


@pytest.mark.parametrize("tp, batch", [(16, 8), (8, 8), (8, 16), (16, 32)])
def test_specialized_layer_with_the_wgmma_glu_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_SHARED_GLU=all in whole layers: the shared experts' gate/up with SiTU-GLU on the warpgroup mma."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_SHARED_GLU", "all", tp, batch, 5710)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gemv_with_row_scale_epilogue_matches_float64(rows):
    """The MoE tail on the expert kernel's bf16(x * norm_w): y += rsqrt(mean(x**2) + eps) * (x * norm_w) @ W.T +
    addend, the mean from partial sums of squares of x."""
    from kimi_decode.kernels.gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(650 + rows)
    w, xs, ssq, add, y0, want = _moe_tail_case(rows, g)
    y = y0.clone()
    gemv(w, xs, y, accumulate=True, addend=add, row_scale=(ssq, 1e-5))
    assert rel_err(y - y0, want) < BF16_TOL


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("preload", ["0", "4", "64"])
def test_gemv_preload_under_pdl_matches_float64(monkeypatch, tp, rows, preload):
    """Under PDL with no, 4, or all of each row's slices copied into shared memory before the wait: the KDA input
    projection (bf16 out), the shared experts' gate/up with SiTU-GLU, and the MoE tail (row scale, addend,
    accumulate) against float64, outputs poisoned, eagerly and replayed in a CUDA graph."""
    from kimi_decode.kernels.gemv import gemv

    monkeypatch.setenv("KIMI_DECODE_PDL", "1")
    monkeypatch.setenv("KIMI_DECODE_GEMV_PRELOAD", preload)
    s = shard("k3", tp=tp)
    g = torch.Generator(device="cuda").manual_seed(900 + tp + rows + int(preload))
    K, n, S = s.model.hidden, s.kda_in_proj_rows, s.shared_inter
    w_in = torch.randn(n, K, device="cuda", generator=g).bfloat16()
    w_gu = (torch.randn(2 * S, K, device="cuda", generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
    w_up, xs, ssq, add, y0, want_tail = _moe_tail_case(rows, g)
    y_in = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    act = torch.empty(rows, S, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(y0)
    h = x.double() @ w_gu.double().T
    want_in, want_act = x.double() @ w_in.double().T, R.situ_glu(h[:, :S], h[:, S:])

    def poison():
        y_in.fill_(float("nan"))
        act.fill_(float("nan"))
        y.copy_(y0)

    def run():
        gemv(w_in, x, y_in)
        gemv(w_gu, x, act, glu=True)
        gemv(w_up, xs, y, accumulate=True, addend=add, row_scale=(ssq, 1e-5))

    def check():
        torch.cuda.synchronize()
        errs = (rel_err(y_in, want_in), rel_err(act, want_act), rel_err(y - y0, want_tail))
        assert max(errs) < BF16_TOL, errs

    eager_then_graphed(run, poison, check)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_gemv_with_the_norm_added_before_its_loop_matches_float64(monkeypatch, tp, rows, pdl):
    """KIMI_DECODE_GEMV_NORM_AFTER=0: the row-scaled GEMV (the MoE tail) adding its partial sums of squares before
    the weight loop (the form before "1" became the default), with and without PDL: as
    `test_gemv_preload_under_pdl_matches_float64`."""
    monkeypatch.setenv("KIMI_DECODE_GEMV_NORM_AFTER", "0")
    if pdl == "1":
        test_gemv_preload_under_pdl_matches_float64(monkeypatch, tp, rows, "4")
    else:
        monkeypatch.setenv("KIMI_DECODE_PDL", "0")
        test_gemv_with_row_scale_epilogue_matches_float64(rows)


@pytest.mark.parametrize("tp", [16, 8])
def test_specialized_layer_with_the_tail_norm_before_its_loop_matches_reference(monkeypatch, tp):
    """KIMI_DECODE_GEMV_NORM_AFTER=0 in the batch-1 layer (the MoE tail's GEMV, under PDL)."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_GEMV_NORM_AFTER", "0", tp, 1, 5400)


def _moe_tail_case(rows, g):
    """The MoE tail's inputs at the TP16 shapes: up-projection W, bf16(x * norm_w) with x's partial sums of squares,
    the shared experts' output (addend), a residual y0, and the float64 update y - y0 (eps 1e-5)."""
    m = shard("k3", tp=16).model
    n, k = m.hidden, m.moe_latent
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    x = torch.randn(rows, k, device="cuda", generator=g) * (1 + torch.arange(rows, device="cuda").view(-1, 1))
    norm_w = 1 + 0.1 * torch.randn(k, device="cuda", generator=g)
    ssq = x.pow(2).view(rows, k // 16, 16).sum(-1)
    add = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    y0 = torch.randn(rows, n, device="cuda", generator=g)
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()
    return w, (x * norm_w).bfloat16(), ssq, add, y0, normed @ w.double().T + add.double()


# (n_blocks, commit, delta_mode, use_partial) as decode_layer calls AttnRes (see tests/test_kimi_specialized.py)
ATTN_RES_FLAGS = [(1, False, 0, False), (1, False, 2, True), (2, True, 0, False), (2, False, 2, True),
                  (3, False, 0, True), (3, False, 1, True), (8, True, 0, False), (8, False, 1, True)]


def _attn_res_float64(blocks, partial, delta, w, n_blocks, commit, delta_mode, use_partial, eps):
    blocks, partial = blocks.double().clone(), partial.double().clone()
    if commit:
        blocks[:, n_blocks - 1] = partial
    if delta_mode == 1:
        partial = partial + delta.double()
    elif delta_mode == 2:
        partial = delta.double()
    cands = blocks[:, :n_blocks]
    if use_partial:
        cands = torch.cat([cands, partial.unsqueeze(1)], dim=1)
    return blocks, partial, R.rms_norm(R.attn_res_mix(cands, w, eps), w.input_norm, eps)


@pytest.mark.parametrize("pdl, early", [("0", "1"), ("1", "1"), ("1", "0")])
@pytest.mark.parametrize("batch, hidden, strided", [(1, 7168, False), (8, 7168, True), (64, 7168, False),
                                                    (1, 256, False)])
def test_attn_res_matches_float64(monkeypatch, batch, hidden, strided, pdl, early):
    """Every AttnRes form against float64, outputs (and the blocks and partial it writes) poisoned; without PDL, and
    under it with the committed blocks read before the wait (the default) or after it."""
    from kimi_decode.kernels.attn_res import attn_res
    from kimi_decode.weights import AttnResWeights

    monkeypatch.setenv("KIMI_DECODE_PDL", pdl)
    monkeypatch.setenv("KIMI_DECODE_ATTN_RES_EARLY", early)

    eps = 1e-5
    for i, (n_blocks, commit, delta_mode, use_partial) in enumerate(ATTN_RES_FLAGS):
        g = torch.Generator(device="cuda").manual_seed(1000 * batch + 10 * i + hidden + strided)
        nb = 8
        # candidates of different sizes, and a query large enough for a peaked softmax
        scale = torch.rand(batch, nb + 2, 1, device="cuda", generator=g) * 4 + 0.25
        store = torch.randn(batch, nb + 2, hidden, device="cuda", generator=g) * scale
        blocks = store[:, 1:nb + 1] if strided else store[:, :nb].contiguous()
        edges = store[:, [0, nb + 1]].clone()
        partial = torch.randn(batch, hidden, device="cuda", generator=g) * 2
        delta = torch.randn(batch, hidden, device="cuda", generator=g).bfloat16() if delta_mode else None
        w = AttnResWeights(query=torch.randn(hidden, device="cuda", generator=g) * (8 / hidden ** 0.5),
                           key_norm=1 + 0.1 * torch.randn(hidden, device="cuda", generator=g),
                           input_norm=1 + 0.1 * torch.randn(hidden, device="cuda", generator=g))
        want_blocks, want_partial, want_out = _attn_res_float64(blocks, partial, delta, w, n_blocks, commit,
                                                                delta_mode, use_partial, eps)
        if commit:
            blocks[:, n_blocks - 1] = float("nan")  # must be written
        if delta_mode == 2:
            partial.fill_(float("nan"))  # must be written
        out = torch.full((batch, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        attn_res(blocks, partial, delta, w.query, w.key_norm, w.input_norm, out, n_blocks=n_blocks, commit=commit,
                 delta_mode=delta_mode, use_partial=use_partial, eps=eps)
        torch.cuda.synchronize()
        errs = {"out": rel_err(out, want_out), "partial": rel_err(partial, want_partial),
                "blocks": rel_err(blocks, want_blocks)}
        assert errs["out"] < BF16_TOL and errs["partial"] < 1e-6 and errs["blocks"] < 1e-6, (i, errs)
        if strided:  # the rows around the view are left alone
            assert torch.equal(store[:, [0, nb + 1]], edges)


@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("batch, hidden, strided", [(1, 7168, False), (8, 7168, True), (64, 7168, False),
                                                    (1, 256, False)])
def test_attn_res_with_its_loads_slice_by_slice_matches_float64(monkeypatch, batch, hidden, strided, pdl):
    """KIMI_DECODE_ATTN_RES_LOADS_FIRST=0 (each slice's loads, add and store in turn; the default, "1", loads every
    slice first): every AttnRes form, as `test_attn_res_matches_float64`."""
    monkeypatch.setenv("KIMI_DECODE_ATTN_RES_LOADS_FIRST", "0")
    test_attn_res_matches_float64(monkeypatch, batch, hidden, strided, pdl, "1")


@pytest.mark.parametrize("K", [768, 1536])
@pytest.mark.parametrize("n_blocks, delta_mode", [(0, 2), (3, 1)])
def test_oproj_attn_res_last_with_the_loads_slice_by_slice_matches_float64(monkeypatch, K, n_blocks, delta_mode):
    """KIMI_DECODE_ATTN_RES_LOADS_FIRST=0 in the output projection's "last" form (its last CTA runs the AttnRes
    body), with and without PDL: as `test_oproj_attn_res_matches_float64`."""
    monkeypatch.setenv("KIMI_DECODE_ATTN_RES_LOADS_FIRST", "0")
    for pdl in ("0", "1"):
        test_oproj_attn_res_matches_float64(monkeypatch, K, n_blocks, delta_mode, pdl, "1", "last")


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_specialized_layer_with_the_attn_res_loads_slice_by_slice_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_ATTN_RES_LOADS_FIRST=0 in whole layers (under PDL at batch 1)."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_ATTN_RES_LOADS_FIRST", "0", tp, batch, 5330)


def _checked_runs(run, poison, check, *, graph: bool) -> None:
    """Two runs of `run`, eagerly or (graph=True) as replays of one CUDA-graph capture of it (compiled first, outside
    the capture), its outputs poisoned before each run and checked after it."""
    if graph:
        run()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            run()
        run = captured.replay
    for _ in range(2):
        poison()
        run()
        torch.cuda.synchronize()
        check()


@pytest.mark.parametrize("form", ["shuffle", "redux"])
@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("E, K, k", [(896, 7168, 16), (200, 512, 8)])
def test_router_topk_matches_float64(monkeypatch, form, rows, E, K, k):
    """The one-kernel router against float64: the chosen experts (up to near-ties), in descending order of their
    selection score, and the renormalised weights; twice eagerly and twice replayed in a CUDA graph (the completion
    counter resets itself), outputs poisoned before each run."""
    from kimi_decode.kernels.router_topk import router_topk
    from kimi_decode.testing import check_routing

    monkeypatch.setenv("KIMI_DECODE_TOPK_FORM", form)
    g = torch.Generator(device="cuda").manual_seed(rows * 100 + E)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for trial in range(2):
        w = (torch.randn(E, K, device="cuda", generator=g) * 0.02).bfloat16()
        x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
        bias = torch.randn(E, device="cuda", generator=g) * 0.1
        logits = torch.full((rows, E), float("nan"), device="cuda")
        ids = torch.full((rows, k), -1, dtype=torch.int32, device="cuda")
        weights = torch.full((rows, k), float("nan"), device="cuda")
        want_logits = x.double() @ w.double().T
        scores = torch.sigmoid(want_logits)
        selection = scores + bias.double()

        def check():
            assert rel_err(logits, want_logits) < 1e-4
            check_routing(selection, ids.long())
            chosen = selection.gather(-1, ids.long())
            assert (chosen[:, :-1] >= chosen[:, 1:] - 1e-4).all(), "not in descending order"
            s = scores.gather(-1, ids.long())
            assert rel_err(weights, s / s.sum(-1, keepdim=True) * 2.5) < 1e-4
            assert counter.item() == 0

        def poison():
            for t in (logits, weights):
                t.fill_(float("nan"))
            ids.fill_(-1)

        _checked_runs(lambda: router_topk(w, x, logits, bias, ids, weights, counter, scaling=2.5), poison, check,
                      graph=trial == 1)


@pytest.mark.parametrize("form", ["shuffle", "redux"])
@pytest.mark.parametrize("rows", [2, 8, 64])
@pytest.mark.parametrize("E, k", [(896, 16), (200, 8)])
def test_route_topk_matches_float64(monkeypatch, form, rows, E, k):
    """The routing kernel (one CTA per row) against float64 on fp32 logits, with each form of the warps' rounds
    (KIMI_DECODE_TOPK_FORM): the chosen experts (up to near-ties) in descending order of their selection score and
    the renormalised weights, for every row; eagerly and replayed in a CUDA graph, outputs poisoned before each run."""
    from kimi_decode.kernels.router_topk import route_topk
    from kimi_decode.testing import check_routing

    monkeypatch.setenv("KIMI_DECODE_TOPK_FORM", form)
    g = torch.Generator(device="cuda").manual_seed(rows * 1000 + E)
    for trial in range(2):
        logits = torch.randn(rows, E, device="cuda", generator=g) * 2.0
        bias = torch.randn(E, device="cuda", generator=g) * 0.1
        ids = torch.full((rows, k), -1, dtype=torch.int32, device="cuda")
        weights = torch.full((rows, k), float("nan"), device="cuda")
        scores = torch.sigmoid(logits.double())
        selection = scores + bias.double()

        def check():
            check_routing(selection, ids.long())
            assert all(len(set(row)) == k for row in ids.tolist()), "an expert chosen twice in a row"
            chosen = selection.gather(-1, ids.long())
            assert (chosen[:, :-1] >= chosen[:, 1:] - 1e-6).all(), "not in descending order"
            s = scores.gather(-1, ids.long())
            assert rel_err(weights, s / s.sum(-1, keepdim=True) * 2.5) < 1e-5

        def poison():
            weights.fill_(float("nan"))
            ids.fill_(-1)

        _checked_runs(lambda: route_topk(logits, bias, ids, weights, scaling=2.5), poison, check, graph=trial == 1)


@pytest.mark.parametrize("form", ["shuffle", "redux"])
def test_route_topk_breaks_ties_by_the_smaller_expert_id(monkeypatch, form):
    """Equal selection scores (a row of equal logits, no bias; negative ones; and a tie straddling the warps' lanes)
    go to the smaller expert ids, listed in ascending id order."""
    from kimi_decode.kernels.router_topk import route_topk

    monkeypatch.setenv("KIMI_DECODE_TOPK_FORM", form)
    E, k = 896, 16
    logits = torch.zeros(3, E, device="cuda")
    logits[1] = -4.0
    logits[2] = torch.arange(E, device="cuda", dtype=torch.float32).remainder(7) * 0.5  # ties of 128 experts each
    bias = torch.zeros(E, device="cuda")
    ids = torch.full((3, k), -1, dtype=torch.int32, device="cuda")
    weights = torch.full((3, k), float("nan"), device="cuda")
    route_topk(logits, bias, ids, weights, scaling=1.0)
    torch.cuda.synchronize()
    assert ids[0].tolist() == list(range(k)) and ids[1].tolist() == list(range(k))
    assert ids[2].tolist() == [e for e in range(E) if e % 7 == 6][:k]
    assert torch.allclose(weights, torch.full_like(weights, 1.0 / k))


def test_specialized_layer_with_the_two_kernel_router_matches_reference(monkeypatch):
    monkeypatch.setenv("KIMI_DECODE_FUSED_ROUTER", "0")
    s = shard("k3", tp=16)
    lw, res, state = layer_case(s, 1, 1, seed=4321, device="cuda")
    check_layer(get_backend("latency_specialized", poison=True), lw, res, state, s).assert_within(BF16_TOL)


@pytest.mark.parametrize("E, K, L, k, S, pf", [(896, 7168, 3584, 16, 0, None), (896, 7168, 3584, 16, 768, None),
                                               (896, 7168, 3584, 16, 768, (256, 192)), (200, 512, 384, 8, 64, None),
                                               (200, 512, 384, 8, 64, (64, 64))])
@pytest.mark.parametrize("pdl, form", [("0", "shuffle"), ("1", "shuffle"), ("1", "redux")])
def test_moe_entry_matches_float64(monkeypatch, E, K, L, k, S, pf, pdl, form):
    """The router and the latent down-projection in one kernel against float64: the routes as the one-kernel
    router's test checks them, the latent within bf16 rounding, and with S the shared experts' gate/up activation;
    eagerly and replayed in a CUDA graph (the router's counter back at 0), outputs poisoned before each run. Under
    PDL each part's first weight slices pass through shared memory (`KIMI_DECODE_GEMV_PRELOAD`). With `pf` = (I,
    used) the down-projection CTAs also ask L2 for the chosen experts' used w13 rows (`prefetch`): the results are
    the same and its two flags are back at 0 after every run."""
    from kimi_decode.kernels.moe_entry import moe_entry
    from kimi_decode.testing import check_routing

    monkeypatch.setenv("KIMI_DECODE_TOPK_FORM", form)  # how the router's last CTA finds each warp's top k
    monkeypatch.setenv("KIMI_DECODE_PDL", pdl)
    g = torch.Generator(device="cuda").manual_seed(E + K)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")
    prefetch = None
    if pf is not None:
        w13 = torch.randint(0, 256, (E, 2 * pf[0], L // 2), dtype=torch.uint8, device="cuda", generator=g)
        prefetch = (w13, flags, pf[1])
    w = (torch.randn(E, K, device="cuda", generator=g) * 0.02).bfloat16()
    w_down = torch.randn(L, K, device="cuda", generator=g).bfloat16()
    x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
    bias = torch.randn(E, device="cuda", generator=g) * 0.1
    logits = torch.empty(1, E, device="cuda")
    ids = torch.empty(1, k, dtype=torch.int32, device="cuda")
    weights = torch.empty(1, k, device="cuda")
    latent = torch.empty(1, L, dtype=torch.bfloat16, device="cuda")
    gate_up = torch.randn(2 * max(S, 1), K, device="cuda", generator=g).bfloat16() * 0.05
    act = torch.empty(1, max(S, 1), dtype=torch.bfloat16, device="cuda")
    want_act = R.situ_glu(*(x.double() @ gate_up.double().T).chunk(2, dim=-1))
    want_logits = x.double() @ w.double().T
    scores = torch.sigmoid(want_logits)
    selection = scores + bias.double()

    def run():
        moe_entry(w, x, logits, bias, ids, weights, counter, w_down, latent, scaling=2.5,
                  glu=(gate_up, act) if S else None, prefetch=prefetch)

    def poison():
        for t in (logits, weights, latent, act):
            t.fill_(float("nan"))
        ids.fill_(-1)

    def check():
        torch.cuda.synchronize()
        assert rel_err(latent, x.double() @ w_down.double().T) < 1e-2
        if S:
            assert rel_err(act, want_act) < 1e-2
        assert rel_err(logits, want_logits) < 1e-4
        check_routing(selection, ids.long())
        s = scores.gather(-1, ids.long())
        assert rel_err(weights, s / s.sum(-1, keepdim=True) * 2.5) < 1e-4
        assert counter.item() == 0
        assert flags.tolist() == [0, 0]

    eager_then_graphed(run, poison, check)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("env", [{"KIMI_DECODE_MOE_ENTRY": "0"}, {"KIMI_DECODE_FUSED_GATE": "0"},
                                 {"KIMI_DECODE_EXPERTS_ONE_KERNEL": "1", "KIMI_DECODE_SHARED_ONE_KERNEL": "1"},
                                 {"KIMI_DECODE_SHARED_IN_EXPERTS": "0"}, {"KIMI_DECODE_SHARED_IN_EXPERTS": "1"},
                                 {"KIMI_DECODE_SHARED_IN_EXPERTS": "1", "KIMI_DECODE_SHARED_GLU_IN": "w13"},
                                 {"KIMI_DECODE_PDL": "0"},
                                 {"KIMI_DECODE_PDL_SKIP": ""},
                                 {"KIMI_DECODE_PDL_PREFETCH_ITERS": "4"},
                                 {"KIMI_DECODE_W2_EARLY": "0"}, {"KIMI_DECODE_KDA_SPLIT": "1"},
                                 {"KIMI_DECODE_OPROJ_EARLY": "0"}, {"KIMI_DECODE_GEMV_EPI_EARLY": "0"},
                                 {"KIMI_DECODE_W13_WARPS": "4"}, {"KIMI_DECODE_GEMV_PRELOAD": "0"},
                                 {"KIMI_DECODE_GEMV_PRELOAD": "64"}, {"KIMI_DECODE_OPROJ_EARLY": "smem"},
                                 {"KIMI_DECODE_KDA_TRIGGER": "late", "KIMI_DECODE_OPROJ_EARLY": "smem"},
                                 {"KIMI_DECODE_W2_CHUNK": "1"}, {"KIMI_DECODE_W13_X_ONCE": "0"},
                                 {"KIMI_DECODE_OPROJ_RES": "last"}, {"KIMI_DECODE_SHARED_DOWN_LANES": "32"},
                                 {"KIMI_DECODE_W13_PREFETCH": "1"},
                                 {"KIMI_DECODE_PDL_SKIP": "moe_w13_act,moe_w13_act_shared"}])
def test_specialized_layer_with_the_batch1_fusions_switched_off_matches_reference(monkeypatch, tp, env):
    """Batch 1 with the router beside the latent down-projection instead of inside it, or with the f_b GEMV as its
    own kernel, or with the expert and shared-expert GEMVs as two-stage kernels, or with the shared experts as
    kernels of their own or always as CTAs in the expert kernels, or without PDL, or with the w13 kernel under it
    too, or with the GEMVs' L2 requests before the wait, or with the w2 kernel's or the output projection's weights
    after the wait, or one KDA thread per state column, or the MoE tail's residual read after its weights, or the
    w13 kernel on 4 warps, or the GEMVs with part or all of their rows copied into shared memory before the wait,
    or the output projection's rows all in shared memory instead of its first rows in registers, also with the KDA
    kernel letting it launch only after reading its inputs, or the w2 kernel's weights one word per load, or the w13
    kernel's activations converted by every lane, or the AttnRes step after the output projection all in its last
    CTA, or the shared down-projection's rows one to a warp, or the w13 weights asked of L2 first, or the w13 kernel
    without PDL (the default before v38): the A/B switches."""
    for key, v in env.items():
        monkeypatch.setenv(key, v)
    s = shard("k3", tp=tp)
    lw, res, state = layer_case(s, 1, 1, seed=4500 + tp + len(env), device="cuda")
    check_layer(get_backend("latency_specialized", poison=True), lw, res, state, s).assert_within(BF16_TOL)


@pytest.mark.parametrize("K", [768, 1536])
@pytest.mark.parametrize("n_blocks, delta_mode", [(0, 2), (3, 1), (8, 1)])
@pytest.mark.parametrize("pdl, early, res", [("0", "smem", "last"), ("1", "smem", "last"), ("1", "1", "last"),
                                             ("1", "0", "last"), ("0", "1", "split"), ("1", "1", "split"),
                                             ("1", "smem", "split")])
def test_oproj_attn_res_matches_float64(monkeypatch, K, n_blocks, delta_mode, pdl, early, res):
    """The output projection + AttnRes kernel (TP16 / TP8 projection widths) against float64: the projection a, the
    updated partial and the AttnRes output, with a, out, the score-sum scratch (and partial when it is set) poisoned
    first; run twice (the completion counter resets itself) and replayed in a CUDA graph. Without PDL, and under it
    with the weights copied into shared memory before the wait, the first rows loaded into registers, or all loaded
    after it; the AttnRes step all in the last CTA, or split between every CTA and the last."""
    from kimi_decode.kernels.oproj_attn_res import oproj_attn_res
    from kimi_decode.weights import AttnResWeights

    monkeypatch.setenv("KIMI_DECODE_PDL", pdl)
    monkeypatch.setenv("KIMI_DECODE_OPROJ_EARLY", early)
    monkeypatch.setenv("KIMI_DECODE_OPROJ_RES", res)
    H, eps = 7168, 1e-5
    g = torch.Generator(device="cuda").manual_seed(K + 10 * n_blocks + delta_mode)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    w_o = (torch.randn(H, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    o = torch.randn(1, K, device="cuda", generator=g).bfloat16()
    blocks = torch.randn(1, 8, H, device="cuda", generator=g) * 2
    partial0 = torch.randn(1, H, device="cuda", generator=g) * 2
    w = AttnResWeights(query=torch.randn(H, device="cuda", generator=g) * (8 / H ** 0.5),
                       key_norm=1 + 0.1 * torch.randn(H, device="cuda", generator=g),
                       input_norm=1 + 0.1 * torch.randn(H, device="cuda", generator=g))
    want_a = o.double() @ w_o.double().T
    _, want_partial, want_out = _attn_res_float64(blocks, partial0, want_a.bfloat16(), w, n_blocks, False,
                                                  delta_mode, True, eps)
    a = torch.empty(1, H, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(1, H, dtype=torch.bfloat16, device="cuda")
    partial = partial0.clone()
    parts = torch.empty(132 * 32, device="cuda")

    def reset():
        a.fill_(float("nan"))
        out.fill_(float("nan"))
        parts.fill_(float("nan"))
        partial.copy_(partial0 if delta_mode == 1 else torch.full_like(partial0, float("nan")))

    def run():
        oproj_attn_res(w_o, o, a, blocks, partial, w.query, w.key_norm, w.input_norm, out, counter,
                       n_blocks=n_blocks, delta_mode=delta_mode, eps=eps, parts=parts)

    def check():
        torch.cuda.synchronize()
        errs = {"a": rel_err(a, want_a), "partial": rel_err(partial, want_partial), "out": rel_err(out, want_out)}
        assert errs["a"] < 1e-2 and errs["partial"] < 1e-3 and errs["out"] < BF16_TOL, errs
        assert counter.item() == 0

    eager_then_graphed(run, reset, check)


@pytest.mark.parametrize("K", [768, 1536])
@pytest.mark.parametrize("n_blocks, delta_mode", [(0, 2), (3, 1)])
def test_oproj_attn_res_with_its_later_rows_in_the_loop_matches_float64(monkeypatch, K, n_blocks, delta_mode):
    """KIMI_DECODE_OPROJ_REST=loop under PDL (each pass's rows loaded after the pass before it, the form before
    "ahead" became the default), in both AttnRes forms: as `test_oproj_attn_res_matches_float64`."""
    monkeypatch.setenv("KIMI_DECODE_OPROJ_REST", "loop")
    for res in ("split", "last"):
        test_oproj_attn_res_matches_float64(monkeypatch, K, n_blocks, delta_mode, "1", "1", res)


@pytest.mark.parametrize("tp", [16, 8])
def test_specialized_layer_with_the_o_proj_rows_in_the_loop_matches_reference(monkeypatch, tp):
    """KIMI_DECODE_OPROJ_REST=loop in the batch-1 layer (under PDL, its default there)."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_OPROJ_REST", "loop", tp, 1, 5300)


@pytest.mark.parametrize("tp", [16, 8])
def test_specialized_layer_with_two_kernel_o_proj_and_attn_res_matches_reference(monkeypatch, tp):
    monkeypatch.setenv("KIMI_DECODE_FUSED_O_RES", "0")
    s = shard("k3", tp=tp)
    lw, res, state = layer_case(s, 1, 1, seed=4400 + tp, device="cuda")
    check_layer(get_backend("latency_specialized", poison=True), lw, res, state, s).assert_within(BF16_TOL)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [2, 8, 16])
@pytest.mark.parametrize("plain", ["0", "1"])
def test_specialized_layer_with_row_tile_projections_matches_reference(monkeypatch, tp, batch, plain):
    """The layer with the row-tile tensor-core projection (`gemm_tc_rows`) from 2 to 16 rows (KIMI_DECODE_WGMMA=0:
    at 16 too): the MoE tail on it, and with KIMI_DECODE_TC_PLAIN=1 every plain projection too."""
    for k, v in {"KIMI_DECODE_TC_FORM": "rows", "KIMI_DECODE_TC_MIN_ROWS": "2", "KIMI_DECODE_TC_MAX_ROWS": "16",
                 "KIMI_DECODE_TC_PLAIN": plain, "KIMI_DECODE_WGMMA": "0"}.items():
        monkeypatch.setenv(k, v)
    s = shard("k3", tp=tp)
    lw, res, state = layer_case(s, 1, batch, seed=7100 + tp + batch, device="cuda")
    check_layer(get_backend("latency_specialized", poison=True), lw, res, state, s).assert_within(BF16_TOL)


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch, env", [(4, {}), (8, {"KIMI_DECODE_TC_PLAIN": "0"}), (16, {}),
                                        (32, {"KIMI_DECODE_TC_MAX_ROWS": "64"})])
def test_specialized_layer_with_tensor_core_projections_matches_reference(monkeypatch, tp, batch, env):
    """The layer on the split-K tensor-core kernel (KIMI_DECODE_TC_FORM=split): every plain projection and the tail
    on it, or (KIMI_DECODE_TC_PLAIN=0) the tail alone, and past the row tiles' range (staged activations at 32
    rows); KIMI_DECODE_WGMMA=0, so the warpgroup mma takes none of them."""
    monkeypatch.setenv("KIMI_DECODE_TC_FORM", "split")
    monkeypatch.setenv("KIMI_DECODE_WGMMA", "0")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = shard("k3", tp=tp)
    lw, res, state = layer_case(s, 1, batch, seed=7000 + tp + batch, device="cuda")
    check_layer(get_backend("latency_specialized", poison=True), lw, res, state, s).assert_within(BF16_TOL)


@pytest.mark.parametrize("tp, batch", [(16, 64), (8, 64), (16, 32), (8, 17)])
def test_specialized_layer_with_cublaslt_projections_matches_reference(monkeypatch, tp, batch):
    """KIMI_DECODE_CUBLAS_LIB=cublaslt: the projections above the tensor-core rows on torch's cuBLASLt path (with
    KIMI_DECODE_WGMMA=0, from 17 rows); torch's own setting is what it was before the layer."""
    import torch

    monkeypatch.setenv("KIMI_DECODE_WGMMA", "0")
    before = torch.backends.cuda.preferred_blas_library()
    _layer_matches_with(monkeypatch, "KIMI_DECODE_CUBLAS_LIB", "cublaslt", tp, batch, 4100)
    assert torch.backends.cuda.preferred_blas_library() == before


def test_cublaslt_projections_replay_in_a_graph_like_eager(monkeypatch):
    """The cuBLASLt projections captured in a CUDA graph (TP16 batch 64): replays give the eager steps' results."""
    monkeypatch.setenv("KIMI_DECODE_CUBLAS_LIB", "cublaslt")
    _check_graph_replays_like_eager(16, 64)


@pytest.mark.parametrize("tp, batch, names", [(16, 64, "1"), (8, 64, "1"), (16, 17, "1"), (8, 40, "1"),
                                             (16, 64, "router,shared_gate_up,o_proj"), (8, 32, "latent_up,in_proj"),
                                             (16, 32, "auto"), (8, 24, "auto"), (16, 16, "auto"), (8, 16, "auto"),
                                             (16, 12, "auto"), (16, 8, "auto"), (8, 4, "auto")])
def test_specialized_layer_with_wgmma_projections_matches_reference(monkeypatch, tp, batch, names):
    """KIMI_DECODE_WGMMA=1: the plain projections and the MoE tail above 16 rows on the warpgroup-mma projection;
    some of them by name: those, the rest on cuBLAS; auto (the default): all of them up to 32 rows, from 2 to 16
    all but f_b (with the shared experts after the latent down-projection, the default from 2 rows)."""
    _layer_matches_with(monkeypatch, "KIMI_DECODE_WGMMA", names, tp, batch, 4300)


@pytest.mark.parametrize("tp, batch, rows", [(16, 8, "2"), (8, 16, "2"), (16, 4, "3")])
def test_specialized_layer_with_wgmma_below_the_row_tiles_matches_reference(monkeypatch, tp, batch, rows):
    """KIMI_DECODE_WGMMA_MIN_ROWS: the warpgroup-mma projection from that many rows instead of the row tiles (TP16
    batch 8: the per-pair experts' partial sums of squares scaled in its epilogue, the MoE tail's fused norm)."""
    monkeypatch.setenv("KIMI_DECODE_WGMMA", "1")
    _layer_matches_with(monkeypatch, "KIMI_DECODE_WGMMA_MIN_ROWS", rows, tp, batch, 4400)


@pytest.mark.parametrize("setting, tp, batch", [("1", 8, 64), ("auto", 16, 12), ("auto", 8, 8)])
def test_wgmma_projections_replay_in_a_graph_like_eager(monkeypatch, setting, tp, batch):
    """The warpgroup-mma projections captured in a CUDA graph (TP8 batch 64 with all of them; TP16 batch 12 and TP8
    batch 8 at the default, where they take the row tiles' place and the shared experts start after the latent;
    their counters on the fork's streams): replays give the eager steps' results."""
    monkeypatch.setenv("KIMI_DECODE_WGMMA", setting)
    _check_graph_replays_like_eager(tp, batch)


@pytest.mark.parametrize("topk", ["1", "16"])
@pytest.mark.parametrize("tp, batch", [(16, 64), (8, 32)])
def test_specialized_layer_with_route_topk_at_every_batch_matches_reference(monkeypatch, topk, tp, batch):
    """KIMI_DECODE_CUTE_TOPK=1 (the default, set here so that the test keeps it if the default moves): `route_topk`
    (one CTA per row) routes above 16 rows too, on cuBLASLt's logits; "16": the Triton top-k there."""
    monkeypatch.setenv("KIMI_DECODE_CUBLAS_LIB", "cublaslt")
    monkeypatch.setenv("KIMI_DECODE_WGMMA", "0")
    _layer_matches_with(monkeypatch, "KIMI_DECODE_CUTE_TOPK", topk, tp, batch, 4200)
