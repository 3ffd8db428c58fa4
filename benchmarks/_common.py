"""Shared benchmark helpers: alternated timing, medians, Markdown tables and JSON results."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def synchronize() -> None:
    """Wait for queued CUDA work, so a timer stops after the GPU is done (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_once(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds one call of `fn` takes on `clock`, GPU work included.

    The default is wall-clock time. Single-threaded CPU work may pass `time.thread_time`: CPU time
    of this thread only, so time spent descheduled on a busy machine does not count.
    """
    synchronize()
    start = clock()
    fn()
    synchronize()
    return clock() - start


def compare(candidates: dict[str, Callable[[], Any]], repeats: int = 20, warmup: int = 3,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Time each candidate `repeats` times, alternating between them in one process, after `warmup` rounds.

    Alternating spreads slow drifts (frequency scaling, other processes) evenly over the candidates.
    `clock` is as in `time_once`. Returns {name: [seconds per repeat]}.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            times[name].append(time_once(fn, clock))
    return times


def median(values: Sequence[float]) -> float:
    """The median of `values`."""
    return statistics.median(values)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; floats are printed with 3 significant digits."""
    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """Where a result was measured: Python, torch, CPU threads and the GPU if any."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "torch_threads": torch.get_num_threads(), "gpu": gpu}


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write `payload` plus the environment to benchmarks/results/NAME.json; return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({**payload, "environment": environment()}, indent=2) + "\n")
    return path
