#!/usr/bin/env bash
# v74 run 1, shortest: the stripe tests, batch 8 at 0 / 40 / 0 / 40 %, a TP16 batch-8 capture at 40 %; an H200 runs
# the batch-1 and batch-8 bench instead.
card=$(cat "$OUT/card.txt")
if echo "$card" | grep -q H200; then
  PACK=run1 bash benchmarks/run_h200.sh 250 bench
  exit 0
fi
NEW_LIMIT=100 NEW_TESTS="stripe" bash benchmarks/run_h200.sh 100 numerics-new
AB_BATCHES=8 AB_LIMIT=30 AB_ENVS="KIMI_DECODE_STRIPE_PREFETCH=0 KIMI_DECODE_STRIPE_PREFETCH=40 KIMI_DECODE_STRIPE_PREFETCH=0 KIMI_DECODE_STRIPE_PREFETCH=40" \
  bash benchmarks/run_h200.sh 100 ab
CAPTURE_TP=16 CAPTURE_BATCH=8 AB_ENVS="KIMI_DECODE_STRIPE_PREFETCH=40" bash benchmarks/run_h200.sh 40 capture-ab
cd "$OUT" && tar czf run1.tgz.part -- * && find . -type f ! -name run1.tgz.part -delete && mv run1.tgz.part run1.tgz
