"""Caffe2's `timeout_guard`: `CompleteInTimeOrDie(seconds)` ends the process if its block runs too long.

Caffe2's trainers wrap each step in it, so a hung collective (a peer that died) kills the trainer
instead of blocking it forever. On timeout a watcher thread logs the stacks of all threads and exits
the process with status 1 (`os._exit`: a hung thread could not be interrupted otherwise).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


def _die(seconds: float) -> None:
    stacks = "\n".join(f"thread {ident}:\n{''.join(traceback.format_stack(frame))}"
                       for ident, frame in sys._current_frames().items())
    log.error("CompleteInTimeOrDie: the block did not complete in %s s; exiting. Stacks:\n%s", seconds, stacks)
    logging.shutdown()
    os._exit(1)


@contextmanager
def CompleteInTimeOrDie(timeout_secs: float) -> Iterator[None]:  # noqa: N802 - Caffe2's name
    """Run the block; if it has not completed after `timeout_secs`, log every thread's stack and exit
    the process with status 1.

    Raises:
        ValueError: a timeout that is not a positive number.
    """
    if isinstance(timeout_secs, bool) or not isinstance(timeout_secs, (int, float)) or not timeout_secs > 0:
        raise ValueError(f"CompleteInTimeOrDie: timeout_secs must be a positive number, got {timeout_secs!r}")
    done = threading.Event()
    def watch() -> None:
        if not done.wait(timeout_secs):
            _die(timeout_secs)

    watcher = threading.Thread(target=watch, daemon=True, name="CompleteInTimeOrDie")
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
