"""Sparse lookups: forward against eager PyTorch, GradientSlice gradients against torch.autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphpar.core.ir import GradientSlice
from graphpar.naming import grad_name
from tests.ops.helpers import gradient_ops, make_op, randn, rel_err, run_op

INDICES = torch.tensor([4, 1, 4, 0, 2, 2, 2], dtype=torch.int32)  # duplicates, and row 3 never read
LENGTHS = torch.tensor([2, 0, 3, 2], dtype=torch.int32)  # an empty segment
OFFSETS = torch.tensor([0, 2, 2, 5])


def _slice_gradient(op_type, inputs, reference, wrt=0, **args):
    """Run op and its gradient; return (dense gradient of input `wrt` from the GradientSlice, autograd's,
    the slice's tensors). Other dense input gradients are checked against autograd too."""
    op = make_op(op_type, len(inputs), **args)
    outputs = run_op(op, inputs)
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    expected = reference(*leaves)
    assert rel_err(outputs[0], expected.detach()) < 1e-12 and outputs[0].dtype == expected.dtype
    dy = randn(outputs[0].shape, seed=3)
    grad_ops, grads = gradient_ops(op, [grad_name(op.outputs[0])])
    blobs = {**dict(zip(op.inputs, inputs)), grad_name(op.outputs[0]): dy}
    for gop in grad_ops:
        blobs.update(zip(gop.outputs, run_op(gop, [blobs[b] for b in gop.inputs])))
    floating = [i for i, x in enumerate(inputs) if x.is_floating_point()]
    auto = dict(zip(floating, torch.autograd.grad(expected, [leaves[i] for i in floating], dy)))
    sliced = grads[wrt]
    assert isinstance(sliced, GradientSlice) and sliced.indices == op.inputs[INDEX_OF[op_type]]
    indices, values = blobs[sliced.indices], blobs[sliced.values]
    dense = torch.zeros_like(inputs[wrt]).index_add_(0, indices.reshape(-1).long(),
                                                     values.reshape(-1, *inputs[wrt].shape[1:]))
    assert rel_err(dense, auto[wrt]) < 1e-12
    for i, g in enumerate(grads):
        if i != wrt and g is not None:
            assert rel_err(blobs[g], auto[i]) < 1e-12, f"input {i}"
    return indices, values


INDEX_OF = {"Gather": 1, "SparseLengthsSum": 1, "SparseLengthsMean": 1, "SparseLengthsWeightedSum": 2}


def test_gather_gradient_is_the_output_gradient_sliced_by_the_indices():
    data = randn((5, 3))
    indices, values = _slice_gradient("Gather", [data, INDICES.reshape(1, 7)],
                                      lambda d, i: F.embedding(i.long(), d))
    assert values.shape == (1, 7, 3) and indices.shape == (1, 7)


@pytest.mark.parametrize(("op_type", "mode"), [("SparseLengthsSum", "sum"), ("SparseLengthsMean", "mean")])
def test_sparse_lengths_pooling_matches_embedding_bag(op_type, mode):
    data = randn((5, 3))

    def reference(d, i, _lengths):
        return F.embedding_bag(i.long(), d, OFFSETS, mode=mode)

    _, values = _slice_gradient(op_type, [data, INDICES, LENGTHS], reference)
    assert values.shape == (7, 3)


@pytest.mark.parametrize("grad_on_weights", [False, True])
def test_sparse_lengths_weighted_sum_matches_embedding_bag(grad_on_weights):
    data, weights = randn((5, 3)), randn((7,), seed=1)

    def reference(d, w, i, _lengths):
        return F.embedding_bag(i.long(), d, OFFSETS, mode="sum", per_sample_weights=w)

    _slice_gradient("SparseLengthsWeightedSum", [data, weights, INDICES, LENGTHS], reference,
                    grad_on_weights=grad_on_weights)


def test_lengths_mismatch_and_bad_index_dtype_raise():
    op = make_op("SparseLengthsSum", 3)
    with pytest.raises(ValueError, match=r"SparseLengthsSum\(X0, X1, X2 -> Y0\): LENGTHS sum to 2 but there are 7"):
        run_op(op, [randn((5, 3)), INDICES, torch.tensor([1, 1], dtype=torch.int32)])
    with pytest.raises(TypeError, match=r"SparseLengthsSum\(X0, X1, X2 -> Y0\): INDICES must be int32 or int64"):
        run_op(op, [randn((5, 3)), INDICES.float(), LENGTHS])


def test_lengths_to_segment_ids():
    (ids,) = run_op(make_op("LengthsToSegmentIds", 1), [LENGTHS])
    assert ids.tolist() == [0, 0, 2, 2, 2, 3, 3] and ids.dtype == torch.int32


def test_sparse_to_dense_sums_duplicates_and_its_gradient_gathers():
    values = randn((7, 3))
    (dense,) = run_op(make_op("SparseToDense", 3), [INDICES, values, randn((6, 2))])
    expected = torch.zeros(6, 3).double().index_add_(0, INDICES.long(), values)
    assert torch.equal(dense, expected)
    (inferred,) = run_op(make_op("SparseToDense", 2), [INDICES, values])
    assert torch.equal(inferred, expected[:5])
    leaf = values.clone().requires_grad_()
    dy = randn((6, 3), seed=2)
    (auto,) = torch.autograd.grad(torch.zeros(6, 3).double().index_add(0, INDICES.long(), leaf), leaf, dy)
    grad_ops, grads = gradient_ops(make_op("SparseToDense", 3), ["dY"])
    (got,) = run_op(grad_ops[0], [dy, INDICES])
    assert grads[1] == grad_ops[0].outputs[0] and torch.equal(got, auto)


NEGATIVE = torch.tensor([-1, 3], dtype=torch.int32)  # sums to the 2 indices: only the sign is wrong
_BAD_LENGTHS = {
    "SparseLengthsSum": lambda lengths: [randn((5, 3)), torch.tensor([0, 1]), lengths],
    "SparseLengthsMean": lambda lengths: [randn((5, 3)), torch.tensor([0, 1]), lengths],
    "SparseLengthsWeightedSum": lambda lengths: [randn((5, 3)), randn((2,)), torch.tensor([0, 1]), lengths],
    "SparseLengthsSumGradient": lambda lengths: [randn((2, 3)), lengths, torch.tensor([0, 1])],
    "SparseLengthsMeanGradient": lambda lengths: [randn((2, 3)), lengths, torch.tensor([0, 1])],
    "SparseLengthsWeightedSumGradient": lambda lengths: [randn((2,)), randn((2, 3)), randn((5, 3)),
                                                         torch.tensor([0, 1]), lengths],
}


@pytest.mark.parametrize("op_type", sorted(_BAD_LENGTHS))
@pytest.mark.parametrize(("lengths", "message"), [(NEGATIVE, r"LENGTHS has a negative length \(-1\)"),
                                                  (torch.tensor([1, 2]), "LENGTHS sum to 3 but there are 2")])
def test_bad_lengths_raise_naming_the_op_before_any_kernel(op_type, lengths, message):
    """Issue 23 item 1: a negative length aborted the process (SIGABRT in repeat_interleave)."""
    inputs = _BAD_LENGTHS[op_type](lengths)
    op = make_op(op_type, len(inputs))
    with pytest.raises(ValueError, match=rf"^{op_type}\(.*\): {message}"):
        run_op(op, inputs)


@pytest.mark.parametrize("op_type", ["SparseLengthsWeightedSum", "SparseLengthsWeightedSumGradient"])
def test_weighted_sum_refuses_one_weight_broadcast_over_the_indices(op_type):
    """Issue 23 item 10: WEIGHTS=[2.0] with two indices was broadcast silently."""
    inputs = _BAD_LENGTHS[op_type](torch.tensor([1, 1]))
    inputs[0 if op_type.endswith("Gradient") else 1] = torch.tensor([2.0], dtype=torch.float64)
    op = make_op(op_type, len(inputs))
    with pytest.raises(ValueError, match=r"WEIGHTS has shape \[1\] but INDICES \[2\]; feed one weight per index"):
        run_op(op, inputs)


def test_on_a_gpu_indices_are_checked_by_a_device_assert_unless_host_checks_are_asked_for(monkeypatch):
    """A device-side assert (`torch._assert_async`) costs no host sync but leaves the CUDA context
    unusable; GRAPHPAR_HOST_INDEX_CHECKS=1 reads indices and lengths on the host on GPUs too (a
    failure-atomic ValueError, a sync per op). The meta device stands in for a GPU here."""
    from graphpar.ops import sparse, sparse_optim

    asserted = []
    monkeypatch.setattr(torch, "_assert_async", lambda ok, message: asserted.append(message))
    on_gpu = torch.tensor([1, 1], device="meta")
    assert sparse.check_on_host(torch.tensor([1, 1])) and not sparse.check_on_host(on_gpu)
    sparse.check_lengths(on_gpu, 2, "SparseLengthsSum(x)")
    sparse_optim._check_rows(on_gpu, 6, "ScatterAssign(x)")
    assert asserted == ["SparseLengthsSum(x): LENGTHS must be non-negative and sum to the 2 INDICES",
                        "ScatterAssign(x): an index is out of range"]
    monkeypatch.setenv(sparse.HOST_CHECKS, "1")
    assert sparse.check_on_host(on_gpu)
    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):  # the host path was taken
        sparse.check_lengths(on_gpu, 2, "SparseLengthsSum(x)")
    assert len(asserted) == 2
