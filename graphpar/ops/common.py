"""Helpers every op module shares: the op label of error messages and short gradient registrations.

Gradient-only ops (`ReluGradient`, `FCGradient`, ...) run only inside the gradient net; each is
registered with `register_gradient` (any shape) or, for the common `Grad(saved, dY) -> dX` of an
element-wise op, `elementwise_grad`. Both name the forward op, so autodiff's copy of its args parses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from graphpar.core.ir import OperatorDef
from graphpar.core.schema import GI, KernelContext, OpSchema, gradient_op, register_op

Maker = Callable[[OperatorDef, list], tuple[list[OperatorDef], list]]


def shaped(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """`t` with `shape`: `t` itself when it has it already. A kernel's output that is not a view of a
    temporary is one the plan may reuse or a collective may reduce without a copy (`executor.program.owns`)."""
    return t if t.shape == tuple(shape) else t.reshape(shape)


def op_label(op: OperatorDef) -> str:
    """'Type(inputs -> outputs)', the prefix of every kernel error message, so it names the op."""
    return f"{op.type}({', '.join(op.inputs)} -> {', '.join(op.outputs)})"


def one_input_gradient(grad_type: str, reads: str = "") -> Maker:
    """Maker for a one-input op: `grad_type([X or Y,] dY) -> dX` (reads "X", "Y" or nothing).

    Only input 0 gets a gradient (further inputs, if the op has any, get none).
    """

    def maker(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
        src = {"X": [op.inputs[0]], "Y": [op.outputs[0]], "": []}[reads]
        grads = [GI(op, 0), *[None] * (len(op.inputs) - 1)]
        return [gradient_op(grad_type, [*src, g[0]], [GI(op, 0)])], grads

    return maker


def register_gradient(type_: str, of: str, kernel: Callable[[SimpleNamespace, KernelContext], Callable[..., Any]],
                      doc: str, *, inputs: int | tuple[int, int | None] = 2,
                      outputs: int | tuple[int, int | None] = 1, **options: Any) -> OpSchema:
    """Register `type_`, a gradient-only op of forward op `of`: it accepts `of`'s args and has no gradient.

    `options` are `register_op`'s (args, inplace, ...); by default the op takes two inputs and has
    one output, the shape of most gradient ops.
    """
    return register_op(type_, inputs=inputs, outputs=outputs, gradient_of=of, kernel=kernel, doc=doc, **options)


def elementwise_grad(type_: str, of: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], doc: str,
                     inplace: Iterable[tuple[int, int]] = (), reuse: tuple[int, Any] | None = None) -> OpSchema:
    """Register `type_(saved, dY) -> dX = fn(saved, dY)`, the gradient of element-wise op `of`, which
    saves X or Y (whichever `fn` reads) and ignores its args; `inplace={(1, 0)}` lets dX overwrite dY
    (and `reuse`, `register_op`'s, writes it into dY's storage where the run owns it)."""
    return register_gradient(type_, of, lambda _a, _ctx: fn, doc, inplace=inplace, reuse=reuse)
