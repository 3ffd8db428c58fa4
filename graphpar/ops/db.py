"""Caffe2's `Load`: blobs read from a checkpoint file (the file `predictor_exporter.save_to_db` and
`graphpar.checkpoint.save` write), so a net can restore parameters, as the global init net of an
exported predictor does. The file's header and checksum (`graphpar.checkpoint` describes them) are
read and checked here, by `read_file`, for the op and for `checkpoint.load` alike.

Each output is the blob of that name in the file, on the op's device. The file is read (and its
checksum verified) on every run; shapes and dtypes come from its header when the net is created.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open

from graphpar.core.schema import NOT_DIFFERENTIABLE, KernelContext, TensorSpec, register_op
from graphpar.errors import CheckpointError
from graphpar.ops.common import op_label

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, FORMAT_VERSION)  # version 1: the checksum covers the tensor data only
HEADER_KEY = "graphpar"  # the safetensors metadata key of the header

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def checksum(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 of the header (all but the checksum itself, with each tensor's dtype and shape), then of
    the tensors' bytes in blob order; version 1 hashed the bytes only."""
    digest = hashlib.sha256()
    names = header["blobs"]
    if header["format_version"] != 1:
        covered = {key: value for key, value in header.items() if key != "sha256"}
        covered["tensors"] = [[str(tensors[n].dtype), list(tensors[n].shape)] for n in names]
        digest.update(json.dumps(covered, sort_keys=True).encode())
    for name in names:  # the tensors are contiguous CPU copies: hash their bytes in place
        data: Any = tensors[name].reshape(-1).view(torch.uint8).numpy()  # a buffer (numpy's stubs do not say so)
        digest.update(data)
    return digest.hexdigest()


def read_file(path: str, tensors: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and (optionally) every tensor of the file, checked for integrity."""
    try:
        with safe_open(path, framework="pt") as file:
            header = _parse_header(path, (file.metadata() or {}).get(HEADER_KEY), set(file.keys()))
            data = {name: file.get_tensor(name) for name in header["blobs"]} if tensors else {}
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error types, OSError, ValueError...
        raise CheckpointError(f"checkpoint {path!r} cannot be read ({type(exc).__name__}: {exc}); "
                              f"the file is missing, truncated or not a safetensors file") from exc
    if tensors and checksum(header, data) != header["sha256"]:
        raise CheckpointError(f"checkpoint {path!r} is corrupt: its header or tensor data does not match "
                              f"the checksum written with it")
    return header, data


def _parse_header(path: str, text: str | None, keys: set[str]) -> dict[str, Any]:
    if text is None:
        raise CheckpointError(f"{path!r} is a safetensors file but not a graphpar checkpoint "
                              f"(no {HEADER_KEY!r} metadata)")
    try:
        header = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint {path!r} has corrupt metadata: {exc}") from None
    if not isinstance(header, dict) or header.get("format_version") not in READABLE_VERSIONS:
        version = header.get("format_version") if isinstance(header, dict) else None
        raise CheckpointError(f"checkpoint {path!r} has format version {version!r}; this graphpar "
                              f"reads version {FORMAT_VERSION}")
    blobs = header.get("blobs")
    if not isinstance(blobs, list) or set(blobs) != keys or not isinstance(header.get("sha256"), str):
        raise CheckpointError(f"checkpoint {path!r} is corrupt: its blob list does not match its tensors")
    return header


def _path(a: SimpleNamespace, ctx: KernelContext) -> str:
    """The file: `db` as given with absolute_path, else relative to the working directory (Caffe2
    read it relative to its root folder, which graphpar's workspace does not have)."""
    if not a.db:
        raise ValueError(f"{op_label(ctx.op)}: needs the file to read in the `db` argument")
    if a.load_all:
        raise ValueError(f"{op_label(ctx.op)}: load_all is not supported: name the blobs to load as outputs")
    return a.db if a.absolute_path else os.path.join(os.getcwd(), a.db)


def _load(a: SimpleNamespace, ctx: KernelContext) -> Callable[[], object]:
    path = _path(a, ctx)

    def run() -> object:
        _, data = read_file(path)
        missing = [b for b in ctx.op.outputs if b not in data]
        if missing:
            raise KeyError(f"{op_label(ctx.op)}: {path!r} has no blobs {missing}")
        outs = tuple(data[b].to(ctx.device) for b in ctx.op.outputs)
        return outs[0] if len(outs) == 1 else outs

    return run


def _load_infer(a: SimpleNamespace, ctx: KernelContext, _inputs: list) -> list[TensorSpec]:
    path = _path(a, ctx)
    with safe_open(path, framework="pt") as file:
        missing = [b for b in ctx.op.outputs if b not in file.keys()]
        if missing:
            raise KeyError(f"{op_label(ctx.op)}: {path!r} has no blobs {missing}")
        slices = [file.get_slice(b) for b in ctx.op.outputs]
        return [TensorSpec(tuple(s.get_shape()), _DTYPES[s.get_dtype()]) for s in slices]


register_op(
    "Load", inputs=0, outputs=(1, None), kernel=_load, infer=_load_infer, gradient=NOT_DIFFERENTIABLE,
    args={"db": "", "db_type": "", "absolute_path": False, "keep_device": False, "load_all": False},
    doc="[] -> the blobs named as outputs, read from the checkpoint file `db` (graphpar's format: "
        "`checkpoint.save`, `predictor_exporter.save_to_db`; `db_type` is accepted for Caffe2's scripts), "
        "on the op's device; `absolute_path=0` reads `db` relative to the working directory.")
