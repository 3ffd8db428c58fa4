"""Sparse updates against torch.optim (sparse gradients, duplicates coalesced) and eager references."""

from __future__ import annotations

import pytest
import torch

from tests.ops.helpers import randn, run_kernel

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # inside torch.optim.Adagrad

INDICES = torch.tensor([[3, 0, 3], [5, 1, 0]], dtype=torch.int32)  # duplicates; rows 2 and 4 untouched
ALL_ROWS = torch.tensor([0, 1, 2, 3, 3, 0], dtype=torch.int64)  # every row, with duplicates


def _lr(value):
    return torch.tensor([value], dtype=torch.float32)


def _sparse(indices, values, rows):
    """torch's sparse gradient of the slice (uncoalesced: duplicates kept)."""
    flat = indices.reshape(-1).long()
    return torch.sparse_coo_tensor(flat[None], values.reshape(flat.numel(), -1), (rows, values.shape[-1]),
                                   check_invariants=True)


def test_scatter_weighted_sum_scales_each_row_once_and_sums_duplicates():
    x0, x1, x2 = randn((6, 3)), randn((2, 3, 3), seed=1), randn((2, 3, 3), seed=2)
    expected = x0.clone()
    touched = INDICES.reshape(-1).long().unique()
    expected[touched] *= 0.5
    expected.index_add_(0, INDICES.reshape(-1).long(), (x1 * -0.125 + x2 * 2.0).reshape(6, 3))
    (got,) = run_kernel("ScatterWeightedSum", [x0.clone(), _lr(0.5), INDICES, x1, _lr(-0.125), x2, _lr(2.0)])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_scatter_assign():
    data, slices = randn((6, 3)), randn((4, 3), seed=1)
    idx = torch.tensor([5, 0, 2, 3])
    (got,) = run_kernel("ScatterAssign", [data.clone(), idx, slices])
    expected = data.clone()
    expected[idx] = slices
    assert torch.equal(got, expected)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sparse_momentum_sgd_equals_torch_sgd_when_every_row_is_touched(nesterov):
    param, lr = randn((4, 3)), 0.125
    reference = param.clone().requires_grad_()
    opt = torch.optim.SGD([reference], lr=lr, momentum=0.9, nesterov=nesterov)
    p, m = param.clone(), torch.zeros(4, 3, dtype=torch.float64)
    for step in range(3):
        values = randn((6, 3), seed=step)
        reference.grad = _sparse(ALL_ROWS, values, 4).to_dense()
        opt.step()
        _, m, p = run_kernel("SparseMomentumSGDUpdate", [values, m, _lr(lr), p, ALL_ROWS], momentum=0.9,
                             nesterov=nesterov)
    torch.testing.assert_close(p, reference.detach(), rtol=1e-12, atol=1e-12)


def test_sparse_momentum_sgd_leaves_untouched_rows_and_returns_each_index_step():
    param, values = randn((6, 3)), randn((2, 3, 3), seed=1)
    moment = randn((6, 3), seed=2)
    step, m, p = run_kernel("SparseMomentumSGDUpdate", [values.clone(), moment.clone(), _lr(0.125), param.clone(),
                                                        INDICES], momentum=0.5)
    dense = _sparse(INDICES, values, 6).to_dense()
    expected_m = 0.125 * dense + 0.5 * moment
    for row in range(6):
        if row in (2, 4):
            assert torch.equal(p[row], param[row]) and torch.equal(m[row], moment[row])
        else:
            torch.testing.assert_close(m[row], expected_m[row], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(p[row], param[row] - expected_m[row], rtol=1e-12, atol=1e-12)
    assert step.shape == values.shape
    torch.testing.assert_close(step[0, 0], expected_m[3], rtol=1e-12, atol=1e-12)


def test_adagrad_and_sparse_adagrad_equal_torch_adagrad():
    param, lr, eps = randn((6, 3)), 0.1, 1e-5
    dense_ref = param.clone().requires_grad_()
    sparse_ref = param.clone().requires_grad_()
    dense_opt = torch.optim.Adagrad([dense_ref], lr=lr, eps=eps)
    sparse_opt = torch.optim.Adagrad([sparse_ref], lr=lr, eps=eps)
    p_dense, h_dense = param.clone(), torch.zeros(6, 3, dtype=torch.float64)
    p_sparse, h_sparse = param.clone(), torch.zeros(6, 3, dtype=torch.float64)
    for step in range(3):
        values = randn((2, 3, 3), seed=step)
        grad = _sparse(INDICES, values, 6)
        dense_ref.grad, sparse_ref.grad = grad.to_dense(), grad
        dense_opt.step()
        sparse_opt.step()
        p_dense, h_dense = run_kernel("Adagrad", [p_dense, h_dense, grad.to_dense(), _lr(-lr)], epsilon=eps)
        p_sparse, h_sparse = run_kernel("SparseAdagrad", [p_sparse, h_sparse, INDICES, values, _lr(-lr)],
                                        epsilon=eps)
    torch.testing.assert_close(p_dense, dense_ref.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(p_sparse, sparse_ref.detach(), rtol=1e-7, atol=1e-9)


def test_row_wise_sparse_adagrad():
    param, moment, values = randn((6, 3)), torch.rand(6, dtype=torch.float64), randn((2, 3, 3), seed=1)
    p, h = run_kernel("RowWiseSparseAdagrad", [param.clone(), moment.clone(), INDICES, values, _lr(-0.125)],
                      epsilon=1e-5)
    dense = _sparse(INDICES, values, 6).to_dense()
    for row in range(6):
        if row in (2, 4):
            assert torch.equal(p[row], param[row]) and h[row] == moment[row]
            continue
        h_row = moment[row] + (dense[row] ** 2).mean()
        torch.testing.assert_close(h[row], h_row, rtol=1e-12, atol=0.0)
        torch.testing.assert_close(p[row], param[row] - 0.125 * dense[row] / (h_row.sqrt() + 1e-5), rtol=1e-12,
                                   atol=1e-12)


def test_sparse_adam_equals_torch_sparse_adam():
    param, lr = randn((6, 3)), 0.01
    reference = param.clone().requires_grad_()
    opt = torch.optim.SparseAdam([reference], lr=lr, eps=1e-8)
    p, m1, m2 = param.clone(), torch.zeros(6, 3, dtype=torch.float64), torch.zeros(6, 3, dtype=torch.float64)
    for step in range(1, 4):
        values = randn((2, 3, 3), seed=step)
        reference.grad = _sparse(INDICES, values, 6)
        opt.step()
        p, m1, m2 = run_kernel("SparseAdam", [p, m1, m2, INDICES, values, _lr(-lr),
                                              torch.tensor([step], dtype=torch.int64)])
    torch.testing.assert_close(p, reference.detach(), rtol=1e-6, atol=1e-7)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="one row per index"):
        run_kernel("SparseAdagrad", [randn((6, 3)), randn((6, 3)), INDICES, randn((5, 3)), _lr(-0.1)])
    with pytest.raises(ValueError, match="epsilon > 0"):
        run_kernel("Adagrad", [randn((6, 3)), randn((6, 3)), randn((6, 3)), _lr(-0.1)], epsilon=0.0)


@pytest.mark.parametrize("bad", [6, -1])
def test_scatter_assign_checks_every_index_before_writing(bad):
    """Issue 23 item 14: the rows before an out-of-range index were written, then it raised."""
    data, slices = randn((6, 3)), randn((3, 3), seed=1)
    target = data.clone()
    with pytest.raises(ValueError, match=rf"ScatterAssign.*: index {bad} is out of range for DATA with 6 rows"):
        run_kernel("ScatterAssign", [target, torch.tensor([0, 1, bad]), slices])
    assert torch.equal(target, data)
