#!/usr/bin/env bash
# Everything the GPU can check (run from the repo root on a CUDA machine; logs go to $OUT or ./device-logs).
# Usage: bash benchmarks/device_checks.sh [pytest -k expression]
#   PART=all (default): the GPU tests, with the samples and a short GPT training beside them
#   PART=tests: the GPU tests alone, on every CPU core; PART=samples: the samples and the training alone.
#   (The whole set took about 570 s on an H100 machine in session 18, at the device tool's 600 s per call; the
#   two parts fit one call each: the tests alone 303 s with 16 workers. Since session 29 the tests alone outgrow
#   one call too: run them as two, PART=tests with "not gluon" (404 s on an H100, 449 s on an H200 in session 30) and
#   with "gluon" (127 s; 198 s in session 30 with the dQ kernel's tests, when the kernel cache was warm from the
#   first part: on a fresh machine it ran past 300 s, so give it the call's whole limit).)
#   On a machine of two GPUs the parts can run side by side, one GPU each (CUDA_VISIBLE_DEVICES, WORKERS=16 each,
#   OUT a folder each). Session 39 on nvidia-h200-x2: "not gluon" took 492 s, while "gluon" beside it was cut at
#   440 s (78%); the next call ran "gluon and fwd" (211 s) beside "gluon and not fwd" (64 s) and the samples.
set -u
OUT=${OUT:-device-logs}
PART=${PART:-all}
case "$PART" in all|tests|samples) ;; *) echo "PART must be all, tests or samples, got $PART" >&2; exit 2 ;; esac
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python -m mxattn info 2>&1 | tee "$OUT/info.txt"
# every test marked gpu or blackwell, in every file (new GPU test files are picked up without editing this);
# in parallel workers when pytest-xdist is there (Triton compiles dominate): 8 beside the samples, one per CPU
# core alone. test_formats.py needs torchao (a CPU-only oracle) and holds no GPU test. --durations: the slowest
# tests in the log (the two test calls fill most of a session's device time).
WORKERS=${WORKERS:-$([ "$PART" = tests ] && nproc || echo 8)}  # (WORKERS in the environment wins: two parts side by side on two GPUs)
XDIST=$(python -c "import xdist" 2>/dev/null && echo "-n $WORKERS -p no:benchmark")
TESTS=
if [ "$PART" != samples ]; then
  python -m pytest -q -ra --durations=30 -p no:cacheprovider $XDIST -m "gpu or blackwell" tests --ignore tests/quantization/test_formats.py \
      ${1:+-k "$1"} > "$OUT/gpu_tests.txt" 2>&1 &
  TESTS=$!
fi
if [ "$PART" != tests ]; then
  # the samples run beside the tests (so their timings are not figures to quote; the benchmark gives those)
  {
    python -m mxattn demo
    python -m mxattn demo --causal --heads 16 --kv-heads 4 --seq 4096
    python samples/compare_with_ref.py --backend triton --batch 2 --heads 8 --kv-heads 2 --seq 1000 --causal
    python samples/cudnn_graphs.py
    python samples/forward.py
    python samples/backward.py
    python samples/varlen.py
    python samples/kvcache_decode.py --device cuda
    if python -c "import transformers" 2>/dev/null; then
      python samples/hf_swap.py --device cuda
      python samples/serve.py --device cuda --prompts 8 --new-tokens 32
    fi
  } 2>&1 | tee "$OUT/samples.txt"
  python samples/train_gpt.py --device cuda --layers 4 --dim 256 --heads 4 --seq 256 --batch 32 --steps 500 --out "$OUT" 2>&1 | tail -n 25 | tee "$OUT/train_gpt.txt"
fi
if [ -n "$TESTS" ]; then
  wait $TESTS
  tail -n 40 "$OUT/gpu_tests.txt"
fi
