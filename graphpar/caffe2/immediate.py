"""Caffe2's immediate mode, a debugging aid: every op recorded into any Net also runs at once in a
workspace of its own (re-exported by `graphpar.workspace`)."""

from __future__ import annotations

import logging
import shutil
import tempfile
from typing import Any

import numpy as np

from graphpar.core import net as core_net
from graphpar.core.ir import DeviceOption, OperatorDef
from graphpar.runtime.workspace import (
    Blobs,
    FeedBlob,
    FetchBlob,
    ResetWorkspace,
    RunOperatorOnce,
    WorkspaceGuard,
)

_IMMEDIATE = "_CAFFE2_IMMEDIATE"  # Caffe2's name of the immediate-mode workspace
_immediate_root_folder = ""


def IsImmediate() -> bool:  # noqa: N802
    """Whether immediate mode is on (StartImmediate)."""
    return core_net.on_record is not None


def StartImmediate(i_know: bool = False) -> None:  # noqa: N802
    """Caffe2's immediate mode, a debugging aid: from now on every op recorded into any Net also runs at
    once in the separate workspace `_CAFFE2_IMMEDIATE` (read it with FetchImmediate/ImmediateBlobs). Slow;
    `i_know=True` skips the warning."""
    global _immediate_root_folder
    StopImmediate()
    with WorkspaceGuard(_IMMEDIATE):
        _immediate_root_folder = tempfile.mkdtemp()
        ResetWorkspace(_immediate_root_folder)
    core_net.on_record = RunOperatorImmediate
    if not i_know:
        logging.getLogger(__name__).warning("immediate mode: every recorded op runs at once (slow, for "
                                            "debugging); StopImmediate() ends it")


def StopImmediate() -> None:  # noqa: N802
    """End immediate mode: empty its workspace and delete its root folder."""
    global _immediate_root_folder
    if not IsImmediate():
        return
    core_net.on_record = None
    with WorkspaceGuard(_IMMEDIATE):
        ResetWorkspace()
    shutil.rmtree(_immediate_root_folder, ignore_errors=True)
    _immediate_root_folder = ""


def RunOperatorImmediate(op: OperatorDef) -> None:  # noqa: N802
    """Run `op` once in the immediate-mode workspace."""
    with WorkspaceGuard(_IMMEDIATE):
        RunOperatorOnce(op)


def ImmediateBlobs() -> list[str]:  # noqa: N802
    """The blob names of the immediate-mode workspace."""
    with WorkspaceGuard(_IMMEDIATE):
        return Blobs()


def FetchImmediate(name: str) -> np.ndarray:  # noqa: N802
    """FetchBlob in the immediate-mode workspace."""
    with WorkspaceGuard(_IMMEDIATE):
        return FetchBlob(name)


def FeedImmediate(name: str, value: Any, device_option: DeviceOption | None = None) -> bool:  # noqa: N802
    """FeedBlob in the immediate-mode workspace."""
    with WorkspaceGuard(_IMMEDIATE):
        return FeedBlob(name, value, device_option)
