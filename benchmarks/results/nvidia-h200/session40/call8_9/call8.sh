source .scratch/pre.sh
rm -f $OUT/gpu.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
cd .scratch/proto2
timeout 185 python -m pytest -q -ra -p no:cacheprovider -n 16 -p no:benchmark -m gpu tests/triton/test_gluon_recipes_gpu.py > $OUT/recipes_gpu_tests.txt 2>&1
cd ../..
tail -n 30 $OUT/recipes_gpu_tests.txt
