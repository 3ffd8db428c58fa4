"""Loss and metric operators against eager PyTorch (forward) and torch.autograd (gradients, float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from graphpar.core.ir import OperatorDef
from graphpar.core.schema import NOT_DIFFERENTIABLE, get_schema
from graphpar.errors import GradientError
from tests.ops.helpers import check_gradient, gradient_ops, rel_err, run_kernel

DTYPES = st.sampled_from([torch.float32, torch.float64])


def _randn(seed: int, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _labels(seed: int, n: int, d: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.randint(0, d, (n,), generator=torch.Generator().manual_seed(seed)).to(dtype)


def _probs(seed: int, n: int, d: int) -> torch.Tensor:
    return torch.softmax(_randn(seed, n, d), 1)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert rel_err(actual, expected.detach()) < (1e-5 if actual.dtype == torch.float32 else 1e-12)


# ---------------------------------------------------------------------------------------------------- SoftmaxWithLoss


@given(
    n=st.integers(1, 6),
    d=st.integers(2, 7),
    dtype=DTYPES,
    seed=st.integers(0, 99),
    label_dtype=st.sampled_from([torch.int32, torch.int64]),
    column=st.booleans(),
)
def test_softmax_with_loss_matches_cross_entropy(
    n: int, d: int, dtype: torch.dtype, seed: int, label_dtype: torch.dtype, column: bool
) -> None:
    x, label = _randn(seed, n, d, dtype=dtype) * 3, _labels(seed, n, d, label_dtype)
    p, loss = run_kernel("SoftmaxWithLoss", [x, label.reshape(n, 1) if column else label])
    _close(p, torch.softmax(x, 1))
    _close(loss, F.cross_entropy(x, label.long()))
    assert loss.dim() == 0


def test_softmax_with_loss_weights_and_scale() -> None:
    x, label, w = _randn(0, 5, 4), _labels(1, 5, 4), _randn(2, 5).abs()
    _, loss = run_kernel("SoftmaxWithLoss", [x, label, w], scale=0.5)
    ce = F.cross_entropy(x, label.long(), reduction="none")
    _close(loss, 0.5 * (w * ce).sum() / w.sum())


def test_softmax_with_loss_keeps_logits_dtype_with_float64_weights() -> None:
    x, label, w = _randn(0, 5, 4, dtype=torch.float32), _labels(1, 5, 4), _randn(2, 5).abs()
    p, loss = run_kernel("SoftmaxWithLoss", [x, label, w])
    assert p.dtype == loss.dtype == torch.float32
    (dx,) = run_kernel("SoftmaxWithLossGradient", [x, label, w, p, torch.ones(())])
    assert dx.dtype == torch.float32


def test_softmax_with_loss_zero_weights_give_zero_loss() -> None:
    x, label = _randn(0, 3, 4), _labels(1, 3, 4)
    _, loss = run_kernel("SoftmaxWithLoss", [x, label, torch.zeros(3, dtype=torch.float64)])
    assert loss.item() == 0.0


def test_softmax_with_loss_label_prob_and_axis() -> None:
    x, target = _randn(0, 2, 3, 4), _probs(1, 6, 4)
    p, loss = run_kernel("SoftmaxWithLoss", [x, target], label_prob=True, axis=2)
    assert p.shape == x.shape
    _close(loss, -(target * torch.log_softmax(x.reshape(6, 4), 1)).sum(1).mean())


def test_softmax_with_loss_is_stable_for_large_logits() -> None:
    x = torch.tensor([[1000.0, -1000.0], [0.0, 2000.0]], dtype=torch.float64)
    _, loss = run_kernel("SoftmaxWithLoss", [x, torch.tensor([1, 0])])
    _close(loss, F.cross_entropy(x, torch.tensor([1, 0])))


def _swl_plain(x: torch.Tensor, lab: torch.Tensor) -> tuple:
    return torch.softmax(x, 1), F.cross_entropy(x, lab.long())


def _swl_weighted(x: torch.Tensor, lab: torch.Tensor, w: torch.Tensor) -> tuple:
    return torch.softmax(x, 1), (w * F.cross_entropy(x, lab.long(), reduction="none")).sum() / w.sum()


def _swl_label_prob(x: torch.Tensor, target: torch.Tensor) -> tuple:
    return torch.softmax(x, 1), -(target * torch.log_softmax(x, 1)).sum(1).mean()


def _swl_scaled_axis2(x: torch.Tensor, lab: torch.Tensor) -> tuple:
    return torch.softmax(x, 2), 3.0 * F.cross_entropy(x.reshape(6, 5), lab.long())


@pytest.mark.parametrize("variant", ["plain", "weighted", "label_prob", "scaled_axis2"])
def test_softmax_with_loss_gradient(variant: str) -> None:
    x, label, w = _randn(0, 6, 5), _labels(1, 6, 5), _randn(2, 6).abs()
    inputs, args, ref = {
        "plain": ([x, label], {}, _swl_plain),
        "weighted": ([x, label, w], {}, _swl_weighted),
        "label_prob": ([x, _probs(3, 6, 5)], {"label_prob": True}, _swl_label_prob),
        "scaled_axis2": ([x.reshape(3, 2, 5), label], {"axis": 2, "scale": 3.0}, _swl_scaled_axis2),
    }[variant]
    check_gradient("SoftmaxWithLoss", inputs, ref, grad_outputs=(1,), **args)


def test_softmax_with_loss_gradient_maker() -> None:
    op = OperatorDef("SoftmaxWithLoss", ["x", "label", "w"], ["p", "loss"])
    (grad,), grad_inputs = gradient_ops(op, [None, "loss_grad"])
    assert (grad.type, grad.inputs) == ("SoftmaxWithLossGradient", ["x", "label", "w", "p", "loss_grad"])
    assert grad_inputs == ["x_grad", None, None]
    with pytest.raises(GradientError, match="only the loss output"):
        gradient_ops(op, ["p_grad", "loss_grad"])


def test_softmax_with_loss_refuses_an_axis_past_the_last_dim() -> None:
    """1-D logits at axis 1 would make one-element rows: P all ones and a zero loss, silently."""
    with pytest.raises(ValueError, match="axis 1 is out of range for a 1-d input"):
        run_kernel("SoftmaxWithLoss", [_randn(0, 5), torch.tensor([0], dtype=torch.int32)])
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        run_kernel("SoftmaxWithLoss", [_randn(0, 4, 3), _labels(0, 4, 3)], axis=2)


@pytest.mark.parametrize(
    "op_type, inputs, match",
    [
        ("SoftmaxWithLoss", [_randn(0, 4, 3), _labels(0, 2, 3)], "2 labels .* for 4 rows"),
        ("SoftmaxWithLoss", [_randn(0, 4, 3), _labels(0, 4, 3), torch.ones(1)], "1 weights .* for 4 rows"),
        ("SoftmaxWithLossGradient", [_randn(0, 4, 3), _labels(0, 3, 3), _randn(1, 4, 3), torch.ones(())],
         "3 labels"),
        ("LabelCrossEntropy", [_randn(0, 4, 3).softmax(1), _labels(0, 2, 3)], "2 labels"),
        ("LabelCrossEntropyGradient", [_randn(0, 4, 3).softmax(1), _labels(0, 1, 3), _randn(1, 4)], "1 labels"),
        ("Accuracy", [_randn(0, 4, 3), _labels(0, 1, 3)], "1 labels"),  # one label would broadcast
        ("Accuracy", [_randn(0, 4), _labels(0, 4, 3)], r"must be \[N, D\]"),
        ("SquaredL2Distance", [_randn(0, 4, 3), _randn(1, 3)], "B has shape"),  # would broadcast
        ("CrossEntropy", [_randn(0, 4, 3).softmax(1), _randn(1, 3).softmax(0)], "the target has shape"),
    ],
)
def test_mismatched_counts_and_shapes_raise_instead_of_broadcasting(op_type: str, inputs: list,
                                                                     match: str) -> None:
    with pytest.raises(ValueError, match=rf"{op_type}\(.*{match}"):
        run_kernel(op_type, inputs)


def test_softmax_with_loss_label_probabilities_must_match_the_logits() -> None:
    x, target = _randn(0, 4, 3), _randn(1, 4, 3).softmax(1)
    for shape in [(3, 4), (12,)]:  # as many elements, but transposed or flat: no silent reshape
        with pytest.raises(ValueError, match="label probabilities have shape"):
            run_kernel("SoftmaxWithLoss", [x, target.reshape(shape)], label_prob=True)
    loss = run_kernel("SoftmaxWithLoss", [x.reshape(4, 3, 1), target], label_prob=True)[1]  # the 2-D view
    assert loss == run_kernel("SoftmaxWithLoss", [x, target], label_prob=True)[1]


def test_softmax_with_loss_refuses_float_labels() -> None:
    with pytest.raises(TypeError, match="labels must be integers"):
        run_kernel("SoftmaxWithLoss", [_randn(0, 2, 3), torch.tensor([0.0, 1.0])])


# ---------------------------------------------------------------------------------------------------- cross entropy


@given(n=st.integers(1, 5), d=st.integers(1, 6), seed=st.integers(0, 99), dtype=DTYPES)
@settings(max_examples=15)
def test_label_cross_entropy(n: int, d: int, seed: int, dtype: torch.dtype) -> None:
    x, label = _probs(seed, n, d).to(dtype), _labels(seed, n, d)
    (y,) = run_kernel("LabelCrossEntropy", [x, label])
    _close(y, -x.gather(1, label.long().reshape(-1, 1)).squeeze(1).log())


def test_label_cross_entropy_floor_and_gradient() -> None:
    (y,) = run_kernel(
        "LabelCrossEntropy", [torch.tensor([[0.0, 1.0]], dtype=torch.float64), torch.tensor([0])]
    )
    assert y.item() == pytest.approx(-torch.log(torch.tensor(1e-20, dtype=torch.float64)).item())
    x, label = _probs(0, 4, 3), _labels(1, 4, 3)
    check_gradient(
        "LabelCrossEntropy",
        [x, label],
        lambda x, lab: -x.gather(1, lab.long().reshape(-1, 1)).squeeze(1).log(),
    )


def test_cross_entropy_forward_and_gradient() -> None:
    x, t = _probs(0, 4, 3), _probs(1, 4, 3)
    (y,) = run_kernel("CrossEntropy", [x, t])
    _close(y, -(t * x.log()).sum(1))
    check_gradient("CrossEntropy", [x, t], lambda x, t: -(t * x.log()).sum(1))


# ---------------------------------------------------------------------------------------------------- SquaredL2Distance


@given(shape=st.sampled_from([(4, 3), (2, 3, 4), (5, 1)]), seed=st.integers(0, 99), dtype=DTYPES)
@settings(max_examples=15)
def test_squared_l2_distance(shape: tuple, seed: int, dtype: torch.dtype) -> None:
    a, b = _randn(seed, *shape, dtype=dtype), _randn(seed + 1, *shape, dtype=dtype)
    (d,) = run_kernel("SquaredL2Distance", [a, b])
    _close(d, 0.5 * ((a - b) ** 2).reshape(shape[0], -1).sum(1))


def test_squared_l2_distance_gradient() -> None:
    a, b = _randn(0, 3, 2, 4), _randn(1, 3, 2, 4)
    check_gradient("SquaredL2Distance", [a, b], lambda a, b: 0.5 * ((a - b) ** 2).sum((1, 2)), wrt=(0, 1))


# ---------------------------------------------------------------------------------------------------- sigmoid xent


@given(shape=st.sampled_from([(4, 3), (2, 3, 5), (6,)]), seed=st.integers(0, 99), dtype=DTYPES)
@settings(max_examples=15)
def test_sigmoid_cross_entropy_with_logits(shape: tuple, seed: int, dtype: torch.dtype) -> None:
    x = _randn(seed, *shape, dtype=dtype) * 4
    t = torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    (y,) = run_kernel("SigmoidCrossEntropyWithLogits", [x, t])
    assert y.shape == shape[:-1]
    _close(y, F.binary_cross_entropy_with_logits(x, t, reduction="none").mean(-1))


def test_sigmoid_cross_entropy_is_stable_and_differentiable() -> None:
    x = torch.tensor([[200.0, -200.0, 0.5]], dtype=torch.float64)
    (y,) = run_kernel(
        "SigmoidCrossEntropyWithLogits", [x, torch.tensor([[0.0, 1.0, 1.0]], dtype=torch.float64)]
    )
    assert torch.isfinite(y).all() and y.item() == pytest.approx(
        (200 + 200 + F.softplus(torch.tensor(-0.5)).item()) / 3
    )
    x, t = (
        _randn(0, 3, 4) * 3,
        torch.rand(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64),
    )
    check_gradient(
        "SigmoidCrossEntropyWithLogits",
        [x, t],
        lambda x, t: F.binary_cross_entropy_with_logits(x, t, reduction="none").mean(-1),
    )


# ---------------------------------------------------------------------------------------------------- Accuracy


def _reference_accuracy(pred: torch.Tensor, label: torch.Tensor, top_k: int) -> float:
    """Rank each row's classes by (-score, index) and look for the label in the first top_k."""
    hits = 0
    for row, lab in zip(pred.tolist(), label.tolist()):
        ranked = sorted(range(len(row)), key=lambda j: (-row[j], j))
        hits += lab in ranked[:top_k]
    return hits / pred.shape[0]


@given(
    n=st.integers(1, 8),
    d=st.integers(1, 6),
    top_k=st.integers(1, 3),
    seed=st.integers(0, 99),
    ties=st.booleans(),
)
def test_accuracy_matches_reference(n: int, d: int, top_k: int, seed: int, ties: bool) -> None:
    pred = _randn(seed, n, d, dtype=torch.float32)
    pred = pred.round() if ties else pred  # rounding makes ties likely
    label = _labels(seed + 1, n, d)
    (acc,) = run_kernel("Accuracy", [pred, label], top_k=top_k)
    assert acc.dim() == 0 and acc.dtype == torch.float32
    assert acc.item() == pytest.approx(_reference_accuracy(pred, label, top_k))


def test_accuracy_ties_go_to_the_lower_class() -> None:
    pred = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    (acc,) = run_kernel("Accuracy", [pred, torch.tensor([0, 1])])
    assert acc.item() == 0.5
    (acc,) = run_kernel("Accuracy", [pred, torch.tensor([0, 1])], top_k=2)
    assert acc.item() == 1.0
    assert get_schema("Accuracy").gradient is NOT_DIFFERENTIABLE
