"""benchmarks/gpu.py on the CPU: its counting against stand-ins (sync-debug-mode warnings, a profiler
table), a smoke run of a case on logical CUDA devices (every contender measured or said why not, the
JSON rewritten after each), the compile's own process and time limit, and no GPU: status 0."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from benchmarks import gpu


def test_syncs_are_the_sync_debug_modes_warnings_per_step():
    """torch.cuda.set_sync_debug_mode("warn") makes each synchronizing call warn; the benchmark's
    own synchronizations are outside the window (the profiler's counted 0.67 per step for everyone)."""
    modes = []

    def step() -> None:
        warnings.warn("called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp)",
                      stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # same line: counted again
        warnings.warn("something else", stacklevel=1)

    assert gpu.count_syncs(step, 4, modes.append) == 2.0 and modes == ["warn", "default"]
    assert gpu.count_syncs(lambda: None, 4, modes.append) == 0.0

    def failing() -> None:
        raise RuntimeError("a step that fails")

    with pytest.raises(RuntimeError):
        gpu.count_syncs(failing, 1, modes.append)
    assert modes[-1] == "default"  # the debug mode is switched off again


def test_copies_come_from_the_profiler_table_less_an_empty_bodys():
    table = [("cudaDeviceSynchronize", 2), ("Memcpy HtoD (Pageable -> Device)", 3), ("Memcpy HtoD (Pinned -> Device)", 3),
             ("Memcpy DtoH (Device -> Pageable)", 3), ("Memcpy DtoD (Device -> Device)", 6), ("aten::item", 9)]
    baseline = [("cudaDeviceSynchronize", 1), ("Memcpy DtoD (Device -> Device)", 3)]
    assert gpu.copies(table, baseline, 3) == {"h2d": 2.0, "d2h": 1.0, "d2d": 1.0, "h2d_pageable": 1.0}


def test_a_smoke_case_measures_every_contender_and_rewrites_the_json_after_each(tmp_path, monkeypatch):
    out = tmp_path / "gpu.json"
    seen = []
    write = gpu.Report.write

    def spy(self, partial: bool) -> None:
        write(self, partial)
        seen.append((partial, len(json.loads(out.read_text())["results"].get("mlp", {}))))

    monkeypatch.setattr(gpu.Report, "write", spy)
    assert gpu.main(["--smoke", "--cases", "mlp", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = payload["results"]["mlp"]
    assert payload["partial"] is False and payload["smoke"] is True and payload["torch"] == torch.__version__
    assert list(rows) == list(gpu.cases(True)["mlp"].contenders)
    for name, r in rows.items():
        assert r["step_ms"] > 0 and r["images_per_s"] == pytest.approx(32e3 / r["step_ms"]), name
        assert r["syncs"] == r["h2d"] == r["d2h"] == r["d2d"] == 0 and r["resident_mib"] is None, name
    assert seen == [*((True, k) for k in range(1, len(rows) + 1)), (False, len(rows))]


def test_a_compile_that_runs_out_of_time_loses_only_its_own_row(tmp_path):
    opts = gpu.parse_args(["--smoke", "--out", str(tmp_path / "gpu.json")])
    row = gpu.compile_in_subprocess("mlp", opts, seconds=0.01)
    assert row == {"note": "not measured: the compile and its steps did not finish within 0 s"}


@pytest.mark.slow
def test_the_compile_is_measured_in_a_process_of_its_own(tmp_path):
    opts = gpu.parse_args(["--smoke", "--out", str(tmp_path / "gpu.json")])
    row = gpu.compile_in_subprocess("mlp", opts, seconds=240)
    assert row["step_ms"] > 0 and row["note"].startswith("torch.compile(backend='eager')"), row


def test_a_case_past_the_budget_is_skipped_with_the_reason(tmp_path):
    assert gpu.main(["--smoke", "--cases", "mlp", "--budget-s", "0", "--out", str(tmp_path / "g.json")]) == 0
    rows = json.loads((tmp_path / "g.json").read_text())["results"]["mlp"]
    assert {r["note"] for r in rows.values()} == {"skipped: 0 s of the budget left"}


def test_without_cuda_nothing_is_measured_and_the_exit_status_is_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--out", str(tmp_path / "g.json")]) == 0
    assert "no CUDA device here; nothing measured" in capsys.readouterr().out and not (tmp_path / "g.json").exists()


def test_resident_memory_counts_a_graphs_pool_once_by_its_reserved_segments(monkeypatch):
    """A contender's resident memory: what it keeps allocated after its build and warm-up, less the live
    tensors of a CUDA graph's private pool, plus that pool's reserved segments (its intermediates stay
    reserved there between replays). A stand-in for torch.cuda's memory counters."""
    state = {"allocated": 1000, "segments": []}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: state["segments"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    runs = []

    def make():
        state["allocated"] += 100  # params and momentum

        def step() -> None:
            runs.append(1)
            if len(runs) == 3:  # the capture: a pool of 512 bytes, 300 of them the graph's outputs
                state["allocated"] += 300
                state["segments"] = [
                    {"device": 0, "segment_pool_id": (0, 1), "total_size": 512, "allocated_size": 300},
                    {"device": 0, "segment_pool_id": (0, 0), "total_size": 4096, "allocated_size": 1400},
                    {"device": 1, "segment_pool_id": (0, 2), "total_size": 2048, "allocated_size": 0}]

        return step

    contender = gpu.build("graphpar cuda_graph", make, gpu.Machine(torch.device("cuda", 0), smoke=False), 3)
    assert contender.resident == 100 + 512 and len(runs) == 3
    state["segments"] = []
    assert gpu.build("eager", make, gpu.Machine(torch.device("cuda", 0), smoke=False), 1).resident == 100
