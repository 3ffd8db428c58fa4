"""Test-only operators (prefixed `_Test`) that exercise executor paths real ops rarely take.

`registered()` registers them for the duration of a block (tests use it through a fixture). Ops whose
kernels record their builds or fail declare shape rules, so that shape inference at CreateNet (which
would otherwise build and run their kernels on meta tensors) leaves those paths to the executor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from graphpar.core.schema import KernelContext, register_op, scoped_registry

FACTORY_CALLS: Counter[str] = Counter()  # op name -> kernel factories built
DEVICES: list[torch.device] = []  # ctx.device of each _TestDevice built
SUNK: list[torch.Tensor] = []  # what _TestSink received
REUSED: list[str] = []  # the ops whose _TestAddOne ran its reuse kernel (in place)


def _counted(a: Any, ctx: KernelContext) -> Any:
    FACTORY_CALLS[ctx.op.name] += 1
    return lambda x: x + a.step


def _device(a: Any, ctx: KernelContext) -> Any:
    DEVICES.append(ctx.device)
    return lambda x: x.to(ctx.device)


def _fail(a: Any, ctx: KernelContext) -> Any:
    def fn(x: torch.Tensor) -> Any:
        raise ValueError(a.message)

    return fn


def _lookup(a: Any, ctx: KernelContext) -> Any:
    table: dict[str, torch.Tensor] = {}
    return lambda x: table["absent"]


def _bad_factory(a: Any, ctx: KernelContext) -> Any:
    raise ValueError("this op cannot be built")


def _add_one_in_place(a: Any, ctx: KernelContext) -> Any:
    def run(x: torch.Tensor) -> torch.Tensor:
        REUSED.append(ctx.op.name)
        return x.add_(1)

    return run


def _broadcast(x: torch.Tensor) -> torch.Tensor:
    """[2, n] from 1-d `x`: a tensor of its own whose two rows are one memory (stride 0, no base)."""
    out = torch.empty_strided((2, *x.shape), (0, 1), dtype=x.dtype)
    out.as_strided(x.shape, (1,)).copy_(x)
    return out


def _like_input(a: Any, ctx: KernelContext, inputs: list) -> list:
    return [inputs[0]]


def _unknown(a: Any, ctx: KernelContext, inputs: list) -> list:
    """Outputs unknown until the op runs, so its failure shows at RunNet."""
    return [None] * len(ctx.op.outputs)


_OPS: dict[str, dict[str, Any]] = {
    "_TestCounted": dict(kernel=_counted, args={"step": 1.0}, infer=_like_input),
    "_TestDevice": dict(kernel=_device, infer=_like_input),
    "_TestTwoOut": dict(outputs=2, kernel=lambda a, ctx: lambda x: (x + 1, x * 2)),
    "_TestAddOne": dict(inplace={(0, 0)}, kernel=lambda a, ctx: lambda x: x + 1, reuse=(0, _add_one_in_place),
                        infer=_like_input),
    "_TestBroadcast": dict(kernel=lambda a, ctx: _broadcast, infer=_unknown),
    "_TestSum3": dict(inputs=3, kernel=lambda a, ctx: lambda x, y, z: x + y + z),
    "_TestSink": dict(outputs=0, kernel=lambda a, ctx: SUNK.append),
    "_TestFail": dict(outputs=(1, 2), kernel=_fail, args={"message": "boom"}, infer=_unknown),
    "_TestWrongCount": dict(outputs=2, kernel=lambda a, ctx: lambda x: (x,), infer=_unknown),
    "_TestKeyError": dict(kernel=_lookup, infer=_unknown),
    "_TestBadFactory": dict(kernel=_bad_factory, infer=_unknown),
}


@contextmanager
def registered() -> Iterator[None]:
    """The toy operators, registered inside the block only."""
    with scoped_registry():
        for name, spec in _OPS.items():
            register_op(name, doc=f"test-only operator {name}", **spec)
        yield
