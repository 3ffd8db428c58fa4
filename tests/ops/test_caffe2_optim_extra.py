"""Storm, DecayAdagrad, GFtrl, YellowFin, SmartDecaySparseAdam and RowWiseCounter against NumPy
references written from Caffe2's formulas (its op tests' references and its C++ loops, element by
element)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.ops.helpers import run_kernel

RNG = np.random.default_rng(0)


def _arr(*shape: int, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    return RNG.uniform(low, high, shape).astype(np.float64)


def _t(*arrays: np.ndarray) -> list[torch.Tensor]:
    return [torch.from_numpy(np.array(a, copy=True)) for a in arrays]


def _close(got: tuple[torch.Tensor, ...], want: tuple[np.ndarray, ...], rtol: float = 1e-10) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=rtol, atol=1e-12)


# ---- Storm (Caffe2's storm_op_test references) ------------------------------------------------------


def _storm_dense_ref(param, moment, gss, grad, lr, momentum, beta):  # noqa: ANN001, ANN202
    gss_out = gss + np.sum(grad * grad)
    nlr = lr * np.power(beta + gss_out, -1.0 / 3.0)
    alpha = momentum * np.square(nlr)
    moment_out = grad + (1 - alpha) * (moment - grad)
    return param + nlr * moment_out, moment_out, gss_out


def test_storm_dense() -> None:
    p, m, g, gss, lr = _arr(4, 3), _arr(4, 3), _arr(4, 3), np.array([0.4]), np.array([-0.3])
    got = run_kernel("Storm", _t(p, m, gss, g, lr), 3, momentum=7.0, beta=0.5)
    _close(got, _storm_dense_ref(p, m, gss, g, lr, 7.0, 0.5))


@pytest.mark.parametrize("op_type", ["Storm", "SparseStorm"])
def test_storm_with_beta_0_and_only_zero_gradients_so_far_makes_no_step(op_type: str) -> None:
    """Issue 32 item 11: beta=0, grad_sq_init=0 and an all-zero gradient gave nlr = lr * 0^(-1/3) = inf and
    NaN params (inf * 0). Nothing has been seen yet: nothing moves; the next nonzero gradient steps as
    Caffe2's formula says."""
    p, m, gss, lr = _arr(3, 2), np.zeros((3, 2)), np.array([0.0]), np.array([-0.3])
    extra = [torch.tensor([0, 1, 2])] if op_type == "SparseStorm" else []
    got = run_kernel(op_type, _t(p, m, gss, np.zeros((3, 2))) + extra + _t(lr), 3, momentum=7.0, beta=0.0)
    _close(got, (p, m, gss))
    g = _arr(3, 2)
    got = run_kernel(op_type, _t(p, m, gss, g) + extra + _t(lr), 3, momentum=7.0, beta=0.0)
    _close(got, _storm_dense_ref(p, m, gss, g, lr, 7.0, 0.0))


def test_sparse_storm_updates_the_rows_of_the_slice() -> None:
    p, m, gss, lr = _arr(6, 2), _arr(6, 2), np.array([0.2]), np.array([-0.5])
    indices, rows = np.array([4, 0, 2]), _arr(3, 2)
    got = run_kernel("SparseStorm", _t(p, m, gss, rows) + [torch.tensor(indices)] + _t(lr), 3, momentum=3.0,
                     beta=2.0)
    # Caffe2's reference: gss from the slice, then each index in turn
    gss_out = gss + np.sum(rows * rows)
    nlr = lr * np.power(2.0 + gss_out, -1.0 / 3.0)
    alpha = 3.0 * nlr ** 2
    p_out, m_out = p.copy(), m.copy()
    for i, index in enumerate(indices):
        m_out[index] = rows[i] + (1 - alpha) * (m[index] - rows[i])
        p_out[index] = p[index] + nlr * m_out[index]
    _close(got, (p_out, m_out, gss_out))


def test_sparse_storm_sums_duplicates_first_and_an_empty_slice_changes_nothing() -> None:
    p, m, gss, lr = _arr(5, 2), _arr(5, 2), np.array([0.3]), np.array([-0.2])
    rows = _arr(3, 2)
    got = run_kernel("SparseStorm", _t(p, m, gss, rows) + [torch.tensor([1, 3, 1])] + _t(lr), 3)
    summed = np.stack([rows[0] + rows[2], rows[1]])
    want_p, want_m, want_gss = _storm_dense_ref(p[[1, 3]], m[[1, 3]], gss, summed, lr, 10.0, 0.1)
    np.testing.assert_allclose(got[0].numpy()[[1, 3]], want_p, rtol=1e-10)
    np.testing.assert_allclose(got[1].numpy()[[1, 3]], want_m, rtol=1e-10)
    np.testing.assert_allclose(got[2].numpy(), want_gss, rtol=1e-10)
    np.testing.assert_array_equal(got[0].numpy()[[0, 2, 4]], p[[0, 2, 4]])
    empty = run_kernel("SparseStorm", _t(p, m, gss, np.zeros((0, 2))) + [torch.zeros(0, dtype=torch.int64)] + _t(lr),
                       3)
    _close(empty, (p, m, gss))


# ---- DecayAdagrad (Caffe2's decay_adagrad_op_test reference) -----------------------------------------


@pytest.mark.parametrize("bias_correction_first", [True, False])
def test_decay_adagrad(bias_correction_first: bool) -> None:
    p, m1, m2, g = _arr(3, 4), _arr(3, 4), _arr(3, 4, low=0.0), _arr(3, 4)
    lr, it, beta1, eps, wd = np.array([0.3]), 6, 0.7, 0.05, 0.2
    got = run_kernel("DecayAdagrad", _t(p, m1, m2, g, lr) + [torch.tensor([it])], 3, beta1=beta1, beta2=0.5,
                     epsilon=eps, weight_decay=wd, bias_correction_first=bias_correction_first)
    t = it + 1
    m1_out = beta1 * m1 + (1 - beta1) * g
    m2_out = m2 + np.square(g)
    c = 1 - np.power(beta1, t) if bias_correction_first else 1.0
    grad_out = m1_out / c / (np.sqrt(m2_out) + eps) + wd * p
    _close(got, (p + lr * grad_out, m1_out, m2_out))


# ---- GFtrl (Caffe2's gftrl_update loop) --------------------------------------------------------------


def _gftrl_ref(w, nz, g, alpha, beta, lambda1, lambda2):  # noqa: ANN001, ANN202
    out_dim = w.shape[0]
    w2, g2 = w.reshape(out_dim, -1), g.reshape(out_dim, -1)
    nz2 = nz.reshape(out_dim, -1, 2)
    new_w, new_nz = np.zeros_like(w2), np.zeros_like(nz2)
    in_dim = w2.shape[1]
    for j in range(in_dim):
        z_norm = 0.0
        for i in range(out_dim):
            new_n = nz2[i, j, 0] + g2[i, j] ** 2
            sigma = (math.sqrt(new_n) - math.sqrt(nz2[i, j, 0])) / alpha
            z_norm += (nz2[i, j, 1] + g2[i, j] - sigma * w2[i, j]) ** 2
        z_norm = math.sqrt(z_norm)
        for i in range(out_dim):
            n, z = nz2[i, j]
            nn = n + g2[i, j] ** 2
            sigma = (math.sqrt(nn) - math.sqrt(n)) / alpha
            nzv = z + g2[i, j] - sigma * w2[i, j]
            new_nz[i, j] = nn, nzv
            if z_norm > lambda1 * math.sqrt(out_dim):
                new_w[i, j] = nzv * (lambda1 * math.sqrt(out_dim) / z_norm - 1) / (
                    (beta + math.sqrt(nn)) / alpha + lambda2)
    return new_w.reshape(w.shape), new_nz.reshape(nz.shape)


def test_gftrl_zeroes_weak_groups_and_shrinks_the_others() -> None:
    w, nz, g = _arr(4, 3), _arr(4, 3, 2, low=0.0), _arr(4, 3)
    g[:, 1] *= 0.01  # a weak column (small gradient, weight and z): its group is zeroed by lambda1
    w[:, 1] *= 0.01
    nz[:, 1, 1] = 0.0
    args = {"alpha": 0.5, "beta": 0.3, "lambda1": 0.2, "lambda2": 0.1}
    got = run_kernel("GFtrl", _t(w, nz, g), 2, **args)
    want = _gftrl_ref(w, nz, g, **args)
    _close(got, want)
    assert (want[0][:, 1] == 0).all() and (want[0][:, 0] != 0).all()  # the test covers both branches
    (alpha_in,) = _t(np.array([0.25]))  # the optional alpha input overrides the argument
    _close(run_kernel("GFtrl", [*_t(w, nz, g), alpha_in], 2, **args), _gftrl_ref(w, nz, g, **{**args, "alpha": 0.25}))


def test_gftrl_rejects_a_state_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match="n_z of that shape"):
        run_kernel("GFtrl", _t(_arr(4, 3), _arr(4, 3), _arr(4, 3)), 2)


# ---- YellowFin (Caffe2's yellowfin_op.{h,cc}, scalar by scalar) ---------------------------------------


class _YellowFinRef:
    """Caffe2's YellowFinOp, written as plain Python over NumPy arrays, with in-place state."""

    def __init__(self, param: np.ndarray, width: int, alpha: float, mu: float, beta: float = 0.999,
                 eps: float = 1e-6, zero_debias: bool = True) -> None:
        self.param, self.moment = param.copy(), np.zeros_like(param)
        self.lr_avg, self.mu_avg = alpha, mu
        self.curv = np.zeros(width)
        self.g_avg, self.g2_avg = np.zeros_like(param), np.zeros_like(param)
        self.mem = np.zeros(5)
        self.width, self.beta, self.eps, self.zero_debias = width, beta, eps, zero_debias

    def step(self, grad: np.ndarray, it: int) -> None:
        beta, eps = self.beta, self.eps
        deb = 1 / (1 - beta ** it) if self.zero_debias else 1.0
        self.moment = self.mu_avg * self.moment + self.lr_avg * grad
        self.param = self.param - self.moment
        self.g_avg = beta * self.g_avg + (1 - beta) * grad
        g_deb = self.g_avg * deb
        self.g2_avg = beta * self.g2_avg + (1 - beta) * grad * grad
        g_norm2 = max(eps, float(np.sum(grad * grad)))
        self.mem[1] = beta * self.mem[1] + (1 - beta) * g_norm2
        self.mem[0] = beta * self.mem[0] + (1 - beta) * math.sqrt(g_norm2)
        self.curv[(it - 1) % self.width] = math.log(g_norm2)
        window = self.curv[:min(self.width, it)]
        self.mem[2] = beta * self.mem[2] + (1 - beta) * window.min()
        self.mem[3] = beta * self.mem[3] + (1 - beta) * window.max()
        h_min, h_max = max(eps, math.exp(self.mem[2] * deb)), max(eps, math.exp(self.mem[3] * deb))
        variance = max(eps, self.mem[1] * deb - float(np.dot(g_deb.ravel(), g_deb.ravel())))
        self.mem[4] = beta * self.mem[4] + (1 - beta) * self.mem[0] / self.mem[1]
        if it > 1:
            dist = self.mem[4] * deb
            p = (dist * h_min) ** 2 / (2 * variance)
            w3 = (-math.sqrt(p * p + 4.0 / 27.0 * p ** 3) - p) / 2
            w = math.copysign(abs(w3) ** (1.0 / 3.0), 1.0 if w3 > 0 else -1.0)
            root = w - p / 3 / w + 1
            ratio = math.sqrt(h_max / h_min)
            mu = max(root * root, ((ratio - 1) / (ratio + 1)) ** 2)
            lr = (1 - math.sqrt(mu)) ** 2 / h_min
            self.mu_avg = beta * self.mu_avg + (1 - beta) * mu
            self.lr_avg = beta * self.lr_avg + (1 - beta) * lr


def test_yellowfin_over_several_steps_matches_caffe2s_kernel() -> None:
    width, param = 3, _arr(4, 2)
    ref = _YellowFinRef(param, width, alpha=0.1, mu=0.0, beta=0.9)
    state = _t(param, np.zeros_like(param), np.array([0.1]), np.array([0.0]), np.zeros(width), np.zeros_like(param),
               np.zeros_like(param), np.zeros(5))
    for it in range(1, 7):  # past the curvature window, and the lr/mu tuning from iter 2
        grad = _arr(4, 2) * it
        state = list(run_kernel("YellowFin", [*state, *_t(grad), torch.tensor([it])], 8, beta=0.9,
                                curv_win_width=width))
        ref.step(grad, it)
    want = (ref.param, ref.moment, [ref.lr_avg], [ref.mu_avg], ref.curv, ref.g_avg, ref.g2_avg, ref.mem)
    _close(tuple(state), tuple(np.asarray(w) for w in want), rtol=1e-9)
    assert ref.mu_avg > 0 and ref.lr_avg != 0.1  # the tuning ran


# ---- SmartDecaySparseAdam (Caffe2's adam_compute_smart_decay) ----------------------------------------


def test_smart_decay_sparse_adam_catches_up_on_skipped_steps() -> None:
    p, m1, m2 = _arr(5, 2), _arr(5, 2), _arr(5, 2, low=0.0)
    last_seen = np.array([0, 3, 6, 1, 0], dtype=np.int64)
    indices, grad, lr, it = np.array([3, 1, 2]), _arr(3, 2), np.array([-0.1]), 6
    b1, b2, eps = 0.8, 0.9, 1e-3
    got = run_kernel("SmartDecaySparseAdam", [*_t(p, m1, m2, last_seen, indices, grad, lr), torch.tensor([it])], 4,
                     beta1=b1, beta2=b2, epsilon=eps)
    t = it + 1
    want = [a.copy() for a in (p, m1, m2, last_seen)]
    for i, idx in enumerate(indices):
        k = float(t - last_seen[idx])
        catchup = m1[idx] * b1 * (1 - b1 ** (k - 1)) / (1 - b1) if k > 1 else 0.0
        mi = m1[idx] * b1 ** k + grad[i] * (1 - b1)
        vi = m2[idx] * b2 ** k + grad[i] ** 2 * (1 - b2)
        want[0][idx] = p[idx] + lr * (mi + catchup) / (np.sqrt(vi) + eps)
        want[1][idx], want[2][idx], want[3][idx] = mi, vi, t
    _close(got, tuple(want))


# ---- RowWiseCounter (Caffe2's rowwise_counter.h) -----------------------------------------------------


def test_row_wise_counter_decays_by_the_half_life_and_counts_repeats() -> None:
    prev = np.array([0, 2, 5, 1], dtype=np.int64)
    counter = np.array([1.0, 3.0, 0.5, 2.0])
    indices, it, halflife = np.array([1, 2, 1, 3]), 5, 4
    got = run_kernel("RowWiseCounter", [*_t(prev, counter, indices), torch.tensor([it])], 2, counter_halflife=halflife)
    want_prev, want_counter = prev.copy(), counter.copy()
    for idx in indices:  # Caffe2's loop, index by index
        delta = max(0, it - want_prev[idx])
        want_counter[idx] = 1.0 + math.exp(-delta * math.log(2.0) / halflife) * want_counter[idx]
        want_prev[idx] = max(it, want_prev[idx])
    _close(got, (want_prev, want_counter))
    off = run_kernel("RowWiseCounter", [*_t(prev, counter, indices), torch.tensor([it])], 2)
    _close(off, (prev, counter))  # counter_halflife <= 0: nothing
