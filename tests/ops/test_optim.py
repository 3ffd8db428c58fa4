"""Optimizer ops: counters, learning-rate policies against hand formulas, updates against torch.optim."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphpar.core.ir import CPU, CUDA, DeviceOption, OperatorDef
from graphpar.core.schema import NOT_DIFFERENTIABLE, check_operator, get_schema
from tests.ops.helpers import randn, rel_err, run_kernel

DTYPES = st.sampled_from([torch.float32, torch.float64])
SHAPES = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-12


def counter(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


@pytest.mark.parametrize("op_type", ["Iter", "AtomicIter", "CreateMutex", "LearningRate", "MomentumSGDUpdate",
                                     "Adam", "ClipTensorByScaling"])
def test_not_differentiable(op_type: str) -> None:
    assert get_schema(op_type).gradient is NOT_DIFFERENTIABLE


def test_iter_and_atomic_iter() -> None:
    (it,) = run_kernel("Iter", [counter(41)])
    assert it.dtype == torch.int64 and it.tolist() == [42]
    (mutex,) = run_kernel("CreateMutex", [])
    (it,) = run_kernel("AtomicIter", [mutex, counter(0)])
    assert it.tolist() == [1]
    check_operator(OperatorDef("AtomicIter", ["m", "it"], ["it"]))
    with pytest.raises(ValueError, match="in place"):
        check_operator(OperatorDef("Iter", ["it"], ["it2"]))
    gpu = DeviceOption(CUDA, 1)
    host = DeviceOption(CPU, 0)
    assert get_schema("Iter").device_inference(OperatorDef("Iter", ["it"], ["it"]), gpu) == ([host], [host])
    assert get_schema("LearningRate").device_inference(OperatorDef("LearningRate", ["it"], ["lr"]), gpu) == \
        ([host], [gpu])


def lr_at(iteration: int, **args: object) -> float:
    (lr,) = run_kernel("LearningRate", [counter(iteration)], **args)
    assert lr.dtype == torch.float32 and lr.shape == (1,)
    return lr.item()


ITERS = [0, 1, 2, 5, 9, 10, 11, 99, 1000]
POLICIES = {
    "fixed": ({}, lambda t: 1.0),
    "step": ({"stepsize": 10, "gamma": 0.5}, lambda t: 0.5 ** (t // 10)),
    "multistep": ({"stepsizes": [2, 10, 100], "gamma": 0.1}, lambda t: 0.1 ** sum(t >= s for s in (2, 10, 100))),
    "exp": ({"gamma": 0.999}, lambda t: 0.999 ** t),
    "inv": ({"gamma": 0.01, "power": 0.75}, lambda t: (1 + 0.01 * t) ** -0.75),
    "poly": ({"power": 2.0, "max_iter": 100}, lambda t: max(0.0, 1 - t / 100) ** 2),
    "linearWarmup": ({"start_multiplier": 0.1, "num_iter": 10},
                     lambda t: 0.1 + 0.9 * min(t, 10) / 10),
    "constantWarmup": ({"multiplier": 0.25, "num_iter": 10}, lambda t: 0.25 if t < 10 else 1.0),
    "hill": ({"num_iter": 10, "start_multiplier": 0.5, "gamma": 0.1, "power": 1.0, "end_multiplier": 0.1},
             lambda t: 0.5 + 0.5 * t / 10 if t < 10 else max(0.1, 1 / (1 + 0.1 * (t - 10)))),
    "alter": ({"active_period": 3, "inactive_period": 2}, lambda t: 1.0 if t % 5 < 3 else 0.0),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_learning_rate_policies(policy: str) -> None:
    args, factor = POLICIES[policy]
    for t in ITERS:
        want = -0.1 * factor(t)
        assert lr_at(t, base_lr=-0.1, policy=policy, **args) == pytest.approx(want, rel=1e-6, abs=1e-12), t


def test_composite_policy() -> None:
    args = {"policy": "composite", "sub_policy_num_iters": [3, 4, 2],
            "sub_policy_0_policy": "linearWarmup", "sub_policy_0_start_multiplier": 0.5,
            "sub_policy_0_num_iter": 4,
            "sub_policy_1_policy": "step", "sub_policy_1_stepsize": 2, "sub_policy_1_gamma": 0.5,
            "sub_policy_1_lr_scale": 2.0,
            "sub_policy_2_policy": "fixed", "sub_policy_2_lr_scale": 0.1}

    def factor(t: int) -> float:  # sub-policies start at iter 1, 4, 8 and see the global iter
        if t < 4:
            return 0.5 + 0.5 * t / 4
        if t < 8:
            return 2.0 * 0.5 ** (t // 2)
        return 0.1

    for t in range(0, 15):
        assert lr_at(t, base_lr=1.0, **args) == pytest.approx(factor(t), rel=1e-6), t


def test_learning_rate_on_the_op_device() -> None:
    (lr,) = run_kernel("LearningRate", [counter(3)], device="meta", base_lr=0.1)
    assert lr.device.type == "meta" and lr.dtype == torch.float32


@pytest.mark.parametrize("args,match", [
    ({"policy": "step", "stepsize": 10}, "'gamma' must be > 0"),
    ({"policy": "step", "gamma": 0.5}, "'stepsize' must be > 0"),
    ({"policy": "poly", "power": 1.0}, "'max_iter' must be > 0"),
    ({"policy": "multistep", "gamma": 0.5}, "needs `stepsizes`"),
    ({"policy": "cosine"}, "unknown learning-rate policy"),
    ({"policy": "composite"}, "positive sub_policy_num_iters"),
    ({"policy": "composite", "sub_policy_num_iters": [2]}, "sub_policy_0_policy"),
    ({"policy": "alter"}, "alter"),
])
def test_learning_rate_argument_errors(args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_kernel("LearningRate", [counter(1)], base_lr=0.1, **args)
    with pytest.raises(TypeError, match="missing required argument 'base_lr'"):
        run_kernel("LearningRate", [counter(1)])


def momentum_sgd(param: torch.Tensor, grads: list[torch.Tensor], lr: float, mu: float,
                 nesterov: bool) -> list[torch.Tensor]:
    """graphpar's MomentumSGDUpdate over a few steps; returns the params after each step."""
    mom, out, param = torch.zeros_like(param), [], param.clone()  # the kernel updates them in place
    lr_blob = torch.tensor([lr], dtype=torch.float32)
    for g in grads:
        g_out, mom, param = run_kernel("MomentumSGDUpdate", [g, mom, lr_blob, param], momentum=mu,
                                       nesterov=nesterov)
        out.append(param.clone())
        assert g_out.dtype == g.dtype
    return out


@pytest.mark.parametrize("nesterov", [False, True])
@settings(max_examples=10)
@given(shape=SHAPES, dtype=DTYPES, seed=st.integers(0, 2**16), mu=st.sampled_from([0.0, 0.5, 0.9]))
def test_momentum_sgd_matches_torch(nesterov: bool, shape: tuple, dtype: torch.dtype, seed: int,
                                    mu: float) -> None:
    lr = 0.125  # exact in float32, so the LR blob equals torch's Python float
    param = randn(shape, dtype, seed)
    grads = [randn(shape, dtype, seed + 1 + k) for k in range(4)]
    ours = momentum_sgd(param, grads, lr, mu, nesterov and mu > 0)
    p = param.clone().requires_grad_(True)
    opt = torch.optim.SGD([p], lr=lr, momentum=mu, nesterov=nesterov and mu > 0)
    for g, mine in zip(grads, ours):
        p.grad = g.clone()
        opt.step()
        assert mine.dtype == dtype and rel_err(mine, p.detach()) < tol(dtype)
    assert torch.equal(param, randn(shape, dtype, seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lr", [0.125, 2.0**-10])
def test_momentum_sgd_is_bit_identical_to_torch_foreach_sgd(dtype: torch.dtype, lr: float) -> None:
    """Issue 23 item 19: with a power-of-two lr, mom = lr * torch's buffer exactly, so the same roundings
    (mu m rounded, then + lr g; no fused multiply-add) give torch's bits (7 of 35 were 1 ulp off)."""
    param = randn((5, 7), dtype, 11)
    grads = [randn((5, 7), dtype, 12 + k) for k in range(6)]
    ours = momentum_sgd(param, grads, lr, 0.9, False)
    p = param.clone().requires_grad_(True)
    opt = torch.optim.SGD([p], lr=lr, momentum=0.9, foreach=True)
    for g, mine in zip(grads, ours):
        p.grad = g.clone()
        opt.step()
        assert torch.equal(mine, p.detach())


def test_momentum_sgd_outputs_and_in_place_rule() -> None:
    g, m, p = randn((3,), seed=1), randn((3,), seed=2), randn((3,), seed=3)
    lr = torch.tensor([0.5], dtype=torch.float32)
    mom, param = m.clone(), p.clone()
    g_out, m_out, p_out = run_kernel("MomentumSGDUpdate", [g, mom, lr, param], momentum=0.9)
    step = 0.5 * g + 0.9 * m
    assert rel_err(g_out, step) < 1e-12 and rel_err(m_out, step) < 1e-12 and rel_err(p_out, p - step) < 1e-12
    assert m_out is mom and p_out is param  # momentum and param are updated in their own storage
    mom, param = m.clone(), p.clone()
    g_out, m_out, p_out = run_kernel("MomentumSGDUpdate", [g, mom, lr, param], momentum=0.9, nesterov=1)
    m_new = 0.9 * m + 0.5 * g
    assert rel_err(m_out, m_new) < 1e-12 and rel_err(p_out, p - (1.9 * m_new - 0.9 * m)) < 1e-12
    assert m_out is mom and p_out is param
    with pytest.raises(ValueError, match="in place"):
        check_operator(OperatorDef("MomentumSGDUpdate", ["g", "m", "lr", "p"], ["g", "m", "p2"]))


@pytest.mark.parametrize("op_type", ["MomentumSGDUpdate", "MultiTensorMomentumSGDUpdate"])
@pytest.mark.parametrize("nesterov", [0, 1])
def test_momentum_sgd_with_a_malformed_lr_changes_nothing(op_type: str, nesterov: int) -> None:
    """Issue 32 item 7: the kernel scaled the momentum in place (m.mul_(mu)) before it read the lr, so a
    malformed lr (an lr_injection of two values) failed the run after the momentum had changed."""
    g, m, p = randn((3,), seed=1), randn((3,), seed=2), randn((3,), seed=3)
    mom, param, lr = m.clone(), p.clone(), torch.tensor([0.5, 1.0])
    inputs = [g.clone(), mom, lr, param] if op_type == "MomentumSGDUpdate" else [g.clone(), mom, param, lr]
    with pytest.raises(RuntimeError, match="invalid for input of size 2"):
        run_kernel(op_type, inputs, n_outputs=3, momentum=0.9, nesterov=nesterov)
    assert torch.equal(mom, m) and torch.equal(param, p)


@settings(max_examples=10)
@given(shape=SHAPES, dtype=DTYPES, seed=st.integers(0, 2**16), betas=st.sampled_from([(0.9, 0.999), (0.5, 0.9)]),
       eps=st.sampled_from([1e-8, 1e-3]))
def test_adam_matches_torch(shape: tuple, dtype: torch.dtype, seed: int, betas: tuple, eps: float) -> None:
    lr = 0.0625
    param = randn(shape, dtype, seed)
    p = param.clone().requires_grad_(True)
    opt = torch.optim.Adam([p], lr=lr, betas=betas, eps=eps)
    m1, m2 = torch.zeros_like(param), torch.zeros_like(param)
    lr_blob = torch.tensor([-lr], dtype=torch.float32)  # graphpar's LR blobs are negative for descent
    for step in range(1, 6):
        g = randn(shape, dtype, seed + step)
        param, m1, m2 = run_kernel("Adam", [param, m1, m2, g, lr_blob, counter(step)], beta1=betas[0],
                                   beta2=betas[1], epsilon=eps)
        p.grad = g.clone()
        opt.step()
        state = opt.state[p]
        assert param.dtype == dtype
        assert rel_err(param, p.detach()) < tol(dtype)
        assert rel_err(m1, state["exp_avg"]) < tol(dtype) and rel_err(m2, state["exp_avg_sq"]) < tol(dtype)


def test_adam_needs_a_started_counter() -> None:
    x = randn((2,))
    with pytest.raises(ValueError, match="t >= 1"):
        run_kernel("Adam", [x, x, x, x, torch.tensor([-0.1]), counter(0)])
    host = DeviceOption(CPU, 0)
    gpu = DeviceOption(CUDA, 0)
    ins, outs = get_schema("Adam").device_inference(OperatorDef("Adam", list("pmgvli"), list("pmg")), gpu)
    assert ins == [gpu] * 5 + [host] and outs == [gpu] * 3


@given(shape=SHAPES, dtype=DTYPES, seed=st.integers(0, 2**16), threshold=st.floats(0.1, 10),
       extra=st.sampled_from([None, 0.5, 2.0]))
def test_clip_tensor_by_scaling(shape: tuple, dtype: torch.dtype, seed: int, threshold: float,
                                extra: float | None) -> None:
    x = randn(shape, dtype, seed)
    norm = x.norm().reshape(1).float()
    inputs = [x, norm] + ([] if extra is None else [torch.tensor([extra])])
    (y,) = run_kernel("ClipTensorByScaling", inputs, threshold=threshold)
    limit = threshold * (1.0 if extra is None else extra)
    want = x * (limit / norm.item()) if norm.item() > limit else x
    assert y.dtype == dtype and y.shape == x.shape and rel_err(y, want) < 1e-5


def test_clip_tensor_by_scaling_zero_norm() -> None:
    x = torch.zeros(3)
    (y,) = run_kernel("ClipTensorByScaling", [x, torch.zeros(1)], threshold=0.0)
    assert torch.equal(y, x) and not math.isnan(y.sum().item())
