#!/usr/bin/env bash
# Everything the GPU can check: the GPU tests, the samples and a short GPT training, on the tree it runs from.
#
# Usage (from the repository root on a CUDA machine):
#   MXATTN_TREE=<hash> bash benchmarks/device_checks.sh [pytest -k expression]
# Logs go to $OUT (default ./device-logs): gpu.txt (nvidia-smi), info.txt (`python -m mxattn info`),
# gpu_tests.txt (pytest), samples.txt, samples_status.txt, train_gpt.txt, and at the end gpu_check.txt:
#   tree <hash>            which library ran: `git ls-files -s mxattn ref | sha256sum | cut -c1-16` of the commit
#   device <name> ...      nvidia-smi's name and driver of the first visible GPU
#   date <YYYY-MM-DD>
#   tests <selection>      the pytest selection (-m, paths, -k), or why no tests ran
#   passed N, skipped N, failed N, errors N   one line each, from pytest's summary line ("incomplete" when the run
#                          was cut short and printed none)
#   samples N ran, M failed
# Copy gpu_check.txt to benchmarks/results/<gpu>/gpu_check.txt (the folder `python -m mxattn bench` writes to) to
# record which tree passed on that GPU; each run's file replaces the last.
#
# MXATTN_TREE: the tree hash, computed where the repository is (the device machine often gets a copy of the
# working tree without .git): MXATTN_TREE=$(git ls-files -s mxattn ref | sha256sum | cut -c1-16). Without it the
# script computes it with git when .git exists (marked "+ uncommitted changes" when mxattn/ or ref/ differ from
# HEAD), else writes "tree unknown".
#
# Install what the machine lacks into the interpreter that runs the tests, `python -m pip install --no-deps
# <wheels>` (nvidia-cudnn-frontend, apache-tvm-ffi, pytest-xdist): a bare `pip` may belong to another Python, and
# without the frontend the cudnn test modules fail to import. info.txt shows what the tests will see.
#
# PART=all (default): the tests, with the samples and the training beside them (the samples' timings are then not
#   figures to quote; the benchmarks give those).
# PART=tests: the tests alone, one pytest-xdist worker per CPU core (Triton's compiles dominate their time).
# PART=samples: the samples and the training alone.
# The whole test set can outgrow one time-limited call on a device machine: split it with the -k argument
# ("not gluon", then "gluon"; the Gluon kernels' tests are the slowest to compile), one call each, or run the parts
# side by side on two GPUs (CUDA_VISIBLE_DEVICES, a WORKERS count and an OUT folder each). Each part's
# gpu_check.txt names its selection.
# The run is mostly Triton building kernels, so a cache of the builds can travel between machines:
# TESTS_TIME_LIMIT: seconds after which the tests are interrupted (with a summary of what ran), for a call with a
#   time limit; an interrupted run is no pass.
# TRITON_CACHE_IN: the pieces of an archive an earlier run saved (a glob, e.g. ".tcache/triton.tgz.*"), unpacked
#   into the cache before the tests (the builds of an unchanged kernel source are then reused, whatever else changed);
# TRITON_CACHE_OUT: a folder where the run leaves its cache (binaries, metadata and PTX; 15 MiB pieces
#   triton.tgz.aa, .ab, ...) when it ends. The cache lives at TRITON_CACHE_DIR (default ~/.triton/cache), and the
#   archive holds absolute paths, so reuse it on a machine with the same TRITON_CACHE_DIR.
set -u
OUT=${OUT:-device-logs}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -n "${TRITON_CACHE_IN:-}" ]; then
  # shellcheck disable=SC2086  # (the glob is meant to expand)
  cat $TRITON_CACHE_IN | tar -xzPf - && echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) builds from $TRITON_CACHE_IN"
fi
PART=${PART:-all}
case "$PART" in all|tests|samples) ;; *) echo "PART must be all, tests or samples, got $PART" >&2; exit 2 ;; esac
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python -m mxattn info 2>&1 | tee "$OUT/info.txt"
# every test marked gpu or blackwell, in every file (new GPU test files are picked up without editing this);
# in parallel workers when pytest-xdist is there: 8 beside the samples, one per CPU core alone (WORKERS in the
# environment wins). test_formats.py needs torchao (a CPU-only oracle) and holds no GPU test. --durations: the
# slowest tests in the log, to see what to split off when the set outgrows a call.
WORKERS=${WORKERS:-$([ "$PART" = tests ] && nproc || echo 8)}
XDIST=$(python -c "import xdist" 2>/dev/null && echo "-n $WORKERS -p no:benchmark")
SELECTION="-m \"gpu or blackwell\" tests --ignore tests/quantization/test_formats.py${1:+ -k \"$1\"}"
# TESTS_TIME_LIMIT (seconds): interrupt the tests then (SIGINT: pytest still prints its summary of what ran, and
# gpu_check.txt says "interrupted"), so a time-limited call keeps its logs and its Triton cache
LIMIT=${TESTS_TIME_LIMIT:+timeout --signal=INT --kill-after=30 $TESTS_TIME_LIMIT}
TESTS=
if [ "$PART" != samples ]; then
  # shellcheck disable=SC2086  # ($LIMIT and $XDIST are word lists)
  $LIMIT python -m pytest -q -ra --durations=30 -p no:cacheprovider $XDIST -m "gpu or blackwell" tests \
      --ignore tests/quantization/test_formats.py ${1:+-k "$1"} > "$OUT/gpu_tests.txt" 2>&1 &
  TESTS=$!
fi
: > "$OUT/samples_status.txt"
run_sample() {  # one sample: its command line first, and "ok" or "failed <exit status>" in samples_status.txt
  echo "### $*"
  "$@"
  local rc=$?
  if [ $rc -eq 0 ]; then echo "ok $*"; else echo "failed $rc $*"; fi >> "$OUT/samples_status.txt"
  return $rc
}
if [ "$PART" != tests ]; then
  {
    run_sample python -m mxattn demo
    run_sample python -m mxattn demo --causal --heads 16 --kv-heads 4 --seq 4096
    run_sample python samples/compare_with_ref.py --backend triton --batch 2 --heads 8 --kv-heads 2 --seq 1000 --causal
    run_sample python samples/cudnn_graphs.py
    run_sample python samples/forward.py
    run_sample python samples/backward.py
    run_sample python samples/varlen.py
    run_sample python samples/kvcache_decode.py --device cuda
    if python -c "import transformers" 2>/dev/null; then
      run_sample python samples/hf_swap.py --device cuda
      run_sample python samples/serve.py --device cuda --prompts 8 --new-tokens 32
    fi
  } 2>&1 | tee "$OUT/samples.txt"
  run_sample python samples/train_gpt.py --device cuda --layers 4 --dim 256 --heads 4 --seq 256 --batch 32 --steps 500 \
      --out "$OUT" 2>&1 | tail -n 25 | tee "$OUT/train_gpt.txt"
fi
if [ -n "$TESTS" ]; then
  wait $TESTS
  tail -n 40 "$OUT/gpu_tests.txt"
fi

# gpu_check.txt: which tree ran, where, when, and what passed
if [ -n "${MXATTN_TREE:-}" ]; then
  TREE=$MXATTN_TREE
elif git rev-parse --git-dir > /dev/null 2>&1; then
  TREE=$(git ls-files -s mxattn ref | sha256sum | cut -c1-16)
  git diff --quiet HEAD -- mxattn ref || TREE="$TREE + uncommitted changes"
else
  TREE=unknown
fi
{
  echo "tree $TREE"
  GPU=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
  GPU=${GPU:-unknown}
  echo "device ${GPU/, /, driver }"
  echo "date $(date -u +%Y-%m-%d)"
  if [ "$PART" = samples ]; then
    echo "tests not run (PART=samples)"
  else
    echo "tests $SELECTION"
    # pytest's summary: the last line that ends in the run's time ("... 71 skipped, 116 warnings in 371.57s (0:06:11)")
    SUMMARY=$(grep -E ' in [0-9.]+s( \([0-9:]+\))?( =+)?$' "$OUT/gpu_tests.txt" | tail -n 1)
    if [ -z "$SUMMARY" ]; then
      echo "incomplete: no pytest summary line in gpu_tests.txt (the run was cut short)"
    else
      if grep -qE '^(!+ KeyboardInterrupt|.*Interrupted)' "$OUT/gpu_tests.txt"; then
        echo "interrupted after TESTS_TIME_LIMIT=${TESTS_TIME_LIMIT:-?}s: the counts below are of the tests that ran"
      fi
      for what in passed skipped failed error; do
        n=$(echo "$SUMMARY" | grep -oE "[0-9]+ ${what}s?\b" | grep -oE '^[0-9]+')
        echo "$([ $what = error ] && echo errors || echo $what) ${n:-0}"
      done
    fi
  fi
  if [ "$PART" = tests ]; then
    echo "samples not run (PART=tests)"
  else
    echo "samples $(grep -c . "$OUT/samples_status.txt") ran, $(grep -c '^failed' "$OUT/samples_status.txt") failed"
  fi
} > "$OUT/gpu_check.txt"
cat "$OUT/gpu_check.txt"
if [ -n "${TRITON_CACHE_OUT:-}" ]; then
  mkdir -p "$TRITON_CACHE_OUT"
  # a later run reads the binaries, their metadata, the PTX (some tests read it) and the compiled launchers; the
  # intermediate IRs stay behind
  find "$TRITON_CACHE_DIR" -type f ! -name '*.cubin' ! -name '*.json' ! -name '*.ptx' ! -name '*.so' -delete
  tar -czPf - "$TRITON_CACHE_DIR" | split -b 15M - "$TRITON_CACHE_OUT/triton.tgz."
  echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) builds saved to $TRITON_CACHE_OUT ($(du -sh "$TRITON_CACHE_OUT" | cut -f1))"
fi
