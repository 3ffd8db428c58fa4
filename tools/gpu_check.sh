#!/usr/bin/env bash
# The one GPU check (issues 21, 31): run it once, from the repository root, on a machine with a CUDA GPU.
#
#   bash tools/gpu_check.sh            # on the GPU; logs to $OUT if set (a device session's result
#                                      # folder), else to gpu_check_logs/
#   bash tools/gpu_check.sh --smoke    # without a GPU: every stage's code path, the benchmark's on
#                                      # logical CUDA devices placed on the CPU (well under a minute
#                                      # of CPU time; it checks the script, it measures nothing)
#
# Within 6 minutes, correctness first, in this order; each stage has a time limit (one that runs out is
# stopped and the next one starts) and writes its result line to summary.txt as it ends:
#   1. preflight   tools/preflight.py --gpu: every package, CUDA, cuDNN batch norm      (<= 40 s)
#   2. cuda_tests  pytest -m cuda: the tests that need a GPU                            (<= 80 s)
#   3. benchmark   python -m benchmarks.gpu: every figure, gpu.json rewritten as each   (<= 190 s)
#                  is measured ("partial": true until the end), torch.compile last
#   4. suite       the rest of the suite with the GPU present (-n 14, 45 s per test), in what is left of
#                  6 minutes; it may be stopped part-way: pytest still reports what ran (suite.xml too)
# Logs: preflight.log, cuda_tests.log, benchmark.log, suite.log (+ suite.xml), nvidia-smi.txt, summary.txt,
# and gpu.json (also written to benchmarks/results/gpu.json: commit it and quote it in docs/gpu.md).
# Exit status: 0 when stages 1-3 passed and the suite had no failure (a suite stopped by its limit passes
# if nothing that ran failed).
set -u
cd "$(dirname "$0")/.."
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOGS="${OUT:-gpu_check_logs}"
mkdir -p "$LOGS"
TOTAL=360                 # seconds for the whole check
START=$SECONDS
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfE)
TIMEOUT=()
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT=(--timeout 45)

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit (SIGINT first), log, record the result
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    local how="exit $rc"
    { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && how="stopped at its ${limit} s limit (exit $rc)"
    echo "$name: $how after $((SECONDS - start)) s; $(grep -E '(passed|failed|error|skipped|preflight:|benchmarks.gpu:)' \
        "$LOGS/$name.log" | tail -n 1)" | tee -a "$LOGS/summary.txt"
    return $rc
}

: >"$LOGS/summary.txt"
rm -f "$LOGS/gpu.json" "$LOGS/suite.xml"
[ $SMOKE -eq 0 ] && rm -f benchmarks/results/gpu.json   # a failed run never leaves a stale file behind
{ nvidia-smi || echo "nvidia-smi not found"; } >"$LOGS/nvidia-smi.txt" 2>&1
failed=0

if [ $SMOKE -eq 1 ]; then
    stage preflight 40 "$PY" tools/preflight.py || failed=1
    stage cuda_tests 80 "${PYTEST[@]}" -m cuda tests/executor/test_graphs.py || failed=1
    stage benchmark 190 "$PY" -m benchmarks.gpu --smoke --out "$LOGS/gpu.json" || failed=1
    stage suite 60 "${PYTEST[@]}" tests/test_cuda_tests.py --junitxml="$LOGS/suite.xml" || failed=1
else
    WORKERS=()
    "$PY" -c "import xdist" 2>/dev/null && WORKERS=(-n 14)
    stage preflight 40 "$PY" tools/preflight.py --gpu || failed=1
    stage cuda_tests 80 "${PYTEST[@]}" "${TIMEOUT[@]}" -m cuda tests || failed=1
    stage benchmark 190 "$PY" -m benchmarks.gpu --out "$LOGS/gpu.json" --budget-s 165 --compile-timeout-s 90 \
        || failed=1
    [ -f "$LOGS/gpu.json" ] && cp "$LOGS/gpu.json" benchmarks/results/gpu.json
    left=$((TOTAL - (SECONDS - START) - 10))
    [ $left -lt 30 ] && left=30
    stage suite $left "${PYTEST[@]}" "${WORKERS[@]}" "${TIMEOUT[@]}" -m "not cuda" --junitxml="$LOGS/suite.xml" tests
    rc=$?
    # stopped by its limit: a pass if nothing that ran failed (pytest prints the summary on SIGINT)
    if [ $rc -ne 0 ] && ! { [ $rc -eq 124 ] && ! tail -n 3 "$LOGS/suite.log" | grep -qE '[0-9]+ (failed|error)'; }; then
        failed=1
    fi
fi
echo "gpu_check: $([ $failed -eq 0 ] && echo "every stage passed" || echo "a stage failed") in \
$((SECONDS - START)) s; logs in $LOGS" | tee -a "$LOGS/summary.txt"
exit $failed
