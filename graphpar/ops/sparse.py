"""Sparse (embedding) operators: lookups whose gradients are `GradientSlice(indices, values)`.

A lookup reads a few rows of a large table (`DATA`); its gradient touches only those rows, so the
gradient maker returns a `GradientSlice`: the `INDICES` blob itself and a values blob with one row per
index (Caffe2's convention). Rows looked up twice appear twice; the sparse update ops
(`graphpar.ops.sparse_optim`) sum duplicates. `SparseToDense` turns a slice into a dense tensor for
users who want a dense gradient.

Segments (`LENGTHS`) are consecutive: segment s takes the next `LENGTHS[s]` indices, and the lengths
must sum to the number of indices, checked before any kernel runs (`check_on_host`: a ValueError
naming the op on CPU devices, and on GPUs with `GRAPHPAR_HOST_INDEX_CHECKS=1`; else on a GPU an
asynchronous device assert, which costs no host sync but leaves the CUDA context unusable: the run
is not failure-atomic there, docs/errors.md). Segment ids are built with the number of indices as the
known output size, so no kernel but `LengthsToSegmentIds` and a `SparseToDense` without its third input
reads values on the host. Index tensors are int32 or int64, as in Caffe2.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import torch

from graphpar.core.ir import GradientSlice, OperatorDef
from graphpar.core.schema import (
    GI,
    NO_GRADIENT,
    KernelContext,
    Precision,
    PrecisionRule,
    TensorSpec,
    Trait,
    gradient_op,
    register_op,
)
from graphpar.ops.common import op_label, register_gradient


def _rows(data: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """data[indices] along dim 0, for indices of any shape (an int64 copy of the indices)."""
    flat = indices.reshape(-1).long()
    return data.index_select(0, flat).reshape(*indices.shape, *data.shape[1:])


HOST_CHECKS = "GRAPHPAR_HOST_INDEX_CHECKS"  # "1": check indices and lengths on the host on GPUs too


def check_on_host(tensor: torch.Tensor) -> bool:
    """Whether a check of `tensor`'s values (indices, lengths) reads them on the host: always on the
    CPU; on a GPU only with GRAPHPAR_HOST_INDEX_CHECKS=1, at the cost of a host sync per op. Otherwise a
    GPU check is `torch._assert_async`: a device-side assert, which makes every later CUDA call of the
    process fail (restart it; the last checkpoint is intact) instead of a ValueError with nothing
    changed."""
    return tensor.device.type == "cpu" or os.environ.get(HOST_CHECKS) == "1"


def check_lengths(lengths: torch.Tensor, count: int, where: str) -> None:
    """Raise ValueError naming the op (`where`) unless `lengths` are non-negative and sum to `count`.

    Runs before any kernel reads them: torch's `repeat_interleave(output_size=...)` aborts the process
    on a negative length. Reads the lengths on the host where `check_on_host` says so; else an
    asynchronous device assert, so nothing waits on the host.
    """
    flat = lengths.reshape(-1).long()
    if not check_on_host(flat):
        ok = (flat >= 0).all() & (flat.sum() == count)
        torch._assert_async(ok, f"{where}: LENGTHS must be non-negative and sum to the {count} INDICES")
        return
    if flat.numel() and int(flat.min()) < 0:
        raise ValueError(f"{where}: LENGTHS has a negative length ({int(flat.min())}); feed one non-negative "
                         f"length per segment")
    if int(flat.sum()) != count:
        raise ValueError(f"{where}: LENGTHS sum to {int(flat.sum())} but there are {count} INDICES; "
                         f"feed one length per segment, summing to the number of indices")


def segment_ids(lengths: torch.Tensor, count: int, where: str) -> torch.Tensor:
    """The segment of each of `count` indices (int64), after `check_lengths`."""
    check_lengths(lengths, count, where)
    positions = torch.arange(lengths.numel(), device=lengths.device)
    return torch.repeat_interleave(positions, lengths.reshape(-1).long(), output_size=count)


def _check_index(tensor: torch.Tensor, what: str, where: str) -> None:
    if tensor.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where}: {what} must be int32 or int64, got {tensor.dtype}")


def _check_weights(weights: torch.Tensor, indices: torch.Tensor, where: str) -> None:
    """One weight per index: a single weight is not broadcast over the indices."""
    if weights.shape != indices.shape:
        raise ValueError(f"{where}: WEIGHTS has shape {list(weights.shape)} but INDICES {list(indices.shape)}; "
                         f"feed one weight per index")


# ------------------------------------------------------------------------------------------------- Gather


def _gather(_a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    where = op_label(ctx.op)

    def run(data: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        _check_index(indices, "INDICES", where)
        return _rows(data, indices)

    return run


def _gather_gradient(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
    """No op: the slice is (INDICES, dOUTPUT), one row of dOUTPUT per index (Caffe2's GetGatherGradient)."""
    return [], [GradientSlice(op.inputs[1], g[0]), None]


register_op(
    "Gather", inputs=2, kernel=_gather, gradient=_gather_gradient,
    precision=PrecisionRule(Precision.FOLLOW, inputs=(0,)),  # input 1: the indices
    doc="[DATA, INDICES] -> OUTPUT = DATA[INDICES] along axis 0 (shape INDICES.shape + DATA.shape[1:]). "
        "Gradient: GradientSlice(INDICES, dOUTPUT) for DATA, without an op.")


# ------------------------------------------------------------------------------------ SparseLengths{Sum,...}


def _pooled(data: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, where: str) -> torch.Tensor:
    """Sum `rows` (one per index) into one row per segment."""
    out = data.new_zeros((lengths.numel(), *data.shape[1:]))
    return out.index_add_(0, segment_ids(lengths, rows.shape[0], where), rows)


def _mean_scale(lengths: torch.Tensor, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """1 / length per segment (1 for empty segments, whose sum is 0), shaped to broadcast over rows."""
    return (1.0 / lengths.clamp(min=1).to(dtype)).reshape(-1, *[1] * (ndim - 1))


def _lengths_kernel(kind: str) -> Callable[[SimpleNamespace, KernelContext], Callable[..., torch.Tensor]]:
    def factory(_a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
        where = op_label(ctx.op)

        def run(data: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
            weights = rest[0] if kind == "weighted" else None
            indices, lengths = rest[-2], rest[-1]
            _check_index(indices, "INDICES", where)
            if indices.dim() != 1 or lengths.dim() != 1:
                raise ValueError(f"{where}: INDICES and LENGTHS must be 1-D, got shapes {list(indices.shape)} "
                                 f"and {list(lengths.shape)}")
            check_lengths(lengths, indices.shape[0], where)
            if weights is not None:
                _check_weights(weights, indices, where)
            rows = data.index_select(0, indices.long())
            if weights is not None:
                rows = rows * weights.to(data.dtype).reshape(-1, *[1] * (data.dim() - 1))
            out = _pooled(data, rows, lengths, where)
            return out * _mean_scale(lengths, data.dtype, data.dim()) if kind == "mean" else out

        return run

    return factory


def _lengths_gradient(kind: str) -> Callable[[OperatorDef, list], tuple[list[OperatorDef], list]]:
    """DATA gets GradientSlice(INDICES, values) with values from `Sparse<kind>Gradient`."""

    def maker(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
        data = op.inputs[0]
        values = f"{GI(op, 0)}_values"
        if kind == "weighted":
            _, weights, indices, lengths = op.inputs
            grad_type = "SparseLengthsWeightedSumGradient"
            inputs = [weights, g[0], data, indices, lengths]
            grad_weights = GI(op, 1) if op.args.get("grad_on_weights") else None
            outputs = [values] + ([grad_weights] if grad_weights else [])
            grads = [GradientSlice(indices, values), grad_weights, None, None]
        else:
            _, indices, lengths = op.inputs
            grad_type = "SparseLengthsSumGradient" if kind == "sum" else "SparseLengthsMeanGradient"
            inputs, outputs = [g[0], lengths, indices], [values]
            grads = [GradientSlice(indices, values), None, None]
        return [gradient_op(grad_type, inputs, outputs)], grads

    return maker


def _spread(dy: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor, where: str) -> torch.Tensor:
    """dY's row of each index's segment: the values of the DATA gradient of a segment sum."""
    return dy.index_select(0, segment_ids(lengths, indices.shape[0], where))


def _weighted_grad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor | tuple]:
    where = op_label(ctx.op)

    def run(weights: torch.Tensor, dy: torch.Tensor, data: torch.Tensor, indices: torch.Tensor,
            lengths: torch.Tensor) -> torch.Tensor | tuple:
        _check_weights(weights, indices, where)
        spread = _spread(dy, lengths, indices, where)
        shape = (-1, *[1] * (dy.dim() - 1))
        values = spread * weights.to(dy.dtype).reshape(shape)
        if not a.grad_on_weights:
            return values
        rows = data.index_select(0, indices.long())
        return values, (spread * rows).reshape(indices.shape[0], -1).sum(1).to(weights.dtype)

    return run


_LENGTHS_DOC = ("Segment s of OUTPUT pools the DATA rows of the next LENGTHS[s] INDICES (1-D; LENGTHS sum "
                "to len(INDICES)); empty segments give 0. Gradient: GradientSlice(INDICES, values) for DATA, "
                "one row per index.")
register_op(
    "SparseLengthsSum", inputs=3, kernel=_lengths_kernel("sum"), gradient=_lengths_gradient("sum"),
    doc=f"[DATA, INDICES, LENGTHS] -> OUTPUT: the sum of each segment's rows. {_LENGTHS_DOC} Equals "
        f"torch.nn.functional.embedding_bag(mode='sum') with offsets from LENGTHS.")
register_op(
    "SparseLengthsMean", inputs=3, kernel=_lengths_kernel("mean"), gradient=_lengths_gradient("mean"),
    doc=f"[DATA, INDICES, LENGTHS] -> OUTPUT: the mean of each segment's rows. {_LENGTHS_DOC}")
register_op(
    "SparseLengthsWeightedSum", inputs=4, args={"grad_on_weights": False}, kernel=_lengths_kernel("weighted"),
    gradient=_lengths_gradient("weighted"),
    doc=f"[DATA, WEIGHTS, INDICES, LENGTHS] -> OUTPUT: the WEIGHTS-weighted sum of each segment's rows "
        f"(one weight per index). {_LENGTHS_DOC} With grad_on_weights, WEIGHTS gets a dense gradient.")
def _sum_grad(_a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    where = op_label(ctx.op)
    return lambda dy, lengths, indices: _spread(dy, lengths, indices, where)


def _mean_grad(_a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    where = op_label(ctx.op)
    return lambda dy, lengths, indices: _spread(dy * _mean_scale(lengths, dy.dtype, dy.dim()), lengths, indices,
                                                where)


register_gradient(
    "SparseLengthsSumGradient", "SparseLengthsSum", _sum_grad, inputs=3,
    doc="[dOUTPUT, LENGTHS, INDICES] -> values: dOUTPUT's row of each index's segment (INDICES give "
        "only the count, so nothing is read on the host).")
register_gradient(
    "SparseLengthsMeanGradient", "SparseLengthsMean", _mean_grad, inputs=3, doc="[dOUTPUT, LENGTHS, INDICES] -> values: dOUTPUT's row of each index's segment / its length.")
register_gradient(
    "SparseLengthsWeightedSumGradient", "SparseLengthsWeightedSum", _weighted_grad, inputs=5, outputs=(1, 2),
    doc="[WEIGHTS, dOUTPUT, DATA, INDICES, LENGTHS] -> values (weight times dOUTPUT's segment row) "
        "[, dWEIGHTS = <dOUTPUT segment row, DATA row> with grad_on_weights].")


# ------------------------------------------------------------------------------- segment ids and densify


def _segment_ids_infer(_a: SimpleNamespace, ctx: KernelContext, inputs: list[TensorSpec]) -> list[TensorSpec | None]:
    if len(inputs[0].shape) != 1:
        raise ValueError(f"{op_label(ctx.op)}: LENGTHS must be 1-D, got shape {list(inputs[0].shape)}")
    return [None]


def _segment_ids(_a: SimpleNamespace, _ctx: KernelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(lengths: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(lengths.numel(), device=lengths.device, dtype=lengths.dtype)
        return torch.repeat_interleave(positions, lengths.long())

    return run


register_op(
    "LengthsToSegmentIds", kernel=_segment_ids, infer=_segment_ids_infer, gradient=NO_GRADIENT,
    traits=(Trait.HOST_SYNC,),
    doc="LENGTHS -> SEGMENT_IDS: segment s repeated LENGTHS[s] times, in LENGTHS' dtype (the output length, "
        "sum(LENGTHS), is read on the host).")


def _sparse_to_dense(_a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    where = op_label(ctx.op)

    def run(indices: torch.Tensor, values: torch.Tensor, *like: torch.Tensor) -> torch.Tensor:
        _check_index(indices, "INDICES", where)
        flat = indices.reshape(-1).long()
        rows = values.reshape(flat.numel(), *values.shape[indices.dim():])
        first = like[0].shape[0] if like else (int(flat.max().item()) + 1 if flat.numel() else 0)
        return rows.new_zeros((first, *rows.shape[1:])).index_add_(0, flat, rows)

    return run


def _sparse_to_dense_infer(_a: SimpleNamespace, ctx: KernelContext,
                           inputs: list[TensorSpec]) -> list[TensorSpec | None]:
    indices, values = inputs[:2]
    if values.shape[:len(indices.shape)] != indices.shape:
        raise ValueError(f"{op_label(ctx.op)}: VALUES {list(values.shape)} must start with the INDICES shape "
                         f"{list(indices.shape)}")
    if len(inputs) < 3:
        return [None]
    return [TensorSpec((inputs[2].shape[0], *values.shape[len(indices.shape):]), values.dtype)]


def _sparse_to_dense_gradient(op: OperatorDef, g: list) -> tuple[list[OperatorDef], list]:
    return [gradient_op("Gather", [g[0], op.inputs[0]], [GI(op, 1)])], [None, GI(op, 1), None][:len(op.inputs)]


register_op(
    "SparseToDense", inputs=(2, 3), kernel=_sparse_to_dense, infer=_sparse_to_dense_infer,
    gradient=_sparse_to_dense_gradient, traits=(Trait.HOST_SYNC,),
    doc="[INDICES, VALUES (, DATA_TO_INFER_DIM)] -> OUTPUT: zeros with OUTPUT[INDICES[i]] += VALUES[i] "
        "(duplicates summed); the first dimension is DATA_TO_INFER_DIM's, else max(INDICES) + 1 (read on "
        "the host). Densifies a GradientSlice. Gradient: Gather(dOUTPUT, INDICES) for VALUES.")
