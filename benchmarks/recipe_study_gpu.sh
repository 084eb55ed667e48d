#!/usr/bin/env bash
# The GPU-sized recipe study (issue 22) on every visible GPU of one machine at once, then merged: the shards of
# samples/recipe_study.py (one process with parts 1 and 2, no training; one training-only process per seed) and of
# samples/recipe_study_hf.py (one process per seed), one process per GPU at a time (CUDA_VISIBLE_DEVICES, assigned
# round-robin; a GPU with several shards runs them one after another, so any number of GPUs >= 1 works), each with
# its log; then both scripts' --merge write the tables (and plots) a single run over every seed would have written.
#
# Usage (from anywhere; it runs from the repository root):
#   bash benchmarks/recipe_study_gpu.sh
#   STEPS=20 SEEDS=2 OUT=/tmp/smoke bash benchmarks/recipe_study_gpu.sh     # a short smoke run
# Environment:
#   SEEDS          seeds 0 .. SEEDS-1 (default 3): SEEDS training shards per script, plus the parts-1-and-2 shard
#   STEPS          training steps per run (default: --size gpu's, 2000); also given to the parts-1-and-2 shard,
#                  whose result must match the training shards' to merge
#   OUT            output folder (default benchmarks/results/<gpu name>/recipe_study): a shard's files in
#                  $OUT/<shard>/ (gpt_parts12, gpt_seed<k>, hf_seed<k>), logs in $OUT/logs/, the merged
#                  recipe_study.{json,md,png} and recipe_study_hf.{json,md} in $OUT/merged/
#   SHARD_TIMEOUT  seconds after which a shard is stopped (default: none); the merge goes on without it
#   CUDA_VISIBLE_DEVICES  the GPUs to use (default: every GPU nvidia-smi lists)
# Each shard prints "shard <name> on GPU <g>: <s> s, exit <rc>" as it ends; the script exits 1 when a shard or a
# merge failed (the merge then holds the shards that finished).
#
# Expected time: not measured -- this script was written on a machine without a GPU. Estimates from session 18's
# H100 study (benchmarks/results/nvidia-h100-80gb-hbm3/session18/): parts 1 and 2 took 80 s; training at 250
# steps took 80-115 s per seed (per-tensor scaling, which runs on the reference backend, 45 s of it; the first
# run's Triton compiles ~10 s), so a GPT training shard at the default 2000 steps would take ~11 minutes: more than
# a 550 s call. STEPS=1000 should bring it to ~6 minutes; with >= 2*SEEDS+1 GPUs (7 for 3 seeds) the wall time is
# the slowest shard's, with fewer the sum of each GPU's shards. The transformers study's GPU time is unknown.
# SHARD_TIMEOUT (e.g. 500) keeps a call within its limit at the cost of the shards cut.
set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}
SEEDS=${SEEDS:-3}
STEPS=${STEPS:-}
SHARD_TIMEOUT=${SHARD_TIMEOUT:-}
[[ $SEEDS =~ ^[1-9][0-9]*$ ]] || { echo "SEEDS must be a positive integer, got '$SEEDS'" >&2; exit 2; }
[[ -z $STEPS || $STEPS =~ ^[1-9][0-9]*$ ]] || { echo "STEPS must be a positive integer, got '$STEPS'" >&2; exit 2; }
[[ -z $SHARD_TIMEOUT || $SHARD_TIMEOUT =~ ^[1-9][0-9]*$ ]] || {
  echo "SHARD_TIMEOUT must be a positive integer (seconds), got '$SHARD_TIMEOUT'" >&2; exit 2; }

# the GPUs: CUDA_VISIBLE_DEVICES's entries, else every GPU nvidia-smi lists
if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
  IFS=, read -ra GPUS <<< "$CUDA_VISIBLE_DEVICES"
else
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  GPUS=()
  for ((g = 0; g < NGPU; g++)); do GPUS+=("$g"); done
fi
NGPU=${#GPUS[@]}
((NGPU >= 1)) || { echo "no GPU: nvidia-smi lists none (or is missing) and CUDA_VISIBLE_DEVICES is empty" >&2; exit 2; }
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader -i "${GPUS[0]}" 2>/dev/null | head -n 1 \
           | tr '[:upper:] ' '[:lower:]-')
OUT=${OUT:-benchmarks/results/${GPU_NAME:-gpu}/recipe_study}
mkdir -p "$OUT/logs" || exit 2

# the shards: name, script, arguments (besides the common ones and --out-dir "$OUT/<name>"), the JSON it writes;
# training shards first (the longest, so that with few GPUs they start first)
NAMES=() SCRIPTS=() ARGS=() JSONS=()
add_shard() {  # name script json arguments...
  NAMES+=("$1") SCRIPTS+=("$2") JSONS+=("$3") ARGS+=("${*:4}")
}
for ((k = 0; k < SEEDS; k++)); do
  add_shard "gpt_seed$k" recipe_study.py recipe_study.json --skip-errors --skip-future --seed "$k" --seeds 1
done
for ((k = 0; k < SEEDS; k++)); do
  add_shard "hf_seed$k" recipe_study_hf.py recipe_study_hf.json --seed "$k" --seeds 1
done
add_shard gpt_parts12 recipe_study.py recipe_study.json --skip-training --seeds "$SEEDS"
NSHARDS=${#NAMES[@]}
PARALLEL=$((NGPU < NSHARDS ? NGPU : NSHARDS))
THREADS=$(($(nproc) / PARALLEL)); ((THREADS >= 1)) || THREADS=1   # the CPU cores shared by the processes at once
COMMON="--size gpu --device cuda --backend auto --threads $THREADS${STEPS:+ --steps $STEPS}"
echo "recipe study: $NSHARDS shards on $NGPU GPU(s) (${GPUS[*]}, ${GPU_NAME:-unknown}), seeds 0..$((SEEDS - 1)),"\
     "steps ${STEPS:-of --size gpu}, $THREADS CPU threads each; output in $OUT"

run_shard() {  # index gpu: runs shard `index` on `gpu`, its output in $OUT/logs/<name>.log and its exit code in .rc
  local j=$1 gpu=$2 name=${NAMES[$1]} start=$SECONDS rc
  rm -f "$OUT/$name/${JSONS[$j]}" "$OUT/logs/$name.rc"   # no earlier run's result is merged in its place
  # shellcheck disable=SC2086  # COMMON and ARGS are lists of plain words
  CUDA_VISIBLE_DEVICES=$gpu ${SHARD_TIMEOUT:+timeout "$SHARD_TIMEOUT"} \
      "$PYTHON" "samples/${SCRIPTS[$j]}" $COMMON ${ARGS[$j]} --out-dir "$OUT/$name" > "$OUT/logs/$name.log" 2>&1
  rc=$?
  echo "$rc" > "$OUT/logs/$name.rc"
  echo "shard $name on GPU $gpu: $((SECONDS - start)) s, exit $rc$( ((rc == 124)) && echo ' (SHARD_TIMEOUT)')"
}

run_queue() {  # q: runs shards q, q + NGPU, q + 2 NGPU, ... one after another on GPU q
  local q=$1 j
  for ((j = q; j < NSHARDS; j += NGPU)); do run_shard "$j" "${GPUS[$q]}"; done
}

START=$SECONDS
QUEUES=()
for ((q = 0; q < PARALLEL; q++)); do
  run_queue "$q" &
  QUEUES+=($!)
done
wait "${QUEUES[@]}"
echo "all shards ended after $((SECONDS - START)) s"

STATUS=0
merge() {  # script json names...: merges the named shards' JSON files that were written, into $OUT/merged
  local script=$1 json=$2 name inputs=()
  shift 2
  for name in "$@"; do
    if [[ -f $OUT/$name/$json && $(cat "$OUT/logs/$name.rc" 2>/dev/null) == 0 ]]; then
      inputs+=("$OUT/$name/$json")
    else
      echo "shard $name failed (see $OUT/logs/$name.log): left out of the merge" >&2
      STATUS=1
    fi
  done
  ((${#inputs[@]})) || { echo "no $json to merge" >&2; STATUS=1; return; }
  "$PYTHON" "samples/$script" --merge "${inputs[@]}" --out-dir "$OUT/merged" > "$OUT/logs/merge_${json%.json}.log" 2>&1 \
      || { echo "merging $json failed (see $OUT/logs/merge_${json%.json}.log)" >&2; STATUS=1; }
}
GPT=(gpt_parts12) HF=()
for ((k = 0; k < SEEDS; k++)); do GPT+=("gpt_seed$k") HF+=("hf_seed$k"); done
merge recipe_study.py recipe_study.json "${GPT[@]}"
merge recipe_study_hf.py recipe_study_hf.json "${HF[@]}"
echo "done after $((SECONDS - START)) s (exit $STATUS); the merged results in $OUT/merged:"
ls "$OUT/merged" 2>/dev/null
exit $STATUS
