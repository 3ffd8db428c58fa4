#!/usr/bin/env bash
# The one GPU check (issue 21): run it from the repository root on a machine with a CUDA GPU.
#
#   bash tools/gpu_check.sh            # logs go to $OUT if set (a device session's result folder),
#                                      # else to gpu_check_logs/
#
# In under 8 minutes, in this order (a stage that runs out of time is stopped, the others still run):
#   1. pytest -m cuda                  the tests that need a real GPU           (<= 90 s)
#   2. python -m benchmarks.gpu --save graphpar vs eager on the GPU             (<= 200 s)
#   3. the whole suite, GPU present    every other test, with the GPU visible   (<= 170 s;
#                                      8 workers when pytest-xdist is installed)
# Then it prints a summary. Logs: cuda_tests.log, benchmark.log, suite.log, nvidia-smi.txt, summary.txt,
# and a copy of benchmarks/results/gpu.json (commit that file and quote it in docs/gpu.md).
# Exit status: 0 when every stage passed.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOGS="${OUT:-gpu_check_logs}"
mkdir -p "$LOGS"
PYTEST=(python -m pytest -q -p no:cacheprovider -rfE)
if python -c "import xdist" 2>/dev/null; then SUITE_WORKERS=(-n 8); else SUITE_WORKERS=(); fi

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log, record the status
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s$( { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo " (stopped at the ${limit} s limit)")" \
        | tee -a "$LOGS/summary.txt"
    tail -n 3 "$LOGS/$name.log" | sed 's/^/    /' | tee -a "$LOGS/summary.txt"
    return $rc
}

: >"$LOGS/summary.txt"
{ nvidia-smi || echo "nvidia-smi not found"; python -c "import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.is_available() and torch.cuda.get_device_name(0))"; } >"$LOGS/nvidia-smi.txt" 2>&1
failed=0
stage cuda_tests 90 "${PYTEST[@]}" -m cuda tests || failed=1
stage benchmark 200 python -m benchmarks.gpu --save --budget-s 150 --compile-needs-s 90 || failed=1
cp benchmarks/results/gpu.json "$LOGS/gpu.json" 2>/dev/null
stage suite 170 "${PYTEST[@]}" "${SUITE_WORKERS[@]}" -m "not cuda" tests || failed=1
echo "gpu_check: $([ $failed -eq 0 ] && echo "every stage passed" || echo "a stage failed"); logs in $LOGS" \
    | tee -a "$LOGS/summary.txt"
exit $failed
