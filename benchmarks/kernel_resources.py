"""Registers, stack and spills of every CuTe DSL kernel a layer runs, as the installed cutlass-dsl compiles them, and
how many CTAs per SM those registers allow.

    python benchmarks/kernel_resources.py --tp 16 --batch 64        # on the GPU machine: runs one bench step
    python benchmarks/kernel_resources.py --ptx-dir DIR            # any machine: PTX files kept earlier

The register count of a kernel depends on the cutlass-dsl version that emits its PTX: the grouped w13 expert kernel
takes 74 registers under 4.3.5 (the GPU machine's) and 100 under 4.8.1 (CI's), 3 CTAs per SM against 2 (NOTES, v22). So
the counts that explain a timing are the ones taken where it was timed. With `--tp` / `--batch` the script runs
`kimi_decode.bench` for one replay in a subprocess that keeps each compiled kernel's PTX and cubin (`CUTE_DSL_KEEP_PTX`
/ `CUTE_DSL_KEEP_CUBIN`, which cutlass-dsl 4.3 reads and 4.8 still accepts). A kernel whose cubin was kept is read from
it with `cuobjdump --dump-resource-usage` (the code that ran: registers, stack; spills are not listed there, "-");
otherwise its PTX is assembled with `ptxas -v` for sm_90a (on the H200 machine the installed ptxas refuses some of
4.3.5's PTX, hence the cubin; the NUL byte 4.3.5 leaves at the end of a kept PTX file is taken out first). The tools are
looked up on PATH, under CUDA_HOME, /usr/local/cuda and in triton's bundled CUDA tools.

Where `nvdisasm` is found, each kernel's SASS is also read for global loads listed after a global store with no
barrier, fence or atomic between them ("ld>st"; `--orders` lists them). The compiler keeps such a load behind the
store whenever the two may alias as far as it knows, so a load there waits until the store has issued, which waits
for the store's own data: round trips that do not depend on each other run one after another. Each one found on a
kernel's path is worth reading (benchmarks/NOTES.md items 82-84); a loop's next iteration shows up too.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REGS_PER_SMSP = 16384  # an SM's 64K registers, in its four sub-partitions, each holding whole warps
SMSPS = 4
REG_UNIT = 256  # registers are given to a warp in units of 256 (8 per thread)
MAX_WARPS_PER_SM = 64
MAX_CTAS_PER_SM = 32


def ctas_per_sm_by_registers(regs: int, threads: int) -> int:
    """CTAs of `threads` threads at `regs` registers each that fit an SM (H100 / H200) by registers alone: each
    sub-partition holds the warps whose register units fit its 16K registers."""
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    warps = -(-threads // 32)
    resident = min(MAX_WARPS_PER_SM, SMSPS * (REGS_PER_SMSP // per_warp))
    return min(MAX_CTAS_PER_SM, resident // warps)


def cuda_tool(name: str) -> str | None:
    """A CUDA binary tool (`ptxas`, `cuobjdump`): PATH, CUDA_HOME, /usr/local/cuda, or the one triton ships."""
    found = shutil.which(name)
    if found:
        return found
    places = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name), f"/usr/local/cuda/bin/{name}"]
    try:
        import triton

        places.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name))
    except ImportError:
        pass
    return next((p for p in places if os.path.isfile(p) and os.access(p, os.X_OK)), None)


def ptxas() -> str | None:
    """A ptxas to assemble with (`cuda_tool`)."""
    return cuda_tool("ptxas")


def kernel_name(ptx_path: str) -> str:
    """The kernel's module and class from a kept PTX file's name (cutlass-dsl names it after the traced call)."""
    stem = Path(ptx_path).name
    m = re.search(r"kimi_decode_?kernels_?(.+?)_object_at", stem)
    return m.group(1) if m else stem[:60]


SASS_OP = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", re.M)
ORDERING = ("BAR", "MEMBAR", "ATOM", "ATOMG", "RED", "REDG", "ERRBAR", "CCTL", "EXIT", "WARPSYNC")


def loads_after_stores(sass: str) -> list[tuple[str, str]]:
    """(store offset, load offset) for every global load (LDG) listed after a global store (STG) of the same listing
    with no barrier, memory fence, atomic or exit between them, from `nvdisasm -c` output."""
    found, last_store = [], None
    for offset, op, _ in SASS_OP.findall(sass):
        if op == "STG":
            last_store = offset
        elif op in ORDERING:
            last_store = None
        elif op == "LDG" and last_store is not None:
            found.append((last_store, offset))
    return found


def sass_of(cubin_path: str, tool: str) -> str:
    """`nvdisasm -c` of a cubin."""
    out = subprocess.run([tool, "-c", cubin_path], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"nvdisasm failed on {Path(cubin_path).name}: {out.stderr.strip()[-300:]}")
    return out.stdout


def cubin_usage(cubin_path: str, tool: str) -> dict:
    """`cuobjdump --dump-resource-usage` of a cubin holding one kernel: its registers and stack bytes."""
    out = subprocess.run([tool, "--dump-resource-usage", cubin_path], capture_output=True, text=True)
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", out.stdout)
    if out.returncode or not m:
        raise RuntimeError(f"cuobjdump failed on {Path(cubin_path).name}: {(out.stderr or out.stdout).strip()[-300:]}")
    return {"registers": int(m.group(1)), "stack": int(m.group(2)), "spill_stores": None, "spill_loads": None}


def ptxas_usage(ptx_path: str, tool: str, arch: str, disasm: str | None = None) -> dict:
    """`ptxas -v` of one PTX file: registers, stack bytes, spill stores / loads, its warnings (as where it had to
    serialize wgmma); with `disasm` (nvdisasm) also the assembled kernel's `loads_after_stores`."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        raw = Path(ptx_path).read_bytes()
        if b"\0" in raw:  # cutlass-dsl 4.3.5 keeps its PTX with the C string's NUL at the end: ptxas stops there
            ptx_path = os.path.join(tmp, Path(ptx_path).name)
            Path(ptx_path).write_bytes(raw.replace(b"\0", b""))
        out = subprocess.run([tool, f"-arch={arch}", "-v", ptx_path, "-o", cubin], capture_output=True, text=True)
        orders = loads_after_stores(sass_of(cubin, disasm)) if disasm and not out.returncode else None
    if out.returncode:
        raise RuntimeError(f"ptxas failed on {Path(ptx_path).name}: {out.stderr.strip()[-300:]}")

    def number(pattern: str) -> int:
        m = re.search(pattern, out.stderr)
        return int(m.group(1)) if m else 0

    return {"registers": number(r"Used (\d+) registers"), "stack": number(r"(\d+) bytes stack frame"),
            "spill_stores": number(r"(\d+) bytes spill stores"), "spill_loads": number(r"(\d+) bytes spill loads"),
            "loads_after_stores": orders,
            "warnings": [ln.strip() for ln in out.stderr.splitlines() if "warning" in ln.lower()]}


def resources(ptx_path: str, tool: str | None, arch: str = "sm_90a", objdump: str | None = None,
              disasm: str | None = None) -> dict:
    """One kernel's registers, stack bytes, spill stores / loads (None when read from a cubin), threads per CTA
    (from its PTX's .reqntid / .maxntid) and the CTAs per SM those registers allow: from the cubin kept beside the
    PTX when there is one and `objdump` (cuobjdump) is given, else by assembling the PTX with `tool` (ptxas). With
    `disasm` (nvdisasm) also its `loads_after_stores` (else None)."""
    text = Path(ptx_path).read_text()
    ntid = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", text)
    threads = 1
    for dim in (ntid.groups() if ntid else ()):
        threads *= int(dim or 1)
    cubin = Path(ptx_path).with_suffix(".cubin")
    if objdump and cubin.is_file():
        usage = cubin_usage(str(cubin), objdump)
        usage["loads_after_stores"] = loads_after_stores(sass_of(str(cubin), disasm)) if disasm else None
    elif tool:
        usage = ptxas_usage(ptx_path, tool, arch, disasm)
    else:
        raise RuntimeError(f"no cubin beside {Path(ptx_path).name} and no ptxas to assemble it")
    return {"kernel": kernel_name(ptx_path), "threads": threads if ntid else None, **usage,
            "ctas_per_sm": ctas_per_sm_by_registers(usage["registers"], threads) if ntid else None}


def keep_layer_ptx(tp: int, batch: int, out_dir: str) -> None:
    """One bench step of layer 1 (latency_specialized) with every compiled kernel's PTX and cubin kept in `out_dir`."""
    env = dict(os.environ, CUTE_DSL_KEEP_PTX="1", CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_DUMP_DIR=out_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                      env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "kimi_decode.bench", "--backend", "latency_specialized", "--tp", str(tp), "--batch",
           str(batch), "--layers", "1", "--copies", "1", "--replays", "1", "--warmup", "1"]
    done = subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the bench step failed: {done.stderr.strip()[-300:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, help="run one bench step at this shard (GPU machine)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ptx-dir", help="summarise the .ptx files here instead")
    p.add_argument("--orders", action="store_true",
                   help="also list each global load after a global store (SASS offsets, store -> load)")
    a = p.parse_args(argv)
    if (a.tp is None) == (a.ptx_dir is None):
        p.error("give --tp (with --batch) or --ptx-dir")
    tool, objdump, disasm = ptxas(), cuda_tool("cuobjdump"), cuda_tool("nvdisasm")
    if tool is None and objdump is None:
        print("kernel_resources: no ptxas or cuobjdump found (PATH, CUDA_HOME, /usr/local/cuda, triton)",
              file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        where = a.ptx_dir or tmp
        try:
            if a.ptx_dir is None:
                keep_layer_ptx(a.tp, a.batch, tmp)
            rows = [resources(f, tool, objdump=objdump, disasm=disasm)
                    for f in sorted(glob.glob(os.path.join(where, "**", "*.ptx"), recursive=True))]
        except RuntimeError as e:
            print(f"kernel_resources: {e}", file=sys.stderr)
            return 1
    if not rows:
        print(f"kernel_resources: no .ptx files in {where}", file=sys.stderr)
        return 1
    print(f"{'kernel':<44} {'threads':>7} {'regs':>5} {'stack':>6} {'spill st/ld':>12} {'CTAs/SM':>8} {'ld>st':>6}")
    for r in rows:
        spills = "-" if r["spill_stores"] is None else f"{r['spill_stores']}/{r['spill_loads']}"
        orders = r["loads_after_stores"]
        print(f"{r['kernel'][:44]:<44} {r['threads'] or '?':>7} {r['registers']:>5} {r['stack']:>6} "
              f"{spills:>12} {r['ctas_per_sm'] or '?':>8} {'-' if orders is None else len(orders):>6}")
        if a.orders and orders:
            print("    " + ", ".join(f"{st} -> {ld}" for st, ld in orders))
    return 0


if __name__ == "__main__":
    sys.exit(main())
