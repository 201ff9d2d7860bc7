#!/usr/bin/env bash
# ncu of one projection variant of benchmarks/projection_sweep.py (its second launch: weights from HBM), with the
# per-instruction SASS page and the details page, into $OUT:
#   source .devsite/activate.sh && bash benchmarks/ncu_projection.sh NAME TP ROWS PROJECTION VARIANT KERNEL_REGEX
# e.g. bash benchmarks/ncu_projection.sh oproj_s2 16 64 o_proj "wgmma g1 s2 st8" Wgmma
# NCU_SWEEP_ARGS: more arguments of the sweep (e.g. "--blas cublaslt"). NAME.ncu-rep, NAME_sass.csv (`--page source
# --print-source sass`), NAME_details.txt and NAME.log go to $OUT.
set -u
name=$1 tp=$2 rows=$3 proj=$4 variant=$5 kernels=$6
OUT="${OUT:-runs/ncu}"
mkdir -p "$OUT"
kind=${variant%% *}
timeout -k 5 "${NCU_LIMIT:-150}" ncu --clock-control none --set full --import-source yes -k "regex:$kernels" \
  --launch-skip 2 --launch-count 1 -o "$OUT/$name" python3 benchmarks/projection_sweep.py --tp "$tp" --rows "$rows" \
  --plans "$rows" --projections "$proj" --variants "$kind" --replays 2 --only "$variant" ${NCU_SWEEP_ARGS:-} \
  >"$OUT/$name.log" 2>&1
echo "## $name: ncu rc=$?"
ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass >"$OUT/${name}_sass.csv" 2>&1
ncu --import "$OUT/$name.ncu-rep" --page details --print-details all >"$OUT/${name}_details.txt" 2>&1
grep -E "Duration|DRAM Throughput|Registers Per|Grid Size|Block Size|Achieved Occupancy|Shared Memory Config" \
  "$OUT/${name}_details.txt" | head -12
