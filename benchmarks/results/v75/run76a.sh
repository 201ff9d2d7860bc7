#!/usr/bin/env bash
# Next session's first run (copy to .devsite/, with results/v75/shared_after_route.patch applied): the `route`
# tests and its batch-8 A/B (item 130), the grouped experts at TP16 batch 8 (item 131), then ncu of the per-pair
# expert kernels at TP16 batch 8 (item 131's hypothesis: the w2 kernel's waves); on an H200 instead the bench of
# today's defaults (the rest in a second call with RUN_ANYWAY=1).
card=$(cat "$OUT/card.txt")
if echo "$card" | grep -q H200 && [ -z "${RUN_ANYWAY:-}" ]; then
  bash benchmarks/run_h200.sh 540 bench bench64
  exit 0
fi
NEW_LIMIT=75 NEW_TESTS="after_the_routing" bash benchmarks/run_h200.sh 80 numerics-new
AB_BATCHES=8 AB_LIMIT=55 AB_ENVS="KIMI_DECODE_SHARED_AFTER=latent KIMI_DECODE_SHARED_AFTER=route KIMI_DECODE_SHARED_AFTER=latent KIMI_DECODE_SHARED_AFTER=route" \
  bash benchmarks/run_h200.sh 190 ab
AB_BATCHES=8 AB_LIMIT=55 AB_ENVS="DEFAULTS=1 KIMI_DECODE_GROUPED_FROM=8" bash benchmarks/run_h200.sh 120 ab
NCU_TP=16 NCU_BATCH=8 NCU_KERNELS="MoEW13Act|MoEW2Sum" NCU_COUNT=2 NCU_SECTIONS="MemoryWorkloadAnalysis SchedulerStats" \
  NCU_ARGS="--metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct" bash benchmarks/run_h200.sh 120 ncu-b1
ls -R "$OUT"
