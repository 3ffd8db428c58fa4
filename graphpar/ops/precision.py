"""Mixed-precision ops: Caffe2's casts (FloatToHalf, HalfToFloat) and the loss scaler's three ops.

FloatToHalf and HalfToFloat are each other's gradient, so a float16 forward between them
back-propagates float16 gradients and the float32 side gets float32 ones. (`Cast` converts to any
dtype, bfloat16 included.)

Loss scaling (`Parallelize(loss_scale=...)`, see `graphpar.passes.loss_scale`): the loss gradients are
seeded with the scale S, so low-precision gradients keep their small values; after the all-reduce,
`UnscaleGradients` divides every gradient by S and raises `GradientOverflowError` if any is not finite
(a few multi-tensor kernels whatever the number of gradients, and one flag read on the host, as
`torch.amp.GradScaler`'s unscale; the run then changes nothing: the step is skipped; `CheckGradients` does the check alone, for Caffe2's
static scale of `build_multi_precision_sgd`); `UpdateLossScale` grows S after `growth_interval`
good steps; `BackoffLossScale` shrinks it after a skipped step.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from graphpar.core.schema import (
    NOT_DIFFERENTIABLE,
    KernelContext,
    Precision,
    PrecisionRule,
    Trait,
    register_op,
    same_index,
)
from graphpar.errors import GradientOverflowError
from graphpar.ops.common import one_input_gradient

register_op("FloatToHalf", kernel=lambda _a, _ctx: lambda x: x.to(torch.float16),
            gradient=one_input_gradient("HalfToFloat"), precision=PrecisionRule(Precision.CONVERT, dtype="float16"),
            doc="Y = X as float16 (Caffe2's name). Gradient: HalfToFloat(dY).")
register_op("HalfToFloat", kernel=lambda _a, _ctx: lambda x: x.to(torch.float32),
            gradient=one_input_gradient("FloatToHalf"), precision=PrecisionRule(Precision.CONVERT, dtype="float32"),
            doc="Y = X as float32 (Caffe2's name). Gradient: FloatToHalf(dY).")


def _check_finite(names: list[str], grads: tuple[torch.Tensor, ...], scale: float | torch.Tensor) -> None:
    """Raise GradientOverflowError naming the gradients holding an inf or a NaN (one host sync)."""
    if not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
        return
    _overflow(names, grads, scale)


def _overflow(names: list[str], grads: tuple[torch.Tensor, ...], scale: float | torch.Tensor) -> None:
    """Raise GradientOverflowError naming the non-finite gradients (their flags read at once)."""
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).tolist()
    bad = [name for name, ok in zip(names, finite) if not ok]
    scale = scale.item() if isinstance(scale, torch.Tensor) else scale
    raise GradientOverflowError(
        f"gradients {bad[:4]}{' ...' if len(bad) > 4 else ''} are inf or NaN at loss scale {scale:g}: the step "
        f"is skipped (params, optimizer state and counters unchanged)")


def _unscale(_a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    names = ctx.op.inputs[:-1]

    def run(*inputs: torch.Tensor) -> tuple:
        """New tensors G_i / S (multi-tensor kernels, in fp32 for low-precision G_i) and one finite flag
        over all of them, read once (GradScaler's `_amp_foreach_non_finite_check_and_unscale_`)."""
        grads, scale = inputs[:-1], inputs[-1]
        if not grads:
            return ()
        inv = torch.reciprocal(scale.to(torch.float32))
        out = tuple(torch._foreach_mul(grads, inv))
        found = torch.zeros(1, dtype=torch.float32, device=scale.device)
        torch._amp_foreach_non_finite_check_and_unscale_(out, found, torch.ones_like(inv))
        if found.item():  # one host sync per device and step, as torch.amp.GradScaler.step
            _overflow(names, out, scale)
        return out

    return run


register_op(
    "UnscaleGradients", inputs=(2, None), outputs=(1, None), inplace=same_index, kernel=_unscale,
    gradient=NOT_DIFFERENTIABLE, traits=(Trait.HOST_SYNC,), infer=lambda _a, _ctx, inputs: list(inputs[:-1]),
    doc="[G_1, ..., G_k, scale] -> [G_1, ..., G_k]: each G_i / scale (in place by name), after checking on "
        "the host that all are finite: raises GradientOverflowError otherwise (a failed run changes "
        "nothing, so the step is skipped). The loss scaler puts one per replica after the all-reduce.")


def _check_gradients(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    names = ctx.op.inputs

    def run(*grads: torch.Tensor) -> tuple:
        _check_finite(names, grads, a.loss_scale)
        return ()

    return run


register_op(
    "CheckGradients", inputs=(1, None), outputs=0, args={"loss_scale": 1.0}, kernel=_check_gradients,
    gradient=NOT_DIFFERENTIABLE, traits=(Trait.HOST_SYNC,), infer=lambda _a, _ctx, _inputs: [],
    doc="[G_1, ...] -> nothing: raises GradientOverflowError if a gradient holds an inf or a NaN (read on the "
        "host; `loss_scale` is named in the message). build_multi_precision_sgd(loss_scale=S) checks each "
        "unscaled gradient with it: the check depends on no update, so it runs before every update.")


def _grow(a: SimpleNamespace, _ctx: KernelContext) -> Callable[..., tuple]:
    def run(scale: torch.Tensor, good: torch.Tensor) -> tuple:
        good = good + 1
        grow = good >= a.growth_interval
        grown = scale * a.growth_factor  # kept only while finite, as torch._amp_update_scale_
        return (torch.where(grow & torch.isfinite(grown), grown, scale),
                torch.where(grow, torch.zeros_like(good), good))

    return run


register_op(
    "UpdateLossScale", inputs=2, outputs=2, enforce_inplace={(0, 0), (1, 1)},
    args={"growth_factor": 2.0, "growth_interval": 2000}, kernel=_grow, gradient=NOT_DIFFERENTIABLE,
    traits=(Trait.INPLACE_UPDATE,),
    doc="[scale, good_steps] -> same, in place: after a step whose gradients were finite, good_steps += 1; "
        "at growth_interval, scale *= growth_factor unless that is not finite, and good_steps = 0 "
        "(torch.amp.GradScaler's update).")
register_op(
    "BackoffLossScale", inputs=2, outputs=2, enforce_inplace={(0, 0), (1, 1)}, args={"backoff_factor": 0.5},
    kernel=lambda a, _ctx: lambda scale, good: (scale * a.backoff_factor, torch.zeros_like(good)),
    gradient=NOT_DIFFERENTIABLE, traits=(Trait.INPLACE_UPDATE,),
    doc="[scale, good_steps] -> same, in place: after a skipped step, scale *= backoff_factor, good_steps = 0.")
