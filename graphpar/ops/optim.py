"""Optimizer operators: iteration counters, learning-rate schedules and parameter updates.

Counters are int64 CPU tensors of shape [1], even inside CUDA ops (their `device_inference` says so).
Update ops are functional like every kernel: they return new tensors, and the in-place blob names
(enforced where Caffe2 enforces them) make the workspace rebind the state. None is differentiable.
LearningRate and Adam read the counter on the host (Trait.HOST_SYNC), so they declare shape rules.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from graphpar.core.ir import DeviceOption, OperatorDef
from graphpar.core.schema import (
    NOT_DIFFERENTIABLE,
    Arg,
    Effects,
    Elementwise,
    InputCheck,
    KernelContext,
    MultiTensor,
    TensorSpec,
    Trait,
    all_checks,
    register_op,
    same_index,
    same_shape,
)
from graphpar.core.shapes import on_meta
from graphpar.ops.common import op_label

_HOST = DeviceOption()


_COUNTER = (Trait.COUNTER, Trait.INPLACE_UPDATE)


def counter_at(index: int) -> InputCheck:
    """An input check: input `index` (-1: the last) is an iteration counter, one integer value.

    A float counter would count wrongly past 2**24 (float32) and feed fractional iterations to the
    learning-rate schedule, silently; a bool one would stop at 1.
    """

    def check(_a: SimpleNamespace, op: OperatorDef, inputs: Sequence[Any]) -> None:
        it, name = inputs[index], op.inputs[index]
        if it.dtype.is_floating_point or it.dtype.is_complex or it.dtype == torch.bool:
            raise TypeError(f"{op.type}: the iteration counter {name!r} is {str(it.dtype).removeprefix('torch.')}; "
                            f"it must be an integer (int64) tensor, e.g. ConstantFill(shape=[1], value=0, "
                            f"dtype=int64) as brew.iter makes it")
        if math.prod(it.shape) != 1:
            raise ValueError(f"{op.type}: the iteration counter {name!r} must hold one value, got shape "
                             f"{list(it.shape)}")

    return check


register_op("Iter", enforce_inplace={(0, 0)}, kernel=lambda _a, _ctx: lambda it: it + 1, check=counter_at(0),
            gradient=NOT_DIFFERENTIABLE, traits=_COUNTER, device_inference=lambda op, d: ([_HOST], [_HOST]),
            doc="it += 1 on an int64 CPU counter of shape [1] (in place enforced).")
register_op("AtomicIter", inputs=2, enforce_inplace={(1, 0)},
            kernel=lambda _a, _ctx: lambda _mutex, it: it + 1, check=counter_at(1),
            gradient=NOT_DIFFERENTIABLE, traits=_COUNTER, device_inference=lambda op, d: ([_HOST, _HOST], [_HOST]),
            doc="[mutex, it] -> it, it += 1. The mutex is a dependency token: executors order every "
                "write of one blob, so the increment is atomic without a lock.")
register_op("CreateMutex", inputs=0, kernel=lambda _a, _ctx: lambda: torch.zeros((), dtype=torch.uint8),
            gradient=NOT_DIFFERENTIABLE, device_inference=lambda op, d: ([], [_HOST]),
            doc="A dummy CPU tensor standing for Caffe2's mutex (see AtomicIter).")


# --------------------------------------------------------------------------------------- learning rate

Schedule = Callable[[int], float]
Getter = Callable[[str], Any]

_POLICY_ARGS: dict[str, Any] = {
    "stepsize": 0, "gamma": 0.0, "stepsizes": Arg("ints", ()), "power": 0.0, "max_iter": 0,
    "num_iter": 0, "start_multiplier": 0.0, "multiplier": 0.5, "end_multiplier": 0.0,
    "active_first": True, "active_period": 0, "inactive_period": 0,
}
MAX_SUB_POLICIES = 8  # composite: sub_policy_<k>_* arguments are declared for k < MAX_SUB_POLICIES


def _positive(get: Getter, name: str, where: str) -> Any:
    value = get(name)
    if not value > 0:
        raise ValueError(f"{where}: argument {name!r} must be > 0, got {value!r}")
    return value


def _linear_warmup(start: float, num_iter: int) -> Schedule:
    return lambda it: start + (1.0 - start) * it / num_iter if it < num_iter else 1.0


def _inv(gamma: float, power: float) -> Schedule:
    return lambda it: (1.0 + gamma * it) ** -power


def _step(get: Getter, w: str) -> Schedule:
    stepsize, gamma = _positive(get, "stepsize", w), _positive(get, "gamma", w)
    return lambda it: gamma ** (it // stepsize)


def _exp(get: Getter, w: str) -> Schedule:
    gamma = _positive(get, "gamma", w)
    return lambda it: gamma ** it


def _constant_warmup(get: Getter, w: str) -> Schedule:
    multiplier, num_iter = get("multiplier"), get("num_iter")
    return lambda it: multiplier if it < num_iter else 1.0


def _multistep(get: Getter, w: str) -> Schedule:
    steps, gamma = get("stepsizes"), _positive(get, "gamma", w)
    if not steps:
        raise ValueError(f"{w}: policy 'multistep' needs `stepsizes`")
    return lambda it: gamma ** sum(1 for s in steps if it >= s)


def _poly(get: Getter, w: str) -> Schedule:
    max_iter, power = _positive(get, "max_iter", w), get("power")
    return lambda it: (1.0 - min(it, max_iter) / max_iter) ** power


def _hill(get: Getter, w: str) -> Schedule:
    num_iter, end = get("num_iter"), get("end_multiplier")
    warmup = _linear_warmup(get("start_multiplier"), num_iter)
    inv = _inv(_positive(get, "gamma", w), _positive(get, "power", w))
    return lambda it: warmup(it) if it < num_iter else max(end, inv(it - num_iter))


def _alter(get: Getter, w: str) -> Schedule:
    first, active, inactive = get("active_first"), get("active_period"), get("inactive_period")
    if active < 0 or inactive < 0 or active + inactive == 0:
        raise ValueError(f"{w}: policy 'alter' needs active_period, inactive_period >= 0, not both 0")
    lead = active if first else inactive
    return lambda it: float(first) if it % (active + inactive) < lead else float(not first)


_POLICIES: dict[str, Callable[[Getter, str], Schedule]] = {
    "fixed": lambda get, w: lambda it: 1.0,
    "step": _step,
    "multistep": _multistep,
    "exp": _exp,
    "inv": lambda get, w: _inv(_positive(get, "gamma", w), _positive(get, "power", w)),
    "poly": _poly,
    "linearWarmup": lambda get, w: _linear_warmup(get("start_multiplier"), get("num_iter")),
    "constantWarmup": _constant_warmup,
    "hill": _hill,
    "alter": _alter,
}


def _composite(a: SimpleNamespace, w: str) -> Schedule:
    """Caffe2's composite policy: sub-policy k runs for sub_policy_num_iters[k] iterations, from iter 1.

    Each sub-policy reads `sub_policy_<k>_<arg>` (its `policy`, `lr_scale` = 1.0, and the policy's
    usual args), sees the global iteration (as in Caffe2), and its factor is multiplied by lr_scale;
    the last one continues past its count, and iteration 0 uses the first.
    """
    counts = a.sub_policy_num_iters
    if not counts or len(counts) > MAX_SUB_POLICIES or min(counts) <= 0:
        raise ValueError(f"{w}: composite needs 1..{MAX_SUB_POLICIES} positive sub_policy_num_iters, "
                         f"got {list(counts)}")
    starts, parts = [], []
    for k in range(len(counts)):
        def get(name: str, k: int = k) -> Any:
            return getattr(a, f"sub_policy_{k}_{name}")

        if get("policy") in ("", "composite"):
            raise ValueError(f"{w}: sub_policy_{k}_policy must name a non-composite policy")
        starts.append(1 + sum(counts[:k]))
        parts.append((_make_schedule(get("policy"), get, w), get("lr_scale")))

    def schedule(it: int) -> float:
        k = max(0, sum(1 for s in starts if it >= s) - 1)
        return parts[k][0](it) * parts[k][1]

    return schedule


def _make_schedule(policy: str, get: Getter, where: str) -> Schedule:
    if policy not in _POLICIES:
        raise ValueError(f"{where}: unknown learning-rate policy {policy!r}; known: "
                         f"{', '.join([*_POLICIES, 'composite'])}")
    return _POLICIES[policy](get, where)


def learning_rate_schedule(a: SimpleNamespace, where: str) -> Schedule:
    """`factor(iter)` for a LearningRate op's parsed arguments (see `parse_args`).

    The kernel builds it at CreateNet; optimizers build it when they record the op, so a bad policy
    fails before the model changes.

    Raises:
        ValueError: an unknown policy, or a policy argument it needs that is missing or out of range.
    """
    if a.policy == "composite":
        return _composite(a, where)
    return _make_schedule(a.policy, lambda name: getattr(a, name), where)


def _learning_rate(a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    schedule = learning_rate_schedule(a, op_label(ctx.op))
    base_lr, device = a.base_lr, ctx.device
    # A fill on the device: the host value travels as a kernel argument (no copy from pageable memory,
    # which would make a CUDA stream synchronize); float64 rounds to float32 as torch.tensor does.
    return lambda it: torch.full((1,), base_lr * schedule(int(it.item())), dtype=torch.float32, device=device)


def _learning_rate_infer(a: SimpleNamespace, ctx: KernelContext, inputs: list[TensorSpec]) -> list[TensorSpec]:
    learning_rate_schedule(a, op_label(ctx.op))
    return [TensorSpec((1,), torch.float32)]


_SUB_POLICY_ARGS = {f"sub_policy_{k}_{name}": arg for k in range(MAX_SUB_POLICIES)
                    for name, arg in {**_POLICY_ARGS, "policy": "", "lr_scale": 1.0}.items()}

register_op(
    "LearningRate", args={"base_lr": Arg("float"), "policy": "fixed", **_POLICY_ARGS,
                          "sub_policy_num_iters": Arg("ints", ()), **_SUB_POLICY_ARGS},
    kernel=_learning_rate, gradient=NOT_DIFFERENTIABLE, device_inference=lambda op, d: ([_HOST], [d]),
    traits=(Trait.LEARNING_RATE, Trait.HOST_SYNC), infer=_learning_rate_infer, check=counter_at(0),
    doc="lr = base_lr * factor(iter), from the CPU int64 counter, computed in float64 on the host and "
        "written as a float32 [1] tensor on the op's device by a fill (no host-to-device copy, no sync). Policies (Caffe2's args): fixed 1; step "
        "gamma^(iter // stepsize); multistep gamma^(#stepsizes <= iter); exp gamma^iter; inv "
        "(1 + gamma iter)^-power; poly (1 - min(iter, max_iter)/max_iter)^power (clamped at max_iter, "
        "where Caffe2 went negative); linearWarmup start_multiplier + (1 - start_multiplier) "
        "iter/num_iter until num_iter, then 1; constantWarmup multiplier until num_iter, then 1; hill "
        "linear warmup then max(end_multiplier, inv(iter - num_iter)); alter 1/0 in active/inactive "
        "periods; composite (sub_policy_num_iters, sub_policy_<k>_<arg>, see `_composite`).")


# ----------------------------------------------------------------------------------------------- updates


def _momentum_sgd(a: SimpleNamespace, _ctx: KernelContext, into_grad: bool = False) -> Callable[..., tuple]:
    """The update; with `into_grad`, lr * grad is computed in grad's storage (same bits, no allocation)."""
    mu = a.momentum

    def scaled(g: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
        return g.mul_(lr.reshape(()).to(g.dtype)) if into_grad else g * lr.reshape(()).to(g.dtype)

    if a.nesterov:
        def nesterov(g: torch.Tensor, m: torch.Tensor, lr: torch.Tensor, p: torch.Tensor) -> tuple:
            m_new = torch.add(scaled(g, lr), m, alpha=mu)
            step = torch.add(m_new * (1.0 + mu), m, alpha=-mu)
            return step, m.copy_(m_new), p.sub_(step)

        return nesterov

    def plain(g: torch.Tensor, m: torch.Tensor, lr: torch.Tensor, p: torch.Tensor) -> tuple:
        rate_g = scaled(g, lr)  # first what can fail (a malformed lr), so a failure leaves m as it was
        step = m.mul_(mu).add_(rate_g)  # mu m rounded, then + lr g: torch.optim.SGD's order, no FMA
        return step, step, p.sub_(step)

    return plain


register_op(
    "MomentumSGDUpdate", inputs=4, outputs=3, enforce_inplace={(0, 0), (1, 1), (3, 2)},
    args={"momentum": 0.0, "nesterov": False}, kernel=_momentum_sgd, gradient=NOT_DIFFERENTIABLE,
    reuse=(0, functools.partial(_momentum_sgd, into_grad=True)),
    traits=(Trait.INPLACE_UPDATE,), check=same_shape((0, 1, 3)),
    effects=Effects(rebinds={0}, momentum=1, elementwise=Elementwise((0, 1, 3)),
                    multi_tensor=MultiTensor("MultiTensorMomentumSGDUpdate", (0, 1, 3), (2,), (0, 1, 3))),
    doc="[grad, mom, lr, param] -> [grad, mom, param] in place (mom and param are updated in their "
        "storage); lr is positive (the op subtracts). Plain: a = (momentum m, rounded) + lr g; mom = a; "
        "param -= a; grad = a (torch.optim.SGD's rounding order: bit-identical for a power-of-two lr). Nesterov: m' = momentum m + lr g; a = (1 + momentum) m' - momentum m; param -= a; "
        "grad = a. Equals torch.optim.SGD (dampening 0) with mom = lr * its buffer. Without nesterov, "
        "grad and mom share one tensor.")


Corrections = tuple[Any, Any]  # Adam's 1 - beta1^t and sqrt(1 - beta2^t): floats, or 0-d float64 tensors


def _adam_step(a: SimpleNamespace, p: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, g: torch.Tensor,
               lr: torch.Tensor, c: Corrections) -> tuple:
    beta1, beta2 = a.beta1, a.beta2
    m1 = torch.lerp(m1, g, 1.0 - beta1)
    m2 = torch.addcmul(m2 * beta2, g, g, value=1.0 - beta2)
    denom = m2.sqrt().div_(_in(c[1], g)).add_(a.epsilon)
    step = m1 * (lr.reshape(()).to(g.dtype) / _in(c[0], g))
    return torch.addcdiv(p, step, denom), m1, m2


def _adam_step_inplace(a: SimpleNamespace, p: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, g: torch.Tensor,
                       lr: torch.Tensor, c: Corrections) -> tuple:
    """`_adam_step` writing param and moments into their storage, with the same roundings."""
    beta1, beta2 = a.beta1, a.beta2
    m1.lerp_(g, 1.0 - beta1)
    m2.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = m2.sqrt().div_(_in(c[1], g)).add_(a.epsilon)
    step = m1 * (lr.reshape(()).to(g.dtype) / _in(c[0], g))
    return p.addcdiv_(step, denom), m1, m2


def _in(value: Any, like: torch.Tensor) -> Any:
    """A correction as `like`'s kernels take a Python float: a 0-d tensor rounded to its dtype first."""
    return value.to(like.dtype) if isinstance(value, torch.Tensor) else value


def _corrections(a: SimpleNamespace, it: torch.Tensor, where: str) -> Corrections:
    """Adam's bias corrections at t = the counter's value: on the host, or, inside a compiled program
    (`executor.compiled`), as tensor math on the counter (no host read, no value baked in)."""
    if torch.compiler.is_compiling():
        t = it.reshape(()).to(torch.float64)
        return 1.0 - torch.pow(a.beta1, t), torch.sqrt(1.0 - torch.pow(a.beta2, t))
    step = _iteration(it, where)
    return 1.0 - a.beta1 ** step, math.sqrt(1.0 - a.beta2 ** step)


def _iteration(it: torch.Tensor, where: str) -> int:
    t = int(it.item())
    if t < 1:
        raise ValueError(f"{where}: the iteration counter is {t}; Adam needs t >= 1 (increment it "
                         f"with Iter/AtomicIter before the update)")
    return t


def _adam(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    where, op = op_label(ctx.op), ctx.op
    step = _adam_step_inplace if op.outputs == op.inputs[:3] else _adam_step

    def run(p: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, g: torch.Tensor, lr: torch.Tensor,
            it: torch.Tensor) -> tuple:
        return step(a, p, m1, m2, g, lr, _corrections(a, it, where))

    return run


def _adam_infer(a: SimpleNamespace, ctx: KernelContext, inputs: list[TensorSpec]) -> list[TensorSpec]:
    """The update's specs from a step at t = 1 on meta tensors (the counter's value is not known)."""
    return on_meta(lambda p, m1, m2, g, lr: _adam_step(a, p, m1, m2, g, lr, (1.0 - a.beta1, math.sqrt(1.0 - a.beta2))),
                   inputs[:5])


register_op(
    "Adam", inputs=6, outputs=3, inplace={(0, 0), (1, 1), (2, 2)},
    args={"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}, kernel=_adam, gradient=NOT_DIFFERENTIABLE,
    traits=(Trait.INPLACE_UPDATE, Trait.HOST_SYNC), infer=_adam_infer, traceable=True,
    check=all_checks(same_shape((0, 1, 2, 3)), counter_at(5)),
    effects=Effects(multi_tensor=MultiTensor("MultiTensorAdam", (0, 1, 2, 3), (4, 5), (0, 1, 2)),
                    elementwise=Elementwise((0, 1, 2, 3))),
    device_inference=lambda op, d: ([d] * 5 + [_HOST], [d] * 3),
    doc="[param, m1, m2, grad, lr, iter] -> [param, m1, m2]: m1 = b1 m1 + (1-b1) g; m2 = b2 m2 + "
        "(1-b2) g^2; param += lr (m1/(1-b1^t)) / (sqrt(m2/(1-b2^t)) + epsilon), lr negative, t = iter; "
        "written into the inputs' storage when the outputs name them. This matches torch.optim.Adam: "
        "t = iter because the counter is incremented before the update (step 1 sees iter 1), and "
        "epsilon is added after the bias correction. Caffe2 used t = iter + 1 and added epsilon to "
        "sqrt(m2) before correcting.")


# ------------------------------------------------------------------------------ multi-tensor updates


def _params_count(ctx: KernelContext, blocks: int, shared: int, updated: int) -> int:
    """k, for a multi-tensor update reading `blocks` blocks of k blobs and `shared` blobs, and writing
    the first `updated` blocks."""
    n = len(ctx.op.inputs) - shared
    k = n // blocks
    if n < blocks or n % blocks or len(ctx.op.outputs) != updated * k:
        raise ValueError(f"{op_label(ctx.op)}: takes {blocks} blocks of one blob per param, then {shared} "
                         f"shared blob(s), and writes the first {updated} blocks; got {len(ctx.op.inputs)} "
                         f"inputs and {len(ctx.op.outputs)} outputs")
    return k


def _blocks(n: int, blocks: int) -> list[tuple[int, ...]]:
    """For `n` inputs in `blocks` blocks of k: the k groups (i, k + i, 2k + i, ...) of one param's blobs."""
    k = n // blocks
    return [tuple(range(i, blocks * k, k)) for i in range(k)]


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of `tensors` grouped by dtype (a multi-tensor kernel takes one dtype at a time)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _multi_momentum_sgd(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    k, mu = _params_count(ctx, 3, 1, 3), a.momentum

    def run(*xs: torch.Tensor) -> tuple:
        gs, ms, ps, lr = xs[:k], xs[k:2 * k], xs[2 * k:3 * k], xs[3 * k]
        rate = lr.reshape(())  # before any update: a malformed lr changes nothing
        steps: list = [None] * k
        for idx in _by_dtype(list(gs)):
            g, m, p = [gs[i] for i in idx], [ms[i] for i in idx], [ps[i] for i in idx]
            scaled = torch._foreach_mul(g, rate.to(g[0].dtype))
            if a.nesterov:
                new = torch._foreach_add(scaled, m, alpha=mu)  # m' = lr g + mu m, as MomentumSGDUpdate's
                step = torch._foreach_mul(new, 1.0 + mu)
                torch._foreach_add_(step, m, alpha=-mu)
            else:
                new = torch._foreach_mul(m, mu)  # mu m rounded, then + lr g, as MomentumSGDUpdate's
                torch._foreach_add_(new, scaled)
                step = new
            torch._foreach_copy_(m, new)
            torch._foreach_sub_(p, step)
            for i, t in zip(idx, step):
                steps[i] = t
        return (*steps, *ms, *ps)

    return run


register_op(
    "MultiTensorMomentumSGDUpdate", inputs=(4, None), outputs=(3, None), enforce_inplace=same_index,
    args={"momentum": 0.0, "nesterov": False}, kernel=_multi_momentum_sgd, gradient=NOT_DIFFERENTIABLE,
    traits=(Trait.INPLACE_UPDATE,), check=same_shape(lambda n: _blocks(n, 3)),
    doc="[grad_1..k, mom_1..k, param_1..k, lr] -> [grad_1..k, mom_1..k, param_1..k] in place: "
        "MomentumSGDUpdate of k params at once with multi-tensor (torch._foreach_*) kernels, with the "
        "same results bit for bit. The fuse_updates pass builds it from a device's MomentumSGDUpdates.")


def _multi_adam(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    k, where, beta1, beta2 = _params_count(ctx, 4, 2, 3), op_label(ctx.op), a.beta1, a.beta2

    def run(*xs: torch.Tensor) -> tuple:
        ps, m1s, m2s, gs, lr, it = xs[:k], xs[k:2 * k], xs[2 * k:3 * k], xs[3 * k:4 * k], xs[4 * k], xs[4 * k + 1]
        c1, c2 = _corrections(a, it, where)
        for idx in _by_dtype(list(gs)):
            p, m1, m2, g = ([blobs[i] for i in idx] for blobs in (ps, m1s, m2s, gs))
            torch._foreach_lerp_(m1, g, 1.0 - beta1)
            torch._foreach_mul_(m2, beta2)
            torch._foreach_addcmul_(m2, g, g, value=1.0 - beta2)
            denom = torch._foreach_sqrt(m2)
            torch._foreach_div_(denom, _in(c2, g[0]))
            torch._foreach_add_(denom, a.epsilon)
            step = torch._foreach_mul(m1, lr.reshape(()).to(g[0].dtype) / _in(c1, g[0]))
            torch._foreach_addcdiv_(p, step, denom)
        return (*ps, *m1s, *m2s)

    return run


register_op(
    "MultiTensorAdam", inputs=(6, None), outputs=(3, None), enforce_inplace=same_index,
    args={"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}, kernel=_multi_adam, gradient=NOT_DIFFERENTIABLE,
    traits=(Trait.INPLACE_UPDATE, Trait.HOST_SYNC), infer=lambda a, ctx, inputs: inputs[:len(ctx.op.outputs)],
    traceable=True,
    check=all_checks(same_shape(lambda n: _blocks(n - 2, 4)), counter_at(-1)),
    device_inference=lambda op, d: ([d] * (len(op.inputs) - 1) + [_HOST], [d] * len(op.outputs)),
    doc="[param_1..k, m1_1..k, m2_1..k, grad_1..k, lr, iter] -> [param_1..k, m1_1..k, m2_1..k] in "
        "place: Adam of k params at once with multi-tensor (torch._foreach_*) kernels, with the same "
        "results bit for bit. The fuse_updates pass builds it from a device's in-place Adam ops.")


def _clip_by_scaling(a: SimpleNamespace, _ctx: KernelContext) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, norm: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        threshold = a.threshold * extra[0].to(norm.dtype) if extra else torch.full_like(norm, a.threshold)
        scale = torch.where(norm > threshold, threshold / norm, torch.ones_like(norm))
        return x * scale.reshape(()).to(x.dtype)

    return run


register_op(
    "ClipTensorByScaling", inputs=(2, 3), inplace={(0, 0)}, args={"threshold": Arg("float")},
    kernel=_clip_by_scaling, gradient=NOT_DIFFERENTIABLE,
    doc="[X, norm (, additional_threshold)] -> X * threshold / norm when norm > threshold, else X; the "
        "threshold is the `threshold` arg times the optional 1-element third input. No host sync.")
