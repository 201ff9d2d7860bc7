#!/usr/bin/env bash
# Next session's first run (copy to .devsite/, with results/v76/experts.patch applied; items 134 and 135): the tests
# of KIMI_DECODE_PAIRS_FIRST and KIMI_DECODE_W2_STAGE_ACT, their A/B at TP16 batch 8 (each alone and both), then
# KIMI_DECODE_W2_STAGE_ACT at batch 1, on whichever card comes; with BENCH_ONLY=1 instead the bench of today's
# defaults at batches 1, 8 and 64.
if [ -n "${BENCH_ONLY:-}" ]; then
  bash benchmarks/run_h200.sh 540 bench bench64
  exit 0
fi
NEW_LIMIT=130 NEW_TESTS="pairs_first or w2_activations_staged" bash benchmarks/run_h200.sh 135 numerics-new
AB_TPS=16 AB_BATCHES=8 AB_LIMIT=40 AB_ENVS="DEFAULTS=1 KIMI_DECODE_PAIRS_FIRST=1 KIMI_DECODE_W2_STAGE_ACT=1 \
KIMI_DECODE_PAIRS_FIRST=1,KIMI_DECODE_W2_STAGE_ACT=1 DEFAULTS=1 KIMI_DECODE_PAIRS_FIRST=1 KIMI_DECODE_W2_STAGE_ACT=1 \
KIMI_DECODE_PAIRS_FIRST=1,KIMI_DECODE_W2_STAGE_ACT=1" bash benchmarks/run_h200.sh 200 ab
AB_BATCHES=1 AB_LIMIT=40 AB_ENVS="DEFAULTS=1 KIMI_DECODE_W2_STAGE_ACT=1 DEFAULTS=1 KIMI_DECODE_W2_STAGE_ACT=1" \
  bash benchmarks/run_h200.sh 150 ab
KIMI_DECODE_PAIRS_FIRST=1 KIMI_DECODE_W2_STAGE_ACT=1 NCU_TP=16 NCU_BATCH=8 NCU_KERNELS="MoEW13Act|MoEW2Sum" \
  NCU_COUNT=2 NCU_SECTIONS="MemoryWorkloadAnalysis SchedulerStats" \
  NCU_ARGS="--metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct" bash benchmarks/run_h200.sh 60 ncu-b1
ls -R "$OUT"
