source .scratch/pre.sh
rm -f $OUT/gpu.txt
export PYTHONUNBUFFERED=1
CUDA_VISIBLE_DEVICES=0 timeout 500 python -m mxattn bench --no-quantizer --no-varlen --no-sink --out-dir $OUT/bench > $OUT/bench.txt 2>&1
ls $OUT $OUT/bench
