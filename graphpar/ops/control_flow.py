"""Caffe2's control flow: the comparison ops (LT, LE, GT, GE, EQ, NE) and the `If` / `While` ops, which
take nets as arguments and run them inside the op.

An `If` or `While` op lists what its nets read from the enclosing net as its inputs (the condition
first) and what they write back as its outputs (`brew.cond` / `brew.loop` compute both from the
nets and their lexical scope, as Caffe2's `control_ops_util` does). The nets run on those blobs by
name: a blob a net writes that is not an output stays local to the op. Each inner op is checked and
its kernel built when the enclosing net is created, so a bad inner op fails at CreateNet.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.schema import (
    NOT_DIFFERENTIABLE,
    REQUIRED,
    Arg,
    KernelContext,
    Trait,
    check_operator,
    parse_args,
    register_op,
)
from graphpar.ops.common import op_label
from graphpar.ops.tensor import _BROADCAST_ARGS, _binary_kernel

# ------------------------------------------------------------------------------------------ comparisons

_COMPARISONS = (("LT", torch.lt, "<"), ("LE", torch.le, "<="), ("GT", torch.gt, ">"), ("GE", torch.ge, ">="),
                ("EQ", torch.eq, "=="), ("NE", torch.ne, "!="))
for _name, _fn, _symbol in _COMPARISONS:
    register_op(
        _name, inputs=2, args=_BROADCAST_ARGS, kernel=_binary_kernel(_fn), gradient=NOT_DIFFERENTIABLE,
        doc=f"C = A {_symbol} B, element-wise, as a bool tensor (NumPy broadcasting; with Caffe2's "
            f"`broadcast=1`, B's dims align with A's from `axis`, -1: trailing).")


# ----------------------------------------------------------------------------------------- If / While


def _netdef(net: Any) -> NetDef:
    return net.Proto() if hasattr(net, "Proto") and not isinstance(net, NetDef) else net


class _Subnet:
    """A net run by name on a dict of blobs, its kernels built once (at the enclosing net's CreateNet)."""

    def __init__(self, net: object, ctx: KernelContext, where: str) -> None:
        self.where = where
        self.steps: list[tuple[OperatorDef, Callable[..., object]]] = []
        for op in _netdef(net).ops:
            label = f"{where}: {op_label(op)}"
            schema = check_operator(op, label)
            device = ctx.device if op.device_option is None else ctx.device_of(op.device_option)
            inner = KernelContext(op=op, device=device, device_of=ctx.device_of, random_stream=ctx.random_stream)
            self.steps.append((op, schema.kernel(parse_args(schema, op.args, label), inner)))

    def run(self, blobs: dict[str, torch.Tensor]) -> None:
        for op, kernel in self.steps:
            missing = [b for b in op.inputs if b not in blobs]
            if missing:
                raise RuntimeError(f"{self.where}: {op_label(op)} reads {missing}, which neither the enclosing "
                                   f"net (the op's inputs) nor an earlier op of this net provides; list them in "
                                   f"the op's inputs (brew.cond/brew.loop: in external_blobs)")
            out = kernel(*[blobs[b] for b in op.inputs])
            blobs.update(zip(op.outputs, out if isinstance(out, tuple) else (out,)))


def _truth(cond: torch.Tensor, where: str) -> bool:
    if cond.numel() != 1:
        raise ValueError(f"{where}: the condition must hold one value, got shape {list(cond.shape)}")
    return bool(cond.reshape(()).item())


def _results(blobs: dict[str, torch.Tensor], op: OperatorDef, where: str) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The op's outputs by name (one tensor for one output, as kernels return them)."""
    missing = [b for b in op.outputs if b not in blobs]
    if missing:
        raise RuntimeError(f"{where}: outputs {missing} were written by no net that ran and are not inputs "
                           f"(an If without the branch that writes them must read them too)")
    results = tuple(blobs[b] for b in op.outputs)
    return results[0] if len(results) == 1 else results


def _if(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., object]:
    where = op_label(ctx.op)
    then_net = _Subnet(a.then_net, ctx, f"{where} then_net")
    else_net = None if a.else_net is None else _Subnet(a.else_net, ctx, f"{where} else_net")

    def run(*inputs: torch.Tensor) -> torch.Tensor | tuple:
        blobs = dict(zip(ctx.op.inputs, inputs))
        branch = then_net if _truth(inputs[0], where) else else_net
        if branch is not None:
            branch.run(blobs)
        return _results(blobs, ctx.op, where)

    return run


def _while(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., object]:
    where = op_label(ctx.op)
    loop_net = _Subnet(a.loop_net, ctx, f"{where} loop_net")
    cond_net = None if a.cond_net is None else _Subnet(a.cond_net, ctx, f"{where} cond_net")
    cond_name = ctx.op.inputs[0]

    def run(*inputs: torch.Tensor) -> torch.Tensor | tuple:
        blobs = dict(zip(ctx.op.inputs, inputs))
        while True:
            if cond_net is not None:
                cond_net.run(blobs)
            if not _truth(blobs[cond_name], where):
                return _results(blobs, ctx.op, where)
            loop_net.run(blobs)

    return run


def _unknown(_a: SimpleNamespace, ctx: KernelContext, _inputs: list) -> list[None]:
    """What the nets write depends on the condition's value: unknown until run."""
    return [None] * len(ctx.op.outputs)


register_op(
    "If", inputs=(1, None), outputs=(0, None), inplace=lambda _i, _o: True,
    args={"then_net": Arg("net", REQUIRED), "else_net": Arg("net", None)}, kernel=_if,
    traits=(Trait.HOST_SYNC,), infer=_unknown,
    doc="[cond, blobs the nets read...] -> [blobs they write...]: runs then_net if cond (one value) is true, "
        "else else_net (if given), on the op's inputs by name; the outputs are read back by name (an "
        "output the branch taken does not write keeps its input value). Caffe2's If.")
register_op(
    "While", inputs=(1, None), outputs=(0, None), inplace=lambda _i, _o: True,
    args={"loop_net": Arg("net", REQUIRED), "cond_net": Arg("net", None)}, kernel=_while,
    traits=(Trait.HOST_SYNC,), infer=_unknown,
    doc="[cond, blobs the nets read...] -> [blobs they write...]: repeats { cond_net (if given); stop "
        "unless cond is true; loop_net } on the op's inputs by name, cond being the first input's name as "
        "the nets update it. Caffe2's While.")
