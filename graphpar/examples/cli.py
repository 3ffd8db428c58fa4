"""What the command-line tools share: help, logging, one-line errors and a clean Ctrl-C.

Imports only the standard library (at module level), so a tool parses its options before it imports
torch. `exit_on_interrupt()` (re-exported from `graphpar.examples.interrupt`, which a tool imports first)
makes a Ctrl-C before `guard` end the process at once, status 130, in one line.

- `parser(module, doc)`: `usage: python -m <module>`, the module docstring as the description, every
  option's default in `--help`, and an error in one line (`<prog>: error: argument --seed: ...`, status
  2) instead of argparse's usage block. `integer(minimum)`, `number(...)` and `file_path` are `type=`s
  that refuse a bad value while parsing, naming the option.
- `setup_logger(verbose)`: one handler on stdout with the time and the rank (`[12:04:31 rank0]`); the
  tools' own lines (logger `graphpar.examples`) always, graphpar's INFO lines with `--verbose`, and
  only warnings and errors on the other ranks of a launched job (as Detectron2's `setup_logger`).
  Lines go through `tqdm.write` while a progress bar is open, so the bar stays whole.
- `progress_bar(show)`: tqdm bars for the steps of an epoch.
- `guard(main, argv)`: runs a tool's main; a Ctrl-C ends it with one line and exit status 130 (the
  first Ctrl-C only: the others are ignored while it stops, so the clean-up cannot be interrupted),
  an error with one line (the message and its hint) and exit status 1 (`--verbose`: the traceback
  too). Under a launcher only rank 0 reports an interrupt; every rank reports its error.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from graphpar.examples.interrupt import INTERRUPTED, exit_on_interrupt

__all__ = ["INTERRUPTED", "ArgumentParser", "exit_on_interrupt", "file_path", "guard", "integer", "number",
           "one_interrupt", "one_line", "parser", "progress_bar", "setup_logger"]


log = logging.getLogger("graphpar.examples")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default (unless it is None or False, or the help says it), and the
    description as written (line breaks kept)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action) or ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: argparse prints its whole usage (9 lines and more) first."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def parser(module: str, doc: str) -> ArgumentParser:
    """An ArgumentParser whose usage is `python -m module`, whose help shows the defaults and whose
    errors are one line."""
    return ArgumentParser(prog=f"python -m {module}", description=doc.strip(), formatter_class=HelpFormatter)


def integer(minimum: int) -> Callable[[str], int]:
    """An argparse `type`: an int >= `minimum` (argparse's message: `argument --seed: must be an
    integer >= 0, got '-1'`)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def number(minimum: float = 0.0, inclusive: bool = False) -> Callable[[str], float]:
    """An argparse `type`: a finite float > `minimum` (>= with `inclusive`); nan and inf are refused."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if inclusive else '>'} {minimum:g}, "
                                             f"got {text!r}")
        return value

    return parse


def file_path(text: str) -> Path:
    """An argparse `type`: a path a file can be written at: not empty, not a directory, and no part of
    its directory an existing file (a missing directory is created when the file is written)."""
    path = Path(text)
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a file path, got ''")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory: name a file in it, e.g. "
                                         f"{str(path / 'model.safetensors')!r}")
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: {str(blocking)!r} is not a directory")
    return path


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


class _QuietBar:
    def update(self, n: int = 1) -> None: ...

    def set_postfix_str(self, text: str) -> None: ...

    def close(self) -> None: ...


def progress_bar(show: bool = True) -> Callable[[int, str], Any]:
    """`bar(total, desc)`: a tqdm progress bar (with its rate and ETA) that vanishes when closed, or one
    that shows nothing (`show` False, as on the other ranks of a launched job, or without tqdm)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with graphpar[examples]
        show = False
    if not show:
        return lambda total, desc: _QuietBar()
    return lambda total, desc: tqdm(total=total, desc=desc, leave=False)


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
