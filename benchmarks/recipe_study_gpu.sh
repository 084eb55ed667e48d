#!/usr/bin/env bash
# The GPU-sized recipe study (issue 22) on every visible GPU of one machine at once, then merged. The study's jobs --
# every training run (script, seed, run label: the baseline or one recipe) of samples/recipe_study.py (GPT) and of
# samples/recipe_study_hf.py (Llama), and parts 1 and 2 of recipe_study.py as one more job -- are spread over the
# GPUs by benchmarks/recipe_study_plan.py so that each GPU's estimated time is about the same: each GPU runs a queue
# of processes one after another (CUDA_VISIBLE_DEVICES), a process training consecutive seeds x a set of runs
# (--seed k --seeds n --runs ...; as few processes as the balance allows, each paying imports, data loading and the
# first Triton compiles once), each with its log. The plan (each GPU's processes and estimated seconds) is printed
# before anything starts; then both scripts' --merge write the tables (and plots) a single run over every seed
# would have written (the merge refuses a study with a (run, seed) missing, e.g. a failed shard: it names it).
#
# Usage (from anywhere; it runs from the repository root):
#   bash benchmarks/recipe_study_gpu.sh
#   STEPS=20 SEEDS=2 OUT=/tmp/smoke bash benchmarks/recipe_study_gpu.sh     # a short smoke run
#   python benchmarks/recipe_study_plan.py --gpus 4 --seeds 3 --steps 1000  # the plan only (no GPU needed)
# Environment:
#   SEEDS          seeds 0 .. SEEDS-1 (default 3)
#   STEPS          training steps per run (default: --size gpu's, 2000); also given to the parts-1-and-2 shard,
#                  whose result must match the training shards' to merge
#   OUT            output folder (default benchmarks/results/<gpu name>/recipe_study): a shard's files in
#                  $OUT/<shard>/ (gpt_parts12, gpt_gpu<q>_<k>, hf_gpu<q>_<k>: the k-th process of the q-th GPU),
#                  logs in $OUT/logs/, the merged recipe_study.{json,md,png} and recipe_study_hf.{json,md} in
#                  $OUT/merged/
#   SHARD_TIMEOUT  seconds after which a shard is stopped (default: none); its runs are then missing from the merge,
#                  which refuses the study (the shards' own files and logs stay)
#   CUDA_VISIBLE_DEVICES  the GPUs to use (default: every GPU nvidia-smi lists)
#   PYTHON         the Python to run (default python)
#   PLAN_ARGS      more options of benchmarks/recipe_study_plan.py, e.g. "--per-tensor-weight 6 --hf-weight 1.5"
#                  (its cost estimates; see its docstring)
# Each shard prints "shard <name> on GPU <g>: <s> s, exit <rc>" as it ends; the script exits 1 when a shard or a
# merge failed.
#
# Expected time: the plan prints its estimate per GPU -- estimates from session 18's H100 study
# (benchmarks/results/nvidia-h100-80gb-hbm3/session18/): a GPT run ~0.02 s per step once compiled, the per-tensor
# recipe (reference backend) ~9x that, a process's start-up and first compiles ~20 s, parts 1 and 2 90 s; the
# transformers runs are not measured on a GPU (guessed as the GPT's). With 4 GPUs and 3 seeds the plan estimates
# ~590 s a GPU at STEPS=1000 and ~470 s at STEPS=750: under a 550 s call, STEPS=750 or fewer (or 8 GPUs at 1000:
# ~310 s). SHARD_TIMEOUT (e.g. 500) keeps a call within its limit, at the cost of the merge.
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

# the plan (benchmarks/recipe_study_plan.py): the processes, each GPU's run one after another; its words on stderr
PLAN=$("$PYTHON" benchmarks/recipe_study_plan.py --gpus "$NGPU" --gpu-ids "$(IFS=,; echo "${GPUS[*]}")" \
       --seeds "$SEEDS" ${STEPS:+--steps "$STEPS"} ${PLAN_ARGS:-}) || { echo "planning failed" >&2; exit 2; }
QUEUE=() NAMES=() SCRIPTS=() SEED0=() NSEEDS=() RUNS=() JSONS=()
while IFS=$'\t' read -r q name script seed nseeds runs _; do
  QUEUE+=("$q") NAMES+=("$name") SCRIPTS+=("$script") SEED0+=("$seed") NSEEDS+=("$nseeds") RUNS+=("$runs")
  JSONS+=("${script%.py}.json")
done <<< "$PLAN"
NSHARDS=${#NAMES[@]}
PARALLEL=$(printf '%s\n' "${QUEUE[@]}" | sort -u | wc -l)   # the GPUs with work (all, unless very few runs)
THREADS=$(($(nproc) / PARALLEL)); ((THREADS >= 1)) || THREADS=1   # the CPU cores shared by the processes at once
COMMON="--size gpu --device cuda --backend auto --threads $THREADS${STEPS:+ --steps $STEPS}"
echo "recipe study: $NSHARDS processes on $NGPU GPU(s) (${GPUS[*]}, ${GPU_NAME:-unknown}), seeds 0..$((SEEDS - 1)),"\
     "steps ${STEPS:-of --size gpu}, $THREADS CPU threads each; output in $OUT"

shard_args() {  # index: the shard's arguments besides COMMON and --out-dir, one per line
  local j=$1
  if [[ ${RUNS[$j]} == - ]]; then
    printf '%s\n' --skip-training --seeds "$SEEDS"                          # parts 1 and 2
  else
    [[ ${SCRIPTS[$j]} == recipe_study.py ]] && printf '%s\n' --skip-errors --skip-future
    printf '%s\n' --seed "${SEED0[$j]}" --seeds "${NSEEDS[$j]}"
    [[ ${RUNS[$j]} != '*' ]] && printf '%s\n' --runs "${RUNS[$j]}"         # labels hold spaces: one argument
  fi
}

run_shard() {  # index gpu: runs shard `index` on `gpu`, its output in $OUT/logs/<name>.log and its exit code in .rc
  local j=$1 gpu=$2 name=${NAMES[$1]} start=$SECONDS rc args
  rm -f "$OUT/$name/${JSONS[$j]}" "$OUT/logs/$name.rc"   # no earlier run's result is merged in its place
  mapfile -t args < <(shard_args "$j")
  # shellcheck disable=SC2086  # COMMON is a list of plain words
  CUDA_VISIBLE_DEVICES=$gpu ${SHARD_TIMEOUT:+timeout "$SHARD_TIMEOUT"} \
      "$PYTHON" "samples/${SCRIPTS[$j]}" $COMMON "${args[@]}" --out-dir "$OUT/$name" > "$OUT/logs/$name.log" 2>&1
  rc=$?
  echo "$rc" > "$OUT/logs/$name.rc"
  echo "shard $name on GPU $gpu: $((SECONDS - start)) s, exit $rc$( ((rc == 124)) && echo ' (SHARD_TIMEOUT)')"
}

run_queue() {  # q: runs the shards the plan gives GPU q (the q-th of GPUS) one after another
  local q=$1 j
  for ((j = 0; j < NSHARDS; j++)); do
    if ((QUEUE[j] == q)); then run_shard "$j" "${GPUS[$q]}"; fi
  done
}

START=$SECONDS
QUEUES=()
for ((q = 0; q < NGPU; q++)); do
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
GPT=() HF=()
for ((j = 0; j < NSHARDS; j++)); do
  if [[ ${SCRIPTS[$j]} == recipe_study.py ]]; then GPT+=("${NAMES[$j]}"); else HF+=("${NAMES[$j]}"); fi
done
merge recipe_study.py recipe_study.json "${GPT[@]}"
merge recipe_study_hf.py recipe_study_hf.json "${HF[@]}"
echo "done after $((SECONDS - START)) s (exit $STATUS); the merged results in $OUT/merged:"
ls "$OUT/merged" 2>/dev/null
exit $STATUS
