"""Checkpoint files: named blobs in a safetensors file (no pickle, so loading never runs code).

The file's safetensors metadata holds one JSON document under the key "graphpar":
`{"format_version": 2, "blobs": [...], "iteration": int | null, "sha256": hex, "metadata": {...}}`.
`iteration` is the value of the optimizer's `optimizer_iteration` counter when it is saved; `sha256` covers
the whole header (format version, blob names, iteration, user metadata, and each tensor's dtype and shape)
and then the tensors' bytes in blob order, so an edited dtype or shape, a flipped bit in the metadata or
anywhere in the data is caught on load. (Version 1 files, whose checksum covers the data only, still load.)

Files are deterministic: identical blobs and metadata give byte-identical files (an unordered collection
of names, such as `GetCheckpointParams`'s set, is sorted). The name `__metadata__` (safetensors' own
header key) is refused before the file is touched.

`save` writes atomically (a temporary file in the same directory, flushed and fsynced, then renamed over
the target and the directory fsynced), so a crash never leaves a truncated file under the final name; an
existing target keeps its permission bits. `load` reads and checks everything before it feeds a single
blob, so a bad file changes nothing.

Both read an unscoped name that the workspace (on save) or the file (on load) lacks from the first
replica's blob of that name (`fc_w` from `cpu_0/fc_w`, `core.naming.first_replica_blobs`): the names
`data_parallel_model.ExtractPredictorNet` gives a predictor's params.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Iterable, Mapping, Set
from typing import Any

import torch
from safetensors.torch import save as serialize

from graphpar.core.ir import CPU, CUDA, DeviceOption
from graphpar.core.naming import (
    OPTIMIZER_ITERATION,
    device_scope_name,
    first_replica_blobs,
    parse_device_scope,
    stripBlobName,
)
from graphpar.errors import CheckpointError
from graphpar.ops.db import FORMAT_VERSION, HEADER_KEY, checksum, read_file
from graphpar.passes.model_state import first_device_scope
from graphpar.platform.devices import device_option_for_blob
from graphpar.runtime.workspace import Workspace, get_workspace

_RESERVED = "__metadata__"  # safetensors' header key: a tensor of that name makes an unreadable file


def _workspace(workspace: Workspace | str | None) -> Workspace:
    """The Workspace object for `workspace` (a Workspace, a workspace name, or None for the current one)."""
    return workspace if isinstance(workspace, Workspace) else get_workspace(workspace)


def _names(blobs: Iterable[str], what: str) -> list[str]:
    if isinstance(blobs, str):
        raise TypeError(f"checkpoint.{what}: blobs must be a list of blob names, not the single string "
                        f"{blobs!r}; wrap it in a list")
    names = list(dict.fromkeys(str(b) for b in blobs))
    if isinstance(blobs, Set):  # no order of its own: sort, so that identical runs write identical files
        names.sort()
    if not names:
        raise ValueError(f"checkpoint.{what}: no blob names given")
    return names


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy (safetensors refuses tensors that share storage, as aliased blobs may)."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def _atomic_write(path: str, data: bytes) -> None:
    """Write `data` to `path` so that the file is either the old one or the complete new one."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666 & ~umask, as open() would
    try:
        if os.path.exists(path):  # a re-save keeps the target's permissions (never widens 0600)
            os.chmod(fd, stat.S_IMODE(os.stat(path).st_mode))
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save(path: str | os.PathLike[str], blobs: Iterable[str], workspace: Workspace | str | None = None,
         metadata: Mapping[str, Any] | None = None) -> None:
    """Write the named blobs of a workspace to a safetensors checkpoint at `path`, atomically.

    Args:
        path: the file to (over)write.
        blobs: blob names (e.g. `data_parallel_model.GetCheckpointParams(model)`); an unscoped name the
            workspace lacks is saved, under that name, from the first replica's blob (see the module).
        workspace: a Workspace, a workspace name, or None for the current workspace.
        metadata: JSON-serialisable user data stored in the file.

    Raises:
        CheckpointError: a named blob does not exist, or an unscoped name is held by both CPU and GPU
            replicas (nothing is written).
        KeyError: `workspace` names a workspace that does not exist.
        TypeError: `blobs` is a single string, or `metadata` is not JSON-serialisable.
        OSError: the file could not be written (the previous file, if any, is left intact).
    """
    ws = _workspace(workspace)
    names = _names(blobs, "save")
    if _RESERVED in names:
        raise CheckpointError(f"checkpoint.save({os.fspath(path)!r}): a blob named {_RESERVED!r} cannot be "
                              f"saved (safetensors reserves the name); rename the blob")
    sources = _sources(names, ws.blobs, f"checkpoint.save({os.fspath(path)!r})")
    missing = [n for n in names if not ws.has_blob(sources[n])]
    if missing:
        raise CheckpointError(f"checkpoint.save({os.fspath(path)!r}): blobs {missing} do not exist in the "
                              f"workspace; run the init net first or check the names")
    tensors = {n: _host_copy(ws.fetch_tensor(sources[n])) for n in names}
    iteration = tensors.get(OPTIMIZER_ITERATION)
    header = {"format_version": FORMAT_VERSION, "blobs": names,
              "iteration": None if iteration is None else int(iteration.reshape(-1)[0]),
              "metadata": dict(metadata or {})}
    try:
        header = json.loads(json.dumps(header))  # what load will parse (tuples become lists...)
        header["sha256"] = checksum(header, tensors)
        text = json.dumps(header, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"checkpoint.save: metadata must be JSON-serialisable: {exc}") from None
    _atomic_write(os.fspath(path), serialize(tensors, metadata={HEADER_KEY: text}))


def _sources(names: list[str], available: Iterable[str], what: str) -> dict[str, str]:
    """{name: the blob it is read from}: itself, or for an unscoped name `available` lacks, its first
    replica's blob (core.naming.first_replica_blobs)."""
    try:
        found = first_replica_blobs(names, available)
    except ValueError as exc:
        raise CheckpointError(f"{what}: {exc}") from None
    return {n: found.get(n, n) for n in names}


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's header: format_version, blobs, iteration, sha256 and the user's metadata.

    Raises:
        CheckpointError: the file is unreadable, not a safetensors file, or not a graphpar checkpoint.
    """
    return read_file(os.fspath(path), tensors=False)[0]


def _device_of(name: str, existing: torch.Tensor | None) -> DeviceOption:
    """Where a loaded blob goes: its name scope's device, else the existing blob's device, else CPU."""
    option = device_option_for_blob(name)
    if option is not None:
        return option
    if existing is not None and existing.device.type == "cuda":
        return DeviceOption(CUDA, existing.device.index or 0)
    return DeviceOption(CPU)


def _conflicts(ws: Workspace, data: Mapping[str, torch.Tensor], names: list[str]) -> list[str]:
    problems = []
    for name in names:
        if ws.has_blob(name):
            old, new = ws.fetch_tensor(name), data[name]
            if old.shape != new.shape or old.dtype != new.dtype:
                problems.append(f"{name}: workspace {tuple(old.shape)} {old.dtype}, "
                                f"file {tuple(new.shape)} {new.dtype}")
    return problems


def load(path: str | os.PathLike[str], blobs: Iterable[str] | None = None,
         workspace: Workspace | str | None = None, model: Any = None) -> list[str]:
    """Feed blobs from a checkpoint into a workspace, onto their devices; return the names fed.

    Everything is read and checked first; only then are the blobs fed, so any error leaves the
    workspace unchanged. A blob goes to the device its name scope implies (`gpu_1/...` -> CUDA 1),
    else to the device of the existing blob of that name, else to the CPU. The workspace remembers
    the loaded blobs until they are used, so that resuming in the wrong order raises
    (`graphpar.resume`): load after RunInitNet, then call FinalizeAfterCheckpoint.

    Args:
        path: a file written by `save`.
        blobs: the names to load, as in the file (default: every blob in the file); an unscoped name the
            file lacks is read from the file's first replica's blob and fed under the unscoped name (see
            the module): `load(path, params)` with the params of a predictor from ExtractPredictorNet.
        workspace: a Workspace, a workspace name, or None for the current workspace.
        model: a parallelized model to resume: the file's replica-scoped blobs (`gpu_0/fc_w`, saved
            with any first device of any type) are fed under the model's first device's scope
            (`cpu_2/fc_w`), onto its device; unscoped blobs keep their names.

    Raises:
        CheckpointError: the file is unreadable, corrupt or of another format version; a requested blob
            is not in it; an unscoped name is held by both CPU and GPU replicas in it; a tensor's shape or
            dtype differs from the existing blob of the same name; or, with `model`, the blobs come from
            several replica scopes.
        KeyError: `workspace` names a workspace that does not exist.
        TypeError: `blobs` is a single string.
        ParallelizeError: `model` was not parallelized.
    """
    path = os.fspath(path)
    ws = _workspace(workspace)
    header, data = read_file(path)
    names = list(header["blobs"]) if blobs is None else _names(blobs, "load")
    sources = _sources(names, data, f"checkpoint {path!r}")
    data = {n: data[sources[n]] for n in names if sources[n] in data}
    absent = [n for n in names if n not in data]
    if absent:
        raise CheckpointError(f"checkpoint {path!r} has no blobs {absent}; it holds {header['blobs']}")
    if model is not None:
        renamed = _onto_first_device(path, model, names)
        data = {renamed[n]: data[n] for n in names}
        names = [renamed[n] for n in names]
    problems = _conflicts(ws, data, names)
    if problems:
        raise CheckpointError(f"checkpoint {path!r} does not match the workspace (shape/dtype):\n  "
                              + "\n  ".join(problems))
    _feed_all(ws, path, {n: data[n] for n in names})
    ws.loaded.update(dict.fromkeys(names, path))
    return names


def _onto_first_device(path: str, model: Any, names: list[str]) -> dict[str, str]:
    """{file name: name in the model}: replica-scoped names move to the model's first device's scope."""
    scope = first_device_scope(model)
    scopes = sorted({device_scope_name(*parsed) for n in names if (parsed := parse_device_scope(n))})
    if len(scopes) > 1:
        raise CheckpointError(f"checkpoint {path!r} holds blobs of several devices ({', '.join(scopes)}), so "
                              f"they cannot be mapped onto model {model.name!r}'s first device; save "
                              f"GetCheckpointParams(model) (the first device's) or pass blobs=[...]")
    return {n: scope + stripBlobName(n) if parse_device_scope(n) else n for n in names}


def _feed_all(ws: Workspace, path: str, data: Mapping[str, torch.Tensor]) -> None:
    """Feed every blob, or (if placing one fails, e.g. on a missing CUDA device) none of them."""
    old: dict[str, torch.Tensor | None] = {name: ws.blobs.get(name) for name in data}
    failing = ""
    try:
        for failing, tensor in data.items():
            ws.feed_blob(failing, tensor, device_option=_device_of(failing, old[failing]))
    except Exception as exc:
        for name, previous in old.items():
            if previous is None:
                ws.blobs.pop(name, None)
            else:
                ws.blobs[name] = previous
        raise CheckpointError(f"checkpoint {path!r}: cannot place blob {failing!r}: {exc}; "
                              f"nothing was loaded") from exc
