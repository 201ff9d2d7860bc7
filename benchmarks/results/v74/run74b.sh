#!/usr/bin/env bash
# v74 run 1, shorter (less device time left): the stripe tests, TP16/TP8 batch-8 captures on one stream and with the
# stripes, and batch 8 at 0 / 40 / 0 / 40 %. An H200 runs the batch-1 and batch-8 bench instead.
card=$(cat "$OUT/card.txt")
if echo "$card" | grep -q H200; then
  PACK=run1 bash benchmarks/run_h200.sh "${BUDGET:-330}" bench
  exit 0
fi
NEW_LIMIT=110 NEW_TESTS="stripe" bash benchmarks/run_h200.sh 110 numerics-new
CAPTURE_TP="16 8" CAPTURE_BATCH=8 AB_ENVS="KIMI_DECODE_OVERLAP=0 KIMI_DECODE_STRIPE_PREFETCH=40" \
  bash benchmarks/run_h200.sh 110 capture-ab
AB_BATCHES=8 AB_LIMIT=30 AB_ENVS="KIMI_DECODE_STRIPE_PREFETCH=0 KIMI_DECODE_STRIPE_PREFETCH=40 KIMI_DECODE_STRIPE_PREFETCH=0 KIMI_DECODE_STRIPE_PREFETCH=40" \
  bash benchmarks/run_h200.sh 110 ab
cd "$OUT" && tar czf run1.tgz.part -- * && find . -type f ! -name run1.tgz.part -delete && mv run1.tgz.part run1.tgz
