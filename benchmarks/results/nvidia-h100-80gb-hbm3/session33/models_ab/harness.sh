source .scratch/pre.sh
cat $OUT/gpu.txt
T0=$(date +%s); ROOT=$(pwd); mkdir -p $OUT/ab
i=0
for arm in new base base new new base base new new base; do
  i=$((i+1)); left=$(( 570 - ($(date +%s)-T0) )); [ $left -lt 40 ] && break
  if [ $arm = new ]; then dir=$ROOT; else dir=$ROOT/.ab/base; fi
  ( cd $dir && PYTHONPATH=/tmp/site:$dir timeout $left python benchmarks/models_bench.py --models gpt2 --out-dir $OUT/ab/run${i}_$arm > $OUT/ab/run${i}_$arm.log 2>&1 )
  echo "run $i $arm rc $? at $(( $(date +%s)-T0 )) s"
done
cd $OUT/ab && for f in run*/models.md; do echo "== $f"; cat $f; done > $OUT/ab_all.md; tar czf $OUT/ab.tgz run*; rm -rf $OUT/ab
grep -E "^\| (gpt2|GPT)" $OUT/ab_all.md | head -60
