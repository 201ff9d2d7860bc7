#!/usr/bin/env bash
# v77 run 3 (copy to .devsite/; NOTES item 137): ncu's per-instruction stall samples (SourceCounters) of the per-pair
# expert kernels at TP16 batch 8 and of the grouped w2 kernel at TP16 batch 64, as SASS listings with their samples;
# everything packed into one file.
set -u
ncu --clock-control none -k "regex:MoEW13Act|MoEW2Sum" --launch-skip 20 --launch-count 2 --section SourceCounters \
  --section WarpStateStats --section SpeedOfLight -o "$OUT/b8" -f python3 -m kimi_decode.bench \
  --backend latency_specialized --tp 16 --batch 8 --layers 1 --copies 1 --replays 5 --warmup 2 >"$OUT/b8_run.txt" 2>&1
echo "b8 rc=$?"
timeout 120 ncu --clock-control none -k regex:Grouped --launch-count 1 --section SourceCounters \
  --section WarpStateStats --section SpeedOfLight -o "$OUT/g64" -f python3 benchmarks/expert_sweep.py --tp 16 \
  --batch 64 --sets 1 --replays 1 --only "grouped w2" >"$OUT/g64_run.txt" 2>&1
echo "g64 rc=$?"
for r in b8 g64; do
  [ -e "$OUT/$r.ncu-rep" ] || continue
  ncu -i "$OUT/$r.ncu-rep" --page source --print-source sass --csv >"$OUT/${r}_sass.csv" 2>&1
  ncu -i "$OUT/$r.ncu-rep" --page details --print-details all >"$OUT/${r}_details.txt" 2>&1
done
ls -la "$OUT"
tar czf /tmp/run77c.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/run77c.tgz "$OUT/"
