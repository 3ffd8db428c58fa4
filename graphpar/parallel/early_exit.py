"""The launcher's first act: take its signals before torch loads, while no process has started yet.

Imports only `os` and `signal`, so `python -m graphpar.launch` installs `exit_on_signals()` a few
milliseconds after graphpar's code starts (importing torch's agent takes seconds: a Ctrl-C then printed
a KeyboardInterrupt traceback and ended the launcher by SIGINT, or was lost). The agent's handlers take
over while the processes run (`graphpar.parallel.agent`).
"""

from __future__ import annotations

import os
import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # what the launcher takes


def exit_on_signals() -> None:
    """Until the agent takes over: each of SIGNALS ends this process at once with status 128 + its number,
    Ctrl-C with one line, `interrupted`. Nothing has started or been written yet, so there is nothing to
    stop or clean up. A signal ignored at start (`nohup` ignores SIGHUP) stays ignored."""

    def stop(signum: int, frame: object) -> None:
        if signum == signal.SIGINT:
            os.write(2, b"\ninterrupted\n")
        os._exit(128 + signum)

    for signum in SIGNALS:
        if signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, stop)
