"""What the command-line tools share: help, logging, one-line errors and a clean Ctrl-C.

Imports only the standard library (at module level), so a tool can install `exit_on_interrupt()` before
it imports torch.

- `parser(module, doc)`: `usage: python -m <module>`, the module docstring as the description, every
  option's default in `--help`.
- `setup_logger(verbose)`: one handler on stdout with the time and the rank (`[12:04:31 rank0]`); the
  tools' own lines (logger `graphpar.examples`) always, graphpar's INFO lines with `--verbose`, and
  only warnings and errors on the other ranks of a launched job (as Detectron2's `setup_logger`).
  Lines go through `tqdm.write` while a progress bar is open, so the bar stays whole.
- `guard(main, argv)`: runs a tool's main; a Ctrl-C ends it with one line and exit status 130 (the
  first Ctrl-C only: the others are ignored while it stops, so the clean-up cannot be interrupted),
  an error with one line (the message and its hint) and exit status 1 (`--verbose`: the traceback
  too). Under a launcher only rank 0 reports an interrupt; every rank reports its error.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence

INTERRUPTED = 130  # the shell's status for a process ended by SIGINT (128 + 2)

log = logging.getLogger("graphpar.examples")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default (unless it is None or False, or the help says it), and the
    description as written (line breaks kept)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action) or ""


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """An ArgumentParser whose usage is `python -m module` and whose help shows the defaults."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc.strip(), formatter_class=HelpFormatter)


def exit_on_interrupt(quiet: bool = False) -> None:
    """Until `guard` takes over: a Ctrl-C (while torch loads, say) ends the process at once, status 130,
    with one line (none with `quiet`, nor on the other ranks of a launched job). Nothing has been
    written yet, so there is nothing to clean up."""
    quiet = quiet or _rank() != 0

    def stop(signum: int, frame: object) -> None:
        if not quiet:
            os.write(2, b"\ninterrupted\n")
        os._exit(INTERRUPTED)

    signal.signal(signal.SIGINT, stop)


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


class _Formatter(logging.Formatter):
    """`[HH:MM:SS rankR] message`; graphpar's own lines also name their logger and level."""

    def __init__(self, rank: int) -> None:
        super().__init__(datefmt="%H:%M:%S")
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        head = f"[{self.formatTime(record, self.datefmt)} rank{self.rank}]"
        text = record.getMessage()
        if record.name != log.name or record.levelno >= logging.WARNING:
            text = f"{record.levelname} {record.name}: {text}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return f"{head} {text}"


class _Handler(logging.Handler):
    """Writes to the current sys.stdout, through `tqdm.write` when tqdm is loaded (an open bar stays whole)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text, tqdm = self.format(record), sys.modules.get("tqdm")
            if tqdm is not None:
                tqdm.tqdm.write(text, file=sys.stdout)
            else:
                sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def setup_logger(verbose: bool = False, rank: int | None = None, all_ranks: bool = False) -> logging.Logger:
    """Log to stdout with the time and the rank (see the module docstring); returns the tools' logger.
    Calling it again replaces the handler it installed before (a tool's main may run several times in
    one process, as in the tests)."""
    rank = _rank() if rank is None else rank
    top = logging.getLogger("graphpar")
    for handler in [h for h in top.handlers if isinstance(h, _Handler)]:
        top.removeHandler(handler)
    handler = _Handler()
    handler.setFormatter(_Formatter(rank))
    handler.setLevel(logging.DEBUG if rank == 0 or all_ranks else logging.WARNING)
    top.addHandler(handler)
    top.setLevel(logging.INFO if verbose else logging.NOTSET)  # NOTSET: the root's level (warnings)
    log.setLevel(logging.INFO)
    return log


_interrupted = threading.Event()  # a Ctrl-C reached a one_interrupt handler: the process is stopping


@contextlib.contextmanager
def one_interrupt() -> Iterator[None]:
    """While inside: the first Ctrl-C raises KeyboardInterrupt, and from then on Ctrl-C is ignored in
    this process (the clean-up it starts, and the interpreter's exit, run to their end). Without an
    interrupt the previous handler comes back on leaving. A no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def first(signum: int, frame: object) -> None:
        if _interrupted.is_set():  # a second SIGINT that came before SIG_IGN was in place (a terminal's
            return  # and a launcher's arrive together): the first one's clean-up must not be interrupted
        _interrupted.set()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        if _interrupted.is_set():
            _forget_escaped_interrupt()
        else:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def _forget_escaped_interrupt() -> None:
    """CPython notes a KeyboardInterrupt that leaves an `exec` of a string (dataclasses, torch and numpy
    build functions from source so) as unhandled even when code above it catches it, and `python -m`
    then ends the process by SIGINT at exit (status -2, not our 130). Each `exec` of a string clears the
    note; an interrupt that really escapes sets it again."""
    exec("None", {})  # noqa: S102 - a constant, for its side effect on the interpreter's note


def guard(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """`main(argv)` with a clean Ctrl-C and one-line errors (see the module docstring); its exit status.
    `SystemExit` (argparse's errors, status 2) passes through."""
    verbose = "--verbose" in (sys.argv[1:] if argv is None else argv)
    with one_interrupt():
        try:
            return main(argv)
        except KeyboardInterrupt:
            if _rank() == 0:  # once per job
                print("\ninterrupted", file=sys.stderr, flush=True)
            return INTERRUPTED
        except Exception as exc:  # noqa: BLE001 - the tool's last word, one line unless --verbose
            if verbose:
                traceback.print_exc()
            print(f"error: {one_line(exc)}" + ("" if verbose else "\n(--verbose shows the details and the traceback)"),
                  file=sys.stderr, flush=True)
            return 1


def one_line(exc: BaseException) -> str:
    """`Type: message`, the message's first line (graphpar puts the fix there; the lines after it are
    details). For a failure in another process, whose message carries that process's traceback, the
    line of the exception that ended it."""
    text = str(exc).strip()
    header = "Traceback (most recent call last):"
    if header in text:
        after = text.rsplit(header, 1)[1].splitlines()
        found = next((line for line in after if line.strip() and not line[0].isspace()), None)
        if found is not None:
            return found.strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
