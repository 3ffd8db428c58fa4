"""More of Caffe2's update kernels, with its signatures and formulas: Storm / SparseStorm, DecayAdagrad,
GFtrl (group-lasso FTRL), YellowFin, SmartDecaySparseAdam and RowWiseCounter (Adagrad's
`counter_halflife` state).

As elsewhere in graphpar, a learning-rate input is added to the param (negative for descent, Caffe2's
sign), and the sparse variants sum duplicate indices first (`sparse_optim.coalesce`, as Caffe2's
`sparse_dedup_aggregator='sum'`; Caffe2's kernels without it applied each duplicate in turn). The ops
that read an iteration counter use Caffe2's step t = iter + 1, as its C++ kernels do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import torch

from graphpar.core.ir import DeviceOption
from graphpar.core.schema import NOT_DIFFERENTIABLE, KernelContext, TensorSpec, Trait, register_op
from graphpar.ops.common import op_label
from graphpar.ops.optim import counter_at
from graphpar.ops.sparse_optim import coalesce

_UPDATE = (Trait.INPLACE_UPDATE,)
_HOST_UPDATE = (Trait.INPLACE_UPDATE, Trait.HOST_SYNC)
_HOST = DeviceOption()


def _scalar(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.reshape(()).to(dtype)


def _same_specs(*pairs: int) -> Callable[[SimpleNamespace, KernelContext, list[TensorSpec]], list[TensorSpec]]:
    return lambda _a, _ctx, inputs: [inputs[i] for i in pairs]


def _iter_on_host(n_inputs: int, iter_index: int, n_outputs: int) -> Callable:
    """Device inference: everything on the op's device but the iteration counter (a CPU blob)."""
    return lambda op, d: ([_HOST if i == iter_index else d for i in range(n_inputs)], [d] * n_outputs)


def _step(it: torch.Tensor) -> int:
    """Caffe2's t = iter + 1."""
    return int(it.item()) + 1


def _same_rows(where: str, names: list[str], *tensors: torch.Tensor) -> None:
    shapes = [tuple(t.shape) for t in tensors]
    if len(set(shapes)) > 1:
        listed = ", ".join(f"{n!r} {list(s)}" for n, s in zip(names, shapes))
        raise ValueError(f"{where}: these inputs must have one shape, got {listed}")


# ---------------------------------------------------------------------------------------------- Storm


def _storm_rows(a: SimpleNamespace, param: torch.Tensor, moment: torch.Tensor, gss: torch.Tensor,
                grad: torch.Tensor, lr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    new_gss = gss + (grad * grad).sum().to(gss.dtype)
    seen = a.beta + _scalar(new_gss, grad.dtype)
    nlr = _scalar(lr, grad.dtype) * torch.pow(seen, -1.0 / 3.0)
    nlr = torch.where(seen > 0, nlr, torch.zeros_like(nlr))  # beta 0 and only zero gradients so far: no step (not inf * 0)
    alpha = a.momentum * nlr * nlr
    new_moment = grad + (1 - alpha) * (moment - grad)
    return param + nlr * new_moment, new_moment, new_gss


def _storm(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    where = op_label(ctx.op)

    def run(param: torch.Tensor, moment: torch.Tensor, gss: torch.Tensor, grad: torch.Tensor,
            lr: torch.Tensor) -> tuple:
        _same_rows(where, [ctx.op.inputs[i] for i in (0, 1, 3)], param, moment, grad)
        return _storm_rows(a, param, moment, gss, grad, lr)

    return run


def _sparse_storm(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    where = op_label(ctx.op)

    def run(param: torch.Tensor, moment: torch.Tensor, gss: torch.Tensor, grad: torch.Tensor,
            indices: torch.Tensor, lr: torch.Tensor) -> tuple:
        rows, g = coalesce(indices, grad, where)
        if rows.numel() == 0:
            return param, moment, gss
        new_p, new_m, new_gss = _storm_rows(a, param.index_select(0, rows), moment.index_select(0, rows), gss, g, lr)
        param.index_copy_(0, rows, new_p)
        moment.index_copy_(0, rows, new_m)
        gss.copy_(new_gss)
        return param, moment, gss

    return run


_STORM_ARGS = {"momentum": 10.0, "beta": 0.1}
_STORM_RULE = ("gss += ‖g‖²; nlr = lr (beta + gss)^(-1/3), 0 while beta + gss is 0 (beta 0, zero gradients: "
               "nothing moves); a = momentum nlr²; moment = g + (1 - a)(moment - g); param += nlr moment (STORM, "
               "Cutkosky & Orabona 2019; lr negative)")
register_op(
    "Storm", inputs=5, outputs=3, inplace={(0, 0), (1, 1), (2, 2)}, args=_STORM_ARGS, kernel=_storm,
    gradient=NOT_DIFFERENTIABLE, traits=_UPDATE,
    doc=f"[param, moment, grad_sq_sum ([1]), grad, lr] -> [param, moment, grad_sq_sum]: {_STORM_RULE}.")
register_op(
    "SparseStorm", inputs=6, outputs=3, enforce_inplace={(0, 0), (1, 1), (2, 2)}, args=_STORM_ARGS,
    kernel=_sparse_storm, gradient=NOT_DIFFERENTIABLE, traits=_HOST_UPDATE, infer=_same_specs(0, 1, 2),
    doc="[param, moment, grad_sq_sum, grad, indices, lr] -> [param, moment, grad_sq_sum] in place (Caffe2's "
        "input order: values before indices): Storm on the rows of the coalesced slice, grad_sq_sum "
        "growing by its squared norm; an empty slice changes nothing.")


# --------------------------------------------------------------------------------------- DecayAdagrad


def _decay_adagrad(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    where = op_label(ctx.op)

    def run(param: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, grad: torch.Tensor, lr: torch.Tensor,
            it: torch.Tensor) -> tuple:
        _same_rows(where, [ctx.op.inputs[i] for i in range(4)], param, m1, m2, grad)
        t = _step(it)
        new_m1 = a.beta1 * m1 + (1 - a.beta1) * grad
        new_m2 = m2 + grad * grad
        c = 1 - a.beta1 ** t if a.bias_correction_first else 1.0
        step = new_m1 / c / (torch.sqrt(new_m2) + a.epsilon) + a.weight_decay * param
        return param + _scalar(lr, grad.dtype) * step, new_m1, new_m2

    return run


register_op(
    "DecayAdagrad", inputs=6, outputs=3, inplace={(0, 0), (1, 1), (2, 2)},
    args={"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-5, "weight_decay": 0.0, "bias_correction_first": True},
    kernel=_decay_adagrad, gradient=NOT_DIFFERENTIABLE, traits=_HOST_UPDATE, infer=_same_specs(0, 1, 2),
    check=counter_at(5), device_inference=_iter_on_host(6, 5, 3),
    doc="[param, m1, m2, grad, lr, iter] -> [param, m1, m2]: m1 = beta1 m1 + (1 - beta1) g; m2 += g²; "
        "param += lr (m1 / c / (sqrt(m2) + epsilon) + weight_decay param), c = 1 - beta1^t with "
        "bias_correction_first (else 1), t = iter + 1 (Caffe2's formula; beta2 is accepted and unused, "
        "as in Caffe2's kernel).")


# ---------------------------------------------------------------------------------------------- GFtrl


def _gftrl(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    where = op_label(ctx.op)

    def run(w: torch.Tensor, nz: torch.Tensor, g: torch.Tensor, *alpha: torch.Tensor) -> tuple:
        if w.dim() == 0 or g.shape != w.shape or nz.shape != (*w.shape, 2):
            raise ValueError(f"{where}: needs var and grad of one shape (at least 1-D) and n_z of that shape + "
                             f"[2], got {list(w.shape)}, {list(g.shape)} and {list(nz.shape)}")
        alpha_inv = 1.0 / (_scalar(alpha[0], w.dtype) if alpha else torch.tensor(a.alpha, dtype=w.dtype))
        rows = w.shape[0]
        w2, g2, nz2 = w.reshape(rows, -1), g.reshape(rows, -1), nz.reshape(rows, -1, 2)
        n, z = nz2[..., 0], nz2[..., 1]
        new_n = n + g2 * g2
        new_z = z + g2 - (torch.sqrt(new_n) - torch.sqrt(n)) * alpha_inv * w2
        z_norm = torch.linalg.vector_norm(new_z, dim=0, keepdim=True)  # one group per input column
        limit = a.lambda1 * math.sqrt(rows)
        shrunk = new_z * (limit / z_norm - 1) / ((a.beta + torch.sqrt(new_n)) * alpha_inv + a.lambda2)
        new_w = torch.where(z_norm > limit, shrunk, torch.zeros_like(shrunk))
        return new_w.reshape(w.shape), torch.stack((new_n, new_z), -1).reshape(nz.shape)

    return run


register_op(
    "GFtrl", inputs=(3, 4), outputs=2, inplace={(0, 0), (1, 1)},
    args={"alpha": 0.005, "beta": 1.0, "lambda1": 0.001, "lambda2": 0.001}, kernel=_gftrl,
    gradient=NOT_DIFFERENTIABLE, traits=_UPDATE,
    doc="[var, n_z (var's shape + [2]), grad, alpha (optional [1], overrides the arg)] -> [var, n_z]: "
        "group-lasso FTRL. var is seen as [dim 0, the rest]; each column j is a group: n += g²; "
        "z += g - (sqrt(n') - sqrt(n)) / alpha w; var = z (lambda1 sqrt(dim0) / ‖z_j‖ - 1) / ((beta + "
        "sqrt(n)) / alpha + lambda2) where ‖z_j‖ > lambda1 sqrt(dim0), else 0 (Caffe2's GFtrl).")


# ------------------------------------------------------------------------------------------ YellowFin


def _yellowfin_lr_mu(dist: torch.Tensor, h_min: torch.Tensor, h_max: torch.Tensor,
                     variance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Caffe2's GetLrMu: the cubic's root (YellowFin's SingleStep) and the curvature-range limit."""
    curv_ratio = torch.sqrt(h_max / h_min)
    mu_limit = (curv_ratio - 1) / (curv_ratio + 1)
    p = (dist * h_min) ** 2 / (2 * variance)
    w3 = (-torch.sqrt(p * p + 4.0 / 27.0 * p ** 3) - p) / 2
    w = torch.where(w3 > 0, 1.0, -1.0) * torch.abs(w3) ** (1.0 / 3.0)
    root = w - p / 3 / w + 1
    mu = torch.maximum(root * root, mu_limit * mu_limit)
    return (1 - torch.sqrt(mu)) ** 2 / h_min, mu


def _yellowfin(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    where = op_label(ctx.op)
    if a.curv_win_width < 1:
        raise ValueError(f"{where}: curv_win_width must be >= 1, got {a.curv_win_width}")

    def run(param: torch.Tensor, moment: torch.Tensor, lr_avg: torch.Tensor, mu_avg: torch.Tensor,
            curv_win: torch.Tensor, g_avg: torch.Tensor, g2_avg: torch.Tensor, memory: torch.Tensor,
            grad: torch.Tensor, it: torch.Tensor) -> tuple:
        names = [ctx.op.inputs[i] for i in (0, 1, 5, 6, 8)]
        _same_rows(where, names, param, moment, g_avg, g2_avg, grad)
        if curv_win.numel() != a.curv_win_width or memory.numel() != 5 or lr_avg.numel() != 1 or mu_avg.numel() != 1:
            raise ValueError(f"{where}: needs curv_win of {a.curv_win_width} values, scalars_memory of 5 and "
                             f"lr_avg, mu_avg of 1")
        t = int(it.item())
        if t < 1:
            raise ValueError(f"{where}: the iteration counter is {t}; YellowFin needs iter >= 1 (Iter before it)")
        beta, eps = a.beta, a.epsilon
        debias = 1.0 / (1.0 - beta ** t) if a.zero_debias else 1.0

        def average(x: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            new = beta * old + (1 - beta) * x
            return new, new * debias

        mu, lr = _scalar(mu_avg, grad.dtype), _scalar(lr_avg, grad.dtype)
        new_moment = mu * moment + lr * grad
        new_param = param - (1 + mu) * new_moment + mu * moment if a.nesterov else param - new_moment
        new_g_avg, g_deb = average(grad, g_avg)
        new_g2_avg, _ = average(grad * grad, g2_avg)
        g_norm2 = torch.clamp((grad * grad).sum(), min=eps)
        norm2_avg, norm2_deb = average(g_norm2, memory[1])
        norm_avg, _ = average(torch.sqrt(g_norm2), memory[0])
        new_curv = curv_win.clone()
        new_curv.view(-1)[(t - 1) % a.curv_win_width] = torch.log(g_norm2)
        window = new_curv.view(-1)[:min(a.curv_win_width, t)]
        min_avg, min_deb = average(window.min(), memory[2])
        max_avg, max_deb = average(window.max(), memory[3])
        h_min, h_max = torch.clamp(torch.exp(min_deb), min=eps), torch.clamp(torch.exp(max_deb), min=eps)
        variance = torch.clamp(norm2_deb - (g_deb * g_deb).sum(), min=eps)
        dist_avg, dist_deb = average(norm_avg / norm2_avg, memory[4])
        new_lr_avg, new_mu_avg = lr_avg.clone(), mu_avg.clone()
        if t > 1:
            lr_t, mu_t = _yellowfin_lr_mu(dist_deb, h_min, h_max, variance)
            new_lr_avg = (beta * lr_avg + (1 - beta) * lr_t).to(lr_avg.dtype)
            new_mu_avg = (beta * mu_avg + (1 - beta) * mu_t).to(mu_avg.dtype)
        new_memory = torch.stack([norm_avg, norm2_avg, min_avg, max_avg, dist_avg]).to(memory.dtype)
        return new_param, new_moment, new_lr_avg, new_mu_avg, new_curv, new_g_avg, new_g2_avg, new_memory

    return run


register_op(
    "YellowFin", inputs=10, outputs=8, inplace=lambda i, o: i == o and i < 8,
    args={"beta": 0.999, "curv_win_width": 20, "epsilon": 1e-6, "nesterov": False, "zero_debias": True},
    kernel=_yellowfin, gradient=NOT_DIFFERENTIABLE, traits=_HOST_UPDATE, infer=_same_specs(*range(8)),
    check=counter_at(9), device_inference=_iter_on_host(10, 9, 8),
    doc="[param, moment, lr_avg, mu_avg, curv_win, g_avg, g2_avg, scalars_memory, grad, iter] -> the first "
        "eight: YellowFin (Zhang & Mitliagkas 2017), Caffe2's kernel: a momentum-SGD step moment = mu_avg "
        "moment + lr_avg g, param -= moment (nesterov: param -= (1 + mu) moment' - mu moment), then moving "
        "averages (beta, zero-debiased by 1 - beta^iter) of g, g², ‖g‖², ‖g‖, the log-curvature range "
        "over the last curv_win_width steps and the distance ‖g‖/‖g‖²; from iter 2 on, lr_avg and mu_avg "
        "move towards the tuned rate and momentum. scalars_memory holds the averages of ‖g‖, ‖g‖², "
        "min and max log ‖g‖², and the distance.")


# ------------------------------------------------------------------------------- SmartDecaySparseAdam


def _smart_decay_adam(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    where = op_label(ctx.op)

    def run(param: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, last_seen: torch.Tensor,
            indices: torch.Tensor, grad: torch.Tensor, lr: torch.Tensor, it: torch.Tensor) -> tuple:
        if last_seen.numel() != param.shape[0]:
            raise ValueError(f"{where}: last_seen {ctx.op.inputs[3]!r} needs one value per row of the param "
                             f"({param.shape[0]}), got {last_seen.numel()}")
        t = _step(it)
        rows, g = coalesce(indices, grad, where)
        shape = (-1,) + (1,) * (param.dim() - 1)
        k = (t - last_seen.view(-1).index_select(0, rows)).to(param.dtype).reshape(shape)
        m, v = m1.index_select(0, rows), m2.index_select(0, rows)
        b1, b2 = a.beta1, a.beta2
        catchup = torch.where(k > 1, m * b1 * (1 - b1 ** (k - 1)) / (1 - b1), torch.zeros_like(m))
        new_m = m * b1 ** k + g * (1 - b1)
        new_v = v * b2 ** k + g * g * (1 - b2)
        new_p = param.index_select(0, rows) + _scalar(lr, param.dtype) * (new_m + catchup) / (torch.sqrt(new_v) + a.epsilon)
        for state, value in ((param, new_p), (m1, new_m), (m2, new_v)):
            state.index_copy_(0, rows, value)
        last_seen.view(-1).index_fill_(0, rows, t)
        return param, m1, m2, last_seen

    return run


register_op(
    "SmartDecaySparseAdam", inputs=8, outputs=4, enforce_inplace={(0, 0), (1, 1), (2, 2), (3, 3)},
    args={"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-5}, kernel=_smart_decay_adam, gradient=NOT_DIFFERENTIABLE,
    traits=_HOST_UPDATE, infer=_same_specs(0, 1, 2, 3), check=counter_at(7), device_inference=_iter_on_host(8, 7, 4),
    doc="[param, m1, m2, last_seen (int64, one per row), indices, grad, lr, iter] -> [param, m1, m2, last_seen] "
        "in place: Adam on the rows of the coalesced slice, each row's moments decayed by beta^k for the "
        "k = t - last_seen steps since the row was last updated, m1 plus the catch-up m1 beta1 (1 - "
        "beta1^(k-1)) / (1 - beta1) in the step, no bias correction; t = iter + 1 (Caffe2's formula).")


# ------------------------------------------------------------------------------------- RowWiseCounter


def _row_wise_counter(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    where = op_label(ctx.op)
    rho = math.log(2.0) / a.counter_halflife if a.counter_halflife > 0 else 0.0

    def run(prev_iter: torch.Tensor, counter: torch.Tensor, indices: torch.Tensor, it: torch.Tensor) -> tuple:
        if prev_iter.numel() != counter.numel():
            raise ValueError(f"{where}: prev_iter and counter must have one size, got {prev_iter.numel()} and "
                             f"{counter.numel()}")
        flat = indices.reshape(-1).long()
        if a.counter_halflife <= 0 or flat.numel() == 0:
            return prev_iter, counter
        rows, seen = torch.unique(flat, return_counts=True)
        now = it.reshape(()).to(prev_iter.dtype)
        prev, count = prev_iter.view(-1).index_select(0, rows), counter.view(-1).index_select(0, rows)
        delta = torch.clamp(now - prev, min=0).to(counter.dtype)
        counter.view(-1).index_copy_(0, rows, seen.to(counter.dtype) + torch.exp(-delta * rho) * count)
        prev_iter.view(-1).index_copy_(0, rows, torch.maximum(prev, now))
        return prev_iter, counter

    return run


register_op(
    "RowWiseCounter", inputs=4, outputs=2, enforce_inplace={(0, 0), (1, 1)}, args={"counter_halflife": -1},
    kernel=_row_wise_counter, gradient=NOT_DIFFERENTIABLE, traits=_HOST_UPDATE, infer=_same_specs(0, 1),
    check=counter_at(3), device_inference=_iter_on_host(4, 3, 2),
    doc="[prev_iter (int64), counter (float64), indices, iter] -> [prev_iter, counter] in place: for each "
        "index, counter = 1 + 2^(-(iter - prev_iter) / counter_halflife) counter and prev_iter = iter "
        "(a repeated index adds 1 more each time); nothing when counter_halflife <= 0 (Caffe2's "
        "RowWiseCounter, the row frequencies of Adagrad's counter_halflife).")
