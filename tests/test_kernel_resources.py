"""benchmarks/kernel_resources.py on the CPU: its CTAs-per-SM model against what ncu reported on the H200, the kernel
names it reads from kept PTX files, and a whole run over the grouped expert kernels compiled for sm_90a."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import kernel_resources as kr  # noqa: E402


@pytest.mark.parametrize("regs, threads, ctas", [
    (74, 224, 3),  # v21's grouped w13 kernel under cutlass-dsl 4.3.5 (ncu "Block Limit Registers", NOTES v22)
    (87, 224, 2),  # its first looping form
    (91, 224, 2),
    (126, 256, 2),  # the grouped w2 kernel
    (122, 256, 2),
    (32, 128, 16),
    (255, 1024, 0),  # more registers than one CTA of 1024 threads can have
    (16, 32, 32),  # the CTA limit, not the registers
])
def test_ctas_per_sm_by_registers_matches_ncu(regs, threads, ctas):
    assert kr.ctas_per_sm_by_registers(regs, threads) == ctas


def test_kernel_name_is_the_module_and_class_of_the_kept_ptx():
    name = ("cutlass___call___kimi_decodekernelsmoe_mxfp4_groupedMoEW13Grouped_object_at__FakeTensorInt3264179217921"
            "_FakeTenso.sm_90a.ptx")
    assert kr.kernel_name(name) == "moe_mxfp4_groupedMoEW13Grouped"
    assert kr.kernel_name("/some/dir/other.ptx") == "other.ptx"


def test_a_kept_ptx_that_ends_in_a_nul_byte_is_assembled(tmp_path):
    """cutlass-dsl 4.3.5 (the H200 machine's) keeps each PTX file with a NUL byte at its end, where ptxas stops with
    "Unexpected EOF": the byte is taken out before assembling."""
    if kr.ptxas() is None:
        pytest.skip("no ptxas on this machine")
    ptx = tmp_path / "k.ptx"
    ptx.write_bytes(b".version 8.0\n.target sm_90a\n.address_size 64\n\n.visible .entry k()\n.reqntid 128, 1, 1\n"
                    b"{\n\tret;\n}\n\0")
    row = kr.resources(str(ptx), kr.ptxas())
    assert row["threads"] == 128 and row["registers"] >= 0 and row["spill_stores"] == 0
    assert ptx.read_bytes().endswith(b"\0")  # the kept file is left as it was


def test_refuses_no_input_and_an_empty_directory(tmp_path, capsys):
    with pytest.raises(SystemExit):
        kr.main([])
    if kr.ptxas() is None:
        pytest.skip("no ptxas on this machine")
    assert kr.main(["--ptx-dir", str(tmp_path)]) == 1
    assert "no .ptx files" in capsys.readouterr().err


def test_grouped_expert_kernels_compiled_for_sm90a(tmp_path, capsys):
    """The two grouped expert kernels (TP16 batch 64, quad-major codes), compiled in a fresh process that keeps
    their PTX and cubins, then assembled: 224 / 256 threads, registers within ptxas's 255, no stack, CTAs per SM as
    the model gives for those registers; the cubins read with cuobjdump give the same registers."""
    pytest.importorskip("cutlass")
    if kr.ptxas() is None:
        pytest.skip("no ptxas on this machine")
    script = textwrap.dedent("""
        import torch
        from kimi_decode.config import shard
        from kimi_decode.kernels.moe_mxfp4_grouped import compile_grouped
        s = shard("k3", tp=16, pad_experts=True)
        m = s.model
        E, L, I, k, B = m.num_experts, m.moe_latent, s.expert_inter, m.top_k, 64
        u8 = torch.uint8
        compile_grouped(torch.empty(B, L, dtype=torch.bfloat16), torch.empty(B, k, dtype=torch.int32),
                        torch.empty(B, k), torch.empty(E, 2 * I, L // 2, dtype=u8),
                        torch.empty(E, 2 * I, L // 32, dtype=u8), torch.empty(E, L, I // 2, dtype=u8),
                        torch.empty(E, L, I // 32, dtype=u8), [torch.empty(B * k, dtype=torch.int32)] * 4,
                        torch.empty(B * k, s.expert_inter_used, dtype=torch.float16), torch.empty(B * k, L),
                        s.expert_inter_used, quad_major=True)
    """)
    env = dict(os.environ, CUTE_DSL_KEEP_PTX="1", CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_DUMP_DIR=str(tmp_path),
               KIMI_DECODE_CUTE_ARCH="sm_90a",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert kr.main(["--ptx-dir", str(tmp_path)]) == 0
    rows = {r["kernel"]: r for r in (kr.resources(str(p), kr.ptxas()) for p in tmp_path.glob("*.ptx"))}
    assert set(rows) == {"moe_mxfp4_groupedMoEW13Grouped", "moe_mxfp4_groupedMoEW2Grouped"}
    assert rows["moe_mxfp4_groupedMoEW13Grouped"]["threads"] == 224
    assert rows["moe_mxfp4_groupedMoEW2Grouped"]["threads"] == 256
    for r in rows.values():
        assert 32 <= r["registers"] <= 255 and r["stack"] == 0
        assert r["ctas_per_sm"] == kr.ctas_per_sm_by_registers(r["registers"], r["threads"]) >= 1
    out = capsys.readouterr().out
    assert "moe_mxfp4_groupedMoEW13Grouped" in out and "CTAs/SM" in out
    # the kept cubins, read with cuobjdump, give what ptxas gives for the same PTX
    objdump = kr.cuda_tool("cuobjdump")
    if objdump is None or not list(tmp_path.glob("*.cubin")):
        pytest.skip("no cuobjdump or no kept cubins here")
    for p in tmp_path.glob("*.ptx"):
        from_cubin = kr.resources(str(p), None, objdump=objdump)
        assert from_cubin["registers"] == rows[from_cubin["kernel"]]["registers"]
        assert from_cubin["spill_stores"] is None and from_cubin["ctas_per_sm"] >= 1


def test_loads_after_stores_reads_the_sass_listing():
    """Global loads after a global store, by listing order: predicated instructions count, a barrier, fence, atomic or
    exit in between clears the store, and shared-memory, async-copy and non-global ops are not loads or stores."""
    sass = textwrap.dedent("""
        /*0100*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0110*/                   STG.E.128 desc[UR4][R2.64], R4 ;
        /*0120*/              @!P0 LDG.E.64 R8, desc[UR4][R6.64] ;
        /*0130*/                   LDS R9, [R1] ;
        /*0140*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64] ;
        /*0150*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0160*/                   LDG.E R10, desc[UR4][R6.64] ;
        /*0170*/               @P1 STG.E.U16 desc[UR4][R6.64], R10 ;
        /*0180*/                   STS [R1], R10 ;
        /*0190*/                   LDG.E R11, desc[UR4][R6.64+0x4] ;
        /*01a0*/                   MEMBAR.ALL.GPU ;
        /*01b0*/                   LDG.E R12, desc[UR4][R6.64+0x8] ;
    """)
    assert kr.loads_after_stores(sass) == [("0110", "0120"), ("0170", "0190")]
    assert kr.loads_after_stores("") == []


def test_the_load_order_switches_leave_no_load_after_a_store(tmp_path):
    """The four kernels where a global load waited behind a store that may alias it (benchmarks/NOTES.md items
    82-84), compiled for sm_90a in fresh processes with each switch at "0" (the default) and at "1": AttnRes, the KDA
    kernel (TP8, one token, f_b applied inside, under PDL), the routed norm with the residual update and the w2
    expert kernel writing the norm's scaled input. At "0" each lists global loads after a store; at "1" none."""
    pytest.importorskip("cutlass")
    if kr.ptxas() is None or kr.cuda_tool("nvdisasm") is None:
        pytest.skip("no ptxas or nvdisasm on this machine")
    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, "TESTS")
        from test_kimi_specialized import _attn_res_args, _kda_cols_args, _moe_args
        from kimi_decode.config import shard
        from kimi_decode.kernels.attn_res import compile_attn_res
        from kimi_decode.kernels.kda_decode import compile_kda_decode
        from kimi_decode.kernels.moe_mxfp4 import compile_moe
        from kimi_decode.kernels import cute_common as cc
        from kimi_decode.kernels.rmsnorm import RoutedNorm
        compile_attn_res(*_attn_res_args(1, delta=True), n_blocks=3, commit=False, delta_mode=1, use_partial=True,
                         eps=1e-5)
        s = shard("k3", tp=8)
        compile_kda_decode(*_kda_cols_args(s, 1), b_col=s.kda_in_proj_layout["b"][0], eps=1e-5, lower_bound=-5.0,
                           f_col=s.kda_in_proj_layout["f_a"][0])
        L = s.model.moe_latent
        compile_moe(*_moe_args(s, 1), scaled=(torch.empty(L), torch.empty(1, L, dtype=torch.bfloat16)))
        x, out = torch.empty(8 * 16, L), torch.empty(8, L, dtype=torch.bfloat16)
        cc.compile_kernel(("rn",), RoutedNorm(L, 1e-5, 16, 7168, cc.norm_weight_first(8)),
                          *(cc.fake_like(t, align=16 if t is x else 4) for t in
                          (x, torch.empty(L), out, torch.empty(8, 7168), torch.empty(8, 7168, dtype=torch.bfloat16))))
    """).replace("TESTS", str(ROOT / "tests"))
    counts = {}
    for setting in ("0", "1"):
        where = tmp_path / setting
        where.mkdir()
        env = dict(os.environ, CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=str(where), KIMI_DECODE_CUTE_ARCH="sm_90a",
                   KIMI_DECODE_PDL="1", KIMI_DECODE_ATTN_RES_LOADS_FIRST=setting, KIMI_DECODE_KDA_INPUTS_FIRST=setting,
                   KIMI_DECODE_NORM_W_FIRST=setting,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        subprocess.run([sys.executable, "-c", script], cwd=where, env=env, check=True, capture_output=True)
        rows = [kr.resources(str(p), kr.ptxas(), disasm=kr.cuda_tool("nvdisasm")) for p in where.glob("*.ptx")]
        counts[setting] = {r["kernel"]: len(r["loads_after_stores"]) for r in rows if "W13" not in r["kernel"]}
    names = {"attn_resAttnRes", "kda_decodeKDADecode", "moe_mxfp4MoEW2Sum", "rmsnormRoutedNorm"}
    assert set(counts["0"]) == set(counts["1"]) == names
    assert all(counts["0"][n] > 0 for n in names), counts
    assert all(counts["1"][n] == 0 for n in names), counts


def test_wgmma_glu_projection_assembles_for_sm90a(tmp_path):
    """The warpgroup-mma projection with the SiTU-GLU epilogue (the shared experts' gate/up at TP16, 8 tokens: the
    plan's 8 splits) compiled in a fresh process that keeps its PTX, then assembled: `wgmma m64n8k16`, the partial
    sums through the cluster's shared memory, bf16 stores of the activation only, no ptxas warning and no stack."""
    pytest.importorskip("cutlass")
    if kr.ptxas() is None:
        pytest.skip("no ptxas on this machine")
    script = textwrap.dedent("""
        import torch
        from kimi_decode.kernels.gemm_tc import workspace
        from kimi_decode.kernels.gemm_wgmma import compile_wgmma_projection, wgmma_plan_for
        plan = wgmma_plan_for(8, 768, 7168, glu=True)
        w = torch.empty(768, 7168, dtype=torch.bfloat16)
        compile_wgmma_projection(w, torch.empty(8, 7168, dtype=torch.bfloat16),
                                 torch.empty(8, 384, dtype=torch.bfloat16), workspace(plan, w.device),
                                 torch.zeros(plan.groups, dtype=torch.int32), glu=True)
    """)
    env = dict(os.environ, CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=str(tmp_path), KIMI_DECODE_CUTE_ARCH="sm_90a",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True, capture_output=True)
    from kimi_decode.kernels.gemm_wgmma import wgmma_plan_for

    plan = wgmma_plan_for(8, 768, 7168, glu=True)
    assert plan.glu and plan.splits == 8
    (path,) = tmp_path.glob("*.ptx")
    lines = path.read_text().splitlines()
    mma = [ln for ln in lines if "wgmma.mma_async" in ln]
    assert len(mma) == 4 and all("m64n8k16.f32.bf16.bf16" in ln for ln in mma)
    assert sum("st.shared::cluster.f32" in ln for ln in lines) == 4 * plan.tiles
    stores = [ln for ln in lines if re.search(r"\bst\.global\.", ln)]
    assert stores and all(".b16" in ln or ".u16" in ln for ln in stores), stores[:3]  # bf16 activations only
    r = kr.resources(str(path), kr.ptxas())
    assert r["threads"] == 128 and r["stack"] == 0
    assert not r["warnings"], r["warnings"]


@pytest.mark.parametrize("splits", [1, 3])
def test_wgmma_projection_compiled_for_sm90a(tmp_path, splits):
    """The warpgroup-mma projection in the MoE tail's form (1/rms per row, accumulate, addend) at 64 tokens, K in
    `splits` (the plan's 1, and 3), compiled in a fresh process that keeps its PTX, then assembled: each stage's
    four `wgmma m64n64k16` on shared-memory descriptors of the 128-byte swizzle, fenced, committed and waited for
    in one block, with no ptxas warning (ptxas warns where it must serialize wgmma); operands staged by 16-byte
    `cp.async` only, with no proxy fence or memory barrier after their wait; the splits' partial sums added through
    the cluster's shared memory (one split: its own, no cluster barrier); 128 threads a warpgroup and no stack."""
    pytest.importorskip("cutlass")
    if kr.ptxas() is None:
        pytest.skip("no ptxas on this machine")
    script = textwrap.dedent("""
        import torch
        from kimi_decode.kernels.gemm_tc import workspace
        from kimi_decode.kernels.gemm_wgmma import WgmmaPlan, compile_wgmma_projection
        plan = WgmmaPlan(64, 7168, 3584, 1, SPLITS, 6)
        w = torch.empty(7168, 3584, dtype=torch.bfloat16)
        compile_wgmma_projection(w, torch.empty(64, 3584, dtype=torch.bfloat16), torch.empty(64, 7168),
                                 workspace(plan, w.device), torch.zeros(plan.groups, dtype=torch.int32),
                                 accumulate=True, addend=torch.empty(64, 7168, dtype=torch.bfloat16),
                                 row_scale=(torch.empty(64, 224), 1e-5), plan=plan)
    """).replace("SPLITS", str(splits))
    env = dict(os.environ, CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=str(tmp_path), KIMI_DECODE_CUTE_ARCH="sm_90a",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True, capture_output=True)
    from kimi_decode.kernels.gemm_wgmma import SBO, SWIZZLE_128B, WgmmaPlan, wgmma_plan_for

    assert wgmma_plan_for(64, 7168, 3584).splits == 1
    plan = WgmmaPlan(64, 7168, 3584, 1, splits, 6)  # the plan the script compiled

    (path,) = tmp_path.glob("*.ptx")
    lines = path.read_text().splitlines()
    mma = [ln for ln in lines if "wgmma.mma_async" in ln]
    assert len(mma) == 4 and all("m64n64k16.f32.bf16.bf16" in ln and "da, db" in ln for ln in mma)
    waits = [ln.strip() for ln in lines if "wgmma.wait_group.sync.aligned" in ln]
    assert waits == ["wgmma.wait_group.sync.aligned 0;"], waits
    assert sum("wgmma.fence.sync.aligned" in ln for ln in lines) == 1
    # both descriptors' high word: 8-row blocks SBO bytes apart in the 128-byte swizzle (the layout the copies fill)
    assert sum(f"mov.b32 hi, {(SBO >> 4) | SWIZZLE_128B};" in ln for ln in lines) == 1
    # no proxy fence or memory barrier in the loop: ptxas makes `fence.proxy.async` a `MEMBAR.ALL.CTA`, which waits
    # for every copy in flight, so each stage waited a whole memory round trip (NOTES item 109)
    assert not any("fence.proxy.async" in ln or "membar" in ln or "fence.sc" in ln for ln in lines)
    copies = [ln for ln in lines if "cp.async." in ln and "commit" not in ln and "wait" not in ln]
    assert copies and all("cp.async.cg.shared.global" in ln and ", 16" in ln for ln in copies), copies[:3]
    # the splits' partial sums meet in shared memory: each accumulator stored into its token's CTA of the cluster,
    # one cluster barrier (release / acquire) after an arrive at the start; no global workspace, counter or fence
    clustered = sum("st.shared::cluster.f32" in ln for ln in lines)
    barriers = [ln.strip() for ln in lines if "barrier.cluster" in ln]
    if splits > 1:
        assert clustered == 4 * plan.tiles
        assert barriers == ["barrier.cluster.arrive.relaxed;", "barrier.cluster.wait;", "barrier.cluster.arrive;",
                            "barrier.cluster.wait;"]
    else:
        assert clustered == 0 and barriers == []
    assert not any(re.search(r"(^|\s)(atom|red)\.", ln) for ln in lines)
    r = kr.resources(str(path), kr.ptxas())
    assert r["threads"] == 128 * plan.wgs and r["stack"] == 0
    assert not r["warnings"], r["warnings"]
