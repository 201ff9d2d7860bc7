#!/usr/bin/env bash
# v74 run 1: on an H200 the bench of today's defaults (and the stripes at batch 8 if time is left); on an H100 the
# stripe prefetch's tests, the batch-8 captures (entry question, stripes) and A/B runs.
card=$(cat "$OUT/card.txt")
if echo "$card" | grep -q H200; then
  AB_BATCHES=8 AB_LIMIT=45 AB_ENVS="KIMI_DECODE_STRIPE_PREFETCH=0 KIMI_DECODE_STRIPE_PREFETCH=40" \
    PACK=run1 bash benchmarks/run_h200.sh "${BUDGET:-540}" bench bench64 ab
  exit 0
fi
NEW_LIMIT=130 NEW_TESTS="stripe or prefetch" bash benchmarks/run_h200.sh 130 numerics-new
CAPTURE_TP="16 8" CAPTURE_BATCH=8 AB_ENVS="KIMI_DECODE_OVERLAP=1 KIMI_DECODE_OVERLAP=0 KIMI_DECODE_STRIPE_PREFETCH=40" \
  bash benchmarks/run_h200.sh 150 capture-ab
AB_BATCHES="8 32" AB_LIMIT=40 AB_ENVS="KIMI_DECODE_STRIPE_PREFETCH=0 KIMI_DECODE_STRIPE_PREFETCH=25 KIMI_DECODE_STRIPE_PREFETCH=50 KIMI_DECODE_STRIPE_PREFETCH=0" \
  bash benchmarks/run_h200.sh 150 ab
mkdir -p "$OUT/b1" && AB_BATCHES=1 AB_LIMIT=35 AB_ENVS="KIMI_DECODE_PREFETCH_MB=0 KIMI_DECODE_PREFETCH_MB=16 KIMI_DECODE_PREFETCH_MB=0 KIMI_DECODE_PREFETCH_MB=16" \
  OUT="$OUT/b1" bash benchmarks/run_h200.sh 110 ab
cd "$OUT" && tar czf run1.tgz.part -- * && find . -type f ! -name run1.tgz.part -delete && mv run1.tgz.part run1.tgz
