"""Ops that stop a run when a value is wrong, before it reaches the params.

`CheckFinite` reads its inputs on the host (one device sync per op), so Parallelize adds it only when
asked (`check_finite_loss=True`): one op per replica over that replica's losses, placed before every
gradient and update op. Executors start no in-place update before every op that precedes the first
update has finished, and a failed run writes nothing back, so a NaN or infinite loss stops the step
with the params and optimizer state as they were.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import torch

from graphpar.core.schema import NO_GRADIENT, KernelContext, TensorSpec, Trait, register_op


def _check_finite(_a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    names = ctx.op.inputs

    def run(*xs: torch.Tensor) -> tuple:
        for name, x in zip(names, xs):
            if not (math.isfinite(x.item()) if x.numel() == 1 else bool(torch.isfinite(x).all())):
                bad = x[~torch.isfinite(x)].reshape(-1)[0].item()
                raise FloatingPointError(
                    f"{name!r} is {bad} (not finite): the step stopped before any parameter update, so the "
                    f"params and optimizer state are those of the previous step. Lower the learning rate, "
                    f"check the batch for NaN or inf, or clip gradients (optimizer.build_sgd("
                    f"max_gradient_norm=...))")
        return ()

    return run


def _no_outputs(_a: SimpleNamespace, _ctx: KernelContext, _inputs: list[TensorSpec]) -> list[TensorSpec | None]:
    return []


register_op(
    "CheckFinite", inputs=(1, None), outputs=0, kernel=_check_finite, gradient=NO_GRADIENT,
    traits=(Trait.HOST_SYNC,), infer=_no_outputs,
    doc="[X_1, ...] -> nothing: raises FloatingPointError naming the first input holding a NaN or an "
        "infinity (read on the host). Parallelize(check_finite_loss=True) puts one per replica on its losses.")
