"""Sparse parameter updates (rows of a table from a GradientSlice) and dense Adagrad, Caffe2's signatures.

Duplicate indices are summed, as torch.sparse coalesces and as Caffe2's dedup aggregator does: the
momentum, Adagrad and Adam updates coalesce the slice first (`torch.unique`, which reads the number
of distinct rows on the host: Trait.HOST_SYNC) and then apply the dense rule to each touched row once,
so a row updated from the concatenated slices of N devices gets exactly the update of one device
holding the whole batch. Rows not in the slice are left alone (lazy updates, as Caffe2 and
torch.optim.SparseAdam). `ScatterWeightedSum` and `ScatterAssign` need no coalescing.

State blobs (param, moments) are updated in their storage, as the dense updates do (the in-place
names are enforced).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from graphpar.core.ir import DeviceOption, OperatorDef
from graphpar.core.schema import (
    NOT_DIFFERENTIABLE,
    Effects,
    Elementwise,
    InputCheck,
    KernelContext,
    TensorSpec,
    Trait,
    all_checks,
    register_op,
    same_shape,
)
from graphpar.ops.common import op_label
from graphpar.ops.optim import counter_at
from graphpar.ops.sparse import check_on_host

_HOST = DeviceOption()
_UPDATE = (Trait.INPLACE_UPDATE,)
_COALESCING = (Trait.INPLACE_UPDATE, Trait.HOST_SYNC)


def _flat(indices: torch.Tensor, values: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 indices as 1-D and values as one row per index (a Gather slice has N-D indices)."""
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where}: indices must be int32 or int64, got {indices.dtype}")
    if values.shape[:indices.dim()] != indices.shape:
        raise ValueError(f"{where}: the values' shape {list(values.shape)} must start with the indices' "
                         f"shape {list(indices.shape)} (one row per index)")
    flat = indices.reshape(-1).long()
    return flat, values.reshape(flat.numel(), *values.shape[indices.dim():])


def coalesce(indices: torch.Tensor, values: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows (sorted) and the sum of the values of each (torch.sparse's coalesce)."""
    flat, rows = _flat(indices, values, where)
    unique, inverse = torch.unique(flat, return_inverse=True)
    return unique, rows.new_zeros((unique.numel(), *rows.shape[1:])).index_add_(0, inverse, rows)


def _same_specs(*pairs: int) -> Callable[[SimpleNamespace, KernelContext, list[TensorSpec]], list[TensorSpec]]:
    """A shape rule: output k has the spec of input pairs[k]."""
    return lambda _a, _ctx, inputs: [inputs[i] for i in pairs]


def _rows_fit(param: int, indices: int, values: int) -> InputCheck:
    """An input check: the slice `values` holds one row of `param` per index (nothing broadcasts)."""

    def check(_a: SimpleNamespace, op: OperatorDef, inputs: Sequence[Any]) -> None:
        p, i, v = (tuple(inputs[k].shape) for k in (param, indices, values))
        if v != i + p[1:]:
            raise ValueError(f"{op.type}: the slice {op.inputs[values]!r} has shape {list(v)}; with indices "
                             f"{op.inputs[indices]!r} of shape {list(i)} and rows of {op.inputs[param]!r} of "
                             f"shape {list(p[1:])} it must be {list(i + p[1:])}, one row per index ({op.type} does not "
                             f"broadcast)")

    return check


def _scalar(lr: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return lr.reshape(()).to(dtype)


# ------------------------------------------------------------------------------------------- scatters


def _scatter_weighted_sum(_a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    where = op_label(ctx.op)
    if len(ctx.op.inputs) % 2 == 0:
        raise ValueError(f"{where}: ScatterWeightedSum takes X0, W0, INDICES, then pairs X1, W1, ...; got "
                         f"{len(ctx.op.inputs)} inputs")

    def run(x0: torch.Tensor, w0: torch.Tensor, indices: torch.Tensor, *pairs: torch.Tensor) -> torch.Tensor:
        flat = None
        update = None
        for x, w in zip(pairs[::2], pairs[1::2]):
            flat, rows = _flat(indices, x, where)
            term = rows * _scalar(w, x0.dtype)
            update = term if update is None else update + term
        flat = flat if flat is not None else indices.reshape(-1).long()
        x0.index_copy_(0, flat, x0.index_select(0, flat) * _scalar(w0, x0.dtype))  # each row scaled once
        return x0 if update is None else x0.index_add_(0, flat, update)

    return run


register_op(
    "ScatterWeightedSum", inputs=(3, None), enforce_inplace={(0, 0)}, kernel=_scatter_weighted_sum,
    gradient=NOT_DIFFERENTIABLE, traits=_UPDATE,
    doc="[X0, W0, INDICES, X1, W1, ...] -> X0 in place: rows X0[INDICES] = W0 X0[INDICES] + sum_k Wk Xk "
        "(Xk one row per index). A duplicate index scales its row by W0 once and adds every slice row "
        "(summed); W0 = 1 is the sparse SGD step.")


def _check_rows(flat: torch.Tensor, count: int, where: str) -> None:
    """Every index in [0, count) before anything is written (index_copy_ writes the rows before a bad one).

    Reads the indices on the host where `sparse.check_on_host` says so; else an asynchronous device assert.
    """
    if not flat.numel():
        return
    if not check_on_host(flat):
        torch._assert_async((flat >= 0).all() & (flat < count).all(), f"{where}: an index is out of range")
        return
    low, high = int(flat.min()), int(flat.max())
    if low < 0 or high >= count:
        bad = low if low < 0 else high
        raise ValueError(f"{where}: index {bad} is out of range for DATA with {count} rows; nothing was written")


def _scatter_assign(_a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    where = op_label(ctx.op)

    def run(data: torch.Tensor, indices: torch.Tensor, slices: torch.Tensor) -> torch.Tensor:
        flat, rows = _flat(indices, slices, where)
        _check_rows(flat, data.shape[0], where)
        return data.index_copy_(0, flat, rows.to(data.dtype))

    return run


register_op(
    "ScatterAssign", inputs=3, enforce_inplace={(0, 0)}, kernel=_scatter_assign, gradient=NOT_DIFFERENTIABLE,
    traits=_UPDATE,
    doc="[DATA, INDICES, SLICES] -> DATA in place: DATA[INDICES] = SLICES (for a duplicate index one of its "
        "slices is kept, as in Caffe2).")


# --------------------------------------------------------------------------------------- momentum SGD


def _sparse_momentum_sgd(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    where, mu = op_label(ctx.op), a.momentum

    def run(grad: torch.Tensor, moment: torch.Tensor, lr: torch.Tensor, param: torch.Tensor,
            indices: torch.Tensor) -> tuple:
        rows, g = coalesce(indices, grad, where)
        m = moment.index_select(0, rows)
        m_new = torch.add(g * _scalar(lr, g.dtype), m, alpha=mu)
        step = torch.add(m_new * (1.0 + mu), m, alpha=-mu) if a.nesterov else m_new
        moment.index_copy_(0, rows, m_new)
        param.index_copy_(0, rows, param.index_select(0, rows) - step)
        position = torch.searchsorted(rows, indices.reshape(-1).long())
        return step.index_select(0, position).reshape(grad.shape), moment, param

    return run


register_op(
    "SparseMomentumSGDUpdate", inputs=5, outputs=3, enforce_inplace={(0, 0), (1, 1), (3, 2)},
    args={"momentum": 0.0, "nesterov": False}, kernel=_sparse_momentum_sgd, gradient=NOT_DIFFERENTIABLE,
    traits=_COALESCING, infer=_same_specs(0, 1, 3), check=all_checks(same_shape((1, 3)), _rows_fit(3, 4, 0)),
    effects=Effects(momentum=1),
    doc="[grad, moment, lr, param, indices] -> [grad, moment, param] in place: MomentumSGDUpdate on the rows "
        "`indices` of moment and param, from the coalesced slice (duplicates summed); grad gets each "
        "index's row step. lr is positive (the op subtracts).")


# -------------------------------------------------------------------------------------------- Adagrad


def _check_adagrad(a: SimpleNamespace, where: str) -> None:
    if not (a.epsilon > 0 and 0 < a.decay <= 1):
        raise ValueError(f"{where}: needs epsilon > 0 and 0 < decay <= 1, got epsilon={a.epsilon}, "
                         f"decay={a.decay}")


def _adagrad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    _check_adagrad(a, op_label(ctx.op))

    def run(param: torch.Tensor, moment: torch.Tensor, grad: torch.Tensor, lr: torch.Tensor) -> tuple:
        h = torch.addcmul(moment * a.decay, grad, grad)
        return torch.addcdiv(param, grad * _scalar(lr, grad.dtype), h.sqrt().add_(a.epsilon)), h

    return run


def _sparse_adagrad(row_wise: bool) -> Callable[[SimpleNamespace, KernelContext], Callable[..., tuple]]:
    def factory(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
        where = op_label(ctx.op)
        _check_adagrad(a, where)

        def run(param: torch.Tensor, moment: torch.Tensor, indices: torch.Tensor, grad: torch.Tensor,
                lr: torch.Tensor) -> tuple:
            rows, g = coalesce(indices, grad, where)
            square = g * g
            if row_wise:
                square = square.reshape(square.shape[0], -1).mean(1)
            h = torch.add(moment.index_select(0, rows) * a.decay, square)
            denom = h.sqrt().add_(a.epsilon)
            if row_wise:
                denom = denom.reshape(-1, *[1] * (g.dim() - 1))
            moment.index_copy_(0, rows, h)
            param.index_copy_(0, rows, torch.addcdiv(param.index_select(0, rows), g * _scalar(lr, g.dtype), denom))
            return param, moment

        return run

    return factory


_ADAGRAD_ARGS = {"epsilon": 1e-5, "decay": 1.0}
register_op(
    "Adagrad", inputs=4, outputs=2, inplace={(0, 0), (1, 1)}, args=_ADAGRAD_ARGS, kernel=_adagrad,
    gradient=NOT_DIFFERENTIABLE, traits=_UPDATE, check=same_shape((0, 1, 2)),
    effects=Effects(elementwise=Elementwise((0, 1, 2))),
    doc="[param, moment, grad, lr] -> [param, moment]: moment = decay moment + grad^2; param += lr grad / "
        "(sqrt(moment) + epsilon). lr is negative for descent (Caffe2's sign); equals torch.optim.Adagrad "
        "(decay 1, lr_decay 0) with its eps.")
register_op(
    "SparseAdagrad", inputs=5, outputs=2, enforce_inplace={(0, 0), (1, 1)}, args=_ADAGRAD_ARGS,
    kernel=_sparse_adagrad(False), gradient=NOT_DIFFERENTIABLE, traits=_COALESCING, infer=_same_specs(0, 1),
    check=all_checks(same_shape((0, 1)), _rows_fit(0, 2, 3)),
    doc="[param, moment, indices, grad, lr] -> [param, moment] in place: Adagrad on the rows `indices` from "
        "the coalesced slice (torch.optim.Adagrad with a sparse gradient).")
register_op(
    "RowWiseSparseAdagrad", inputs=5, outputs=2, enforce_inplace={(0, 0), (1, 1)}, args=_ADAGRAD_ARGS,
    kernel=_sparse_adagrad(True), gradient=NOT_DIFFERENTIABLE, traits=_COALESCING, infer=_same_specs(0, 1),
    check=_rows_fit(0, 2, 3),
    doc="[param, moment, indices, grad, lr] -> [param, moment] in place: moment holds one value per row; "
        "moment[i] = decay moment[i] + mean(g_i^2); param[i] += lr g_i / (sqrt(moment[i]) + epsilon), on the "
        "coalesced slice.")


# ----------------------------------------------------------------------------------------------- Adam


def _sparse_adam(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    where = op_label(ctx.op)

    def run(param: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, indices: torch.Tensor, grad: torch.Tensor,
            lr: torch.Tensor, it: torch.Tensor) -> tuple:
        t = int(it.item())
        if t < 1:
            raise ValueError(f"{where}: the iteration counter is {t}; Adam needs t >= 1")
        rows, g = coalesce(indices, grad, where)
        first = torch.lerp(m1.index_select(0, rows), g, 1.0 - a.beta1)
        second = torch.addcmul(m2.index_select(0, rows) * a.beta2, g, g, value=1.0 - a.beta2)
        denom = second.sqrt().div_(math.sqrt(1.0 - a.beta2 ** t)).add_(a.epsilon)
        step = first * (_scalar(lr, g.dtype) / (1.0 - a.beta1 ** t))
        m1.index_copy_(0, rows, first)
        m2.index_copy_(0, rows, second)
        param.index_copy_(0, rows, torch.addcdiv(param.index_select(0, rows), step, denom))
        return param, m1, m2

    return run


register_op(
    "SparseAdam", inputs=7, outputs=3, enforce_inplace={(0, 0), (1, 1), (2, 2)},
    args={"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}, kernel=_sparse_adam, gradient=NOT_DIFFERENTIABLE,
    traits=_COALESCING, infer=_same_specs(0, 1, 2),
    check=all_checks(same_shape((0, 1, 2)), _rows_fit(0, 3, 4), counter_at(6)),
    device_inference=lambda op, d: ([d] * 6 + [_HOST], [d] * 3),
    doc="[param, m1, m2, indices, grad, lr, iter] -> [param, m1, m2] in place: Adam (the dense op's rule, "
        "bias-corrected with the CPU counter) on the rows of the coalesced slice only: "
        "torch.optim.SparseAdam. lr is negative (Caffe2's sign).")
