"""Loss and metric operators: SoftmaxWithLoss, (Label)CrossEntropy, SquaredL2Distance,
SigmoidCrossEntropyWithLogits and Accuracy.

Integer labels may be int32 or int64, shaped [N] or [N, 1]; float labels are refused (except as
probabilities where the op takes them), since truncating them would hide a wrong feed. Labels are not
range-checked on the host (that would synchronise the GPU every step); an out-of-range label fails in
PyTorch's gather. Counts and shapes are checked, as Caffe2 does: one label (and weight) per row, and
inputs that must match (SquaredL2Distance's A and B, CrossEntropy's X and target) of one shape, since
gather and broadcasting would otherwise turn a wrong feed into a wrong loss without an error.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from graphpar.core.ir import OperatorDef
from graphpar.core.schema import GI, NOT_DIFFERENTIABLE, KernelContext, PredictAs, gradient_op, register_op
from graphpar.errors import GradientError
from graphpar.ops.common import op_label, register_gradient
from graphpar.ops.nn import flatten_2d

_PROB_FLOOR = 1e-20  # Caffe2's floor under probabilities before taking their log


def _label_index(label: torch.Tensor, rows: int, ctx: KernelContext) -> torch.Tensor:
    """Integer labels, one per row of the scores, as an int64 [rows, 1] index for gather/scatter.

    A label count that differs from the row count raises: gather would otherwise use the first
    labels only, or broadcast a single one, and give a wrong loss silently.
    """
    if label.is_floating_point() or label.dtype == torch.bool:
        raise TypeError(f"{op_label(ctx.op)}: labels must be integers (int32/int64), got {label.dtype}")
    if label.numel() != rows:
        raise ValueError(f"{op_label(ctx.op)}: {label.numel()} labels (shape {tuple(label.shape)}) for "
                         f"{rows} rows of scores; feed one label per row")
    return label.reshape(-1, 1).long()


def _same_shape(x: torch.Tensor, y: torch.Tensor, what: str, ctx: KernelContext) -> None:
    """Raise unless `y` (named `what`) has X's shape; broadcasting would give a wrong result silently."""
    if x.shape != y.shape:
        raise ValueError(f"{op_label(ctx.op)}: {what} has shape {tuple(y.shape)}, X has {tuple(x.shape)}; "
                         f"they must match")


def _label_probs(label: torch.Tensor, x: torch.Tensor, x2: torch.Tensor, ctx: KernelContext) -> torch.Tensor:
    """label_prob=1 targets, shaped like the logits or their 2-D view, as X2's shape and dtype.

    Any other shape raises, even with the same element count: a transposed feed would reshape silently.
    """
    if label.shape != x.shape and label.shape != x2.shape:
        raise ValueError(f"{op_label(ctx.op)}: label probabilities have shape {tuple(label.shape)}, "
                         f"the logits {tuple(x.shape)}; with label_prob=1 they must match")
    return label.to(x2.dtype).reshape(x2.shape)


def _weights(w: torch.Tensor | None, rows: int, dtype: torch.dtype, ctx: KernelContext) -> torch.Tensor | None:
    """SoftmaxWithLoss's per-row weights as a [rows] vector of `dtype` (None without weights)."""
    if w is None:
        return None
    if w.numel() != rows:
        raise ValueError(f"{op_label(ctx.op)}: {w.numel()} weights (shape {tuple(w.shape)}) for {rows} "
                         f"rows; feed one weight per row")
    return w.reshape(-1).to(dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """X as [N, D]: 2-D inputs as they are, a 1-D input as one row."""
    return x.reshape(1, -1) if x.dim() == 1 else x


# ----------------------------------------------------------------------------------------------------
# SoftmaxWithLoss
# ----------------------------------------------------------------------------------------------------


def _swl_weight_sum(w: torch.Tensor | None, n: int) -> torch.Tensor | float:
    """Σw (N without weights); an all-zero weight vector gives a zero loss rather than 0/0."""
    if w is None:
        return float(max(n, 1))
    total = w.sum()
    return torch.where(total != 0, total, torch.ones_like(total))


def _softmax_with_loss(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    def softmax_with_loss(x: torch.Tensor, label: torch.Tensor, w: torch.Tensor | None = None) -> tuple:
        x2 = flatten_2d(x, a.axis, ctx.op)
        w = _weights(w, x2.shape[0], x.dtype, ctx)
        logp = torch.log_softmax(x2, 1)
        if a.label_prob:
            nll = -(_label_probs(label, x, x2, ctx) * logp).sum(1)
        else:
            nll = -logp.gather(1, _label_index(label, x2.shape[0], ctx)).squeeze(1)
        if w is not None:
            nll = nll * w
        loss = nll.sum() * (a.scale / _swl_weight_sum(w, x2.shape[0]))
        return logp.exp().reshape(x.shape), loss

    return softmax_with_loss


def _softmax_with_loss_grad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    weighted = len(ctx.op.inputs) == 5

    def softmax_with_loss_grad(x: torch.Tensor, label: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        w = rest[0] if weighted else None
        p, dloss = rest[-2], rest[-1]
        p2 = flatten_2d(p, a.axis, ctx.op)
        w = _weights(w, p2.shape[0], p.dtype, ctx)
        if a.label_prob:
            d = p2 - _label_probs(label, p, p2, ctx)
        else:
            d = p2.scatter_add(1, _label_index(label, p2.shape[0], ctx), p2.new_full((p2.shape[0], 1), -1.0))
        coeff = dloss.reshape(()) * (a.scale / _swl_weight_sum(w, p2.shape[0]))
        d = d * coeff if w is None else d * (w.reshape(-1, 1) * coeff)
        return d.reshape(x.shape)

    return softmax_with_loss_grad


def _softmax_with_loss_gradient(op: OperatorDef, g: list) -> tuple[list, list]:
    if g[0] is not None or g[1] is None:
        raise GradientError(
            f"{op_label(op)}: only the loss output can be differentiated; for a gradient "
            f"through the softmax output use Softmax + LabelCrossEntropy"
        )
    inputs = [*op.inputs, op.outputs[0], g[1]]
    grad = gradient_op("SoftmaxWithLossGradient", inputs, [GI(op, 0)])
    return [grad], [GI(op, 0), *([None] * (len(op.inputs) - 1))]


register_op(
    "SoftmaxWithLoss",
    inputs=(2, 3),
    outputs=2,
    args={"scale": 1.0, "label_prob": False, "axis": 1, "only_loss": False},
    kernel=_softmax_with_loss,
    gradient=_softmax_with_loss_gradient,
    predict_as=PredictAs(unused=(1,), type="Softmax", inputs=(0,), outputs=(0,), args=("axis",)),  # P without the loss
    doc="SoftmaxWithLoss(logits, labels[, weights]) -> P (softmax of logits viewed as [N, D] at `axis`, "
    "logits' shape), loss (0-d) = scale·Σ w_i·(-log P[i, label_i]) / Σw, with Σw = N without "
    "weights. Labels are int [N], or probabilities [N, D] with label_prob=1. Computed with "
    "log_softmax, so no 1e-20 floor is needed. `only_loss` (Caffe2's scripts pass it) is accepted and "
    "changes nothing: both outputs are written, and P is what the gradient reads.",
)

register_gradient(
    "SoftmaxWithLossGradient", "SoftmaxWithLoss", _softmax_with_loss_grad, inputs=(4, 5),
    doc="SoftmaxWithLossGradient(logits, labels[, weights], P, dLoss) -> dlogits = (P - onehot)·w·"
    "scale·dLoss / Σw.",
)


# ----------------------------------------------------------------------------------------------------
# LabelCrossEntropy / CrossEntropy
# ----------------------------------------------------------------------------------------------------


def _label_xent(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    def label_xent(x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        x2 = _rows(x)
        picked = x2.gather(1, _label_index(label, x2.shape[0], ctx)).squeeze(1)
        return -picked.clamp_min(_PROB_FLOOR).log()

    return label_xent


def _label_xent_grad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    def label_xent_grad(x: torch.Tensor, label: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        x2 = _rows(x)
        index = _label_index(label, x2.shape[0], ctx)
        picked = x2.gather(1, index).clamp_min(_PROB_FLOOR)
        return torch.zeros_like(x2).scatter_(1, index, -dy.reshape(-1, 1) / picked).reshape(x.shape)

    return label_xent_grad


def _xent_gradient(grad_type: str) -> Callable[[OperatorDef, list], tuple[list, list]]:
    def maker(op: OperatorDef, g: list) -> tuple[list, list]:
        return [gradient_op(grad_type, [op.inputs[0], op.inputs[1], g[0]], [GI(op, 0)])], [GI(op, 0), None]

    return maker


register_op(
    "LabelCrossEntropy",
    inputs=2,
    kernel=_label_xent,
    gradient=_xent_gradient("LabelCrossEntropyGradient"),
    doc="LabelCrossEntropy(X, label) -> Y[N] = -log(max(X[i, label_i], 1e-20)), X probabilities [N, D].",
)

register_gradient(
    "LabelCrossEntropyGradient", "LabelCrossEntropy", _label_xent_grad, inputs=3,
    doc="LabelCrossEntropyGradient(X, label, dY) -> dX: -dY / max(X, 1e-20) at each row's label entry, "
    "0 elsewhere (Caffe2's formula, also below the floor); the label gets no gradient.",
)


def _xent(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    def xent(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        _same_shape(x, t, "the target", ctx)
        return -(t * x.clamp_min(_PROB_FLOOR).log()).reshape(_rows(x).shape).sum(1)

    return xent


register_op(
    "CrossEntropy",
    inputs=2,
    kernel=_xent,
    gradient=_xent_gradient("CrossEntropyGradient"),
    doc="CrossEntropy(X, target) -> Y[N] = -Σ_j target_ij·log(max(X_ij, 1e-20)), with X and the target "
    "distribution both [N, D].",
)

register_gradient(
    "CrossEntropyGradient", "CrossEntropy", inputs=3,
    kernel=lambda a, ctx: lambda x, t, dy: -_rows(t) * dy.reshape(-1, 1) / _rows(x).clamp_min(_PROB_FLOOR),
    doc="CrossEntropyGradient(X, target, dY) -> dX = -dY·target / max(X, 1e-20); the target gets none.",
)


# ----------------------------------------------------------------------------------------------------
# SquaredL2Distance
# ----------------------------------------------------------------------------------------------------


def _sq_l2(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    def sq_l2(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _same_shape(x, y, "B", ctx)
        diff = (x - y).reshape(x.shape[0] if x.dim() else 1, -1)
        return 0.5 * diff.square().sum(1)

    return sq_l2


def _sq_l2_grad(x: torch.Tensor, y: torch.Tensor, dd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dx = (x - y) * dd.reshape(-1, *([1] * (x.dim() - 1)))
    return dx, -dx


register_op(
    "SquaredL2Distance",
    inputs=2,
    kernel=_sq_l2,
    gradient=lambda op, g: (
        [gradient_op("SquaredL2DistanceGradient", [*op.inputs, g[0]], [GI(op, 0), GI(op, 1)])],
        [GI(op, 0), GI(op, 1)],
    ),
    doc="SquaredL2Distance(A, B) -> D[N] = ½‖A_i - B_i‖² per row (A, B of one shape, rows on axis 0).",
)

register_gradient(
    "SquaredL2DistanceGradient", "SquaredL2Distance", lambda a, ctx: _sq_l2_grad, inputs=3, outputs=2,
    doc="SquaredL2DistanceGradient(A, B, dD) -> dA = (A - B)·dD, dB = -dA.",
)


# ----------------------------------------------------------------------------------------------------
# SigmoidCrossEntropyWithLogits
# ----------------------------------------------------------------------------------------------------


def _sigmoid_xent(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(x, t, reduction="none").mean(-1)


def _sigmoid_xent_grad(dy: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (torch.sigmoid(x) - t) * (dy.unsqueeze(-1) / x.shape[-1])


register_op(
    "SigmoidCrossEntropyWithLogits",
    inputs=2,
    kernel=lambda a, ctx: _sigmoid_xent,
    gradient=lambda op, g: (
        [gradient_op("SigmoidCrossEntropyWithLogitsGradient", [g[0], *op.inputs], [GI(op, 0)])],
        [GI(op, 0), None],
    ),
    doc="SigmoidCrossEntropyWithLogits(logits, targets) -> Y = mean over the last axis of "
    "max(x, 0) - x·t + log(1 + exp(-|x|)) (the stable form of -t·log σ(x) - (1-t)·log(1-σ(x))); "
    "Y has logits.shape[:-1].",
)

register_gradient(
    "SigmoidCrossEntropyWithLogitsGradient", "SigmoidCrossEntropyWithLogits", lambda a, ctx: _sigmoid_xent_grad,
    inputs=3,
    doc="SigmoidCrossEntropyWithLogitsGradient(dY, logits, targets) -> dlogits = (σ(x) - t)·dY / D; "
    "the targets get no gradient.",
)


# ----------------------------------------------------------------------------------------------------
# Accuracy
# ----------------------------------------------------------------------------------------------------


def _accuracy(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    if a.top_k < 1:
        raise ValueError(f"{op_label(ctx.op)}: top_k must be >= 1, got {a.top_k}")

    def accuracy(pred: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        if pred.dim() != 2:
            raise ValueError(f"{op_label(ctx.op)}: predictions must be [N, D], got shape {tuple(pred.shape)}")
        index = _label_index(label, pred.shape[0], ctx)
        score = pred.gather(1, index)
        classes = torch.arange(pred.shape[1], device=pred.device)
        ahead = (pred > score) | ((pred == score) & (classes < index))  # ties rank the lower class first
        correct = ahead.sum(1) < a.top_k
        return correct.to(pred.dtype).mean()

    return accuracy


register_op(
    "Accuracy",
    inputs=2,
    args={"top_k": 1},
    gradient=NOT_DIFFERENTIABLE,
    kernel=_accuracy,
    doc="Accuracy(pred[N, D], label[N]) -> 0-d fraction of rows whose label is among the top_k scores; "
    "ties rank the lower class index first (as Caffe2). Not differentiable.",
)
