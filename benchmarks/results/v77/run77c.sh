#!/usr/bin/env bash
# v77 run 3 (copy to .devsite/; NOTES item 137): ncu's per-instruction stall samples (SourceCounters) of the per-pair
# expert kernels at TP16 batch 8 and of the grouped w2 kernel at TP16 batch 64, as SASS listings with their samples;
# everything packed into one file (run_h200.sh's PACK).
set -u
NCU_TP=16 NCU_BATCH=8 NCU_KERNELS="MoEW13Act|MoEW2Sum" NCU_COUNT=2 NCU_SECTIONS=SourceCounters \
  NCU_ARGS="-o $OUT/b8 -f" bash benchmarks/run_h200.sh 100 ncu-b1
timeout 120 ncu --clock-control none -k regex:Grouped --launch-count 1 --section SourceCounters \
  --section WarpStateStats --section SpeedOfLight -o "$OUT/g64" -f python3 benchmarks/expert_sweep.py --tp 16 \
  --batch 64 --sets 1 --replays 1 --only "grouped w2" >"$OUT/g64_run.txt" 2>&1
echo "g64 rc=$?"
for r in b8 g64; do
  [ -e "$OUT/$r.ncu-rep" ] || continue
  ncu -i "$OUT/$r.ncu-rep" --page source --print-source sass --csv >"$OUT/${r}_sass.csv" 2>&1
  ncu -i "$OUT/$r.ncu-rep" --page details --print-details all >"$OUT/${r}_details.txt" 2>&1
done
PACK=run77c bash benchmarks/run_h200.sh 0  # no steps: only the packing
