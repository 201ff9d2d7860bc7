#!/usr/bin/env bash
# v76 run 2 (copy to .devsite/; item 134): KIMI_DECODE_PAIRS_FIRST's GPU tests, its A/B at TP16 batch 8, then ncu of
# the per-pair expert kernels with it (DRAM bytes against run 1's 78.95 / 38.04 MB).
NEW_LIMIT=70 NEW_TESTS="pairs_first" bash benchmarks/run_h200.sh 75 numerics-new
AB_TPS=16 AB_BATCHES=8 AB_LIMIT=40 AB_ENVS="DEFAULTS=1 KIMI_DECODE_PAIRS_FIRST=1 DEFAULTS=1 KIMI_DECODE_PAIRS_FIRST=1" \
  bash benchmarks/run_h200.sh 110 ab
KIMI_DECODE_PAIRS_FIRST=1 NCU_TP=16 NCU_BATCH=8 NCU_KERNELS="MoEW13Act|MoEW2Sum" NCU_COUNT=2 \
  NCU_SECTIONS="MemoryWorkloadAnalysis" NCU_ARGS="--metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct" \
  bash benchmarks/run_h200.sh 45 ncu-b1
ls -R "$OUT"
