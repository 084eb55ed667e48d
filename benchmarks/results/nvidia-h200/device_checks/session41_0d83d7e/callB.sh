source .scratch/pre.sh
rm -f $OUT/gpu.txt
export PYTHONUNBUFFERED=1
CUDA_VISIBLE_DEVICES=0 WORKERS=30 OUT=$OUT/ng PART=tests timeout 480 bash benchmarks/device_checks.sh "not gluon" > /dev/null 2>&1
CUDA_VISIBLE_DEVICES=1 timeout 100 python -m mxattn bench --no-quantizer --no-varlen --no-sink --out-dir $OUT/bench > $OUT/bench_stdout.txt 2>&1
find $OUT -type f | sort
