"""tools/gpu_check.sh and tools/preflight.py without a GPU: the script's stages, in order, with the
commands a GPU run gets, each result in summary.txt as it ends, no stale gpu.json left by a failed
run (a stand-in Python records the calls); the preflight's cuDNN check on a batch-norm stand-in."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
out=""; prev=""
for a in "$@"; do [ "$prev" = "--out" ] && out=$a; prev=$a; done
case "$*" in
    "-c "*) exit 0 ;;
    *preflight.py*) echo "preflight: ok in 0.1 s" ;;
    *benchmarks.gpu*)
        [ "$BENCH_RC" = 0 ] && echo '{"partial": false, "fresh": true}' > "$out"
        echo "benchmarks.gpu: 3 of 3 contenders measured in 1 s"; exit "$BENCH_RC" ;;
    *"-m cuda"*) echo "2 passed in 0.1s" ;;
    *) echo "$SUITE_SAYS"; exit "$SUITE_RC" ;;
esac
"""


def _check(tmp_path: Path, *argv: str, bench_rc: int = 0, suite_rc: int = 0,
           suite_says: str = "5 passed in 0.1s") -> tuple[int, list[str], str]:
    """Run a copy of gpu_check.sh in `tmp_path` with the stand-in Python: (status, calls, summary)."""
    (tmp_path / "tools").mkdir(exist_ok=True)
    shutil.copy(ROOT / "tools" / "gpu_check.sh", tmp_path / "tools" / "gpu_check.sh")
    python = tmp_path / "python3"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    calls = tmp_path / "calls.log"
    calls.unlink(missing_ok=True)
    env = {**os.environ, "PY": str(python), "OUT": str(tmp_path / "logs"), "CALLS": str(calls),
           "BENCH_RC": str(bench_rc), "SUITE_RC": str(suite_rc), "SUITE_SAYS": suite_says}
    done = subprocess.run(["bash", str(tmp_path / "tools" / "gpu_check.sh"), *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    return done.returncode, calls.read_text().splitlines(), (tmp_path / "logs" / "summary.txt").read_text()


def test_the_gpu_run_orders_its_stages_and_never_leaves_a_stale_figure_file(tmp_path: Path) -> None:
    results = tmp_path / "benchmarks" / "results" / "gpu.json"
    results.parent.mkdir(parents=True)
    results.write_text('{"stale": true}')
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "gpu.json").write_text('{"stale": true}')
    code, calls, summary = _check(tmp_path)
    stages = [c for c in calls if not c.startswith("-c ")]
    assert code == 0 and len(stages) == 4, calls
    assert stages[0] == "tools/preflight.py --gpu"
    assert "--timeout 45 -m cuda tests" in stages[1]
    assert stages[2].startswith("-m benchmarks.gpu --out ") and "--compile-timeout-s" in stages[2]
    assert "-n 14 --timeout 45 -m not cuda --junitxml=" in stages[3]
    names = [line.split(":")[0] for line in summary.splitlines()]
    assert names == ["preflight", "cuda_tests", "benchmark", "suite", "gpu_check"], summary
    assert "suite: exit 0 after" in summary and "5 passed" in summary and "every stage passed" in summary
    assert json.loads(results.read_text()) == {"partial": False, "fresh": True}

    code, _, summary = _check(tmp_path, bench_rc=1, suite_rc=1, suite_says="1 failed, 4 passed in 0.1s")
    assert code == 1 and "benchmark: exit 1" in summary and "1 failed" in summary and "a stage failed" in summary
    assert not results.exists() and not (tmp_path / "logs" / "gpu.json").exists()  # no stale figures


def test_the_smoke_run_checks_every_stage_without_a_gpu_and_keeps_the_committed_figures(tmp_path: Path) -> None:
    results = tmp_path / "benchmarks" / "results" / "gpu.json"
    results.parent.mkdir(parents=True)
    results.write_text('{"committed": true}')
    code, calls, summary = _check(tmp_path, "--smoke")
    stages = [c for c in calls if not c.startswith("-c ")]
    assert code == 0 and stages[0] == "tools/preflight.py" and "-m benchmarks.gpu --smoke --out" in stages[2]
    assert len(stages) == 4 and summary.splitlines()[-1].startswith("gpu_check: every stage passed")
    assert json.loads(results.read_text()) == {"committed": True}


def _preflight() -> ModuleType:
    spec = importlib.util.spec_from_file_location("preflight", ROOT / "tools" / "preflight.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_preflight_fails_unless_batch_norm_ran_cudnns_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """On logical CUDA devices (the CPU) SpatialBN runs the native kernel: the check fails, naming it;
    with cuDNN's kernel (a stand-in that leaves its reserve space on the saved mean) it passes."""
    from graphpar.devices import cuda_on_cpu
    from graphpar.ops import norm

    preflight = _preflight()
    with cuda_on_cpu(), pytest.raises(AssertionError, match="did not run cuDNN's batch norm"):
        preflight._cudnn_batch_norm_runs()

    def cudnn(x, scale, bias, rm, rv, factor, eps):  # noqa: ANN001, ANN202
        return (*torch.native_batch_norm(x, scale, bias, rm, rv, True, factor, eps), torch.zeros(1))

    monkeypatch.setattr(norm, "_uses_cudnn", lambda *args: True)
    monkeypatch.setattr(norm, "_cudnn_forward", cudnn)
    with cuda_on_cpu():
        assert preflight._cudnn_batch_norm_runs() == "SpatialBN runs cuDNN's batch norm"
