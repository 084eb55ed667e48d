source .scratch/pre.sh
export PYTHONUNBUFFERED=1
P="python -m pytest -q -ra --durations=30 -p no:cacheprovider -n 16 -p no:benchmark -m 'gpu or blackwell'"
(CUDA_VISIBLE_DEVICES=0 timeout 100 bash -c "$P tests/triton/test_gluon_recipes_gpu.py" > $OUT/gluon_recipes_tests.txt 2>&1;
 CUDA_VISIBLE_DEVICES=0 timeout 300 bash -c "$P tests --ignore tests/quantization/test_formats.py --ignore tests/triton/test_gluon_recipes_gpu.py -k 'gluon and fwd'" > $OUT/gluon_fwd_tests.txt 2>&1;
 CUDA_VISIBLE_DEVICES=0 timeout 150 bash -c "$P tests --ignore tests/quantization/test_formats.py --ignore tests/triton/test_gluon_recipes_gpu.py -k 'gluon and not fwd'" > $OUT/gluon_not_fwd_tests.txt 2>&1) &
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/s PART=samples timeout 560 bash benchmarks/device_checks.sh > /dev/null 2>&1) &
wait
rm -f $OUT/s/train_gpt_loss.png $OUT/s/gpu.txt; find $OUT -type f | sort
