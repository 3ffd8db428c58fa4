"""benchmarks/gpu.py's logic, run on the CPU (`--device cpu --quick`): every contender is built and
measured, or reported with the reason it is not; without CUDA the GPU run says so and exits 0."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu


def test_a_quick_cpu_run_measures_every_contender_or_says_why_not(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # its timer would sync a (faked) GPU
    payload = gpu.run(gpu.parse_args(["--device", "cpu", "--quick", "--models", "mlp"]))
    results = payload["results"]["mlp"]
    assert payload["device"] == "cpu" and payload["torch"] == torch.__version__
    for name in ("eager", "graphpar simple", "graphpar dag"):
        r = results[name]
        assert r["step_ms"] > 0 and r["images_per_s"] == pytest.approx(32e3 / r["step_ms"])
        assert r["syncs"] == r["h2d"] == r["d2d"] == 0 and r["resident_mib"] is None  # CPU: no CUDA traffic or memory
    assert results["eager + torch.compile"] == {"note": "skipped: --quick"}
    cuda_graph = results["graphpar cuda_graph"]
    assert "step_ms" in cuda_graph or cuda_graph["note"].startswith("not available: ")
    table = gpu.table(payload["results"])
    assert table.count("\n| mlp |") == 5 and "| mlp | eager | " in table


def test_without_cuda_nothing_is_measured_and_the_exit_status_is_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--save"]) == 0
    assert "no CUDA device here; nothing measured" in capsys.readouterr().out
