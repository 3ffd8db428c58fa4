"""Start shard processes (spawned, real gloo over loopback, a FileStore in a temp dir) and collect results."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

LIMIT_SEC = 90  # no test may wait longer for its processes: a hang fails the test instead


def run_processes(target: Callable[..., None], arg_lists: Sequence[tuple], kwarg_lists: Sequence[dict] | None = None,
                  limit: float = LIMIT_SEC) -> list[int | None]:
    """Run `target(*args, **kwargs)` in one spawned process per entry; their exit codes (None: still
    running after `limit` seconds, then killed)."""
    ctx = _context()
    kwarg_lists = kwarg_lists or [{} for _ in arg_lists]
    procs = [ctx.Process(target=target, args=args, kwargs=kwargs) for args, kwargs in zip(arg_lists, kwarg_lists)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit
    codes = []
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        codes.append(p.exitcode)
        if p.exitcode is None:
            p.kill()
            p.join()
    return codes


def _context() -> mp.context.BaseContext:
    """A forkserver that imported graphpar once: each shard then starts in milliseconds, not seconds,
    from a clean single-threaded process (forking pytest itself, whose thread pools ran, is unsafe)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.multihost.workers", "graphpar.data_parallel_model", "graphpar.ops"])
    return ctx


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def assert_identical(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], keys: Any = None) -> None:
    """Bit-identical on `keys` (default: every key of `actual`), every key present in both."""
    keys = list(actual) if keys is None else list(keys)
    assert keys
    for key in keys:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)
