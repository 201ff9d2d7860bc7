#!/usr/bin/env bash
# Second run of v77 (copy to .devsite/, with results/v76/experts.patch applied): the settings whose outputs run77a.sh
# could not bring back (KIMI_DECODE_W2_STAGE_ACT alone at TP16 batch 8 and at batch 1, with the defaults beside), the
# ncu of the expert kernels with each switch alone, everything packed into one file.
AB_TPS=16 AB_BATCHES=8 AB_LIMIT=40 AB_ENVS="DEFAULTS=1 KIMI_DECODE_W2_STAGE_ACT=1 DEFAULTS=1 KIMI_DECODE_W2_STAGE_ACT=1" \
  bash benchmarks/run_h200.sh 180 ab
AB_BATCHES=1 AB_LIMIT=40 AB_ENVS="DEFAULTS=1 KIMI_DECODE_W2_STAGE_ACT=1 DEFAULTS=1 KIMI_DECODE_W2_STAGE_ACT=1" \
  bash benchmarks/run_h200.sh 160 ab
for s in DEFAULTS KIMI_DECODE_W2_STAGE_ACT KIMI_DECODE_PAIRS_FIRST; do
  env $s=1 NCU_TP=16 NCU_BATCH=8 NCU_KERNELS="MoEW13Act|MoEW2Sum" NCU_COUNT=2 \
    NCU_ARGS="--metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct" bash benchmarks/run_h200.sh 50 ncu-b1
  mv "$OUT/log.txt" "$OUT/ncu_$s.txt"
done
tar czf /tmp/run77b.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/run77b.tgz "$OUT/"
