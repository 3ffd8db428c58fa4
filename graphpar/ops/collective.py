"""Single-process collectives over the per-device copies of a blob (NOT_DIFFERENTIABLE).

When the NCCL backend accepts the inputs (`torch.cuda.nccl`: every input a CUDA tensor on its own
device), the kernels call it on clones of the inputs (kernels never write their inputs). Otherwise a
reference implementation runs: the all-reduce adds the inputs in list order on the first input's
device and copies the sum to every input's device; the broadcast copies the root input to every
device. Results equal NCCL's up to the order of the floating-point additions, so every graph also
runs on CPU. The backend is injectable (`nccl_backend`), so the NCCL branch is tested on machines
without GPUs with a fake that implements `is_available`, `all_reduce` and `broadcast`. Both ops
declare shape rules (each output has a copy's spec), so shape inference never calls the backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from graphpar.core.ir import DeviceOption, OperatorDef
from graphpar.core.schema import (
    NOT_DIFFERENTIABLE,
    Arg,
    KernelContext,
    TensorSpec,
    Trait,
    register_op,
    same_index,
)
from graphpar.ops.common import op_label

_COLLECTIVE = (Trait.COLLECTIVE, Trait.CROSS_DEVICE)


def _devices(op: OperatorDef, device: DeviceOption) -> tuple[list, list]:
    """Copy i lives on device `input_device_ids[i]` of the op's type, else on device i (Caffe2's rule)."""
    ids = op.args.get("input_device_ids") or ()
    where = [DeviceOption(device.device_type, ids[i] if i < len(ids) else i) for i in range(len(op.inputs))]
    return where, list(where)


def _check(ctx: KernelContext) -> str:
    where = op_label(ctx.op)
    if len(ctx.op.inputs) != len(ctx.op.outputs):
        raise ValueError(f"{where}: needs one output per input, got {len(ctx.op.inputs)} inputs and "
                         f"{len(ctx.op.outputs)} outputs")
    return where


class _TorchNccl:
    """`torch.cuda.nccl`, asked only about CUDA tensors (it warns on CPU-only builds otherwise)."""

    @staticmethod
    def is_available(xs: Sequence[torch.Tensor]) -> bool:
        return xs[0].is_cuda and torch.cuda.nccl.is_available(xs)

    all_reduce = staticmethod(lambda xs: torch.cuda.nccl.all_reduce(xs))
    broadcast = staticmethod(lambda xs, root=0: torch.cuda.nccl.broadcast(xs, root=root))


TORCH_NCCL = _TorchNccl()
_backend: Any = None  # None: TORCH_NCCL


def current_nccl() -> Any:
    """The NCCL backend kernels built now will call (torch.cuda.nccl unless `nccl_backend` says otherwise)."""
    return TORCH_NCCL if _backend is None else _backend


@contextmanager
def nccl_backend(module: Any) -> Iterator[None]:
    """Kernels built inside the block call `module` (is_available, all_reduce, broadcast) for NCCL."""
    global _backend
    old, _backend = _backend, module
    try:
        yield
    finally:
        _backend = old


def _use_nccl(nccl: Any, xs: Sequence[torch.Tensor]) -> bool:
    return len(xs) > 1 and nccl.is_available(xs)


def _same_copies(xs: Sequence[torch.Tensor | TensorSpec], where: str) -> None:
    """Raise unless every copy has copy 0's shape and dtype (tensors or, in shape rules, specs)."""
    for i, x in enumerate(xs[1:], 1):
        if x.shape != xs[0].shape or x.dtype != xs[0].dtype:
            raise ValueError(f"{where}: copy {i} is {x.dtype} {tuple(x.shape)}, copy 0 is "
                             f"{xs[0].dtype} {tuple(xs[0].shape)}; all copies must match")


def _allreduce(_a: SimpleNamespace, ctx: KernelContext) -> Callable[..., object]:
    where, nccl = _check(ctx), current_nccl()

    def run(*xs: torch.Tensor) -> object:
        _same_copies(xs, where)
        if _use_nccl(nccl, xs):
            outs = [x.clone() for x in xs]
            nccl.all_reduce(outs)
        else:
            total = xs[0]
            for x in xs[1:]:
                total = total + x.to(total.device)
            outs = [total, *[total.to(x.device, copy=True) for x in xs[1:]]]
        return outs[0] if len(outs) == 1 else tuple(outs)

    return run


def _allreduce_infer(_a: SimpleNamespace, ctx: KernelContext, inputs: list[TensorSpec]) -> list[TensorSpec]:
    _same_copies(inputs, _check(ctx))
    return [inputs[0]] * len(inputs)


register_op(
    "NCCLAllreduce", inputs=(1, None), outputs=(1, None), inplace=same_index, kernel=_allreduce,
    args={"input_device_ids": Arg("ints", ())}, infer=_allreduce_infer,
    gradient=NOT_DIFFERENTIABLE, device_inference=_devices, traits=_COLLECTIVE,
    doc="Outputs i = X0 + X1 + ... on input i's device (one output per input, in place allowed; input i "
        "on device `input_device_ids[i]`, default i, as Caffe2). "
        "NCCL when every copy is on its own GPU, else a reference sum in input order.")


def _root(a: SimpleNamespace, ctx: KernelContext) -> int:
    """The broadcast's root, checked to be an input index (and the op's counts checked)."""
    where = _check(ctx)
    if not 0 <= a.root < len(ctx.op.inputs):
        raise ValueError(f"{where}: root {a.root} is not an input index (0..{len(ctx.op.inputs) - 1})")
    return a.root


def _broadcast(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., object]:
    root, nccl = _root(a, ctx), current_nccl()

    def run(*xs: torch.Tensor) -> object:
        src = xs[root]
        if _use_nccl(nccl, xs):
            outs = [src.clone() if i == root else torch.empty_like(src, device=x.device)
                    for i, x in enumerate(xs)]
            nccl.broadcast(outs, root=root)
        else:
            outs = [src if i == root else src.to(x.device, copy=True) for i, x in enumerate(xs)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    return run


def _broadcast_infer(a: SimpleNamespace, ctx: KernelContext, inputs: list[TensorSpec]) -> list[TensorSpec]:
    _root(a, ctx)
    return [inputs[a.root]] * len(inputs)


register_op(
    "NCCLBroadcast", inputs=(1, None), outputs=(1, None), args={"root": 0, "input_device_ids": Arg("ints", ())},
    enforce_inplace=same_index, kernel=_broadcast, gradient=NOT_DIFFERENTIABLE, infer=_broadcast_infer,
    device_inference=_devices, traits=_COLLECTIVE,
    doc="Output i = X[root] on input i's device (in place enforced; `root` is a position in the input "
        "list, not a GPU id). NCCL when every copy is on its own GPU, else plain copies.")
