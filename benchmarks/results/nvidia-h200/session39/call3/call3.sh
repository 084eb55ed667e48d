source .scratch/pre.sh
export PYTHONUNBUFFERED=1 CUDA_LAUNCH_BLOCKING=1
C1="16384 16 16 128 1 256 2048"
for m in fwd bwd_triton bwd_gluon bwd_gluon_st4; do timeout 60 python .scratch/diag.py $m $C1; done
for c in "4096 16 16 128 1 256 2048" "16384 16 16 128 1 2048 2048"; do timeout 60 python .scratch/diag.py bwd_gluon $c; done
