"""Caffe2's other update kernels against element-wise numpy references of Caffe2's C++ loops, and the
sparse variants against the dense rule on the touched rows (duplicates summed first)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops.helpers import run_kernel

RNG = np.random.default_rng(0)


def _arr(*shape: int, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    return RNG.uniform(low, high, shape).astype(np.float64)


def _t(*arrays: np.ndarray) -> list[torch.Tensor]:
    return [torch.from_numpy(a.copy()) for a in arrays]


def _close(got: tuple[torch.Tensor, ...], want: tuple[np.ndarray, ...]) -> None:
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-12, atol=1e-12)


def test_lars_matches_its_formula_and_clips() -> None:
    x, dx = _arr(4, 3), _arr(4, 3)
    wd, trust, lr_max = np.array([0.1]), np.array([0.8]), np.array([10.0])
    (y,) = run_kernel("Lars", _t(x, dx, wd, trust, lr_max), offset=0.5, lr_min=0.02)
    want = 0.8 / (np.linalg.norm(dx) / np.linalg.norm(x) + 0.1 + 0.5)
    assert y.shape == (1,) and y.item() == pytest.approx(want, rel=1e-6)
    (y,) = run_kernel("Lars", _t(np.zeros((4, 3)), dx, wd, trust, lr_max), offset=0.5, lr_min=0.0)
    assert y.item() == 1.0  # a zero param: no rescaling
    (y,) = run_kernel("Lars", _t(x, dx, wd, trust, np.array([0.3])), offset=0.0, lr_min=0.0)
    assert y.item() == pytest.approx(min(0.3, 0.8 / (np.linalg.norm(dx) / np.linalg.norm(x) + 0.1)), rel=1e-6)


def test_rms_prop() -> None:
    g, ms, mom, lr = _arr(5), _arr(5, low=0.0), _arr(5), np.array([0.3])
    new_ms = ms + 0.1 * (g * g - ms)
    new_mom = 0.5 * mom + 0.3 * g / np.sqrt(new_ms + 1e-5)
    _close(run_kernel("RmsProp", _t(g, ms, mom, lr), 3, decay=0.9, momentum=0.5, epsilon=1e-5),
           (new_mom, new_ms, new_mom))


def _adadelta(w, h, d, g, lr, eps, decay):  # noqa: ANN001, ANN202 - Caffe2's loop, vectorised
    h = decay * h + (1 - decay) * g * g
    step = np.sqrt(d + eps) / np.sqrt(h + eps) * g
    return w + lr * step, h, decay * d + (1 - decay) * step * step


def test_adadelta_dense_and_sparse() -> None:
    w, h, d, g = _arr(6, 2), _arr(6, 2, low=0.0), _arr(6, 2, low=0.0), _arr(6, 2)
    _close(run_kernel("Adadelta", _t(w, h, d, g, np.array([-0.5])), 3, epsilon=1e-4, decay=0.9),
           _adadelta(w, h, d, g, -0.5, 1e-4, 0.9))
    indices, rows = np.array([4, 1, 4]), _arr(3, 2)
    got = run_kernel("SparseAdadelta", _t(w, h, d) + [torch.tensor(indices), *_t(rows, np.array([-0.5]))], 3,
                     epsilon=1e-4, decay=0.9)
    dense_g = np.zeros_like(w)
    np.add.at(dense_g, indices, rows)
    want = _adadelta(w, h, d, dense_g, -0.5, 1e-4, 0.9)
    for got_state, want_state, old in zip(got, want, (w, h, d)):
        touched = [1, 4]
        np.testing.assert_allclose(got_state.numpy()[touched], want_state[touched], rtol=1e-12)
        np.testing.assert_array_equal(np.delete(got_state.numpy(), touched, 0), np.delete(old, touched, 0))


def test_wngrad_dense_and_sparse() -> None:
    w, b, g = _arr(4, 3), np.array([2.0]), _arr(4, 3)
    _close(run_kernel("Wngrad", _t(w, b, g, np.array([-0.1])), 2, epsilon=1e-5),
           (w - 0.1 * g / (2.0 + 1e-5), b + (g * g).sum() / (2.0 + 1e-5)))
    new_w, new_b = run_kernel("SparseWngrad", _t(w, b) + [torch.tensor([2, 0])] + _t(g[:2], np.array([-0.1])), 2,
                              epsilon=1e-5)
    want = w.copy()
    want[[2, 0]] -= 0.1 * g[:2] / (2.0 + 1e-5)
    _close((new_w, new_b), (want, b + (g[:2] ** 2).sum() / (2.0 + 1e-5)))


def _ftrl(w, nz, g, alpha, beta, l1, l2):  # noqa: ANN001, ANN202 - Caffe2's ftrl_compute, vectorised
    n, z = nz[..., 0], nz[..., 1]
    new_n = n + g * g
    sigma = (np.sqrt(new_n) - np.sqrt(n)) / alpha
    new_z = z + g - sigma * w
    new_w = np.where(np.abs(new_z) > l1, (l1 * np.sign(new_z) - new_z) / ((beta + np.sqrt(new_n)) / alpha + l2), 0.0)
    return new_w, np.stack([new_n, new_z], -1)


@pytest.mark.parametrize("l1", [0.0, 0.2])
def test_ftrl_dense_and_sparse(l1: float) -> None:
    args = {"alpha": 0.5, "beta": 0.1, "lambda1": l1, "lambda2": 0.05}
    w, nz, g = _arr(5, 2), np.stack([_arr(5, 2, low=0.0), _arr(5, 2)], -1), _arr(5, 2)
    want = _ftrl(w, nz, g, 0.5, 0.1, l1, 0.05)
    _close(run_kernel("Ftrl", _t(w, nz, g), 2, **args), want)
    got = run_kernel("SparseFtrl", _t(w, nz) + [torch.tensor([3, 0])] + _t(g[[3, 0]]), 2, **args)
    for state, old, full in zip(got, (w, nz), want):
        expected = old.copy()
        expected[[3, 0]] = full[[3, 0]]
        np.testing.assert_allclose(state.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_radam_equals_torch_radam_and_sparse_rows_equal_dense() -> None:
    param, grads = torch.randn(4, 3, dtype=torch.float64), [torch.randn(4, 3, dtype=torch.float64) for _ in range(8)]
    reference = param.clone().requires_grad_()
    opt = torch.optim.RAdam([reference], lr=0.1, betas=(0.9, 0.99), eps=1e-8)
    p, m1, m2 = param.clone(), torch.zeros_like(param), torch.zeros_like(param)
    lr, args = torch.tensor([-0.1], dtype=torch.float64), {"beta1": 0.9, "beta2": 0.99, "epsilon": 1e-8}
    for t, g in enumerate(grads, 1):  # steps 1..5 take the un-rectified branch, later ones the rectified
        reference.grad = g.clone()
        opt.step()
        p, m1, m2 = run_kernel("RAdam", [p, m1, m2, g, lr, torch.tensor([t])], 3, **args)
        torch.testing.assert_close(p, reference.detach(), rtol=1e-12, atol=1e-12)
    dense = run_kernel("RAdam", [p, m1, m2, grads[0], lr, torch.tensor([9])], 3, **args)
    rows = run_kernel("SparseRAdam", [p.clone(), m1.clone(), m2.clone(), torch.tensor([2, 0]), grads[0][[2, 0]], lr,
                                      torch.tensor([9])], 3, **args)
    for got, want, old in zip(rows, dense, (p, m1, m2)):
        torch.testing.assert_close(got[[0, 2]], want[[0, 2]])
        torch.testing.assert_close(got[[1, 3]], old[[1, 3]])
