#!/usr/bin/env bash
# Second run of v76 (copy to .devsite/; item 133): does the padded TP16 w2 row (96 of 128 bytes used) cost a 64-byte
# L2 fetch's fourth sector? Batch 8 at the context's own L2 fetch granularity and at 32 bytes, A/B/A/B, both TPs;
# batch 1 once each; then ncu of the per-pair w2 kernel at TP16 batch 8 with 32-byte fetches (DRAM bytes read).
L2_BATCHES=8 L2_LIMIT=55 L2_VALUES="default 32 default 32" bash benchmarks/run_h200.sh 240 l2fetch
L2_BATCHES=1 L2_LIMIT=40 L2_VALUES="default 32" bash benchmarks/run_h200.sh 90 l2fetch
NCU_TP=16 NCU_BATCH=8 NCU_KERNELS="MoEW2Sum" NCU_COUNT=2 NCU_L2=32 NCU_SECTIONS="MemoryWorkloadAnalysis" \
  NCU_ARGS="--metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct" bash benchmarks/run_h200.sh 100 ncu-b1
ls -R "$OUT"
