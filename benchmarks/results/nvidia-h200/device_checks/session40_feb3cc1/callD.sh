source .scratch/pre.sh
export PYTHONUNBUFFERED=1
(timeout 150 python benchmarks/peak_memory_breakdown.py --json $OUT/peak_memory.json > $OUT/peak_memory.md 2>&1) &
mkdir -p $OUT/t; timeout 280 python samples/train_gpt.py --device cuda --layers 4 --dim 256 --heads 4 --seq 256 --batch 32 --steps 500 --out $OUT/t > $OUT/t/train_gpt_full.txt 2>&1
tail -n 25 $OUT/t/train_gpt_full.txt > $OUT/t/train_gpt.txt; rm -f $OUT/t/train_gpt_full.txt
wait
find $OUT -type f | sort
