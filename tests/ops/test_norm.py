"""SpatialBN, SpatialBNGradient, ChannelStats and ChannelBackpropStats against eager PyTorch / autograd."""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._prims_common import suggest_memory_format

from graphpar.core.ir import OperatorDef
from graphpar.core.schema import NOT_DIFFERENTIABLE, check_operator, get_schema
from graphpar.errors import GradientError
from tests.ops.helpers import check_gradient, gradient_ops, make_op, rel_err, run_gradient, run_kernel, run_op

EPS, MOMENTUM = 1e-5, 0.9


def _randn(seed: int, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _params(c: int, seed: int = 10, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """scale, bias, running mean, running variance."""
    return [
        _randn(seed, c, dtype=dtype) + 1.5,
        _randn(seed + 1, c, dtype=dtype),
        _randn(seed + 2, c, dtype=dtype),
        _randn(seed + 3, c, dtype=dtype).abs() + 0.5,
    ]


def _reference_train(
    x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """PyTorch's training batch norm; PyTorch's momentum is the weight of the NEW value."""
    rm, rv = rm.detach().clone(), rv.detach().clone()
    y = F.batch_norm(x, rm, rv, scale, bias, True, 1 - MOMENTUM, EPS)
    dims = [0, *range(2, x.dim())]
    var = x.var(dims, unbiased=False)
    return y, rm, rv, x.mean(dims), (var + EPS).rsqrt()


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert rel_err(actual, expected.detach()) < (1e-5 if actual.dtype == torch.float32 else 1e-10)


# ---------------------------------------------------------------------------------------------------- forward


@settings(max_examples=15)
@given(
    shape=st.sampled_from([(4, 3), (3, 2, 5), (2, 3, 4, 5), (5, 1, 2, 3)]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 99),
)
def test_spatial_bn_train_matches_batch_norm(shape: tuple, dtype: torch.dtype, seed: int) -> None:
    x = _randn(seed, *shape, dtype=dtype) * 2 + 0.5
    inputs = [x, *_params(shape[1], seed, dtype)]
    outputs = run_kernel("SpatialBN", inputs, n_outputs=5)
    for got, want in zip(outputs, _reference_train(*inputs)):
        _close(got, want)
    assert torch.equal(inputs[3], _params(shape[1], seed, dtype)[2])  # inputs untouched


@settings(max_examples=10)
@given(dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 99))
def test_spatial_bn_test_mode_uses_running_stats(dtype: torch.dtype, seed: int) -> None:
    x = _randn(seed, 2, 3, 4, 4, dtype=dtype)
    scale, bias, rm, rv = _params(3, seed, dtype)
    (y,) = run_kernel("SpatialBN", [x, scale, bias, rm, rv], is_test=True, epsilon=1e-3)
    _close(y, F.batch_norm(x, rm, rv, scale, bias, False, 0.0, 1e-3))


def test_spatial_bn_momentum_and_epsilon_args() -> None:
    x = _randn(0, 6, 2, 3, 3)
    scale, bias, rm, rv = _params(2)
    y, rm2, rv2, mean, inv_std = run_kernel(
        "SpatialBN", [x, scale, bias, rm, rv], n_outputs=5, momentum=0.25, epsilon=0.1
    )
    var = x.var((0, 2, 3), unbiased=False)
    _close(rm2, 0.25 * rm + 0.75 * x.mean((0, 2, 3)))
    _close(rv2, 0.25 * rv + 0.75 * x.var((0, 2, 3), unbiased=True))
    _close(inv_std, (var + 0.1).rsqrt())


# ---------------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("shape", [(4, 3, 2, 3), (5, 2), (3, 2, 4)])
def test_spatial_bn_train_gradient(shape: tuple) -> None:
    x = _randn(1, *shape) * 3 - 1
    check_gradient("SpatialBN", [x, *_params(shape[1])], _reference_train, wrt=(0, 1, 2), n_outputs=5)


def test_spatial_bn_test_mode_gradient() -> None:
    x = _randn(1, 3, 2, 4, 4)

    def reference(
        x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor
    ) -> torch.Tensor:
        return F.batch_norm(x, rm, rv, scale, bias, False, 0.0, EPS)

    check_gradient("SpatialBN", [x, *_params(2)], reference, wrt=(0, 1, 2), is_test=True)


def test_spatial_bn_gradient_maker_wiring() -> None:
    op = OperatorDef("SpatialBN", ["x", "s", "b", "rm", "rv"], ["y", "rm", "rv", "sm", "siv"])
    (grad,), grad_inputs = gradient_ops(op, ["y_grad", None, None, None, None])
    assert grad.type == "SpatialBNGradient"
    assert grad.inputs == ["x", "s", "y_grad", "sm", "siv"]
    assert grad.outputs == ["x_grad", "s_grad", "b_grad"]
    assert grad_inputs == ["x_grad", "s_grad", "b_grad", None, None]
    test_op = OperatorDef("SpatialBN", ["x", "s", "b", "rm", "rv"], ["y"], {"is_test": 1})
    (grad,), _ = gradient_ops(test_op, ["y_grad"])
    assert grad.inputs == ["x", "s", "y_grad", "rm", "rv"] and grad.args["is_test"] == 1


def test_spatial_bn_gradient_maker_refuses_rewritten_op() -> None:
    op = OperatorDef(
        "SpatialBN",
        ["x", "s", "b", "rm", "rv", "sums", "sumsq"],
        ["y", "rm", "rv", "sm", "siv"],
        {"num_batches": 2},
    )
    with pytest.raises(GradientError, match="before the inter-device"):
        gradient_ops(op, ["y_grad", None, None, None, None])


# ---------------------------------------------------------------------------------------------------- channel stats


@settings(max_examples=10)
@given(
    shape=st.sampled_from([(4, 3), (2, 3, 4, 5)]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 99),
)
def test_channel_stats(shape: tuple, dtype: torch.dtype, seed: int) -> None:
    x = _randn(seed, *shape, dtype=dtype)
    sums, sumsq = run_kernel("ChannelStats", [x])
    flat = x.transpose(0, 1).reshape(shape[1], -1)
    _close(sums, flat.sum(1))
    _close(sumsq, (flat * flat).sum(1))


def test_channel_backprop_stats_equal_scale_and_bias_gradients() -> None:
    x = _randn(0, 4, 3, 2, 5)
    scale, bias, rm, rv = _params(3)
    _, _, _, mean, inv_std = run_kernel("SpatialBN", [x, scale, bias, rm, rv], n_outputs=5)
    dy = _randn(7, *x.shape)
    scale_, bias_ = scale.clone().requires_grad_(), bias.clone().requires_grad_()
    y, *_ = _reference_train(x, scale_, bias_, rm, rv)
    want = torch.autograd.grad(y, [scale_, bias_], dy)
    dscale, dbias = run_kernel("ChannelBackpropStats", [x, mean, inv_std, dy])
    _close(dscale, want[0])
    _close(dbias, want[1])


@pytest.mark.parametrize("op_type", ["ChannelStats", "ChannelBackpropStats"])
def test_channel_stats_are_not_differentiable(op_type: str) -> None:
    assert get_schema(op_type).gradient is NOT_DIFFERENTIABLE


# ---------------------------------------------------------------------------------------------------- num_batches


def _split_bn(x: torch.Tensor, params: list[torch.Tensor], dy: torch.Tensor, parts: int) -> dict:
    """Inter-device batch norm by hand: per-part SpatialBN(num_batches) and SpatialBNGradient."""
    xs, dys = x.chunk(parts), dy.chunk(parts)
    stats = [run_kernel("ChannelStats", [xi]) for xi in xs]
    sums, sumsq = sum(s[0] for s in stats), sum(s[1] for s in stats)
    fwd = [run_kernel("SpatialBN", [xi, *params, sums, sumsq], n_outputs=5, num_batches=parts) for xi in xs]
    back = [run_kernel("ChannelBackpropStats", [xi, f[3], f[4], dyi]) for xi, f, dyi in zip(xs, fwd, dys)]
    dscale_g, dbias_g = sum(b[0] for b in back), sum(b[1] for b in back)
    grads = [
        run_kernel(
            "SpatialBNGradient",
            [xi, params[0], dyi, f[3], f[4], dscale_g, dbias_g],
            n_outputs=3,
            num_batches=parts,
        )
        for xi, f, dyi in zip(xs, fwd, dys)
    ]
    return {
        "y": torch.cat([f[0] for f in fwd]),
        "fwd": fwd,
        "dx": torch.cat([g[0] for g in grads]),
        "grads": grads,
    }


@pytest.mark.parametrize("parts, shape", [(2, (6, 3, 4, 5)), (3, (9, 2, 3, 3)), (2, (8, 4))])
def test_num_batches_equals_full_batch(parts: int, shape: tuple) -> None:
    x, dy = _randn(0, *shape) * 2 + 1, _randn(1, *shape)
    params = _params(shape[1])
    split = _split_bn(x, params, dy, parts)

    leaves = [
        x.clone().requires_grad_(),
        params[0].clone().requires_grad_(),
        params[1].clone().requires_grad_(),
    ]
    full = _reference_train(*leaves, params[2], params[3])
    dx, dscale, dbias = torch.autograd.grad(full[0], leaves, dy)
    _close(split["y"], full[0])
    for f in split["fwd"]:
        for k in range(1, 5):  # running stats (unbiased with the global count), saved mean, saved inv std
            _close(f[k], full[k])
    _close(split["dx"], dx)
    for g in split["grads"]:
        _close(g[1] * parts, dscale)
        _close(g[2] * parts, dbias)


def test_num_batches_float32() -> None:
    x, dy = _randn(0, 8, 3, 4, 4, dtype=torch.float32), _randn(1, 8, 3, 4, 4, dtype=torch.float32)
    params = _params(3, dtype=torch.float32)
    split = _split_bn(x, params, dy, 2)
    full = run_kernel("SpatialBN", [x, *params], n_outputs=5)
    assert split["y"].dtype == torch.float32 and rel_err(split["y"], full[0]) < 1e-4
    assert split["dx"].dtype == torch.float32


def test_spatial_bn_gradient_accepts_global_stats_in_place() -> None:
    op = OperatorDef(
        "SpatialBNGradient",
        ["x", "s", "dy", "sm", "siv", "s_grad", "b_grad"],
        ["x_grad", "s_grad", "b_grad"],
        {"num_batches": 2},
    )
    check_operator(op)


# ---------------------------------------------------------------------------------------------------- errors


def test_spatial_bn_may_not_run_in_place_on_x() -> None:
    with pytest.raises(ValueError, match="in place"):
        check_operator(OperatorDef("SpatialBN", ["x", "s", "b", "rm", "rv"], ["x", "rm", "rv", "sm", "siv"]))


def test_spatial_bn_running_stats_must_be_in_place() -> None:
    with pytest.raises(ValueError, match="must be input 3"):
        check_operator(OperatorDef("SpatialBN", ["x", "s", "b", "rm", "rv"], ["y", "rm2", "rv", "sm", "siv"]))


@pytest.mark.parametrize(
    "n_inputs, n_outputs, args, match",
    [
        (5, 5, {"num_batches": 2}, "needs the summed sums"),
        (5, 1, {}, "five outputs"),
        (5, 5, {"is_test": True}, "one output"),
        (6, 5, {}, "needs 5 inputs, or 7"),
        (5, 5, {"order": "CHWN"}, "NCHW only"),
    ],
)
def test_spatial_bn_rejects_bad_configurations(n_inputs: int, n_outputs: int, args: dict, match: str) -> None:
    inputs = [_randn(0, 2, 3, 2, 2), *_params(3), *[_randn(1, 3)] * (n_inputs - 5)]
    with pytest.raises(ValueError, match=match):
        run_op(make_op("SpatialBN", n_inputs, n_outputs, **args), inputs)


def test_spatial_bn_train_needs_two_values_per_channel() -> None:
    with pytest.raises(ValueError, match="more than one value per channel"):
        run_kernel("SpatialBN", [_randn(0, 1, 3, 1, 1), *_params(3)], n_outputs=5)


def test_spatial_bn_gradient_num_batches_needs_global_sums() -> None:
    with pytest.raises(ValueError, match="global dscale and dbias"):
        run_kernel(
            "SpatialBNGradient",
            [_randn(0, 2, 3, 2, 2), *_params(3)[:1], _randn(1, 2, 3, 2, 2), _randn(2, 3), _randn(3, 3)],
            num_batches=2,
        )


# ---------------------------------------------------------------------------------------------------- cuDNN


def test_cudnn_is_not_chosen_on_the_cpu() -> None:
    from graphpar.ops import norm

    x, (scale, bias, rm, rv) = _randn(0, 4, 3, 2, 2, dtype=torch.float32), _params(3, dtype=torch.float32)
    assert not norm._uses_cudnn(x, scale, bias, rm, rv, EPS)


def test_the_cudnn_calls_match_torchs_signatures() -> None:
    """The arguments bind to aten's schemas (torch 2.13); a CPU build then has no kernel to run."""
    from graphpar.ops import norm

    x, (scale, bias, rm, rv) = _randn(0, 4, 3, 2, 2, dtype=torch.float32), _params(3, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="Could not run 'aten::cudnn_batch_norm' with arguments from"):
        norm._cudnn_forward(x, scale, bias, rm, rv, 0.1, EPS)
    reserve = torch.empty(0, dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match="Could not run 'aten::cudnn_batch_norm_backward' with"):
        norm._cudnn_backward(x.to(memory_format=torch.channels_last), x, scale, rm, rv.rsqrt(), EPS, reserve)
    assert norm._memory_format(x.to(memory_format=torch.channels_last)) == torch.channels_last
    assert norm._memory_format(x) == norm._memory_format(x[:, :1]) == torch.contiguous_format


class _CudnnStandIn:
    """cuDNN's two kernels, computed with the native ones; records the reserve each call sees."""

    def __init__(self) -> None:
        self.reserves: list = []
        self.layouts: list = []

    def check_layout(self, x, *others):  # noqa: ANN001, ANN201
        """What cuDNN's kernels check: X contiguous in its suggested memory format, dY like it."""
        layout = suggest_memory_format(x)
        assert all(t.is_contiguous(memory_format=layout) for t in (x, *others)), "cuDNN needs X contiguous"
        self.layouts.append(layout)

    def forward(self, x, scale, bias, rm, rv, factor, eps):  # noqa: ANN001, ANN201
        self.check_layout(x)
        reserve = torch.arange(3, dtype=torch.uint8)
        self.reserves.append(("forward", reserve))
        return (*torch.native_batch_norm(x, scale, bias, rm, rv, True, factor, eps), reserve)

    def backward(self, x, dy, scale, mean, inv_std, eps, reserve):  # noqa: ANN001, ANN201
        self.check_layout(x, dy)
        self.reserves.append(("backward", reserve))
        return torch.ops.aten.native_batch_norm_backward(dy, x, scale, None, None, mean, inv_std, True, eps,
                                                         (True,) * 3)


@pytest.mark.parametrize("torch_picks_cudnn", [True, False])
def test_training_uses_cudnn_where_torch_would_and_hands_its_reserve_to_the_gradient(
        monkeypatch: pytest.MonkeyPatch, torch_picks_cudnn: bool) -> None:
    """The dispatch, with stand-ins for torch's backend choice and cuDNN's kernels (no GPU here):
    cuDNN's forward and backward run together, the forward's reserve reaches the backward, and the
    results equal PyTorch's batch norm and autograd; otherwise the native kernels run."""
    from graphpar.ops import norm

    cudnn, asked = _CudnnStandIn(), []
    monkeypatch.setattr(norm, "_uses_cudnn", lambda *args: asked.append(args[-1]) or torch_picks_cudnn)
    monkeypatch.setattr(norm, "_cudnn_forward", cudnn.forward)
    monkeypatch.setattr(norm, "_cudnn_backward", cudnn.backward)
    x = _randn(1, 4, 3, 2, 3) * 3 - 1
    check_gradient("SpatialBN", [x, *_params(3)], _reference_train, wrt=(0, 1, 2), n_outputs=5)
    assert asked == [EPS]
    if torch_picks_cudnn:
        (_, made), (_, used) = cudnn.reserves
        assert used is made
    else:
        assert cudnn.reserves == []


@pytest.mark.parametrize("layout", ["a channel slice", "channels_last"])
def test_cudnn_gets_x_contiguous_in_its_suggested_memory_format(monkeypatch: pytest.MonkeyPatch,
                                                                  layout: str) -> None:
    """A view from Split or Slice is copied before cuDNN's kernels, as torch.batch_norm does; a
    channels-last X stays channels-last. Results equal torch's batch norm and autograd."""
    from graphpar.ops import norm

    cudnn = _CudnnStandIn()
    monkeypatch.setattr(norm, "_uses_cudnn", lambda *args: True)
    monkeypatch.setattr(norm, "_cudnn_forward", cudnn.forward)
    monkeypatch.setattr(norm, "_cudnn_backward", cudnn.backward)
    whole = _randn(4, 4, 5, 2, 3) * 3 - 1
    x = whole[:, 1:4] if layout == "a channel slice" else whole[:, :3].contiguous().to(memory_format=torch.channels_last)
    assert not x.is_contiguous()
    check_gradient("SpatialBN", [x, *_params(3)], _reference_train, wrt=(0, 1, 2), n_outputs=5)
    want = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    assert cudnn.layouts and set(cudnn.layouts) == {want}


def test_without_torchs_backend_choice_cuda_runs_native_batch_norm_and_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from graphpar.ops import norm

    monkeypatch.delattr(torch._C, "_select_batch_norm_backend")
    monkeypatch.setattr(norm, "_warn_no_backend_choice", functools.cache(norm._warn_no_backend_choice.__wrapped__))
    x, params = _randn(0, 4, 3, 2, 2), _params(3)
    assert not norm._uses_cudnn(x, *params, EPS) and caplog.text == ""  # the CPU: nothing to say
    cuda_like = SimpleNamespace(is_cuda=True)
    with caplog.at_level(logging.WARNING, logger="graphpar.ops.norm"):
        assert not norm._uses_cudnn(cuda_like, *params, EPS)
        assert not norm._uses_cudnn(cuda_like, *params, EPS)
    assert caplog.text.count("native batch norm on CUDA, not cuDNN's") == 1


def test_inter_device_bn_keeps_its_exact_statistics_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphpar.ops import norm

    monkeypatch.setattr(norm, "_uses_cudnn", lambda *args: pytest.fail("asked about cuDNN"))
    x = _randn(2, 4, 3, 2, 2)
    sums, sumsq = x.sum((0, 2, 3)), x.square().sum((0, 2, 3))
    run_kernel("SpatialBN", [x, *_params(3), sums, sumsq], n_outputs=5)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(8, 16, 7, 7), (4, 3, 5)])
def test_cudnn_spatial_bn_matches_torch_within_cudnn_tolerance(shape: tuple) -> None:
    from graphpar.ops import norm

    x = _randn(3, *shape, dtype=torch.float32).cuda() * 2 + 0.5
    params = [p.cuda() for p in _params(shape[1], dtype=torch.float32)]
    assert norm._uses_cudnn(x, *params, EPS)
    outputs = run_kernel("SpatialBN", [x, *params], n_outputs=5, device="cuda")
    assert getattr(outputs[3], norm._CUDNN_RESERVE, None) is not None  # cuDNN ran
    leaves = [t.detach().clone().requires_grad_(i < 3) for i, t in enumerate([x, *params])]
    expected = _reference_train(*leaves)
    for got, want in zip(outputs, expected):
        assert rel_err(got, want.detach()) < 1e-4
    dy = torch.randn_like(x)
    op = make_op("SpatialBN", 5, 5)
    got = run_gradient(op, [x, *params], outputs, {0: dy})
    want = torch.autograd.grad(expected[0], leaves[:3], dy)
    for g, w in zip(got[:3], want):
        assert rel_err(g, w) < 1e-4
