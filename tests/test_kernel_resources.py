"""benchmarks/kernel_resources.py on the CPU: its CTAs-per-SM model against what ncu reported on the H200, the kernel
names it reads from kept PTX files, and a whole run over the grouped expert kernels compiled for sm_90a."""
import os
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
