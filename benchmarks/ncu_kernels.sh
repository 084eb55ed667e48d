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
# the Hopper tensor-core (wgmma) pipe's utilisation, where this ncu knows the metric
GMMA=sm__pipe_tensor_op_gmma_cycles_active
METRICS=""
if ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}' | grep -qx "$GMMA"; then
  METRICS="--metrics $GMMA.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum"
fi
for case in dense causal; do
  flag=""; [ "$case" = causal ] && flag="--causal"
  ncu --profile-from-start off --clock-control none $SECTIONS $METRICS -f -o "$OUT/ncu_$case" \
      python benchmarks/ncu_kernels.py $flag > "$OUT/ncu_$case.log" 2>&1 || tail -n 20 "$OUT/ncu_$case.log"
  ncu -i "$OUT/ncu_$case.ncu-rep" --page details --csv > "$OUT/ncu_$case.details.csv"
  ncu -i "$OUT/ncu_$case.ncu-rep" --page raw --csv > "$OUT/ncu_$case.raw.csv"
  rm -f "$OUT/ncu_$case.ncu-rep"
done
