"""Caffe2's `dyndep`: loading operator libraries. graphpar's operators are Python registrations
(docs/extending.md), so there is no shared library to load."""

from __future__ import annotations

import logging
import os

_log = logging.getLogger(__name__)


def InitOpsLibrary(name: str, trigger_lazy: bool = True) -> None:  # noqa: N802 - Caffe2 name
    """As Caffe2: a library path that does not exist (e.g. a `@/caffe2/...` build target) is ignored
    with a log line. An existing file is refused: graphpar cannot load C++ operators."""
    if not os.path.exists(name):
        _log.info("Ignoring %s as it is not a valid file.", name)
        return
    raise NotImplementedError(f"cannot load the operator library {name!r}: graphpar's operators are "
                              "registered in Python (docs/extending.md)")
