#!/usr/bin/env bash
# A device session on the H200 within one command's limit: the named steps, in the order given, each with its own
# time limit (never past BUDGET seconds in all); the log and the results go to $OUT.
#   source .devsite/activate.sh && bash benchmarks/run_h200.sh BUDGET STEP...
# Steps: numerics (every latency_specialized GPU test, on NUMERICS_WORKERS pytest-xdist workers, default 9: all 754
# in 362 s on an H100, benchmarks/NOTES.md item 124), bench (both backends, TP16/TP8, batch 1 and 8), bench64 (the
# same at batch 64), fidelity (benchmarks/capture_fidelity.py), captures (latency_specialized TP16/TP8 batch 1 into
# $OUT), sweep (benchmarks/projection_sweep.py), captures-batch (both backends, TP16, at each of CAPTURE_BATCHES, default 8 64), capture-tests (tests/test_capture_gpu.py), dist1 (kimi_decode.dist_bench on one GPU), serial (latency_specialized
# with KIMI_DECODE_OVERLAP=0: the MoE block on one stream), noprefetch / prefetch12 / prefetch40 (latency_specialized with
# KIMI_DECODE_PREFETCH_MB=0 / 12 / 40), glu (the shared experts' gate/up GEMV with and without
# its SiTU-GLU epilogue, KIMI_DECODE_SHARED_GLU=0), tcplain (latency_specialized with KIMI_DECODE_TC_PLAIN=1, batch 8 and 16), router
# (latency_specialized at batch 1 with KIMI_DECODE_FUSED_ROUTER=0: router GEMV and top-k as two kernels), ores (the same
# with KIMI_DECODE_FUSED_O_RES=0: output projection and AttnRes as two kernels), numerics-new
# (the GPU tests of the kernels and switches added last, `-k "$NEW_TESTS"`, in NEW_FILES, default
# tests/test_kimi_specialized_gpu.py), experts (benchmarks/expert_sweep.py),
# experts-tiles (the grouped kernels at 4 and 1 row tiles per warp), ncu-experts (ncu sections of the grouped
# expert kernels at TP16 batch 64), noentry (latency_specialized at batch 1 with KIMI_DECODE_MOE_ENTRY=0: router and
# latent down-projection as two kernels), nogate (batch 1 and 8 with KIMI_DECODE_FUSED_GATE=0: the f_b GEMV on its own),
# oneexperts / oneshared / eight (the two-stage expert and shared-expert kernels, each and both), sharedown (batch 1
# with the shared experts as kernels of their own, not CTAs in the expert kernels), pdl / pdlstart / pdleight (PDL at
# every batch with the trigger after each kernel's wait, at its start, and with the shared experts inside at both
# shards), nopdl / pdlskip13 / pdliters / pdlall (batch 1 without PDL, with the w13 kernel launched without it and 4
# iterations of L2 requests before the wait, with w13 under PDL and 0 / 8 iterations, with w13 under PDL), special
# (latency_specialized alone), pdlcombo (the w13 kernel without PDL and no L2 requests before the wait: the
# defaults), pdl8iters0 (batch 8 under PDL without them), statelate (the KDA kernel's state loaded after the conv),
# captures-pdl (the batch-1 captures with PDL), kdasplit (the KDA kernel at the thread splits KDA_SPLITS, default 1 8),
# captures-pdl8 (TP8 batch 8 with KIMI_DECODE_PDL=1 and 0), pdl8 (batch 8 under PDL, the w2 weights after / before
# the wait), w2late (batch 1, the w2 weights after the wait),
# oprojlate (batch 1, the output projection's first rows after the wait), ab (latency_specialized once per setting
# in AB_ENVS), capture-ab (a capture per setting in AB_ENVS, at CAPTURE_BATCH, default 1), w13warps (batch 1 and 8, the w13 kernel on
# W13_WARPS warps, default 4), epilate (batch 1 and 8, the GEMV epilogue's reads after the loop), ncu-b1 (ncu sections of the KDA, o_proj + AttnRes and expert kernels, or NCU_KERNELS, at batch NCU_BATCH (default 1),
# TP NCU_TP, default 8), chain (benchmarks/stream_chain.py at CHAIN_BATCHES, default 1), resources
# (benchmarks/kernel_resources.py at RES_TP x RES_BATCHES: each kernel's registers under the machine's cutlass-dsl),
# v24 (the A/B runs of benchmarks/NOTES.md items 35 and 36: KIMI_DECODE_GROUPED_ALIGN, KIMI_DECODE_W13_FIRST),
# v25 (item 38: KIMI_DECODE_W2_COMPACT at TP16, both backends beside the new setting), v26 (items 40 and 41:
# KIMI_DECODE_MX_ALU, KIMI_DECODE_ENTRY_PREFETCH).
# AB_LIMIT: seconds per ab setting (default 70). PACK=NAME: at the end, every file under $OUT goes into $OUT/NAME.tgz
# and the rest is removed (the device tool brings back at most 8 files).
set -u
# The device bundle has no msgspec (the Kineto JSON reader's decoder, which torch.profiler captures and their tests
# need); pytest-xdist (the numerics step's workers) comes the same way: carry their wheels unpacked at .whl/site
# (`pip download msgspec --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl/dl &&
# pip download pytest-xdist execnet --no-deps --only-binary=:all: -d .whl/dl &&
# for w in .whl/dl/*.whl; do python3 -m zipfile -e "$w" .whl/site; done`, carry ".whl").
if [ -d .whl/site ]; then export PYTHONPATH="$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}"; fi
OUT="${OUT:-runs/h200}"
mkdir -p "$OUT"
BUDGET="${1:-540}"
shift
LOG="$OUT/log.txt"
end=$((SECONDS + BUDGET))

step() {  # step NAME SECONDS COMMAND...
  local name=$1 want=$2
  shift 2
  local left=$((end - SECONDS))
  if [ "$left" -lt 20 ]; then echo "## $name: skipped (no time left)" | tee -a "$LOG"; return 1; fi
  [ "$want" -gt "$left" ] && want=$left
  echo "## $name (limit ${want}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 5 "$want" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "## $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  return $rc
}

export_setting() {  # export_setting "NAME=VALUE[,NAME=VALUE]": each NAME=VALUE (values may hold commas)
  local kv
  for kv in $(echo "$1" | sed 's/,\([A-Z_][A-Z0-9_]*=\)/ \1/g'); do export "$kv"; done
}

bench() {  # bench NAME SECONDS JSON ARGS...
  local name=$1 want=$2 json=$3
  shift 3
  step "$name" "$want" python3 -m kimi_decode.bench --copies 3 --replays 100 --json "$OUT/$json" "$@"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv >>"$LOG" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$LOG" 2>&1
pip list 2>/dev/null | grep -i cutlass >>"$LOG"

for name in "$@"; do
  case "$name" in
    numerics)
      step numerics 450 python3 -m pytest -q -p no:cacheprovider -n "${NUMERICS_WORKERS:-9}" --durations=10 \
        tests/test_kimi_specialized_gpu.py ;;
    numerics-new)
      step numerics-new ${NEW_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider \
        ${NEW_FILES:-tests/test_kimi_specialized_gpu.py} -k "${NEW_TESTS:-router}" ;;
    router)
      KIMI_DECODE_FUSED_ROUTER=0 bench router 90 bench_router2.json --backend latency_specialized --tp 16 8 --batch 1 ;;
    ores)
      KIMI_DECODE_FUSED_O_RES=0 bench ores 90 bench_ores2.json --backend latency_specialized --tp 16 8 --batch 1 ;;
    bench)
      bench bench 200 bench.json --backend auto latency_specialized --tp 16 8 --batch ${BENCH_BATCHES:-1 8} ;;
    bench64)
      bench bench64 150 bench64.json --backend auto latency_specialized --tp 16 8 --batch 64 ;;
    fidelity)
      step fidelity 180 python3 benchmarks/capture_fidelity.py --backend auto --tp 16 --batch 1 --layers 4 \
        --steps 50 --out-dir /tmp/fidelity
      sed -n '/^# kprof capture fidelity/,/^## fidelity: rc/p' "$LOG" >"$OUT/fidelity.txt" ;;
    captures)
      for tp in 16 8; do
        step "capture latency_specialized tp$tp" 60 python3 -m profiler.cli capture --backend latency_specialized \
          --tp "$tp" --batch 1 --layers 4 --context 8192 --steps 50 --profiler cupti \
          -o "$OUT/latency_specialized_tp${tp}_b1.kprof"
      done ;;
    sweep)  # the projections alone: cuBLAS, GEMV and tensor-core tilings by rows (benchmarks/projection_sweep.py)
      step sweep ${SWEEP_LIMIT:-240} python3 benchmarks/projection_sweep.py --tp ${SWEEP_TP:-16 8} --rows ${SWEEP_ROWS:-1 2 4 8 16 64} \
        --plans ${SWEEP_PLANS:-8 64} ${SWEEP_PROJ:+--projections $SWEEP_PROJ} \
        ${SWEEP_VARIANTS:+--variants $SWEEP_VARIANTS} --blas ${SWEEP_BLAS:-cublas} --json "$OUT/sweep${SWEEP_TAG:-}.json" ;;
    captures-batch)  # both backends at each batch of CAPTURE_BATCHES (default 8 64), TP16, for per-stage tables
      for b in ${CAPTURE_BATCHES:-8 64}; do
        for be in auto latency_specialized; do
          step "capture $be tp16 b$b" 90 python3 -m profiler.cli capture --backend "$be" --tp 16 --batch "$b" \
            --layers 4 --context 8192 --steps 20 --profiler cupti -o "$OUT/${be}_tp16_b${b}.kprof"
        done
      done ;;
    capture-tests)
      step capture-tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_capture_gpu.py ;;
    dist1)
      step dist1 120 python3 -m kimi_decode.dist_bench --world 1 --batch 1 --layers 2 --copies 1 --replays 20 \
        --trace-dir /tmp/dist --trace-steps 5 --deadline 110 --json "$OUT/dist1.json" ;;
    serial)
      KIMI_DECODE_OVERLAP=0 bench serial 120 bench_serial.json --backend latency_specialized --tp 16 8 --batch 1 8 ;;
    noprefetch)
      KIMI_DECODE_PREFETCH_MB=0 bench noprefetch 90 bench_noprefetch.json --backend latency_specialized --tp 16 8 --batch 1 8 ;;
    prefetch40)
      KIMI_DECODE_PREFETCH_MB=40 bench prefetch40 90 bench_prefetch40.json --backend latency_specialized --tp 16 8 --batch 1 ;;
    prefetch12)
      KIMI_DECODE_PREFETCH_MB=12 bench prefetch12 90 bench_prefetch12.json --backend latency_specialized --tp 16 8 --batch 1 ;;
    glu)
      KIMI_DECODE_PREFETCH_MB=0 bench glu 90 bench_glu.json --backend latency_specialized --tp 16 8 --batch 1 4 8
      KIMI_DECODE_PREFETCH_MB=0 KIMI_DECODE_SHARED_GLU=0 bench noglu 90 bench_noglu.json --backend latency_specialized \
        --tp 16 8 --batch 1 4 8 ;;
    tcplain)  # every plain projection and the MoE tail on the tensor-core kernel, up to 16 rows
      KIMI_DECODE_TC_PLAIN=1 KIMI_DECODE_TC_MAX_ROWS=16 bench tcplain 90 bench_tcplain.json \
        --backend latency_specialized --tp 16 8 --batch 8 16 ;;
    noentry)  # batch 1 with the router beside the latent down-projection (two kernels, two streams)
      KIMI_DECODE_MOE_ENTRY=0 bench noentry 90 bench_noentry.json --backend latency_specialized --tp 16 8 --batch 1 ;;
    nogate)  # batch 1 and 8 with the decay gate's f_b GEMV as its own kernel
      KIMI_DECODE_FUSED_GATE=0 bench nogate 120 bench_nogate.json --backend latency_specialized --tp 16 8 --batch 1 8 ;;
    oneexperts)  # batch 1 and 8 with the per-pair expert stages as one kernel (KIMI_DECODE_EXPERTS_ONE_KERNEL=1)
      KIMI_DECODE_EXPERTS_ONE_KERNEL=1 bench oneexperts 90 bench_oneexperts.json --backend latency_specialized \
        --tp 16 8 --batch 1 8 ;;
    oneshared)  # batch 1 with the shared experts' two GEMVs as one kernel (KIMI_DECODE_SHARED_ONE_KERNEL=1)
      KIMI_DECODE_SHARED_ONE_KERNEL=1 bench oneshared 60 bench_oneshared.json --backend latency_specialized \
        --tp 16 8 --batch 1 ;;
    sharedown)  # batch 1 with the shared experts as kernels of their own (KIMI_DECODE_SHARED_IN_EXPERTS=0)
      KIMI_DECODE_SHARED_IN_EXPERTS=0 bench sharedown 60 bench_sharedown.json --backend latency_specialized \
        --tp 16 8 --batch 1 ;;
    eight)  # batch 1 with both (8 kernels per KDA layer)
      KIMI_DECODE_EXPERTS_ONE_KERNEL=1 KIMI_DECODE_SHARED_ONE_KERNEL=1 bench eight 60 bench_eight.json \
        --backend latency_specialized --tp 16 8 --batch 1 ;;
    pdl)  # PDL, each kernel letting the next launch after its own wait (KIMI_DECODE_PDL_TRIGGER=wait)
      KIMI_DECODE_PDL=1 bench pdl 90 bench_pdl.json --backend latency_specialized --tp 16 8 --batch ${BENCH_BATCHES:-1 8} ;;
    pdlstart)  # PDL, each kernel letting the next launch at its start (the first form measured)
      KIMI_DECODE_PDL=1 KIMI_DECODE_PDL_TRIGGER=start bench pdlstart 90 bench_pdlstart.json --backend latency_specialized \
        --tp 16 8 --batch 1 ;;
    pdleight)  # PDL with the shared experts inside the expert kernels at both shards (8 kernels at TP8 too)
      KIMI_DECODE_PDL=1 KIMI_DECODE_SHARED_IN_EXPERTS=1 bench pdleight 60 bench_pdleight.json \
        --backend latency_specialized --tp 16 8 --batch 1 ;;
    special)  # latency_specialized alone at BENCH_BATCHES (default 1 8), the defaults
      bench special 90 bench_special.json --backend latency_specialized --tp 16 8 --batch ${BENCH_BATCHES:-1 8} ;;
    pdlcombo)  # batch 1 with the w13 kernel launched without PDL and no L2 requests before the wait
      KIMI_DECODE_PDL_SKIP=moe_w13_act,moe_w13_act_shared KIMI_DECODE_PDL_PREFETCH_ITERS=0 bench pdlcombo 60 \
        bench_pdlcombo.json --backend latency_specialized --tp 16 8 --batch 1 ;;
    pdl8iters0)  # batch 8 under PDL without L2 requests before the wait
      KIMI_DECODE_PDL=1 KIMI_DECODE_PDL_PREFETCH_ITERS=0 bench pdl8iters0 60 bench_pdl8iters0.json \
        --backend latency_specialized --tp 16 8 --batch 8 ;;
    nopdl)  # batch 1 without PDL (KIMI_DECODE_PDL=0): at TP8 the shared experts then fork again
      KIMI_DECODE_PDL=0 bench nopdl 60 bench_nopdl.json --backend latency_specialized --tp 16 8 --batch 1 ;;
    pdlskip13)  # batch 1 with the w13 expert kernel launched without PDL (it still lets w2 launch early), 4 iterations
      KIMI_DECODE_PDL_SKIP=moe_w13_act,moe_w13_act_shared KIMI_DECODE_PDL_PREFETCH_ITERS=4 bench pdlskip13 60 \
        bench_pdlskip13.json \
        --backend latency_specialized --tp 16 8 --batch 1 ;;
    pdliters)  # batch 1, w13 under PDL, the GEMVs asking L2 for 0 and 8 iterations of their rows before the wait
      for n in 0 8; do
        KIMI_DECODE_PDL_SKIP= KIMI_DECODE_PDL_PREFETCH_ITERS=$n bench "pdliters$n" 60 "bench_pdliters$n.json" \
          --backend latency_specialized --tp 16 8 --batch 1
      done ;;
    pdlall)  # batch 1 with every kernel under PDL, the w13 kernel too (KIMI_DECODE_PDL_SKIP empty)
      KIMI_DECODE_PDL_SKIP= bench pdlall 60 bench_pdlall.json --backend latency_specialized --tp 16 8 --batch 1 ;;
    statelate)  # the KDA kernel with its state loaded after the conv (KIMI_DECODE_KDA_STATE_FIRST=0)
      KIMI_DECODE_KDA_STATE_FIRST=0 bench statelate 90 bench_statelate.json --backend latency_specialized --tp 16 8 \
        --batch 1 8 ;;
    kdasplit)  # the KDA kernel at other thread splits per head (KIMI_DECODE_KDA_SPLIT, default 4), batch 1 and 8
      for sp in ${KDA_SPLITS:-1 8}; do
        KIMI_DECODE_KDA_SPLIT=$sp bench "kdasplit$sp" 90 "bench_kdasplit$sp.json" --backend latency_specialized \
          --tp 16 8 --batch ${BENCH_BATCHES:-1 8}
      done ;;
    pdl8)  # batch 8 under PDL, the w2 kernel's weights after its wait (the default there), and before it
      KIMI_DECODE_PDL=1 bench pdl8 60 bench_pdl8.json --backend latency_specialized --tp 16 8 --batch 8
      KIMI_DECODE_PDL=1 KIMI_DECODE_W2_EARLY=1 bench pdl8early 60 bench_pdl8early.json --backend latency_specialized \
        --tp 16 8 --batch 8 ;;
    w2late)  # batch 1 with the w2 kernel's weights loaded after its PDL wait
      KIMI_DECODE_W2_EARLY=0 bench w2late 60 bench_w2late.json --backend latency_specialized --tp 16 8 --batch 1 ;;
    captures-pdl8)  # latency_specialized TP8 batch 8 with PDL at every batch and without, for the per-kernel view
      for pdl in 1 0; do
        KIMI_DECODE_PDL=$pdl step "capture latency_specialized tp8 b8 pdl$pdl" 60 python3 -m profiler.cli capture \
          --backend latency_specialized --tp 8 --batch 8 --layers 4 --context 8192 --steps 20 --profiler cupti \
          -o "$OUT/latency_specialized_tp8_b8_pdl$pdl.kprof"
      done ;;
    captures-pdl)  # latency_specialized TP16 / TP8 batch 1 with PDL, for the per-kernel view
      for tp in 16 8; do
        KIMI_DECODE_PDL=1 step "capture pdl tp$tp" 60 python3 -m profiler.cli capture --backend latency_specialized \
          --tp "$tp" --batch 1 --layers 4 --context 8192 --steps 50 --profiler cupti \
          -o "$OUT/latency_specialized_pdl_tp${tp}_b1.kprof"
      done ;;
    experts)  # the routed-expert kernels alone, grouped CuTe against auto's Triton (benchmarks/expert_sweep.py)
      mkdir -p "$OUT/cubin"  # the compiled kernels, for cuobjdump (registers, local memory)
      CUTE_DSL_KEEP_CUBIN=1 CUTE_DSL_DUMP_DIR="$OUT/cubin" \
        step experts 150 python3 benchmarks/expert_sweep.py --tp ${EXPERTS_TP:-16 8} --batch ${EXPERTS_BATCHES:-16 64} \
        --json "$OUT/experts${EXPERTS_TAG:-}.json" ;;
    experts-tiles)  # the same with 4 and 1 row tiles per warp in the grouped kernels (KIMI_DECODE_GROUPED_TILES)
      for n in 4 1; do
        KIMI_DECODE_GROUPED_TILES=$n step "experts tiles=$n" 90 python3 benchmarks/expert_sweep.py --tp 16 8 \
          --batch 64 --only "grouped w" --json "$OUT/experts_tiles$n.json"
      done ;;
    oprojlate)  # batch 1 with the output projection's first rows loaded after its PDL wait (KIMI_DECODE_OPROJ_EARLY=0)
      KIMI_DECODE_OPROJ_EARLY=0 bench oprojlate 60 bench_oprojlate.json --backend latency_specialized --tp 16 8 \
        --batch 1 ;;
    w13warps)  # batch 1 and 8 with the w13 kernel's K over at most W13_WARPS warps (default 4) instead of 7
      for wv in ${W13_WARPS:-4}; do
        KIMI_DECODE_W13_WARPS=$wv bench "w13warps$wv" 60 "bench_w13warps$wv.json" --backend latency_specialized \
          --tp 16 8 --batch 1 8
      done ;;
    epilate)  # batch 1 and 8 with the accumulating GEMVs reading y and the addend after the weight loop
      KIMI_DECODE_GEMV_EPI_EARLY=0 bench epilate 60 bench_epilate.json --backend latency_specialized --tp 16 8 \
        --batch 1 8 ;;
    ab)  # latency_specialized at AB_BATCHES (default 1) and AB_TPS (default 16 8) once per setting in AB_ENVS
      # ("NAME=VALUE[,NAME=VALUE]" each, separated by spaces), e.g.
      # AB_ENVS="KIMI_DECODE_GEMV_PRELOAD=0 KIMI_DECODE_OPROJ_EARLY=1"
      # (a setting given again gets its own JSON: bench_ab_<tag>.json, then bench_ab_<tag>_run2.json, ...;
      # benchmarks/ab_table.py sets them side by side)
      for setting in ${AB_ENVS:-}; do
        tag=$(echo "$setting" | tr ',=' '__' | tr -cd 'A-Za-z0-9_')
        json="bench_ab_$tag.json" n=1
        while [ -e "$OUT/$json" ]; do n=$((n + 1)); json="bench_ab_${tag}_run$n.json"; done
        (export_setting "$setting"
         bench "ab $setting" ${AB_LIMIT:-70} "$json" --backend latency_specialized --tp ${AB_TPS:-16 8} \
           --batch ${AB_BATCHES:-1})
      done ;;
    v26)  # benchmarks/NOTES.md items 40 and 41, each setting in its own process, latency_specialized only: the expert
      # kernels' integer work off the ALU pipe at batches 1 / 8 / 64, then the entry kernel's expert prefetch at batch 1
      for v in 0 1; do
        KIMI_DECODE_MX_ALU=$v bench "mx_alu=$v" 100 bench_mx_alu_$v.json --backend latency_specialized --tp 16 8 \
          --batch 1 8 64
      done
      for v in 0 1; do
        KIMI_DECODE_ENTRY_PREFETCH=$v bench "entry_prefetch=$v" 60 bench_entry_prefetch_$v.json \
          --backend latency_specialized --tp 16 8 --batch 1
      done ;;
    v25)  # benchmarks/NOTES.md item 38, each setting in its own process: TP16 with the w2 copy cut to its used
      # columns (KIMI_DECODE_W2_COMPACT=1, with auto beside it) and without
      KIMI_DECODE_W2_COMPACT=0 bench "compact=0" 70 bench_compact_0.json --backend latency_specialized --tp 16 \
        --batch 1 8 16 64
      KIMI_DECODE_W2_COMPACT=1 bench "compact=1" 100 bench_compact_1.json --backend auto latency_specialized \
        --tp 16 --batch 1 8 16 64 ;;
    v24)  # benchmarks/NOTES.md items 35 and 36, each setting in its own process, latency_specialized only: the
      # grouped path's alignment at batches 16 and 64, then the per-pair w13 kernel's early quads at batches 1 and 8
      for v in 0 align 1; do
        KIMI_DECODE_GROUPED_ALIGN=$v bench "align=$v" 60 "bench_align_$v.json" --backend latency_specialized \
          --tp 16 8 --batch 16 64
      done
      for v in 0 2 all; do
        KIMI_DECODE_W13_FIRST=$v bench "w13first=$v" 45 "bench_w13first_$v.json" --backend latency_specialized \
          --tp 16 8 --batch 1 8
      done ;;
    cublas-fill)  # the cuBLAS projections above the tensor-core rows: their kernels' CTAs against the SMs, and the
      # same GEMMs with the weights stored [K, N] or the outputs in chunks on parallel streams (benchmarks/cublas_fill.py)
      step cublas-fill 200 python3 benchmarks/cublas_fill.py --tp 16 8 --rows ${FILL_ROWS:-32 64} \
        --json "$OUT/cublas_fill.json"
      step cublas-fill-lt 200 python3 benchmarks/cublas_fill.py --tp 16 8 --rows ${FILL_ROWS:-32 64} --blas cublaslt \
        --json "$OUT/cublas_fill_lt.json" ;;
    chain)  # the layer's bytes as pure streaming reads in its kernel structure (benchmarks/stream_chain.py)
      step chain 150 python3 benchmarks/stream_chain.py --tp 16 8 --batch ${CHAIN_BATCHES:-1} --json "$OUT/chain.json" ;;
    capture-ab)  # latency_specialized captures at CAPTURE_TP (default 16) and CAPTURE_BATCH (default 1) once per
      # setting in AB_ENVS, for benchmarks/per_kernel.py
      for setting in ${AB_ENVS:-}; do
        tag=$(echo "$setting" | tr ',=' '__' | tr -cd 'A-Za-z0-9_')
        for tp in ${CAPTURE_TP:-16}; do
          (export_setting "$setting"
           cb=${CAPTURE_BATCH:-1}
           step "capture $setting tp$tp b$cb" 60 python3 -m profiler.cli capture --backend latency_specialized \
             --tp "$tp" --batch "$cb" --layers 4 --context 8192 --steps 30 --profiler cupti \
             -o "$OUT/ab_${tag}_tp${tp}$([ "$cb" = 1 ] || echo "_b$cb").kprof")
        done
      done ;;
    ncu-b1)  # per-kernel metrics of the KDA, o_proj + AttnRes and expert kernels, latency_specialized TP8 batch 1
      # (NCU_KERNELS, NCU_TP, NCU_BATCH, NCU_SKIP, NCU_COUNT; NCU_SECTIONS adds sections, e.g. "SchedulerStats";
      # NCU_ARGS more ncu options, e.g. "--print-details all" for the stall reasons)
      step "ncu-b1 tp${NCU_TP:-8} b${NCU_BATCH:-1}" 150 ncu --clock-control none \
        -k "regex:${NCU_KERNELS:-KDADecode|OProjAttnRes|MoEW13Act|MoEW2Sum}" --launch-skip ${NCU_SKIP:-20} \
        --launch-count ${NCU_COUNT:-4} --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats $(for n in ${NCU_SECTIONS:-}; do echo "--section $n"; done) ${NCU_ARGS:-} \
        python3 -m kimi_decode.bench --backend latency_specialized --tp ${NCU_TP:-8} \
        --batch ${NCU_BATCH:-1} --layers 1 --copies 1 --replays 5 --warmup 2 ;;
    ncu-experts)  # per-kernel metrics of the grouped expert kernels at TP16 batch 64 (one eager launch each)
      for v in w13 w2; do
        step "ncu-experts $v" 90 ncu --clock-control none -k regex:Grouped --launch-count 1 --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
          --section Occupancy --section LaunchStats --section InstructionStats \
          python3 benchmarks/expert_sweep.py --tp 16 --batch 64 --sets 1 --replays 1 --only "grouped $v"
      done ;;
    resources)  # registers, stack, spills and CTAs per SM of every CuTe kernel of layer 1, as cutlass-dsl 4.3.5
      # compiles them here, at RES_TP (default 16 8) x RES_BATCHES (default 1 64)
      for tp in ${RES_TP:-16 8}; do
        for b in ${RES_BATCHES:-1 64}; do
          step "resources tp$tp b$b" 90 python3 benchmarks/kernel_resources.py --tp "$tp" --batch "$b"
        done
      done ;;
    *)
      echo "## unknown step $name" | tee -a "$LOG" ;;
  esac
done
echo "## done in ${SECONDS}s" | tee -a "$LOG"
if [ -n "${PACK:-}" ]; then  # everything under $OUT as one archive (a device run returns only a few files)
  (cd "$OUT" && tar czf "$PACK.tgz.part" --exclude "$PACK.tgz.part" -- * && find . -type f ! -name "$PACK.tgz.part" -delete \
     && mv "$PACK.tgz.part" "$PACK.tgz")
fi
