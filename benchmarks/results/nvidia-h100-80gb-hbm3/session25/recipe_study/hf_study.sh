#!/usr/bin/env bash
# re-run of the HF half of the recipe study (session 25), results tarred into one file
export PYTHONUNBUFFERED=1
S=/tmp/st; mkdir -p $S/logs
C="python3 samples/recipe_study_hf.py --size gpu --device cuda --backend auto --threads 16 --steps 600"
R7="sdpa,default,p_quant=lazy16,p_quant=none,v_operand=bf16,ds_quant=bf16,scale_rounding=floor"
( CUDA_VISIBLE_DEVICES=0 $C --seed 0 --seeds 1 --runs "$R7" --out-dir $S/hf_s0a > $S/logs/hf_s0a.log 2>&1; echo "hf_s0a $?";
  CUDA_VISIBLE_DEVICES=0 $C --seed 2 --seeds 1 --runs scale_rounding=floor --out-dir $S/hf_s2b > $S/logs/hf_s2b.log 2>&1; echo "hf_s2b $?" ) &
( CUDA_VISIBLE_DEVICES=1 $C --seed 1 --seeds 1 --runs "$R7" --out-dir $S/hf_s1a > $S/logs/hf_s1a.log 2>&1; echo "hf_s1a $?" ) &
( CUDA_VISIBLE_DEVICES=2 $C --seed 2 --seeds 1 --runs "sdpa,default,p_quant=lazy16,p_quant=none,v_operand=bf16,ds_quant=bf16,scaling=per_tensor" --out-dir $S/hf_s2a > $S/logs/hf_s2a.log 2>&1; echo "hf_s2a $?" ) &
( CUDA_VISIBLE_DEVICES=3 $C --seed 0 --seeds 1 --runs scaling=per_tensor --out-dir $S/hf_s0b > $S/logs/hf_s0b.log 2>&1; echo "hf_s0b $?";
  CUDA_VISIBLE_DEVICES=3 $C --seed 1 --seeds 1 --runs scaling=per_tensor --out-dir $S/hf_s1b > $S/logs/hf_s1b.log 2>&1; echo "hf_s1b $?" ) &
wait
echo "shards done after $SECONDS s"
python3 samples/recipe_study_hf.py --merge $S/hf_s*/recipe_study_hf.json --out-dir $S/merged > $S/logs/merge_hf.log 2>&1; echo "merge $?"
cat $S/merged/recipe_study_hf.md
tar -czf $OUT/hf_study.tgz -C /tmp st
