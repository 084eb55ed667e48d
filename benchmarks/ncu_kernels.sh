#!/usr/bin/env bash
# Nsight Compute figures of the triton backend's kernels (benchmarks/ncu_kernels.py: one training step at
# B2 H16 S4096 D128, dense and causal). Run from the repo root on the GPU machine; writes $OUT (or ./ncu-logs):
# ncu_<case>.details.csv (the sections' figures), ncu_<case>.raw.csv (every collected metric, stall reasons too).
set -u
OUT=${OUT:-ncu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
--section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats"
# (these sections collect the tensor pipe's activity, sm__pipe_tensor_op_hmma_cycles_active, which on Hopper
# counts wgmma too: it equals the all-types sm__pipe_tensor_type_*_cycles_active)
for case in dense causal; do
  flag=""; [ "$case" = causal ] && flag="--causal"
  ncu --profile-from-start off --clock-control none $SECTIONS -f -o "$OUT/ncu_$case" \
      python benchmarks/ncu_kernels.py $flag > "$OUT/ncu_$case.log" 2>&1 || tail -n 20 "$OUT/ncu_$case.log"
  ncu -i "$OUT/ncu_$case.ncu-rep" --page details --csv > "$OUT/ncu_$case.details.csv"
  ncu -i "$OUT/ncu_$case.ncu-rep" --page raw --csv > "$OUT/ncu_$case.raw.csv"
  rm -f "$OUT/ncu_$case.ncu-rep"
done
