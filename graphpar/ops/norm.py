"""Spatial batch normalisation and the per-channel statistics ops of inter-device batch norm.

Channels are axis 1 (NCHW); statistics reduce over every other axis, so [N, C], [N, C, L] and
[N, C, H, W] inputs all work. `momentum` is Caffe2's: the weight of the OLD running value. The running
variance is updated with the unbiased batch variance (as PyTorch; Caffe2 of 2018 used the biased one),
normalisation uses the biased one.

On CUDA, training SpatialBN and its gradient run cuDNN's batch norm wherever PyTorch's own
`F.batch_norm` would (`_uses_cudnn`), on X made contiguous in its suggested memory format first (a
view from Split or Slice is copied, a channels-last X stays channels-last), as torch does; elsewhere
(CPU, 2-d inputs, bfloat16, cudnn disabled, ...) PyTorch's native kernels. A torch without the
binding that tells (`torch._C._select_batch_norm_backend`) runs the native kernels on CUDA too, and
says so in a warning. Inter-device batch norm keeps its own exact statistics path.

Inter-device batch norm (SPEC §7.7, `num_batches` = N devices): every device's SpatialBN receives the
per-channel Σx and Σx² summed over all devices (ChannelStats + Sum) and normalises with the statistics
of the global batch, count = N·H·W·num_batches, or, given the summed per-device counts as an eighth
input (ChannelStats' third output), the real global count, so devices fed batches of different sizes
still get the whole batch's statistics (as `SyncBatchNorm` weights by `count_all`). Backward, every
SpatialBNGradient receives the global dscale and dbias (ChannelBackpropStats + Sum) and outputs them
divided by num_batches, because the gradient all-reduce that follows sums the per-device copies back up.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format

from graphpar.core.capture import capturing
from graphpar.core.ir import OperatorDef
from graphpar.core.schema import (
    GI,
    NOT_DIFFERENTIABLE,
    InputCheck,
    KernelContext,
    Precision,
    PrecisionRule,
    Trait,
    gradient_op,
    register_op,
)
from graphpar.errors import GradientError
from graphpar.ops.common import op_label, register_gradient
from graphpar.ops.nn import nhwc_capable, require_nchw

log = logging.getLogger(__name__)
aten = torch.ops.aten
_CUDNN_RESERVE = "_graphpar_cudnn_reserve"  # attribute of a saved mean made by cuDNN: its reserve space


def _reduce_dims(x: torch.Tensor) -> tuple[int, ...]:
    """Every axis but the channel axis."""
    return (0, *range(2, x.dim()))


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A [C] vector shaped to broadcast against X."""
    return v.reshape(1, -1, *([1] * (x.dim() - 2)))


def _count(x: torch.Tensor) -> int:
    """Values per channel in X."""
    return x.numel() // x.shape[1]


def _per_channel_inputs(*vectors: int, like_x: tuple[int, ...] = ()) -> InputCheck:
    """An input check: X (input 0) has a channel axis (1, or the last with order NHWC), inputs
    `vectors` (those present) have shape [C], and inputs `like_x` have X's shape; torch's batch-norm
    kernels would broadcast a [1] scale or running statistic silently."""

    def check(a: SimpleNamespace, op: OperatorDef, inputs: Sequence[Any]) -> None:
        x = tuple(inputs[0].shape)
        if len(x) < 2:
            raise ValueError(f"{op.type}: X {op.inputs[0]!r} needs a batch and a channel axis, got shape {list(x)}")
        channels = x[-1] if a.order == "NHWC" else x[1]
        for k in vectors:
            if k < len(inputs) and tuple(inputs[k].shape) != (channels,):
                raise ValueError(f"{op.type}: input {k} {op.inputs[k]!r} has shape {list(inputs[k].shape)}; it "
                                 f"needs one value per channel of X {op.inputs[0]!r} (shape {list(x)}): "
                                 f"[{channels}]")
        for k in like_x:
            if tuple(inputs[k].shape) != x:
                raise ValueError(f"{op.type}: input {k} {op.inputs[k]!r} has shape {list(inputs[k].shape)}; it "
                                 f"must have X's shape {list(x)}")

    return check


# ----------------------------------------------------------------------------------------------------
# SpatialBN
# ----------------------------------------------------------------------------------------------------


def _uses_cudnn(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, rm: torch.Tensor | None,
                rv: torch.Tensor | None, epsilon: float) -> bool:
    """Whether torch would run cuDNN's batch norm here (`F.batch_norm`'s own choice: a CUDA input of
    3+ dims, a supported dtype, epsilon and batch size, `torch.backends.cudnn.enabled`). Never inside a
    compiled program, whose compiler generates batch norm's kernels itself (`executor.compiled`)."""
    if torch.compiler.is_compiling():
        return False
    select = getattr(torch._C, "_select_batch_norm_backend", None)
    if select is None:
        if x.is_cuda and torch.backends.cudnn.enabled:
            _warn_no_backend_choice()
        return False
    return bool(select(x, scale, bias, rm, rv, True, epsilon) == torch._C._BatchNormBackend.Cudnn)  # type: ignore[attr-defined]  # torch's stub misnames it


@functools.cache
def _warn_no_backend_choice() -> None:
    log.warning("this torch (%s) lacks torch._C._select_batch_norm_backend: SpatialBN runs PyTorch's native "
                "batch norm on CUDA, not cuDNN's", torch.__version__)


def _cudnn_forward(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor,
                   factor: float, epsilon: float) -> tuple[torch.Tensor, ...]:
    """cuDNN's training forward: Y, saved mean, saved inverse std, the reserve space its backward
    needs; updates rm and rv in place by `factor` (the weight of the new value). Takes X contiguous in
    its suggested memory format and the rest contiguous (`_cudnn_inputs`), as `torch.batch_norm`
    passes them: cuDNN's kernel checks that layout."""
    return aten.cudnn_batch_norm(x, scale, bias, rm, rv, True, factor, epsilon)


def _cudnn_backward(x: torch.Tensor, dy: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor,
                    inv_std: torch.Tensor, epsilon: float, reserve: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cuDNN's training backward: dX, dscale, dbias (X as the forward got it, dY in X's layout:
    `_cudnn_inputs`)."""
    return aten.cudnn_batch_norm_backward(x, dy, scale, None, None, mean, inv_std, epsilon, reserve)


def _cudnn_inputs(x: torch.Tensor, *others: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """X contiguous in its suggested memory format, and the others (dY) in the same layout."""
    layout = _memory_format(x)
    return tuple(t.contiguous(memory_format=layout) for t in (x, *others))


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    """X's suggested memory format (torch's `suggest_memory_format`): channels-last when its strides
    are ordered so, else contiguous."""
    return suggest_memory_format(x)


def _bn_local(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    """Training with this batch's own statistics: cuDNN's kernel where torch would use it (CUDA), else
    PyTorch's native fused kernel. cuDNN's reserve space rides on the saved mean (`_CUDNN_RESERVE`) to
    SpatialBNGradient, as autograd saves it for torch's backward.

    Both kernels update the running stats in place, and no out-of-place form gives their bits (each
    fuses the update with its own reduction; torch's functional form clones too). A run that fails must
    leave the workspace's running stats unchanged and SpatialBN runs in the forward pass, before
    the ops that may still fail, so the kernels get copies (two per layer and step), except in a
    CUDA-graph capture (`core.capture`), where they update the static buffers in place."""

    def bn(
        x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor
    ) -> tuple:
        if _count(x) < 2:
            raise ValueError(
                f"{op_label(ctx.op)}: training needs more than one value per channel, "
                f"got input shape {tuple(x.shape)}"
            )
        if not capturing():  # both kernels update the running stats in place
            rm, rv = rm.clone(), rv.clone()
        if _uses_cudnn(x, scale, bias, rm, rv, a.epsilon):
            (x,) = _cudnn_inputs(x)
            y, mean, inv_std, reserve = _cudnn_forward(x, scale.contiguous(), bias.contiguous(), rm, rv,
                                                       1.0 - a.momentum, a.epsilon)
            setattr(mean, _CUDNN_RESERVE, reserve)
            return y, rm, rv, mean, inv_std
        y, mean, inv_std = torch.native_batch_norm(x, scale, bias, rm, rv, True, 1.0 - a.momentum, a.epsilon)
        return y, rm, rv, mean, inv_std

    return bn


def _bn_global(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    """Training with the statistics of the global batch, from per-channel sums over all devices."""
    m = a.momentum

    def bn(
        x: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor,
        rm: torch.Tensor,
        rv: torch.Tensor,
        sums: torch.Tensor,
        sumsq: torch.Tensor,
        total: torch.Tensor | None = None,
    ) -> tuple:
        # The summed count is a 0-d tensor (no host sync to check it); without it, N equal batches.
        count = total.to(sums.dtype) if total is not None else _count(x) * a.num_batches
        if total is None and count < 2:
            raise ValueError(f"{op_label(ctx.op)}: training needs more than one value per channel")
        mean = sums / count
        var = (sumsq / count - mean * mean).clamp_min(0.0)  # biased; clamp rounding below zero
        inv_std = torch.rsqrt(var + a.epsilon)
        gain = scale * inv_std
        y = torch.addcmul(_per_channel(bias - mean * gain, x), x, _per_channel(gain, x)).to(x.dtype)
        new_mean, new_var = mean * (1.0 - m), var * (count / (count - 1) * (1.0 - m))
        if capturing():  # in place on the static buffers (`core.capture`), the same bits
            return y, rm.mul_(m).add_(new_mean), rv.mul_(m).add_(new_var), mean, inv_std
        return y, rm * m + new_mean, rv * m + new_var, mean, inv_std

    return bn


def _spatial_bn(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., object]:
    require_nchw(a, ctx)
    n_in, n_out, where = len(ctx.op.inputs), len(ctx.op.outputs), op_label(ctx.op)
    if a.is_test:
        if n_out != 1:
            raise ValueError(f"{where}: is_test=1 has one output (Y), got {n_out}")
        return lambda x, scale, bias, rm, rv, *_: F.batch_norm(x, rm, rv, scale, bias, False, 0.0, a.epsilon)
    if n_out != 5:
        raise ValueError(
            f"{where}: training has five outputs (Y, running_mean, running_var, "
            f"saved_mean, saved_inv_std), got {n_out}; or set is_test=1"
        )
    if n_in == 6 or a.num_batches < 1:
        raise ValueError(f"{where}: needs 5 inputs, or 7-8 (plus sums, sumsq[, count]) with num_batches >= 1")
    if n_in >= 7:
        return _bn_global(a, ctx)
    if a.num_batches != 1:
        raise ValueError(
            f"{where}: num_batches={a.num_batches} needs the summed sums and sumsq "
            f"inputs (ChannelStats over every device)"
        )
    return _bn_local(a, ctx)


def _spatial_bn_gradient(op: OperatorDef, g: list) -> tuple[list, list]:
    if len(op.inputs) >= 7:
        raise GradientError(
            f"{op_label(op)}: add gradient operators before the inter-device batch-norm "
            f"rewrite; that pass wires SpatialBNGradient's global statistics itself"
        )
    is_test = bool(op.args.get("is_test", False))
    stats = op.inputs[3:5] if is_test else op.outputs[3:5]  # running stats, or saved mean / inv std
    grad = gradient_op(
        "SpatialBNGradient", [op.inputs[0], op.inputs[1], g[0], *stats], [GI(op, 0), GI(op, 1), GI(op, 2)]
    )
    return [grad], [GI(op, 0), GI(op, 1), GI(op, 2), None, None]


register_op(
    "SpatialBN",
    inputs=(5, 8),
    outputs=(1, 5),
    enforce_inplace={(3, 1), (4, 2)},
    args={"is_test": False, "epsilon": 1e-5, "momentum": 0.9, "num_batches": 1, "order": "NCHW"},
    kernel=nhwc_capable(_spatial_bn),
    gradient=_spatial_bn_gradient,
    check=_per_channel_inputs(1, 2, 3, 4, 5, 6),
    traits=(Trait.BATCH_NORM,),
    # X and Y in X's dtype; scale, bias, running and saved statistics fp32 (torch's batch-norm kernels
    # accumulate in fp32 and take fp32 statistics with a low X)
    precision=PrecisionRule(Precision.FOLLOW, inputs=(0,), outputs=(0,)),
    doc="Batch norm over NCHW channels. Training: X, scale, bias, running_mean, running_var[, sums, "
    "sumsq] -> Y, running_mean, running_var (in place), saved_mean, saved_inv_std; batch mean and "
    "biased variance normalise, running stats move by momentum (weight of the old value), the "
    "variance with the unbiased estimate. With sums/sumsq (Σx, Σx² over all devices) the statistics "
    "are the global batch's over N·H·W·num_batches values, or over `count` values when the summed "
    "per-device counts (ChannelStats' third output) are given as input 7. is_test=1: Y from the running stats. "
    "May not run in place X -> Y (its gradient reads X).",
)


def _bn_grad_global(a: SimpleNamespace) -> Callable[..., tuple]:
    nb = a.num_batches

    def bn_grad(
        x: torch.Tensor,
        scale: torch.Tensor,
        dy: torch.Tensor,
        mean: torch.Tensor,
        inv_std: torch.Tensor,
        dscale: torch.Tensor,
        dbias: torch.Tensor,
        total: torch.Tensor | None = None,
    ) -> tuple:
        # dX = scale·inv_std/count · (count·dY - dbias - (x - μ)·inv_std·dscale), written per channel
        # as dX = scale·inv_std·dY + cx·x + c0, with dscale and dbias the GLOBAL sums.
        count = total.to(dscale.dtype) if total is not None else _count(x) * nb
        k = scale * inv_std / count
        cx = -k * inv_std * dscale
        c0 = -cx * mean - k * dbias
        dx = torch.addcmul(_per_channel(c0, x), x, _per_channel(cx, x))
        return dx.addcmul_(dy, _per_channel(scale * inv_std, x)).to(x.dtype), dscale / nb, dbias / nb

    return bn_grad


def _spatial_bn_grad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    require_nchw(a, ctx)
    n_in, where = len(ctx.op.inputs), op_label(ctx.op)
    mask = (True, True, True)
    if n_in == 6 or (n_in >= 7 and a.is_test):
        raise ValueError(f"{where}: takes 5 inputs, or 7-8 (plus global dscale, dbias[, count]) in training")
    if n_in >= 7:
        return _bn_grad_global(a)
    if a.num_batches != 1:
        raise ValueError(f"{where}: num_batches={a.num_batches} needs the global dscale and dbias inputs")
    if a.is_test:  # inputs 3, 4 are the running mean and variance
        return lambda x, scale, dy, rm, rv: aten.native_batch_norm_backward(
            dy, x, scale, rm, rv, None, None, False, a.epsilon, mask
        )
    return functools.partial(_bn_grad_local, a.epsilon)


def _bn_grad_local(epsilon: float, x: torch.Tensor, scale: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                   inv_std: torch.Tensor) -> tuple:
    """The training backward: cuDNN's when the forward ran cuDNN's (its saved mean carries the
    reserve space), else the native one (also right for cuDNN's saved mean and inverse std)."""
    reserve = getattr(mean, _CUDNN_RESERVE, None)
    if reserve is not None:
        x, dy = _cudnn_inputs(x, dy)
        return _cudnn_backward(x, dy, scale.contiguous(), mean, inv_std, epsilon, reserve)
    return aten.native_batch_norm_backward(dy, x, scale, None, None, mean, inv_std, True, epsilon, (True,) * 3)


register_gradient(
    "SpatialBNGradient", "SpatialBN", nhwc_capable(_spatial_bn_grad), inputs=(5, 8), outputs=3, inplace={(5, 1), (6, 2)},
    check=_per_channel_inputs(1, 3, 4, 5, 6, like_x=(2,)), traits=(Trait.BATCH_NORM,),
    doc="SpatialBNGradient(X, scale, dY, saved_mean, saved_inv_std[, dscale, dbias[, count]]) -> dX, "
    "dscale, dbias. Without the extras: the usual batch-norm backward. With them (the GLOBAL dscale/dbias "
    "summed over num_batches devices, possibly in place on outputs 1, 2): dX uses the global sums "
    "and count N·H·W·num_batches (or the summed `count`), and dscale/dbias come out divided by num_batches (the gradient "
    "all-reduce adds them back up). With is_test=1 inputs 3, 4 are the running mean and variance.",
)


# ----------------------------------------------------------------------------------------------------
# Per-channel statistics for inter-device batch norm
# ----------------------------------------------------------------------------------------------------


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    """Statistics of low-precision X accumulate and stay in fp32 (mixed precision keeps them there)."""
    return torch.promote_types(x.dtype, torch.float32)


def _channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    dims, dtype = _reduce_dims(x), _stats_dtype(x)
    return (x.sum(dims, dtype=dtype), x.to(dtype).square().sum(dims),
            torch.full((), _count(x), dtype=torch.float32, device=x.device))


def _channel_backprop_stats(
    x: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dims = _reduce_dims(x)
    return ((x - _per_channel(mean, x)) * dy).sum(dims) * inv_std, dy.sum(dims, dtype=_stats_dtype(x))


register_op(
    "ChannelStats",
    outputs=(2, 3),
    gradient=NOT_DIFFERENTIABLE,
    kernel=lambda a, ctx: lambda x: _channel_stats(x)[:len(ctx.op.outputs)],
    doc="ChannelStats(X) -> sum[C] = Σx, sumsq[C] = Σx² over every axis but channels (axis 1; fp32 for a "
    "low-precision X)[, count: the number of values per channel, a float32 scalar (summed over devices, SpatialBN's input 7)].",
)

register_op(
    "ChannelBackpropStats",
    inputs=4,
    outputs=2,
    gradient=NOT_DIFFERENTIABLE,
    kernel=lambda a, ctx: _channel_backprop_stats,
    doc="ChannelBackpropStats(X, saved_mean, saved_inv_std, dY) -> dscale[C] = Σ(x - μ)·inv_std·dY, "
    "dbias[C] = ΣdY: this device's share of SpatialBN's scale and bias gradients.",
)
