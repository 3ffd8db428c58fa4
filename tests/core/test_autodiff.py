"""Tests of graphpar.core.autodiff.

Structure tests assert the exact gradient ops emitted, as Caffe2's core_gradients_test does, on
test-only operators (prefixed `_Test`) registered below; numerical tests run small real nets through
the workspace and compare every gradient with torch.autograd.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from graphpar import workspace
from graphpar.core import CPU, CUDA, BlobReference, DeviceOption, GradientSlice, Net, NetDef, OperatorDef
from graphpar.core.autodiff import backward_pass
from graphpar.core.schema import (
    GI,
    NO_GRADIENT,
    NOT_DIFFERENTIABLE,
    gradient_op,
    register_op,
    scoped_registry,
)
from graphpar.errors import GradientError


def _clone_kernel(args, ctx):
    return lambda *xs: tuple(x.clone() for x in xs) if len(xs) > 1 else xs[0].clone()


def _register(type_, gradient, inputs=1, outputs=1, inplace=lambda i, o: True, args=None, **extra):
    register_op(type_, kernel=_clone_kernel, doc="Test-only op.", inputs=inputs, outputs=outputs,
                inplace=inplace, args=args, gradient=gradient, **extra)


def _direct_gradient(op, g):
    return [gradient_op("_TestDirectGradient", [g[0]], [GI(op, 0)])], [GI(op, 0)]


def _use_input_gradient(op, g):
    return [gradient_op("_TestUseInputGradient", [op.inputs[0], g[0]], [GI(op, 0)])], [GI(op, 0)]


def _use_output_gradient(op, g):
    return [gradient_op("_TestUseOutputGradient", [op.outputs[0], g[0]], [GI(op, 0)])], [GI(op, 0)]


def _pair_gradient(op, g):
    return [gradient_op("_TestPairGradient", [g[0]], [GI(op, 0), GI(op, 1)])], [GI(op, 0), GI(op, 1)]


def _add_gradient(op, g):
    return [], [g[0], g[0]]  # pass-through, like Caffe2's Sum/Add


def _gather_gradient(op, g):
    return [], [GradientSlice(op.inputs[1], g[0]), None]  # pass-through slice, like Caffe2's Gather


def _sparse_gradient(op, g):
    out = GradientSlice(op.inputs[0] + "_grad_indices", op.inputs[0] + "_grad_values")
    return [gradient_op("_TestSparseGradient", [op.inputs[1], g[0]], list(out))], [out, None]


def _two_step_gradient(op, g):
    return ([gradient_op("_TestDirectGradient", [g[0]], [GI(op, 0)]),
             gradient_op("_TestDirectGradient", [GI(op, 0)], [GI(op, 0)])], [GI(op, 0)])


def _scaled_gradient(op, g):
    return [gradient_op("_TestScaledGradient", [g[0]], [GI(op, 0)], scale=3.0)], [GI(op, 0)]


def _branchy_gradient(op, g):
    x = [op.outputs[0]] if op.inputs[0] == op.outputs[0] else [op.inputs[0], op.outputs[0]]
    return [gradient_op("_TestUseInputGradient", [*x, g[0]], [GI(op, 0)])], [GI(op, 0)]


@pytest.fixture(autouse=True, scope="module")
def _test_ops() -> Iterator[None]:
    """This module's test-only operators, registered for its tests only."""
    with scoped_registry():
        _register("_TestDirect", _direct_gradient)
        _register("_TestDirectGradient", NOT_DIFFERENTIABLE)
        _register("_TestUseInput", _use_input_gradient)
        _register("_TestUseInputGradient", NOT_DIFFERENTIABLE, inputs=(2, 3))
        _register("_TestUseOutput", _use_output_gradient)
        _register("_TestUseOutputGradient", NOT_DIFFERENTIABLE, inputs=2)
        _register("_TestPair", _pair_gradient, inputs=2)
        _register("_TestPairGradient", NOT_DIFFERENTIABLE, outputs=2)
        _register("_TestAdd", _add_gradient, inputs=2)
        _register("_TestAlias", lambda o, g: ([], [g[0]]))
        _register("_TestGather", _gather_gradient, inputs=2, inplace=())
        _register("_TestSparse", _sparse_gradient, inputs=2, inplace=())
        _register("_TestSparseGradient", NOT_DIFFERENTIABLE, inputs=2, outputs=2, inplace=())
        _register("_TestTwoStep", _two_step_gradient)
        _register("_TestNoGrad", NO_GRADIENT)
        _register("_TestNotDiff", NOT_DIFFERENTIABLE)
        _register("_TestNoMaker", None)
        _register("_TestBranchy", _branchy_gradient)
        _register("_TestScaled", _scaled_gradient, args={"scale": 1.0, "mode": "a"})
        _register("_TestScaledGradient", NOT_DIFFERENTIABLE, args={"scale": 1.0}, gradient_of="_TestScaled")
        _register("_TestScaledNoCopy", _scaled_gradient, args={"mode": "a"}, copy_args_to_gradient=False)
        _register("_TestBadMaker", lambda o, g: ([], [g[0], g[0]]))  # two input gradients for one input
        yield



def op(type_, inputs, outputs, **args):
    """A forward op as a Net would record it (with a source), inputs/outputs as lists."""
    inputs = [inputs] if isinstance(inputs, str) else inputs
    outputs = [outputs] if isinstance(outputs, str) else outputs
    return OperatorDef(type_, list(inputs), list(outputs), args, source="model.py:7")


def summary(ops):
    """(type, inputs, outputs) per op: what Caffe2's tests compare."""
    return [(o.type, list(o.inputs), list(o.outputs)) for o in ops]


D, DG = "_TestDirect", "_TestDirectGradient"


# -- Caffe2 core_gradients_test cases ---------------------------------------------------------------

def test_direct_chain():
    ops = [op(D, "in", "hidden"), op(D, "hidden", "out")]
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"})
    assert summary(grad_ops) == [(DG, ["out_grad"], ["hidden_grad"]), (DG, ["hidden_grad"], ["in_grad"])]
    assert grad_map == {"out": "out_grad", "hidden": "hidden_grad", "in": "in_grad"}
    assert all(type(k) is BlobReference and type(v) is BlobReference for k, v in grad_map.items())


def test_list_seed_is_input_shaped_constant_fill_named_grad():
    ops = [op(D, "in", "hidden"), op(D, "hidden", "out")]
    grad_ops, grad_map = backward_pass(ops, ["out"])
    fill = grad_ops[0]
    assert summary(grad_ops) == [("ConstantFill", ["out"], ["out_grad"]), (DG, ["out_grad"], ["hidden_grad"]),
                                 (DG, ["hidden_grad"], ["in_grad"])]
    assert fill.args == {"value": 1.0} and fill.is_gradient_op
    assert grad_map["out"] == "out_grad"


def test_dict_seed_none_is_automatic_and_given_seed_is_used():
    ops = [op(D, "in", "out")]
    assert summary(backward_pass(ops, {"out": None})[0])[0] == ("ConstantFill", ["out"], ["out_grad"])
    grad_ops, grad_map = backward_pass(ops, {"out": "my_seed"})
    assert summary(grad_ops) == [(DG, ["my_seed"], ["in_grad"])]
    assert grad_map == {"out": "my_seed", "in": "in_grad"}


def test_does_not_generate_unnecessary_gradients():
    ops = [op(D, "in", "hidden"), op(D, "hidden", "out")]
    grad_ops, grad_map = backward_pass(ops, {"hidden": "hidden_grad"})
    assert summary(grad_ops) == [(DG, ["hidden_grad"], ["in_grad"])]
    assert "out" not in grad_map


def test_direct_in_place_chain():
    ops = [op(D, "in", "in"), op(D, "in", "out")]
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"})
    assert summary(grad_ops) == [(DG, ["out_grad"], ["in_grad"]), (DG, ["in_grad"], ["in_grad"])]
    assert grad_map["in"] == "in_grad"


def test_version_mismatch_raises():
    ops = [op(D, "x", "x"), op(D, "y", "x"), op(D, "x", "y")]
    with pytest.raises(GradientError, match=r"version 1.*Do two ops write 'x'"):
        backward_pass(ops, {"y": "y_grad"})


@pytest.mark.parametrize("writer", [D, "_TestAlias"])
def test_a_version_whose_readers_give_no_gradient_gets_none_not_a_later_versions(writer):
    """Caffe2 handed the writer of h's version 0 the gradient of version 1 (and Alias passed it on)."""
    ops = [op(writer, "a", "h"), op("_TestAlias", "h", "s"), op("StopGradient", "s", "s"), op(D, "b", "h"),
           op("_TestPair", ["h", "s"], "out")]
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"})
    assert summary(grad_ops) == [("_TestPairGradient", ["out_grad"], ["h_grad", "s_grad"]),
                                 (DG, ["h_grad"], ["b_grad"])]
    assert "a" not in grad_map


def test_use_input_and_use_output():
    grad_ops, _ = backward_pass([op("_TestUseInput", "in", "hidden"), op(D, "hidden", "out")], ["out"])
    assert summary(grad_ops)[2] == ("_TestUseInputGradient", ["in", "hidden_grad"], ["in_grad"])
    grad_ops, _ = backward_pass([op("_TestUseOutput", "in", "hidden"), op(D, "hidden", "out")], ["out"])
    assert summary(grad_ops)[2] == ("_TestUseOutputGradient", ["hidden", "hidden_grad"], ["in_grad"])


def test_use_input_overwritten_by_a_later_op_raises():
    ops = [op("_TestUseInput", "in", "out"), op(D, "in", "in")]
    with pytest.raises(GradientError) as err:
        backward_pass(ops, ["out"])
    message = str(err.value)
    for part in ("_TestUseInputGradient", "forward op #0 _TestUseInput", "forward op #1 _TestDirect",
                 "'in'", "model.py:7", "Version history of 'in'", "version 1 written by forward op #1"):
        assert part in message
    with pytest.raises(GradientError, match="overwrites it later"):
        backward_pass([op("_TestUseInput", "in", "out"), op(D, "out", "in")], ["out"])


def test_use_output_overwritten_by_a_later_op_raises():
    ops = [op("_TestUseOutput", "in", "hidden"), op(D, "hidden", "hidden"), op(D, "hidden", "out")]
    with pytest.raises(GradientError, match=r"reads the output 'hidden' at version 0.*#1 _TestDirect"):
        backward_pass(ops, ["out"])


def test_use_output_in_place_is_allowed():
    grad_ops, grad_map = backward_pass([op("_TestUseOutput", "in", "in")], ["in"])
    assert summary(grad_ops) == [("ConstantFill", ["in"], ["in_grad"]),
                                 ("_TestUseOutputGradient", ["in", "in_grad"], ["in_grad"])]
    assert grad_map == {"in": "in_grad"}


def test_use_input_in_place_raises_unlike_caffe2():
    """Caffe2 took the shared name for the output and let a gradient read the post-op value."""
    with pytest.raises(GradientError, match=r"writes 'x' in place.*may not run in place on 'x'"):
        backward_pass([op(D, "a", "x"), op("_TestUseInput", "x", "x")], ["x"])


def test_in_place_maker_whose_ops_depend_on_names_raises():
    with pytest.raises(GradientError, match="cannot tell whether"):
        backward_pass([op(D, "a", "x"), op("_TestBranchy", "x", "x")], ["x"])
    grad_ops, _ = backward_pass([op(D, "a", "x"), op("_TestBranchy", "x", "y")], ["y"])
    assert summary(grad_ops)[1] == ("_TestUseInputGradient", ["x", "y", "y_grad"], ["x_grad"])


# -- accumulation ------------------------------------------------------------------------------------

def test_multi_use_input_autosplit_and_sum():
    ops = [op(D, "in", "hidden1"), op(D, "in", "hidden2"), op("_TestPair", ["hidden1", "hidden2"], "out")]
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"})
    assert summary(grad_ops) == [
        ("_TestPairGradient", ["out_grad"], ["hidden1_grad", "hidden2_grad"]),
        (DG, ["hidden2_grad"], ["in_grad"]),
        (DG, ["hidden1_grad"], ["_in_grad_autosplit_0"]),
        ("Sum", ["in_grad", "_in_grad_autosplit_0"], ["in_grad"]),
    ]
    assert grad_ops[-1].is_gradient_op and grad_map["in"] == "in_grad"


def test_sum_lands_after_the_earliest_consumer_and_before_the_producer():
    ops = [op(D, "z", "x"), op(D, "x", "a"), op(D, "a", "b"), op(D, "x", "c"), op(D, "x", "d"),
           op("_TestPair", ["b", "c"], "e"), op("_TestPair", ["e", "d"], "out")]
    grad_ops, _ = backward_pass(ops, {"out": "out_grad"})
    assert summary(grad_ops) == [
        ("_TestPairGradient", ["out_grad"], ["e_grad", "d_grad"]),
        ("_TestPairGradient", ["e_grad"], ["b_grad", "c_grad"]),
        (DG, ["d_grad"], ["x_grad"]),
        (DG, ["c_grad"], ["_x_grad_autosplit_0"]),
        (DG, ["b_grad"], ["a_grad"]),
        (DG, ["a_grad"], ["_x_grad_autosplit_1"]),
        ("Sum", ["x_grad", "_x_grad_autosplit_0", "_x_grad_autosplit_1"], ["x_grad"]),
        (DG, ["x_grad"], ["z_grad"]),
    ]


def test_pass_through_accumulation():
    ops = [op(D, "x1", "x2"), op(D, "x2", "x3"), op("_TestAdd", ["x2", "x3"], "x4")]
    grad_ops, grad_map = backward_pass(ops, {"x4": "x4_grad"})
    assert summary(grad_ops) == [(DG, ["x4_grad"], ["x2_grad"]), ("Sum", ["x2_grad", "x4_grad"], ["x2_grad"]),
                                 (DG, ["x2_grad"], ["x1_grad"])]
    assert grad_map["x3"] == "x4_grad" and grad_map["x2"] == "x2_grad"


def test_pass_through_of_the_same_blob_twice_is_summed():
    grad_ops, grad_map = backward_pass([op(D, "a", "x"), op("_TestAdd", ["x", "x"], "y")], {"y": "y_grad"})
    assert summary(grad_ops) == [("Sum", ["y_grad", "y_grad"], ["x_grad"]), (DG, ["x_grad"], ["a_grad"])]


def test_in_place_residual_sum_renames_every_gradient_op_output():
    """Sum(x, r) -> x passes x_grad through to x; Caffe2 raised here, graphpar accumulates."""
    ops = [op(D, "x0", "x"), op(D, "x", "r"), op("_TestAdd", ["x", "r"], "x")]
    grad_ops, grad_map = backward_pass(ops, ["x"])
    assert summary(grad_ops) == [
        ("ConstantFill", ["x"], ["x_grad"]),
        (DG, ["x_grad"], ["_x_grad_autosplit_0"]),
        ("Sum", ["x_grad", "_x_grad_autosplit_0"], ["x_grad"]),
        (DG, ["x_grad"], ["x0_grad"]),
    ]
    assert grad_map["x0"] == "x0_grad" and grad_map["r"] == "x_grad"


def test_a_write_never_destroys_a_gradient_another_blob_still_needs():
    """x_grad also holds h's gradient (the in-place Add passed it through) until h's writer is reached:
    Caffe2 let the gradient op of the in-place Direct overwrite it."""
    ops = [op(D, "a", "h"), op(D, "x", "x"), op("_TestAdd", ["x", "h"], "x")]
    grad_ops, grad_map = backward_pass(ops, ["x"])
    assert summary(grad_ops) == [("ConstantFill", ["x"], ["x_grad"]), (DG, ["x_grad"], ["_x_grad_autosplit_0"]),
                                 (DG, ["x_grad"], ["a_grad"])]
    assert grad_map == {"x": "_x_grad_autosplit_0", "h": "x_grad", "a": "a_grad"}


def test_an_input_read_twice_gets_both_partial_gradients():
    grad_ops, _ = backward_pass([op("Mul", ["x", "x"], "y")], {"y": "dy"})
    assert summary(grad_ops) == [("MulGradient", ["dy", "x", "x"], ["x_grad", "_x_grad_autosplit_0"]),
                                 ("Sum", ["x_grad", "_x_grad_autosplit_0"], ["x_grad"])]


def test_versions_of_one_name_accumulate_separately():
    ops = [op(D, "a", "x"), op(D, "x", "b"), op(D, "x", "c"), op(D, "x", "x"), op(D, "x", "d"),
           op(D, "x", "e"), op("_TestPair", ["b", "c"], "bc"), op("_TestPair", ["d", "e"], "de"),
           op("_TestPair", ["bc", "de"], "out")]
    grad_ops, _ = backward_pass(ops, {"out": "out_grad"})
    assert summary(grad_ops)[3:] == [
        (DG, ["e_grad"], ["x_grad"]), (DG, ["d_grad"], ["_x_grad_autosplit_0"]),
        ("Sum", ["x_grad", "_x_grad_autosplit_0"], ["x_grad"]),  # version 1: read by d and e
        (DG, ["x_grad"], ["x_grad"]),  # the in-place op: gradient of version 0
        (DG, ["c_grad"], ["_x_grad_autosplit_1"]), (DG, ["b_grad"], ["_x_grad_autosplit_2"]),
        ("Sum", ["x_grad", "_x_grad_autosplit_1", "_x_grad_autosplit_2"], ["x_grad"]),  # k never restarts
        (DG, ["x_grad"], ["a_grad"]),
    ]


def test_renaming_follows_a_gradient_chain_inside_one_maker():
    ops = [op("_TestTwoStep", "x", "a"), op(D, "x", "b"), op("_TestPair", ["a", "b"], "out")]
    grad_ops, _ = backward_pass(ops, {"out": "out_grad"})
    assert summary(grad_ops)[2:] == [
        (DG, ["a_grad"], ["_x_grad_autosplit_0"]), (DG, ["_x_grad_autosplit_0"], ["_x_grad_autosplit_0"]),
        ("Sum", ["x_grad", "_x_grad_autosplit_0"], ["x_grad"])]


def test_accumulation_order_follows_input_order():
    ops = [op(D, "p", "q"), op("_TestPair", ["q", "p"], "s"), op("_TestPair", ["s", "q"], "t"),
           op("_TestPair", ["t", "p"], "out")]
    sums = [o for o in backward_pass(ops, {"out": "out_grad"})[0] if o.type == "Sum"]
    assert [o.outputs for o in sums] == [["q_grad"], ["p_grad"]]


def test_partial_gradients_on_different_devices_raise():
    a, b = op(D, "x", "a"), op(D, "x", "b")
    a.device_option, b.device_option = DeviceOption(CUDA, 0), DeviceOption(CUDA, 1)
    with pytest.raises(GradientError, match="different devices"):
        backward_pass([a, b, op("_TestPair", ["a", "b"], "out")], ["out"])


def test_seed_given_for_a_blob_that_is_also_consumed_is_accumulated():
    """Caffe2 dropped the given seed when y had another consumer; graphpar sums it in."""
    ops = [op(D, "in", "y"), op(D, "y", "z")]
    grad_ops, grad_map = backward_pass(ops, {"y": "y_seed", "z": None})
    assert summary(grad_ops) == [("ConstantFill", ["z"], ["z_grad"]), (DG, ["z_grad"], ["y_grad"]),
                                 ("Sum", ["y_grad", "y_seed"], ["y_grad"]), (DG, ["y_grad"], ["in_grad"])]
    grad_ops, _ = backward_pass(ops, ["y", "z"])
    assert summary(grad_ops)[2:4] == [(DG, ["z_grad"], ["_y_grad_autosplit_0"]),
                                      ("Sum", ["y_grad", "_y_grad_autosplit_0"], ["y_grad"])]
    grad_ops, grad_map = backward_pass(ops, {"y": "y_grad", "z": None})  # a fed seed is never overwritten
    assert summary(grad_ops)[1:4] == [(DG, ["z_grad"], ["_y_grad_autosplit_0"]),
                                      ("Sum", ["_y_grad_autosplit_0", "y_grad"], ["_y_grad_autosplit_0"]),
                                      (DG, ["_y_grad_autosplit_0"], ["in_grad"])]
    assert grad_map["y"] == "_y_grad_autosplit_0"


# -- sparse ------------------------------------------------------------------------------------------

def test_sparse_pass_through_gradients_are_concatenated():
    ops = [op("_TestGather", ["w", "i1"], "g1"), op("_TestGather", ["w", "i2"], "g2"),
           op("_TestPair", ["g1", "g2"], "out")]
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"})
    assert summary(grad_ops)[1:] == [
        ("Concat", ["i2", "i1"], ["w_grad_indices_concat", "w_grad_indices_concat_split"]),
        ("Concat", ["g2_grad", "g1_grad"], ["w_grad_values_concat", "w_grad_values_concat_split"])]
    assert grad_ops[1].args == {"axis": 0}
    assert grad_map["w"] == GradientSlice("w_grad_indices_concat", "w_grad_values_concat")
    _, single = backward_pass(ops[:1], {"g1": "g1_grad"})
    assert single == {"g1": "g1_grad", "w": GradientSlice("i1", "g1_grad")}


def test_sparse_gradient_op_outputs_are_all_renamed():
    ops = [op("_TestSparse", ["w", "i1"], "g1"), op("_TestGather", ["w", "i2"], "g2"),
           op("_TestPair", ["g1", "g2"], "out")]
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"})
    assert summary(grad_ops)[1:] == [
        ("_TestSparseGradient", ["i1", "g1_grad"], ["_w_grad_indices_autosplit_0", "_w_grad_values_autosplit_0"]),
        ("Concat", ["i2", "_w_grad_indices_autosplit_0"], ["w_grad_indices_concat", "w_grad_indices_concat_split"]),
        ("Concat", ["g2_grad", "_w_grad_values_autosplit_0"], ["w_grad_values_concat", "w_grad_values_concat_split"]),
    ]


def test_mixing_dense_and_sparse_gradients_raises():
    ops = [op(D, "w", "g1"), op("_TestGather", ["w", "i"], "g2"), op("_TestPair", ["g1", "g2"], "out")]
    with pytest.raises(GradientError, match="both dense and sparse"):
        backward_pass(ops, ["out"])


# -- stopping and refusing gradients -----------------------------------------------------------------

def test_no_gradient_op_stops_the_flow():
    grad_ops, grad_map = backward_pass([op("_TestNoGrad", "in", "h"), op(D, "h", "out")], ["out"])
    assert summary(grad_ops)[1:] == [(DG, ["out_grad"], ["h_grad"])]
    assert "in" not in grad_map


@pytest.mark.parametrize(("type_", "why"), [("_TestNotDiff", "must not be differentiated"),
                                            ("_TestNoMaker", "has no gradient maker")])
def test_non_differentiable_ops_raise_only_when_reached(type_, why):
    ops = [op(D, "in", "h"), op(type_, "h", "side"), op(D, "h", "out")]
    assert summary(backward_pass(ops, ["out"])[0])[-1] == (DG, ["h_grad"], ["in_grad"])
    with pytest.raises(GradientError) as err:
        backward_pass(ops, ["side"])
    for part in (f"forward op #1 {type_}", why, "model.py:7", "'side'"):
        assert part in str(err.value)


def test_stop_gradient_not_in_place():
    ops = [op(D, "in", "hidden"), op("StopGradient", "hidden", "hidden2"), op(D, "hidden2", "out")]
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"})
    assert summary(grad_ops) == [(DG, ["out_grad"], ["hidden2_grad"])]
    assert set(grad_map) == {"out", "hidden2"}


def test_stop_gradient_in_place():
    ops = [op(D, "in", "hidden"), op("StopGradient", "hidden", "hidden"), op(D, "hidden", "out")]
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"})
    assert summary(grad_ops) == [(DG, ["out_grad"], ["hidden_grad"])]
    assert "in" not in grad_map and "hidden" not in grad_map


def test_stop_gradient_with_multi_use_operators():
    ops = [op(D, "in", "hidden"), op(D, "hidden", "hidden2"), op("StopGradient", "hidden", "hidden3"),
           op("_TestPair", ["hidden2", "hidden3"], "out")]
    grad_ops, _ = backward_pass(ops, {"out": "out_grad"})
    assert summary(grad_ops) == [("_TestPairGradient", ["out_grad"], ["hidden2_grad", "hidden3_grad"]),
                                 (DG, ["hidden2_grad"], ["hidden_grad"]), (DG, ["hidden_grad"], ["in_grad"])]


def test_stop_gradient_orphan_raises():
    ops = [op(D, "in", "hidden"), op("StopGradient", "hidden", "auto"), op(D, "hidden", "out")]
    with pytest.raises(GradientError, match="'auto' is never read"):
        backward_pass(ops, ["out"])


# -- what gradient ops carry -------------------------------------------------------------------------

def test_gradient_ops_copy_device_engine_and_args():
    fwd = op("_TestScaled", "x", "y", scale=2.0, mode="b")
    fwd.device_option, fwd.engine = DeviceOption(CUDA, 1), "CUDNN"
    fill, grad = backward_pass([fwd], ["y"])[0]
    assert grad.device_option == DeviceOption(CUDA, 1) and grad.engine == "CUDNN"
    assert grad.args == {"scale": 3.0, "mode": "b"}  # the maker's own args win
    assert grad.is_gradient_op and grad.source == "model.py:7 (gradient)"
    assert fill.device_option == DeviceOption(CUDA, 1)  # the seed lives where y does
    nocopy = op("_TestScaledNoCopy", "x", "y", mode="b")
    assert backward_pass([nocopy], {"y": "g"})[0][0].args == {"scale": 3.0}


def test_sum_ops_take_the_generators_device_and_the_forward_ops_are_untouched():
    ops = [op(D, "in", "h1"), op(D, "in", "h2"), op("_TestPair", ["h1", "h2"], "out")]
    for o in ops:
        o.device_option = DeviceOption(CPU, 2)
    before = summary(ops)
    grad_ops, _ = backward_pass(ops, ["out"])
    assert grad_ops[-1].type == "Sum" and grad_ops[-1].device_option == DeviceOption(CPU, 2)
    assert summary(ops) == before and not any(o.is_gradient_op for o in ops)


# -- unwanted gradients (no_gradient_to) -------------------------------------------------------------

def test_gradient_ops_serving_only_unwanted_blobs_are_dropped():
    ops = [op(D, "in", "hidden"), op(D, "hidden", "out")]
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"}, no_gradient_to=["in"])
    assert summary(grad_ops) == [(DG, ["out_grad"], ["hidden_grad"])]
    assert grad_map == {"out": "out_grad", "hidden": "hidden_grad"}


def test_gradients_of_intermediates_are_kept():
    """Caffe2's multi-device BN test reads `tanh_grad`, the gradient of an op's output."""
    ops = [op("Tanh", "data", "tanh"), op(D, "tanh", "out")]
    grad_ops, grad_map = backward_pass(ops, ["out"], no_gradient_to=["data"])
    assert summary(grad_ops) == [("ConstantFill", ["out"], ["out_grad"]), (DG, ["out_grad"], ["tanh_grad"])]
    assert "data" not in grad_map and grad_map["tanh"] == "tanh_grad"


def test_a_gradient_shared_with_a_wanted_blob_is_kept():
    ops = [op("_TestAlias", "x", "y"), op(D, "y", "out")]  # x's gradient IS y's (pass-through)
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"}, no_gradient_to=["x"])
    assert summary(grad_ops) == [(DG, ["out_grad"], ["y_grad"])]
    assert grad_map == {"out": "out_grad", "y": "y_grad"}


def test_an_op_with_a_wanted_output_keeps_its_other_outputs():
    ops = [op("_TestPair", ["x", "w"], "out")]  # no schema mechanism drops x_grad here
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"}, no_gradient_to=["x"])
    assert summary(grad_ops) == [("_TestPairGradient", ["out_grad"], ["x_grad", "w_grad"])]
    assert grad_map == {"out": "out_grad", "w": "w_grad"}


def test_partial_gradients_and_their_sum_into_an_unwanted_blob_are_dropped():
    ops = [op(D, "x", "a"), op(D, "x", "b"), op("_TestAdd", ["a", "b"], "out")]
    full, _ = backward_pass(ops, {"out": "out_grad"})
    assert [o.type for o in full] == [DG, DG, "Sum"]
    assert backward_pass(ops, {"out": "out_grad"}, no_gradient_to=["x"]) == ([], {"out": "out_grad",
                                                                                 "a": "out_grad",
                                                                                 "b": "out_grad"})


def test_a_gradient_read_after_being_overwritten_keeps_both_writers():
    ops = [op(D, "x", "h"), op(D, "h", "h"), op(D, "h", "out")]  # h_grad written twice, in place
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"}, no_gradient_to=["x"])
    assert summary(grad_ops) == [(DG, ["out_grad"], ["h_grad"]), (DG, ["h_grad"], ["h_grad"])]
    assert grad_map == {"out": "out_grad", "h": "h_grad"}


def test_an_op_without_gradient_on_data_and_constants_alone_stops_the_gradient():
    """LT has no gradient: reading the data and a constant only, it needs none; reading a param, it raises."""
    ops = [op("ConstantFill", [], "limit", shape=[1], value=0.0), op("LT", ["data", "limit"], "mask"),
           op("Cast", "mask", "fmask", to="float"), op("Mul", ["fmask", "data"], "x"), op(D, "x", "out")]
    grad_ops, grad_map = backward_pass(ops, {"out": "out_grad"}, no_gradient_to=["data"])
    assert [o.type for o in grad_ops] == [DG, "MulGradient", "CastGradient"]  # the intermediates' gradients, as ever
    assert grad_map["fmask"] == "fmask_grad" and "data" not in grad_map and "limit" not in grad_map
    ops[1] = op("LT", ["data", "w"], "mask")  # a param reaches the op: its missing gradient is an error
    with pytest.raises(GradientError, match="LT.*must not be differentiated"):
        backward_pass(ops, {"out": "out_grad"}, no_gradient_to=["data"])
    with pytest.raises(GradientError, match="LT.*must not be differentiated"):
        backward_pass(ops[:1] + [op("LT", ["data", "limit"], "mask")] + ops[2:], {"out": "out_grad"})


def test_dead_input_gradient_of_fc_and_conv_is_dropped_by_no_gradient_to_input():
    ops = [op("Conv", ["x", "k"], "c", kernel=3), op("FC", ["c", "w", "b"], "h"), op("Relu", "h", "h"),
           op("FC", ["h", "w2", "b2"], "y"), op("FC", ["d", "w3", "b3"], "z")]
    full, _ = backward_pass(ops, {"y": "dy", "z": "dz"})
    grad_ops, grad_map = backward_pass(ops, {"y": "dy", "z": "dz"}, no_gradient_to=["x", "d"])
    assert summary(grad_ops) == [
        ("FCGradient", ["d", "w3", "dz"], ["w3_grad", "b3_grad"]),
        ("FCGradient", ["h", "w2", "dy"], ["w2_grad", "b2_grad", "h_grad"]),
        ("ReluGradient", ["h", "h_grad"], ["h_grad"]),
        ("FCGradient", ["c", "w", "h_grad"], ["w_grad", "b_grad", "c_grad"]),
        ("ConvGradient", ["x", "k", "c_grad"], ["k_grad"]),
    ]
    assert [o.args.get("no_gradient_to_input", False) for o in grad_ops] == [True, False, False, False, True]
    assert summary(full)[0] == ("FCGradient", ["d", "w3", "dz"], ["w3_grad", "b3_grad", "d_grad"])
    assert "x" not in grad_map and "d" not in grad_map and grad_map["c"] == "c_grad"


def test_no_unwanted_blobs_changes_nothing():
    ops = [op(D, "x", "a"), op(D, "x", "b"), op("_TestAdd", ["a", "b"], "out")]
    assert summary(backward_pass(ops, ["out"], no_gradient_to=[])[0]) == summary(backward_pass(ops, ["out"])[0])


@pytest.mark.parametrize("bad", ["x", [1], None])
def test_no_gradient_to_must_be_a_list_of_blob_names(bad):
    with pytest.raises(TypeError, match="no_gradient_to"):
        backward_pass([op(D, "x", "out")], ["out"], no_gradient_to=bad)


# -- misuse --------------------------------------------------------------------------------------------

def test_misuse_raises_clear_errors():
    ops = [op(D, "in", "out")]
    with pytest.raises(TypeError, match="list of blobs or a dict"):
        backward_pass(ops, "out")
    with pytest.raises(GradientError, match="no forward op writes it"):
        backward_pass(ops, ["gpu_0/out"])
    with pytest.raises(TypeError, match="seed gradient of 'out'"):
        backward_pass(ops, {"out": 3})


def test_maker_breaking_its_contract_raises():
    with pytest.raises(GradientError, match="returned 2 input gradients for 1 inputs"):
        backward_pass([op("_TestBadMaker", "x", "y")], ["y"])


# -- numerical checks against torch.autograd ---------------------------------------------------------

def _add_gradients(net, ys, no_gradient_to):
    """Append the gradient ops of `net` for `ys`, without gradients to `no_gradient_to`."""
    grad_ops, grad_map = backward_pass(net.Proto().ops, ys, no_gradient_to=no_gradient_to)
    net.AppendNet(NetDef("grads", ops=grad_ops))
    return grad_map


def _run_and_compare(net, ys, feeds, reference, blobs, no_gradient_to=None):
    """Add gradient ops to `net`, run it, and compare the gradients of `blobs` with torch.autograd."""
    if no_gradient_to is None:
        grad_map = net.AddGradientOperators(ys)
    else:
        grad_map = _add_gradients(net, ys, no_gradient_to)
        assert not set(no_gradient_to) & set(grad_map)
    for name, value in feeds.items():
        workspace.FeedBlob(name, value)
    workspace.RunNetOnce(net)
    tensors = {n: torch.tensor(v, requires_grad=True) for n, v in feeds.items()}
    expected = torch.autograd.grad(reference(tensors), [tensors[b] for b in blobs])
    for blob, want in zip(blobs, expected):
        got = workspace.FetchBlob(grad_map[blob])
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-6, err_msg=blob)
    return grad_map


def _rand(*shape, seed=0):
    return np.random.default_rng(seed + len(shape)).standard_normal(shape)


def test_mlp_with_shared_weight_and_in_place_relu_matches_autograd():
    net = Net("mlp")
    h = net.FC(["x", "w", "b"], "h")
    net.Relu(h, h)
    h2 = net.FC([h, "w", "b"], "h2")  # w and b are used twice: accumulated
    net.Tanh(h2, "t")
    net.SumSqrElements("t", "loss")
    feeds = {"x": _rand(4, 5), "w": _rand(5, 5, seed=1), "b": _rand(5, seed=2)}

    def reference(t):
        h = torch.relu(t["x"] @ t["w"].T + t["b"])
        return torch.tanh(h @ t["w"].T + t["b"]).pow(2).sum()

    grad_map = _run_and_compare(net, ["loss"], feeds, reference, ["x", "w", "b"])
    assert any(o.type == "Sum" for o in net.Proto().ops) and grad_map["w"] == "w_grad"


def test_residual_in_place_sum_matches_autograd():
    net = Net("residual")
    net.FC(["x", "w", "b"], "y")
    net.Relu("y", "r")
    net.Sum(["y", "r"], "y")  # in place into input 0
    net.FC(["y", "w2", "b2"], "z")
    net.SumSqrElements("z", "loss")
    feeds = {"x": _rand(3, 4), "w": _rand(4, 4, seed=3), "b": _rand(4, seed=4),
             "w2": _rand(2, 4, seed=5), "b2": _rand(2, seed=6)}

    def reference(t):
        y = t["x"] @ t["w"].T + t["b"]
        y = y + torch.relu(y)
        return (y @ t["w2"].T + t["b2"]).pow(2).sum()

    _run_and_compare(net, ["loss"], feeds, reference, ["x", "w", "b", "w2", "b2"])


def test_softmax_loss_with_given_seed_and_stop_gradient_matches_autograd():
    net = Net("cls")
    net.StopGradient("x", "x")
    net.FC(["x", "w", "b"], "logits")
    _, loss = net.SoftmaxWithLoss(["logits", "label"], ["softmax", "loss"])
    net.Scale(loss, "scaled", scale=0.5)
    net.ConstantFill("scaled", "scaled_grad", value=1.0)  # the seed, as Parallelize builds it
    label = np.array([0, 2, 1], dtype=np.int32)
    feeds = {"x": _rand(3, 4), "w": _rand(3, 4, seed=7), "b": _rand(3, seed=8)}
    workspace.FeedBlob("label", label)

    def reference(t):
        logits = t["x"] @ t["w"].T + t["b"]
        return 0.5 * torch.nn.functional.cross_entropy(logits, torch.tensor(label, dtype=torch.long))

    grad_map = _run_and_compare(net, {"scaled": "scaled_grad"}, feeds, reference, ["w", "b"])
    assert "x" not in grad_map and "label" not in grad_map


def test_real_relu_in_place_gives_in_place_relu_gradient():
    grad_ops, grad_map = backward_pass([op("FC", ["x", "w", "b"], "h"), op("Relu", "h", "h")], {"h": "dh"})
    assert summary(grad_ops) == [("ReluGradient", ["h", "dh"], ["h_grad"]),
                                 ("FCGradient", ["x", "w", "h_grad"], ["w_grad", "b_grad", "x_grad"])]


@pytest.mark.parametrize("fwd", [
    op("Mul", ["a", "b"], "a"),
    op("SpatialBN", ["a", "s", "bias", "rm", "rv"], ["a", "rm", "rv", "sm", "siv"]),
])
def test_real_ops_whose_gradient_reads_the_input_may_not_run_in_place(fwd):
    with pytest.raises(GradientError, match=f"{fwd.type} may not run in place on 'a'"):
        backward_pass([op("Relu", "x", "a"), fwd], ["a"])


def test_real_spatial_bn_with_in_place_running_stats_is_fine():
    fwd = op("SpatialBN", ["a", "s", "bias", "rm", "rv"], ["y", "rm", "rv", "sm", "siv"])
    grad_ops, grad_map = backward_pass([fwd], ["y"])
    assert summary(grad_ops)[1] == ("SpatialBNGradient", ["a", "s", "y_grad", "sm", "siv"],
                                    ["a_grad", "s_grad", "bias_grad"])
    assert "rm" not in grad_map and "rv" not in grad_map


# Random nets of real element-wise ops with shared blobs, pass-through ops (Sum, Alias), in-place
# writes, blob names written again, and StopGradient, checked against torch.autograd. Per op: the torch
# function, its arity (Sum: 1 to 3) and what its gradient reads. The net inputs x0..x2 are never
# written, so their gradients are well defined.
_RANDOM_OPS = {
    "Relu": (torch.relu, 1, "output"), "Tanh": (torch.tanh, 1, "output"),
    "Sigmoid": (torch.sigmoid, 1, "output"), "Scale": (lambda x: 0.7 * x, 1, "nothing"),
    "Negative": (torch.neg, 1, "nothing"), "Sum": (lambda *xs: sum(xs), 3, "nothing"),
    "Alias": (lambda x: x, 1, "nothing"), "StopGradient": (torch.Tensor.detach, 1, "nothing"),
    "Mul": (torch.mul, 2, "input"), "Sqr": (lambda x: x * x, 1, "input"),
}


def _random_output(rng, type_, inputs, k, live, needed, unread):
    """In place, over an older blob, or new; never destroying a value a recorded gradient needs."""
    draw, reads = rng.random(), _RANDOM_OPS[type_][2]
    if (draw < 0.3 and reads != "input" and type_ != "Alias" and inputs[0][0] == "h"
            and inputs[0] not in needed and inputs[0] not in inputs[1:]):
        return inputs[0]
    reusable = [b for b in live if b[0] == "h" and b not in needed | unread | set(inputs)]
    if draw < 0.45 and type_ != "StopGradient" and reusable:
        return str(rng.choice(reusable))
    return f"h{k}"


def _random_net(rng):
    """Ops (type, inputs, output) ending in a Sum of every value nothing else reads."""
    live, needed, ops, unread = ["x0", "x1", "x2"], set(), [], set()
    for k in range(int(rng.integers(4, 14))):
        type_ = str(rng.choice(list(_RANDOM_OPS)))
        arity = int(rng.integers(1, 4)) if type_ == "Sum" else _RANDOM_OPS[type_][1]
        inputs = [str(rng.choice(live[-4:] if rng.random() < 0.7 else live)) for _ in range(arity)]
        out = _random_output(rng, type_, inputs, k, live, needed, unread)
        if type_ == "StopGradient" and out != inputs[0]:
            continue  # a StopGradient whose output is a new blob must be read: keep it simple
        reads = _RANDOM_OPS[type_][2]
        needed = ((needed | (set(inputs) if reads == "input" else set())) - {out}) | (
            {out} if reads == "output" else set())
        unread = (unread - set(inputs)) | {out}
        live = [b for b in live if b != out] + [out]
        ops.append((type_, inputs, out))
    return [*ops, ("Sum", sorted(unread), "total")]


@pytest.mark.parametrize("seed", range(80))
def test_random_nets_match_autograd(seed):
    rng = np.random.default_rng(seed)
    ops = _random_net(rng)
    net = Net("random")
    for type_, inputs, out in ops:
        getattr(net, type_)(inputs, out, **({"scale": 0.7} if type_ == "Scale" else {}))
    net.SumSqrElements("total", "loss")
    grad_map = net.AddGradientOperators(["loss"])
    feeds = {f"x{i}": rng.standard_normal((3, 4)) for i in range(3)}
    for name, value in feeds.items():
        workspace.FeedBlob(name, value)
    workspace.RunNetOnce(net)

    env = {n: torch.tensor(v, requires_grad=True) for n, v in feeds.items()}
    inputs = list(env.values())
    for type_, op_inputs, out in ops:
        env[out] = _RANDOM_OPS[type_][0](*[env[b] for b in op_inputs])
    loss = env["total"].pow(2).sum()
    expected = (torch.autograd.grad(loss, inputs, allow_unused=True) if loss.requires_grad
                else [None] * len(inputs))  # every path was stopped
    for name, want in zip(feeds, expected):
        want = np.zeros((3, 4)) if want is None else want.numpy()
        got = workspace.FetchBlob(grad_map[name]) if name in grad_map else np.zeros((3, 4))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=f"{name} in {ops}")


def _is_subsequence(part, whole):
    rest = iter(whole)
    return all(any(item == other for other in rest) for item in part)


@pytest.mark.parametrize("seed", range(40))
def test_random_nets_without_unwanted_gradients_match_autograd(seed):
    """Unwanted: some of the inputs and intermediates; the other inputs' gradients must not change."""
    rng = np.random.default_rng(1000 + seed)
    ops = _random_net(rng)
    net = Net("random_unwanted")
    for type_, inputs, out in ops:
        getattr(net, type_)(inputs, out, **({"scale": 0.7} if type_ == "Scale" else {}))
    net.SumSqrElements("total", "loss")
    blobs = sorted({b for _, inputs, out in ops for b in [*inputs, out]})
    unwanted = [b for b in blobs if rng.random() < 0.4] or ["x0"]
    full, _ = backward_pass(net.Proto().ops, ["loss"])
    grad_ops, grad_map = backward_pass(net.Proto().ops, ["loss"], no_gradient_to=unwanted)
    assert _is_subsequence(summary(grad_ops), summary(full)) and not set(unwanted) & set(grad_map)
    net.AppendNet(NetDef("grads", ops=grad_ops))
    feeds = {f"x{i}": rng.standard_normal((3, 4)) for i in range(3)}
    for name, value in feeds.items():
        workspace.FeedBlob(name, value)
    workspace.RunNetOnce(net)
    env = {n: torch.tensor(v, requires_grad=True) for n, v in feeds.items()}
    inputs = list(env.values())
    for type_, op_inputs, out in ops:
        env[out] = _RANDOM_OPS[type_][0](*[env[b] for b in op_inputs])
    loss = env["total"].pow(2).sum()
    expected = (torch.autograd.grad(loss, inputs, allow_unused=True) if loss.requires_grad
                else [None] * len(inputs))
    for name, want in zip(feeds, expected):
        if name in unwanted:
            continue
        want = np.zeros((3, 4)) if want is None else want.numpy()
        got = workspace.FetchBlob(grad_map[name]) if name in grad_map else np.zeros((3, 4))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=f"{name} in {ops}, {unwanted}")


def test_small_cnn_with_batch_norm_matches_autograd():
    net = Net("cnn")
    net.Conv(["x", "k", "kb"], "c", kernel=3, pad=1)
    net.SpatialBN(["c", "s", "sb", "rm", "rv"], ["bn", "rm", "rv", "sm", "siv"], epsilon=1e-5)
    net.Relu("bn", "bn")
    net.MaxPool("bn", "p", kernel=2, stride=2)
    net.AveragePool("p", "g", global_pooling=True)
    net.FC(["g", "w", "b"], "logits")
    net.SoftmaxWithLoss(["logits", "label"], ["softmax", "loss"])
    net.Accuracy(["softmax", "label"], "accuracy")  # not differentiable, and no gradient reaches it
    label = np.array([1, 0, 2, 1], dtype=np.int32)
    workspace.FeedBlob("label", label)
    workspace.FeedBlob("rm", np.zeros(3))
    workspace.FeedBlob("rv", np.ones(3))
    feeds = {"x": _rand(4, 2, 6, 6), "k": _rand(3, 2, 3, 3, seed=1), "kb": _rand(3, seed=2),
             "s": _rand(3, seed=3), "sb": _rand(3, seed=4), "w": _rand(3, 3, seed=5), "b": _rand(3, seed=6)}

    def reference(t):
        c = torch.nn.functional.conv2d(t["x"], t["k"], t["kb"], padding=1)
        bn = torch.relu(torch.nn.functional.batch_norm(c, None, None, t["s"], t["sb"], True, 0.0, 1e-5))
        g = torch.nn.functional.max_pool2d(bn, 2, 2).mean(dim=(2, 3))
        return torch.nn.functional.cross_entropy(g @ t["w"].T + t["b"], torch.tensor(label, dtype=torch.long))

    grad_map = _run_and_compare(net, ["loss"], feeds, reference, list(feeds))
    assert "rm" not in grad_map and "rv" not in grad_map and "accuracy" not in grad_map


@pytest.mark.parametrize("bias", [True, False])
def test_cnn_without_input_gradients_matches_autograd(bias):
    net = Net("cnn_params_only")
    net.Conv(["x", "k", "kb"] if bias else ["x", "k"], "c", kernel=3, pad=1)
    net.Relu("c", "c")
    net.MaxPool("c", ["p", "p_index"], kernel=2, stride=2)
    net.FC(["p", "w", "b"], "logits")
    net.SoftmaxWithLoss(["logits", "label"], ["softmax", "loss"])
    label = np.array([1, 0, 2, 1], dtype=np.int32)
    workspace.FeedBlob("label", label)
    feeds = {"x": _rand(4, 2, 6, 6), "k": _rand(3, 2, 3, 3, seed=1), "kb": _rand(3, seed=2),
             "w": _rand(3, 27, seed=5), "b": _rand(3, seed=6)}
    feeds = feeds if bias else {n: v for n, v in feeds.items() if n != "kb"}

    def reference(t):
        c = torch.relu(torch.nn.functional.conv2d(t["x"], t["k"], t.get("kb"), padding=1))
        p = torch.nn.functional.max_pool2d(c, 2, 2).flatten(1)
        return torch.nn.functional.cross_entropy(p @ t["w"].T + t["b"], torch.tensor(label, dtype=torch.long))

    params = [n for n in feeds if n != "x"]
    _run_and_compare(net, ["loss"], feeds, reference, params, no_gradient_to=["x", "label"])
    grads = [(o.type, o.inputs, o.outputs) for o in net.Proto().ops if o.is_gradient_op]
    assert ("MaxPoolWithIndexGradient", ["c", "p_grad", "p_index"], ["c_grad"]) in grads
    assert grads[-1] == ("ConvGradient", ["x", "k", "c_grad"], ["k_grad", "kb_grad"] if bias else ["k_grad"])
    assert not workspace.HasBlob("x_grad")
