"""Ops for looking at values while a net runs: Caffe2's `Print`.

`Print` reads its input on the host (a device sync), so it is for debugging, not for a training step
one cares to time. It logs through `logging` (logger `graphpar.ops.debug`, level INFO, where Caffe2
used glog's INFO), or with `to_file` appends to `<blob>.log` in the current directory (Caffe2's
workspace root folder: graphpar reads and writes nothing relative to `RootFolder()`), in Caffe2's
format: `Tensor <blob> of type <dtype>. Dims: (<dims>): <values>`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from graphpar.core.schema import NO_GRADIENT, KernelContext, TensorSpec, Trait, register_op

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 1000  # Caffe2's k_limit_default: values printed when `limit` is 0


def _print(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    name = ctx.op.inputs[0]
    if a.every_n < 1 or a.limit < 0:
        raise ValueError(f"Print({name}): every_n must be >= 1 and limit >= 0, got {a.every_n} and {a.limit}")
    path = Path(f"{name.replace('/', '_')}.log") if a.to_file else None
    if path is not None:
        path.write_text("")  # Caffe2 opened the file anew (truncated) when the op was created
    runs = 0

    def run(x: torch.Tensor) -> tuple:
        nonlocal runs
        runs += 1
        if (runs - 1) % a.every_n:
            return ()
        values = x.detach().reshape(-1)[:a.limit or DEFAULT_LIMIT].to("cpu").tolist()
        line = (f"Tensor {name} of type {str(x.dtype).removeprefix('torch.')}. Dims: "
                f"({','.join(map(str, x.shape))}): {','.join(map(str, values))}")
        if path is None:
            log.info("%s", line)
        else:
            with path.open("a") as file:
                file.write(line + "\n")
        return ()

    return run


def _no_outputs(_a: SimpleNamespace, _ctx: KernelContext, _inputs: list[TensorSpec]) -> list[TensorSpec | None]:
    return []


register_op(
    "Print", inputs=1, outputs=0, args={"to_file": 0, "limit": 0, "every_n": 1}, kernel=_print,
    gradient=NO_GRADIENT, traits=(Trait.HOST_SYNC,), infer=_no_outputs,
    doc="[X] -> nothing: logs X's first `limit` values (0: 1000) on its 1st, (every_n + 1)th, ... run, as "
        "Caffe2's Print: to logger graphpar.ops.debug (INFO), or with to_file=1 appended to '<X>.log' in the "
        "current directory.")
