"""The first thing a command does: take Ctrl-C, before anything else is imported.

Imports only `os` and `signal`, so a tool installs `exit_on_interrupt()` within a few milliseconds of
its start (`graphpar.examples.cli`, which imports argparse and logging, took 70 ms more: a Ctrl-C then
raised a KeyboardInterrupt with a traceback, and `python -m` ended by SIGINT).
"""

from __future__ import annotations

import os
import signal

INTERRUPTED = 130  # the shell's status for a process ended by SIGINT (128 + 2)


def exit_on_interrupt(quiet: bool = False) -> None:
    """Until `cli.guard` takes over: a Ctrl-C (while torch loads, say) ends the process at once, status
    130, with one line (none with `quiet`, nor on the other ranks of a launched job). Nothing has been
    written yet, so there is nothing to clean up."""
    quiet = quiet or int(os.environ.get("RANK", 0)) != 0

    def stop(signum: int, frame: object) -> None:
        if not quiet:
            os.write(2, b"\ninterrupted\n")
        os._exit(INTERRUPTED)

    signal.signal(signal.SIGINT, stop)
    # a process `launch.launch` started has SIGINT blocked until it can stop cleanly: from here it can
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
