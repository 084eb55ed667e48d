source .scratch/pre.sh
rm -f $OUT/gpu.txt
export PYTHONUNBUFFERED=1
C="--config d64:4:16:16:2048:64:0 --config d64c:8:16:4:1024:64:1 --config d64l:2:16:16:4096:64:1"
(CUDA_VISIBLE_DEVICES=0 timeout 250 python benchmarks/gluon_bwd_bench.py $C --variant base: --variant wide128:block_m=128,stages=2,defer=0 --json $OUT/dkdv_d64_ab.json > $OUT/dkdv_d64_ab.txt 2>&1;
 CUDA_VISIBLE_DEVICES=0 timeout 200 python benchmarks/gluon_bwd_bench.py $C --padded --variant base: --variant wide128:block_m=128,stages=2,defer=0 > $OUT/dkdv_d64_padded_ab.txt 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 200 python benchmarks/gluon_bwd_bench.py --dq $C --variant base: --variant bn64:block_n=64 --variant defer:defer=1 > $OUT/dq_d64_ab.txt 2>&1;
 CUDA_VISIBLE_DEVICES=1 timeout 240 python -m pytest -q -ra -p no:cacheprovider -n 8 -p no:benchmark -m 'gpu' tests -k 'packed' > $OUT/packed_tests.txt 2>&1) &
wait
