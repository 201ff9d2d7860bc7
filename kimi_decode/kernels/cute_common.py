"""Shared host plumbing of the CuTe DSL kernels: availability, compile cache, torch tensors in, current stream.

Kernels are compiled once per shape key against fake tensors (so the same code path compiles for `sm_90a` on a
machine without a GPU), cached in-process, and launched on the current torch stream so CUDA graphs capture them.

Programmatic dependent launch (PDL): a kernel compiled with `pdl_enabled()` (KIMI_DECODE_PDL: "auto", the default,
where the backend asks for it with `set_layer_pdl`; "1" everywhere; "0" nowhere) is launched with programmatic stream
serialisation. It may load or prefetch what does not depend on the previous kernel (weights, state), waits for the
previous kernel's results (`pdl_wait`), and then lets the next kernel launch (`pdl_trigger()` "wait", the default). So
at most one kernel runs ahead of the one that is working, and whatever was written two or more kernels back may be
read before the wait (`pdl_reads_ahead()`). `KIMI_DECODE_PDL_TRIGGER=start` lets the next kernel launch at each
kernel's very start instead (`pdl_launch_dependents`), the first form measured: a chain of small kernels can then
launch many kernels ahead, each holding SM slots and asking L2 for its weights. After a kernel that does not take part
(Triton, cuBLAS, NCCL) the wait returns at once. For A/B runs, `KIMI_DECODE_PDL_SKIP` names kernels launched without
PDL (default: the w13 expert kernel with the shared experts' gate/up CTAs; "moe_w13_act,moe_w13_act_shared" is the
form before v38, the plain w13 kernel without PDL too) and `KIMI_DECODE_PDL_PREFETCH_ITERS` how much of its rows a
GEMV asks of L2 before the wait (default none).

"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

try:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack, make_fake_stream, make_fake_tensor

    try:
        from cuda.bindings import driver as cuda_driver
    except ImportError:  # older cuda-python layout
        from cuda import cuda as cuda_driver
    HAVE_CUTE = True
except ImportError:  # the `kernels` extra is not installed
    cutlass = cute = cuda_driver = None
    HAVE_CUTE = False

_TORCH_TO_CUTE = {}
if HAVE_CUTE:
    _TORCH_TO_CUTE = {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32,
                      torch.float16: cutlass.Float16, torch.int32: cutlass.Int32, torch.uint8: cutlass.Uint8}

_cache: dict[tuple, Callable] = {}
DEFAULT_SMS = 132  # H100 / H200: the SM count kernels are planned for when compiled without a GPU


def sm_count(device: torch.device | None = None) -> int:
    """SMs of the CUDA `device` (None: the current one), or DEFAULT_SMS without one (a CPU tensor, no GPU)."""
    if device is None:
        if not torch.cuda.is_available():
            return DEFAULT_SMS
        return _sm_count(torch.cuda.current_device())
    if device.type != "cuda":
        return DEFAULT_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


PDL_SETTINGS = ("auto", "0", "1")
PDL_TRIGGERS = ("wait", "start")
# GEMV loop iterations of weights asked of L2 before the wait (`SmallBatchGemv.project`): none by default, since on the
# H200 at TP16 batch 1 4 / 8 iterations made the layer 1.4-1.5 / 3.5-4.1 us slower (TP8: within 1 us; NOTES, v14)
PDL_PREFETCH_ITERS = 0
# kernels launched without PDL by default: the w13 expert kernel with the shared experts' gate/up CTAs (the
# `KIMI_DECODE_SHARED_GLU_IN=w13` placement). The plain w13 kernel was on this list from v14 (its CTAs, launched early,
# took 2.6 us longer after the entry kernel at TP16 batch 1 then) to v38, when under PDL it measured 0.1-0.9 us faster
# per KDA layer at batch 1 on both shards in three paired runs (NOTES, items 74 and 75)
PDL_SKIP = "moe_w13_act_shared"
# the PDL choices of the kernel being compiled (read while its code is traced), and the layer's wish (`set_layer_pdl`)
_pdl_mode = {"trigger": "wait", "prefetch": PDL_PREFETCH_ITERS, "layer": False}


def env_choice(name: str, default: str, allowed: tuple) -> str:
    """The environment variable `name` (`default` when unset), refused by name unless it is one of `allowed`."""
    value = os.environ.get(name, default)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    return value


def env_flag(name: str, default: str) -> bool:
    """The on/off environment variable `name`: "1" on, "0" off (`default` when unset), anything else refused by name."""
    return env_choice(name, default, ("0", "1")) == "1"


def env_int(name: str, default: int, lo: int, hi: int, what: str) -> int:
    """The environment variable `name` as a whole number (`default` when unset), refused by name unless it lies in
    lo..hi; `what` says what it counts, for the message."""
    raw = os.environ.get(name, str(default))
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise ValueError(f"{name} must be {what} in {lo}..{hi}, not {raw!r}")
    return int(raw)


def pdl_setting() -> str:
    """KIMI_DECODE_PDL: "1" every kernel under PDL, "0" none, "auto" (default) where the backend asks for it for the
    layer it runs (`set_layer_pdl`)."""
    return env_choice("KIMI_DECODE_PDL", "auto", PDL_SETTINGS)


def mx_alu() -> bool:
    """KIMI_DECODE_MX_ALU: whether the MXFP4 expert kernels move integer work from the ALU pipe, where their mma loops
    are bound at batches 8 to 64, to the multiply-add pipe ("1"): the dequantisation's right shift as a `mul.hi`
    (`moe_mxfp4._DEQUANT`), and each ue8m0 scale byte taken out of its word and turned into an fp32 by one mask and
    one `mad` (`moe_mxfp4.mx_scale_of`) instead of a shift, a mask, an add and a shift. The same bits either way.
    "0", the default, keeps the ALU forms: on the H200 "1" measured slower per layer above batch 1 (+2.1 / +2.3 us at
    batch 8, +5.2 / +0.6 at batch 64, TP16 / TP8) and even at batch 1 (benchmarks/NOTES.md, item 40)."""
    return env_flag("KIMI_DECODE_MX_ALU", "0")


def mx_packed() -> bool:
    """KIMI_DECODE_MX_PACKED: whether the MXFP4 expert kernels dequantise quad-major codes (`moe_mxfp4.quad_major`,
    whose copy then also moves each byte's two codes into the fields the dequantisation wants) in 9 instructions per
    word of 8 codes ("1", the default: on the H200 0 to 8 us faster per layer at batches 1 to 64, benchmarks/NOTES.md
    item 56) or in 11 ("0", for A/B runs). The same values either way."""
    return env_flag("KIMI_DECODE_MX_PACKED", "1")


def norm_weight_first(tokens: int) -> bool:
    """KIMI_DECODE_NORM_W_FIRST: where the norm kernels (`rmsnorm.RMSNormRows`, `RoutedNorm`, `RoutedNormSplit`), and
    the w2 expert kernels that write the norm's scaled input (`moe_mxfp4.MoEW2Sum`, `scaled`), load the norm weight
    for a batch of `tokens`: "1" into registers before their first store (the split and row forms and the w2 kernels
    before their PDL wait, the 1024-thread `RoutedNorm`, whose registers its pair loads need, after those); "0" next
    to the stores that use it. As far as the compiler knows each output store may alias the weight, so with "0"
    every weight load is issued only after the store before it: one round trip per value (4 per thread in the routed
    forms, 14 in the row form at the latent width, 2 in the w2 kernels), one after another. "auto", the default:
    "1" at one token, else "0". On the H200 "1" was 0.7-1.1 us faster per KDA layer at batch 1 at TP16 and
    1.6-1.7 at TP8, even at batch 64 and at TP8 batch 8, and 2.3-2.8 us slower at TP16 batch 8, where the per-pair
    w2 kernel writes the scaled input for 8 tokens (benchmarks/NOTES.md, item 86)."""
    raw = env_choice("KIMI_DECODE_NORM_W_FIRST", "auto", ("auto", "0", "1"))
    return tokens == 1 if raw == "auto" else raw == "1"


def set_layer_pdl(on: bool) -> None:
    """The backend's choice for the kernels of the layer it is about to run (under KIMI_DECODE_PDL=auto)."""
    _pdl_mode["layer"] = bool(on)


def pdl_enabled() -> bool:
    setting = pdl_setting()
    return setting == "1" or (setting == "auto" and _pdl_mode["layer"])


def pdl_trigger() -> str:
    """Where a kernel lets the next one launch under PDL: "wait" (after its own wait) or "start"."""
    return env_choice("KIMI_DECODE_PDL_TRIGGER", "wait", PDL_TRIGGERS)


def pdl_skipped() -> frozenset:
    """Kernels (by compile-key name, KIMI_DECODE_PDL_SKIP, comma-separated; default PDL_SKIP, empty for none)
    launched without PDL: they start after the kernel before them has finished, and still let the next one launch
    early."""
    return frozenset(n for n in os.environ.get("KIMI_DECODE_PDL_SKIP", PDL_SKIP).split(",") if n)


def pdl_prefetch_iters() -> int:
    """GEMV weight iterations asked of L2 before the PDL wait (KIMI_DECODE_PDL_PREFETCH_ITERS, default
    PDL_PREFETCH_ITERS)."""
    return env_int("KIMI_DECODE_PDL_PREFETCH_ITERS", PDL_PREFETCH_ITERS, 0, 1024, "loop iterations")


def pdl_reads_ahead() -> bool:
    """Whether the kernel being compiled may read, before its PDL wait, what kernels two or more back wrote: true when
    every kernel lets the next launch only after its own wait (so the one before the previous has finished)."""
    return _pdl_mode["trigger"] == "wait"


def gemv_prefetch_iters() -> int:
    """`PDL_PREFETCH_ITERS` as set for the kernel being compiled."""
    return _pdl_mode["prefetch"]


def cute_dtype(dtype: torch.dtype):
    return _TORCH_TO_CUTE[dtype]


def fake_like(t: torch.Tensor, align: int = 16):
    """A fake CuTe tensor with `t`'s dtype, shape and strides (static), for compiling without data."""
    return make_fake_tensor(cute_dtype(t.dtype), tuple(t.shape), stride=tuple(t.stride()), assumed_align=align)


def signature(*tensors: torch.Tensor) -> tuple:
    return tuple((t.dtype, tuple(t.shape), tuple(t.stride())) for t in tensors)


def target_arch() -> str | None:
    """`--gpu-arch` for cross-compiling (CI: KIMI_DECODE_CUTE_ARCH=sm_90a); None compiles for the GPU in use."""
    return os.environ.get("KIMI_DECODE_CUTE_ARCH")


def compile_kernel(key: tuple, op, *fake_args):
    """Compile `op` for `fake_args` once per `key` (cached in-process). `op.pdl` (the kernel takes part in PDL) is set
    from `pdl_enabled()`, `op.pdl_launch` (it is launched as a PDL dependent) from that and `pdl_skipped()`, the
    trigger's place from `pdl_trigger()` and the GEMVs' L2 requests before the wait from `pdl_prefetch_iters()`; the
    key carries `mx_alu()` and `mx_packed()`, which the expert kernels' instruction forms follow."""
    op.pdl = pdl_enabled()
    op.pdl_launch = op.pdl and key[0] not in pdl_skipped()
    mode = (pdl_trigger(), pdl_prefetch_iters()) if op.pdl else ("wait", PDL_PREFETCH_ITERS)
    key = (*key, op.pdl, op.pdl_launch, mode, mx_alu(), mx_packed())
    fn = _cache.get(key)
    if fn is None:
        arch = target_arch()
        opts = {"options": f"--gpu-arch {arch}"} if arch else {}
        _pdl_mode["trigger"], _pdl_mode["prefetch"] = mode
        try:
            fn = _cache[key] = cute.compile(op, *fake_args, make_fake_stream(), **opts)
        finally:
            _pdl_mode["trigger"], _pdl_mode["prefetch"] = "wait", PDL_PREFETCH_ITERS
    return fn


def launch(fn, *tensors: torch.Tensor, align: int | Callable[[torch.Tensor], int] = 16) -> None:
    """Run a compiled kernel on torch tensors, on the current torch stream (capturable by CUDA graphs).

    `align` must be the alignment the kernel was compiled for (see `fake_like`): one for all tensors, or a function
    of the tensor.
    """
    stream = cuda_driver.CUstream(torch.cuda.current_stream().cuda_stream)
    fn(*(from_dlpack(t, assumed_align=align(t) if callable(align) else align) for t in tensors), stream)


if HAVE_CUTE:
    from cutlass._mlir.dialects import llvm as _llvm
    from cutlass.cute.nvgpu import cpasync

    def prefetch_l2(tensor) -> None:
        """Ask L2 for the 128-byte line holding `tensor`'s first element (global memory)."""
        _llvm.inline_asm(None, [tensor.iterator.toint().ir_value()], "prefetch.global.L2 [$0];", "l",
                         has_side_effects=True, is_align_stack=False, asm_dialect=_llvm.AsmDialect.AD_ATT)

    def bulk_prefetch_l2(tensor, nbytes) -> None:
        """Ask L2 for `nbytes` (a multiple of 16) from `tensor`'s first element on (global memory, 16-byte aligned),
        as one bulk request to the SM's copy engine; nothing comes back to the thread."""
        _llvm.inline_asm(None, [tensor.iterator.toint().ir_value(), cutlass.Int32(nbytes).ir_value()],
                         "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", has_side_effects=True,
                         is_align_stack=False, asm_dialect=_llvm.AsmDialect.AD_ATT)

    def sigmoid(x):
        """1 / (1 + exp(-x)) on an fp32 value."""
        return cutlass.Float32(1.0) / (cutlass.Float32(1.0) + cute.math.exp(cutlass.Float32(0.0) - cutlass.Float32(x)))

    def situ_glu(g, u):
        """SiTU-GLU of a gate and an up value (fp32): 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25)."""
        F = cutlass.Float32
        gate = F(4.0) * cute.math.tanh(g * F(0.25)) / (F(1.0) + cute.math.exp(F(0.0) - g))
        return gate * (F(25.0) * cute.math.tanh(u * F(0.04)))

    def mma_lanes(tidx):
        """Thread `tidx`'s warp and lane and its place in an `mma.sync` fragment: (warp, lane, g, t) with g = lane // 4
        (rows g and g + 8 of A, column g of B) and t = lane % 4 (its k-slots)."""
        warp = tidx // 32
        lane = tidx % 32
        return warp, lane, lane // 4, lane % 4

    @cute.jit
    def load4(tile: cute.Tensor):
        """A (small, contiguous) global or shared tile copied into registers, returned as a register tensor."""
        r = cute.make_rmem_tensor_like(tile)
        cute.autovec_copy(tile, r)
        return r

    def pdl_launch_dependents(pdl: bool) -> None:
        """A kernel's start: with the "start" trigger, let the next kernel launch now."""
        if pdl and _pdl_mode["trigger"] == "start":
            cute.arch.griddepcontrol_launch_dependents()

    def pdl_wait(pdl: bool, trigger: bool = True) -> None:
        """Wait for the previous kernel's results; with the "wait" trigger, then let the next kernel launch, unless
        `trigger` is false: the kernel then does so itself later (`cute.arch.griddepcontrol_launch_dependents`)."""
        if pdl:
            cute.arch.griddepcontrol_wait()
            if trigger and _pdl_mode["trigger"] == "wait":
                cute.arch.griddepcontrol_launch_dependents()

    def _copy_async(src: cute.Tensor, dst: cute.Tensor, nbits: int, cache_mode) -> None:
        """One `cp.async` of `nbits` from the start of global tile `src` to the start of shared tile `dst` (one
        element type, both aligned to the copy's size)."""
        n = nbits // src.element_type.width
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cache_mode), src.element_type, num_bits_per_copy=nbits)
        cute.copy(atom, cute.make_tensor(src.iterator, cute.make_layout(n)),
                  cute.make_tensor(dst.iterator, cute.make_layout(n)))

    def copy_async_16(src: cute.Tensor, dst: cute.Tensor) -> None:
        """One 16-byte `cp.async` (cached in L2 only) from the start of global tile `src` to the start of shared tile
        `dst` (both 16-byte aligned, of one element type); the thread commits its copies with
        `cute.arch.cp_async_commit_group` and waits for them with `cute.arch.cp_async_wait_group`."""
        _copy_async(src, dst, 128, cpasync.LoadCacheMode.GLOBAL)

    def copy_async_words(src: cute.Tensor, dst: cute.Tensor, words: int = 1) -> None:
        """`copy_async_16` for 1 or 2 32-bit elements (4 or 8 bytes, aligned to their size; `cp.async.ca`: the
        16-byte form is the only one that may skip L1)."""
        _copy_async(src, dst, 32 * words, cpasync.LoadCacheMode.ALWAYS)

    def _element(tensor, index):
        """A pointer to `tensor`'s element `index` (its iterator itself for a constant 0)."""
        return tensor.iterator if isinstance(index, int) and index == 0 else tensor.iterator + index

    def atomic_add_u32(tensor, value, index=0):
        """atom.add.u32 on `tensor`'s element `index`, in global or shared memory as the tensor lies (a shared
        address is 32 bits wide); returns the old value."""
        addr = _element(tensor, index).toint()
        space, width = ("shared", "r") if isinstance(addr, cutlass.Int32) else ("global", "l")
        return cutlass.Int32(_llvm.inline_asm(
            cutlass.Int32.mlir_type, [addr.ir_value(), cutlass.Int32(value).ir_value()],
            f"atom.{space}.add.u32 $0, [$1], $2;", f"=r,{width},r", has_side_effects=True, is_align_stack=False,
            asm_dialect=_llvm.AsmDialect.AD_ATT))

    @cute.jit
    def last_cta(counter: cute.Tensor, flag: cute.Tensor, tidx, n_ctas, index=0):
        """Called by every thread of every CTA once its results are stored: 1 in the CTA that finishes last (which may
        then read what all the others wrote), else 0. `counter[index]` is an int32 in global memory that is 0 at
        launch and that `n_ctas` CTAs count on (several groups of CTAs may each have their own, `index` being the
        group's); the last CTA sets it back to 0, so a kernel in a CUDA graph replays without a memset. `flag` is one
        int32 of shared memory. The ordering is the grid-sync one: CTA barrier, a gpu-scope fence and the atomic by one
        thread, a barrier, and a fence in every thread of the last CTA before it reads."""
        cute.arch.barrier()
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            old = atomic_add_u32(counter, 1, index)
            last = cutlass.Int32(0)
            if old == n_ctas - 1:
                last = cutlass.Int32(1)
                counter[index] = cutlass.Int32(0)
            flag[0] = last
        cute.arch.barrier()
        is_last = flag[0]
        if is_last != 0:
            cute.arch.fence_acq_rel_gpu()
        return is_last

    def store_cluster_f32(tensor, index, rank, value) -> None:
        """tensor[index] = value (fp32) in the shared memory of CTA `rank` of this thread's cluster: `tensor` is this
        CTA's own copy of a shared buffer that every CTA of the cluster allocates alike (`mapa` maps the address).
        Ordered for the peer by a cluster barrier (`cute.arch.cluster_arrive`, release, then its `cluster_wait`)."""
        addr = _element(tensor, index).toint()
        _llvm.inline_asm(None, [addr.ir_value(), cutlass.Int32(rank).ir_value(), cutlass.Float32(value).ir_value()],
                         "{\n .reg .u32 ra;\n mapa.shared::cluster.u32 ra, $0, $1;\n st.shared::cluster.f32 [ra], $2;\n}",
                         "r,r,f", has_side_effects=True, is_align_stack=False, asm_dialect=_llvm.AsmDialect.AD_ATT)

    def load_acquire(counter: cute.Tensor, index=0):
        """counter[index] (an int32 in global memory) read with acquire ordering at gpu scope, without waiting: what
        the thread that released it stored before is then visible to this thread."""
        return cutlass.Int32(_llvm.inline_asm(
            cutlass.Int32.mlir_type, [_element(counter, index).toint().ir_value()], "ld.acquire.gpu.global.u32 $0, [$1];", "=r,l",
            has_side_effects=True, is_align_stack=False, asm_dialect=_llvm.AsmDialect.AD_ATT))

    _WAIT_ASM = ("{\n .reg .pred p;\n .reg .u32 v;\n WAIT:\n ld.acquire.gpu.global.u32 v, [$0];\n"
                 " setp.ge.u32 p, v, $1;\n @p bra DONE;\n nanosleep.u32 32;\n bra WAIT;\n DONE:\n}")

    def _wait_at_least(counter, index, target) -> None:
        """Spin in this thread until counter[index] >= target (an acquire load per poll, a short sleep between)."""
        _llvm.inline_asm(None, [_element(counter, index).toint().ir_value(), cutlass.Int32(target).ir_value()],
                         _WAIT_ASM, "l,r", has_side_effects=True, is_align_stack=False,
                         asm_dialect=_llvm.AsmDialect.AD_ATT)

    # Two dependent stages in one kernel. Each CTA takes a ticket (the order CTAs start in) and the ticket, not the
    # block index, says what it does: tickets below the first stage's CTA count run the first stage, the others the
    # second. A second-stage CTA may wait for first-stage results (`wait_count`): every first-stage ticket was taken
    # before it, by a CTA that is running and waits for nothing, so the wait always ends, whatever order the
    # hardware starts CTAs in and however few fit at once. The counters live in one int32 tensor that is 0 at
    # launch; the last second-stage CTA sets them back to 0 (`last_cta` on its own index), so the kernel replays in a
    # CUDA graph as it is.
    @cute.jit
    def take_ticket(counter: cute.Tensor, slot: cute.Tensor, tidx):
        """This CTA's ticket, from counter[0] (`slot`: one int32 of shared memory)."""
        if tidx == 0:
            slot[0] = atomic_add_u32(counter, 1, 0)
        cute.arch.barrier()
        return slot[0]

    @cute.jit
    def count_done(counter: cute.Tensor, index, tidx):
        """Called by every thread of a CTA once its results are stored: counter[index] += 1, ordered after them."""
        cute.arch.barrier()
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            atomic_add_u32(counter, 1, index)

    @cute.jit
    def wait_count(counter: cute.Tensor, index, target, tidx):
        """Every thread of the CTA waits until counter[index] >= target; what the counted CTAs stored before
        `count_done` is then visible to it."""
        if tidx == 0:
            _wait_at_least(counter, index, target)
            cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()

