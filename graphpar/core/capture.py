"""Whether the kernels running now are being captured in a CUDA graph (`executor.graphs`).

A captured step is replayed with one launch: once the capture succeeded, no op of a replay can fail
on the host after another op changed state. So a kernel that copies persistent state only to leave it
unchanged when a later op of the run fails (SpatialBN's running statistics, see `ops.norm`) may update
it in place while `capturing()` is true: in a graph, that state is the capture's static buffer, which
then stays the workspace's blob (no copy into the static buffer before the next replay either).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_state = threading.local()


def capturing() -> bool:
    """Whether this thread is running a step's kernels for a CUDA-graph capture (or the stand-in's replay)."""
    return getattr(_state, "capturing", False)


@contextmanager
def capture() -> Iterator[None]:
    """Within the block, `capturing()` is true in this thread."""
    old, _state.capturing = capturing(), True
    try:
        yield
    finally:
        _state.capturing = old
