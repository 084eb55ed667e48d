source .scratch/pre.sh
rm -f $OUT/gpu.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
cd .scratch/proto
timeout 230 python benchmarks/gluon_bwd_bench.py --rounds 7 --config d64:4:16:16:2048:64:0 --config d64c:8:16:4:1024:64:1 --variant base: --variant waited:defer=0 --variant c3:consumers=3,defer=0 --json $OUT/nc3_ab.json > $OUT/nc3_ab.txt 2>&1
cd ../..
grep -v Warn $OUT/nc3_ab.txt | tail -5
