"""Caffe2's `Load`: blobs read from a checkpoint file (the file `predictor_exporter.save_to_db` and
`graphpar.checkpoint.save` write), so a net can restore parameters, as the global init net of an
exported predictor does.

Each output is the blob of that name in the file, on the op's device. The file is read (and its
checksum verified) on every run; shapes and dtypes come from its header when the net is created.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import torch
from safetensors import safe_open

from graphpar.core.schema import NOT_DIFFERENTIABLE, KernelContext, TensorSpec, register_op
from graphpar.ops.common import op_label

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


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
        from graphpar.runtime.checkpoint import (
            _read,  # the checked reader; imported here (checkpoint imports ops)
        )

        _, data = _read(path)
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
