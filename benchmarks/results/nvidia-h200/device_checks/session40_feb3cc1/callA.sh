source .scratch/pre.sh
rm -f $OUT/gpu.txt
export PYTHONUNBUFFERED=1
P="python -m pytest -q -ra --durations=30 -p no:cacheprovider -n 16 -p no:benchmark -m 'gpu or blackwell' tests --ignore tests/quantization/test_formats.py"
(CUDA_VISIBLE_DEVICES=0 timeout 330 bash -c "$P -k 'gluon and fwd'" > $OUT/gluon_fwd_tests.txt 2>&1;
 CUDA_VISIBLE_DEVICES=0 timeout 200 bash -c "$P -k 'gluon and not fwd'" > $OUT/gluon_not_fwd_tests.txt 2>&1) &
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/s PART=samples timeout 300 bash benchmarks/device_checks.sh > /dev/null 2>&1;
 CUDA_VISIBLE_DEVICES=1 timeout 200 python benchmarks/peak_memory_breakdown.py > $OUT/peak_memory.md 2>&1) &
wait
rm -f $OUT/s/train_gpt_loss.png; find $OUT -type f | sort
