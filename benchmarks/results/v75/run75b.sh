#!/usr/bin/env bash
# v75 run 3: KIMI_DECODE_SHARED_AFTER=route (GPU tests, then batch-8 A/B against latent); no tar: a cut run still
# brings back what it wrote
NEW_LIMIT=75 NEW_TESTS="after_the_routing" bash benchmarks/run_h200.sh 80 numerics-new
AB_BATCHES=8 AB_LIMIT=55 AB_ENVS="KIMI_DECODE_SHARED_AFTER=latent KIMI_DECODE_SHARED_AFTER=route KIMI_DECODE_SHARED_AFTER=latent KIMI_DECODE_SHARED_AFTER=route" \
  bash benchmarks/run_h200.sh 190 ab
ls -R "$OUT"
