source .scratch/pre.sh
rm -f $OUT/gpu.txt
export PYTHONUNBUFFERED=1
(CUDA_VISIBLE_DEVICES=0 WORKERS=16 OUT=$OUT/g PART=tests timeout 440 bash benchmarks/device_checks.sh gluon > /dev/null 2>&1; CUDA_VISIBLE_DEVICES=0 timeout 130 python benchmarks/packed_bwd_bench.py --rounds 5 > $OUT/packed_bench.txt 2>&1) &
CUDA_VISIBLE_DEVICES=1 WORKERS=16 OUT=$OUT/ng PART=tests timeout 575 bash benchmarks/device_checks.sh "not gluon" > /dev/null 2>&1
wait
