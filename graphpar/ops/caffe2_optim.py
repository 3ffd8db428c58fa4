"""Caffe2's other update kernels, with its signatures and rules: Lars, RmsProp, Adadelta, Wngrad and Ftrl
(dense, and sparse on the rows of a GradientSlice), and RAdam (Caffe2's `Adam(enableRAdam=True)`).

As elsewhere in graphpar, a learning-rate input is added to the param (negative for descent, Caffe2's
sign), and the sparse variants sum duplicate indices first (`sparse_optim.coalesce`; Caffe2 applied
each duplicate in turn) and update the touched rows in place.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import torch

from graphpar.core.ir import DeviceOption
from graphpar.core.schema import (
    NOT_DIFFERENTIABLE,
    Effects,
    Elementwise,
    KernelContext,
    TensorSpec,
    Trait,
    register_op,
)
from graphpar.core.shapes import on_meta
from graphpar.ops.common import op_label
from graphpar.ops.optim import counter_at
from graphpar.ops.sparse_optim import coalesce

_UPDATE = (Trait.INPLACE_UPDATE,)
_COALESCING = (Trait.INPLACE_UPDATE, Trait.HOST_SYNC)


def _scalar(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.reshape(()).to(dtype)


def _same_specs(*pairs: int) -> Callable[[SimpleNamespace, KernelContext, list[TensorSpec]], list[TensorSpec]]:
    return lambda _a, _ctx, inputs: [inputs[i] for i in pairs]


def _positive(a: SimpleNamespace, ctx: KernelContext, *names: str) -> None:
    bad = [f"{n}={getattr(a, n)}" for n in names if not getattr(a, n) > 0]
    if bad:
        raise ValueError(f"{op_label(ctx.op)}: needs {', '.join(names)} > 0, got {', '.join(bad)}")


# ----------------------------------------------------------------------------------------------- Lars


def _lars(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    if a.offset < 0:
        raise ValueError(f"{op_label(ctx.op)}: offset must be >= 0, got {a.offset}")

    def run(x: torch.Tensor, dx: torch.Tensor, wd: torch.Tensor, trust: torch.Tensor,
            lr_max: torch.Tensor) -> torch.Tensor:
        x_norm, dx_norm = torch.linalg.vector_norm(x.float()), torch.linalg.vector_norm(dx.float())
        scaled = trust.reshape(()) / (dx_norm / x_norm + wd.reshape(()) + a.offset)
        val = torch.where(x_norm > 0, scaled, torch.ones_like(scaled))
        return torch.clamp(torch.minimum(val, lr_max.reshape(()).float()), min=a.lr_min).reshape(1)

    return run


register_op(
    "Lars", inputs=5, args={"offset": 0.5, "lr_min": 0.02}, kernel=_lars, gradient=NOT_DIFFERENTIABLE,
    doc="[X, dX, wd, trust, lr_max] -> lr_rescaled [1] (float32): trust / (‖dX‖/‖X‖ + wd + offset) (1 when "
        "‖X‖ = 0), clipped to [lr_min, lr_max]: layer-wise adaptive rate scaling (LARS).")


# -------------------------------------------------------------------------------------------- RmsProp


def _rms_prop(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    _positive(a, ctx, "epsilon")

    def run(grad: torch.Tensor, ms: torch.Tensor, mom: torch.Tensor, lr: torch.Tensor) -> tuple:
        new_ms = ms + (1 - a.decay) * (grad * grad - ms)
        new_mom = mom * a.momentum + _scalar(lr, grad.dtype) * grad / torch.sqrt(new_ms + a.epsilon)
        return new_mom, new_ms, new_mom

    return run


register_op(
    "RmsProp", inputs=4, outputs=3, inplace={(0, 0), (1, 1), (2, 2)},
    args={"decay": 0.9, "momentum": 0.0, "epsilon": 1e-5}, kernel=_rms_prop, gradient=NOT_DIFFERENTIABLE,
    traits=_UPDATE, effects=Effects(elementwise=Elementwise((0, 1, 2))),
    doc="[grad, mean_squares, mom, lr] -> [step, mean_squares, mom]: ms += (1 - decay)(g^2 - ms); mom = "
        "momentum mom + lr g / sqrt(ms + epsilon); step = mom (Caffe2 then adds -lr' step to the param).")


# ------------------------------------------------------------------------------------------- Adadelta


def _adadelta_rows(a: SimpleNamespace, param: torch.Tensor, h: torch.Tensor, d: torch.Tensor, g: torch.Tensor,
                   lr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    new_h = h * a.decay + (1 - a.decay) * g * g
    step = torch.sqrt(d + a.epsilon) / torch.sqrt(new_h + a.epsilon) * g
    return param + _scalar(lr, g.dtype) * step, new_h, d * a.decay + (1 - a.decay) * step * step


def _adadelta(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    _positive(a, ctx, "epsilon")
    return lambda param, h, d, grad, lr: _adadelta_rows(a, param, h, d, grad, lr)


def _sparse_adadelta(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    _positive(a, ctx, "epsilon")
    where = op_label(ctx.op)

    def run(param: torch.Tensor, h: torch.Tensor, d: torch.Tensor, indices: torch.Tensor, grad: torch.Tensor,
            lr: torch.Tensor) -> tuple:
        rows, g = coalesce(indices, grad, where)
        new = _adadelta_rows(a, param.index_select(0, rows), h.index_select(0, rows), d.index_select(0, rows), g, lr)
        for state, value in zip((param, h, d), new):
            state.index_copy_(0, rows, value)
        return param, h, d

    return run


_ADADELTA_ARGS = {"epsilon": 1e-5, "decay": 0.95}
register_op(
    "Adadelta", inputs=5, outputs=3, inplace={(0, 0), (1, 1), (2, 2)}, args=_ADADELTA_ARGS, kernel=_adadelta,
    gradient=NOT_DIFFERENTIABLE, traits=_UPDATE, effects=Effects(elementwise=Elementwise((0, 1, 2, 3))),
    doc="[param, moment, moment_delta, grad, lr] -> [param, moment, moment_delta]: h = decay h + (1 - decay) "
        "g^2; step = sqrt(d + epsilon) / sqrt(h + epsilon) g; param += lr step; d = decay d + (1 - decay) "
        "step^2.")
register_op(
    "SparseAdadelta", inputs=6, outputs=3, enforce_inplace={(0, 0), (1, 1), (2, 2)}, args=_ADADELTA_ARGS,
    kernel=_sparse_adadelta, gradient=NOT_DIFFERENTIABLE, traits=_COALESCING, infer=_same_specs(0, 1, 2),
    doc="[param, moment, moment_delta, indices, grad, lr] -> [param, moment, moment_delta] in place: "
        "Adadelta on the rows `indices`, from the coalesced slice.")


# --------------------------------------------------------------------------------------------- Wngrad


def _wngrad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    _positive(a, ctx, "epsilon")

    def run(param: torch.Tensor, seq_b: torch.Tensor, grad: torch.Tensor, lr: torch.Tensor) -> tuple:
        b = seq_b.reshape(()) + a.epsilon
        return param + _scalar(lr, grad.dtype) * grad / b.to(grad.dtype), seq_b + (grad * grad).sum() / b

    return run


def _sparse_wngrad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    _positive(a, ctx, "epsilon")
    where = op_label(ctx.op)

    def run(param: torch.Tensor, seq_b: torch.Tensor, indices: torch.Tensor, grad: torch.Tensor,
            lr: torch.Tensor) -> tuple:
        rows, g = coalesce(indices, grad, where)
        b = seq_b.reshape(()) + a.epsilon
        param.index_copy_(0, rows, param.index_select(0, rows) + _scalar(lr, g.dtype) * g / b.to(g.dtype))
        seq_b.add_((g * g).sum() / b)
        return param, seq_b

    return run


register_op(
    "Wngrad", inputs=4, outputs=2, inplace={(0, 0), (1, 1)}, args={"epsilon": 1e-5}, kernel=_wngrad,
    gradient=NOT_DIFFERENTIABLE, traits=_UPDATE,
    doc="[param, seq_b ([1]), grad, lr] -> [param, seq_b]: param += lr g / (b + epsilon); b += ‖g‖^2 / "
        "(b + epsilon) (WNGrad).")
register_op(
    "SparseWngrad", inputs=5, outputs=2, enforce_inplace={(0, 0), (1, 1)}, args={"epsilon": 1e-5},
    kernel=_sparse_wngrad, gradient=NOT_DIFFERENTIABLE, traits=_COALESCING, infer=_same_specs(0, 1),
    doc="[param, seq_b, indices, grad, lr] -> [param, seq_b] in place: Wngrad on the rows `indices`.")


# ----------------------------------------------------------------------------------------------- Ftrl


def _ftrl_rows(a: SimpleNamespace, w: torch.Tensor, nz: torch.Tensor, g: torch.Tensor) -> tuple:
    n, z = nz[..., 0], nz[..., 1]
    new_n = n + g * g
    sigma = (torch.sqrt(new_n) - torch.sqrt(n)) / a.alpha
    new_z = z + g - sigma * w
    shrunk = (a.lambda1 * torch.sign(new_z) - new_z) / ((a.beta + torch.sqrt(new_n)) / a.alpha + a.lambda2)
    return torch.where(new_z.abs() > a.lambda1, shrunk, torch.zeros_like(shrunk)), torch.stack((new_n, new_z), -1)


def _ftrl(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    _positive(a, ctx, "alpha")
    return lambda w, nz, grad: _ftrl_rows(a, w, nz, grad)


def _sparse_ftrl(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    _positive(a, ctx, "alpha")
    where = op_label(ctx.op)

    def run(w: torch.Tensor, nz: torch.Tensor, indices: torch.Tensor, grad: torch.Tensor) -> tuple:
        rows, g = coalesce(indices, grad, where)
        new_w, new_nz = _ftrl_rows(a, w.index_select(0, rows), nz.index_select(0, rows), g)
        w.index_copy_(0, rows, new_w)
        nz.index_copy_(0, rows, new_nz)
        return w, nz

    return run


_FTRL_ARGS = {"alpha": 0.005, "beta": 1.0, "lambda1": 0.001, "lambda2": 0.001}
register_op(
    "Ftrl", inputs=3, outputs=2, inplace={(0, 0), (1, 1)}, args=_FTRL_ARGS, kernel=_ftrl,
    gradient=NOT_DIFFERENTIABLE, traits=_UPDATE,
    doc="[var, n_z (var's shape + [2]), grad] -> [var, n_z]: FTRL-Proximal (McMahan et al.) with the "
        "per-coordinate rate alpha / (beta + sqrt(n)) and L1/L2 terms lambda1, lambda2.")
register_op(
    "SparseFtrl", inputs=4, outputs=2, enforce_inplace={(0, 0), (1, 1)}, args=_FTRL_ARGS, kernel=_sparse_ftrl,
    gradient=NOT_DIFFERENTIABLE, traits=_COALESCING, infer=_same_specs(0, 1),
    doc="[var, n_z, indices, grad] -> [var, n_z] in place: Ftrl on the rows `indices`.")


# ---------------------------------------------------------------------------------------------- RAdam


def _radam_rows(a: SimpleNamespace, p: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, g: torch.Tensor,
                lr: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.optim.RAdam's step t (t >= 1), with Caffe2's negative lr."""
    m1 = torch.lerp(m1, g, 1.0 - a.beta1)
    m2 = torch.addcmul(m2 * a.beta2, g, g, value=1.0 - a.beta2)
    step = m1 * (_scalar(lr, g.dtype) / (1.0 - a.beta1 ** t))
    rho_inf = 2.0 / (1.0 - a.beta2) - 1.0
    rho_t = rho_inf - 2.0 * t * a.beta2 ** t / (1.0 - a.beta2 ** t)
    if rho_t > 5.0:  # the variance is tractable: rectified adaptive step
        rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
        step = step * (rect * math.sqrt(1.0 - a.beta2 ** t)) / (m2.sqrt() + a.epsilon)
    return p + step, m1, m2


def _count(it: torch.Tensor, where: str) -> int:
    t = int(it.item())
    if t < 1:
        raise ValueError(f"{where}: the iteration counter is {t}; RAdam needs t >= 1")
    return t


def _radam(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    where = op_label(ctx.op)
    return lambda p, m1, m2, g, lr, it: _radam_rows(a, p, m1, m2, g, lr, _count(it, where))


def _sparse_radam(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    where = op_label(ctx.op)

    def run(param: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, indices: torch.Tensor, grad: torch.Tensor,
            lr: torch.Tensor, it: torch.Tensor) -> tuple:
        t = _count(it, where)
        rows, g = coalesce(indices, grad, where)
        new = _radam_rows(a, param.index_select(0, rows), m1.index_select(0, rows), m2.index_select(0, rows), g,
                          lr, t)
        for state, value in zip((param, m1, m2), new):
            state.index_copy_(0, rows, value)
        return param, m1, m2

    return run


_HOST = DeviceOption()
_ADAM_ARGS = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}
register_op(
    "RAdam", inputs=6, outputs=3, inplace={(0, 0), (1, 1), (2, 2)}, args=_ADAM_ARGS, kernel=_radam,
    gradient=NOT_DIFFERENTIABLE, traits=(Trait.INPLACE_UPDATE, Trait.HOST_SYNC), check=counter_at(5),
    infer=lambda a, _ctx, inputs: on_meta(lambda p, m1, m2, g, lr: _radam_rows(a, p, m1, m2, g, lr, 1), inputs[:5]),
    effects=Effects(elementwise=Elementwise((0, 1, 2, 3))),
    device_inference=lambda op, d: ([d] * 5 + [_HOST], [d] * 3),
    doc="[param, m1, m2, grad, lr, iter] -> [param, m1, m2]: rectified Adam, torch.optim.RAdam's update with "
        "t = iter (lr negative). Caffe2 ran it as Adam with enableRAdam=1; graphpar's build_adam records "
        "this op instead.")
register_op(
    "SparseRAdam", inputs=7, outputs=3, enforce_inplace={(0, 0), (1, 1), (2, 2)}, args=_ADAM_ARGS,
    kernel=_sparse_radam, gradient=NOT_DIFFERENTIABLE, traits=_COALESCING, infer=_same_specs(0, 1, 2),
    check=counter_at(6), device_inference=lambda op, d: ([d] * 6 + [_HOST], [d] * 3),
    doc="[param, m1, m2, indices, grad, lr, iter] -> [param, m1, m2] in place: RAdam on the rows of the "
        "coalesced slice.")
