"""Caffe2's control flow: the comparison ops against NumPy, If / While with nets as op arguments, and
brew.cond / brew.loop as Caffe2's brew_test uses them (against the same logic in plain Python)."""

from __future__ import annotations

import numpy as np
import pytest

from graphpar import brew, core, workspace
from graphpar.errors import OperatorError
from graphpar.model_helper import ModelHelper

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("op, fn", [("LT", np.less), ("LE", np.less_equal), ("GT", np.greater),
                                    ("GE", np.greater_equal), ("EQ", np.equal), ("NE", np.not_equal)])
def test_comparisons_match_numpy(op: str, fn) -> None:  # noqa: ANN001
    a = RNG.integers(0, 3, (2, 3, 4)).astype(np.float32)
    b = RNG.integers(0, 3, (2, 3, 4)).astype(np.float32)
    row = RNG.integers(0, 3, (3,)).astype(np.float32)
    workspace.ResetWorkspace()
    for name, value in (("a", a), ("b", b), ("row", row)):
        workspace.FeedBlob(name, value)
    net = core.Net("cmp")
    getattr(net, op)(["a", "b"], "same")
    getattr(net, op)(["a", "row"], "legacy", broadcast=1, axis=1)  # Caffe2's broadcast: row aligns at dim 1
    workspace.RunNetOnce(net)
    np.testing.assert_array_equal(workspace.FetchBlob("same"), fn(a, b))
    np.testing.assert_array_equal(workspace.FetchBlob("legacy"), fn(a, row.reshape(1, 3, 1)))
    assert workspace.FetchBlob("same").dtype == np.bool_


def _cond_models(else_branch: bool) -> ModelHelper:
    then_model = ModelHelper(name="then_model")
    then_model.net.Copy("then_value", "output_blob")
    else_model = None
    if else_branch:
        else_model = ModelHelper(name="else_model")
        else_model.net.Copy("else_value", "output_blob")
    model = ModelHelper(name="cond_model")
    brew.cond(model, "cond", ["then_value", "else_value", "output_blob"], then_model, else_model)
    return model


@pytest.mark.parametrize("flag", [True, False])
def test_brew_cond_runs_the_branch_the_condition_picks(flag: bool) -> None:
    workspace.ResetWorkspace()
    workspace.FeedBlob("cond", np.array(flag))
    workspace.FeedBlob("then_value", np.array(1))
    workspace.FeedBlob("else_value", np.array(2))
    model = _cond_models(else_branch=True)
    (op,) = model.net.Proto().op
    assert (op.type, op.input, op.output) == ("If", ["cond", "then_value", "else_value"], ["output_blob"])
    workspace.RunNetOnce(model.net)
    assert workspace.FetchBlob("output_blob") == (1 if flag else 2)


def test_brew_cond_without_else_keeps_the_outputs_when_false() -> None:
    workspace.ResetWorkspace()
    workspace.FeedBlob("cond", np.array(False))
    workspace.FeedBlob("then_value", np.array(1))
    workspace.FeedBlob("output_blob", np.array(7))
    model = _cond_models(else_branch=False)
    assert model.net.Proto().op[0].input == ["cond", "then_value", "output_blob"]  # the output is read too
    workspace.RunNetOnce(model.net)
    assert workspace.FetchBlob("output_blob") == 7
    workspace.FeedBlob("cond", np.array(True))
    workspace.RunNetOnce(model.net)
    assert workspace.FetchBlob("output_blob") == 1


@pytest.mark.parametrize("limit", [10, 0])
def test_brew_loop_runs_the_condition_net_before_each_iteration(limit: int) -> None:
    workspace.ResetWorkspace()
    for name, value in (("cond", True), ("ONE", 1), ("TWO", 2), ("LIMIT", limit), ("counter", 0), ("output_blob", 0)):
        workspace.FeedBlob(name, np.array(value))
    loop_model = ModelHelper(name="loop_model")
    loop_model.net.Add(["output_blob", "TWO"], "output_blob")
    cond_model = ModelHelper(name="cond_model")
    cond_model.net.Add(["counter", "ONE"], "counter")
    cond_model.net.Copy(cond_model.net.LT(["counter", "LIMIT"]), "cond")
    model = ModelHelper(name="loop")
    brew.loop(model, "cond", ["cond", "ONE", "TWO", "LIMIT", "counter", "output_blob"], loop_model, cond_model)
    workspace.RunNetOnce(model.net)
    counter, output = 0, 0  # the same loop in Python: condition net first, then the body
    while True:
        counter += 1
        if not counter < limit:
            break
        output += 2
    assert (workspace.FetchBlob("output_blob"), workspace.FetchBlob("counter")) == (output, counter)
    assert not workspace.HasBlob(str(model.net.Proto().op[0].args["cond_net"].ops[1].outputs[0]))  # local to the op


def test_if_with_nets_as_op_arguments_survives_the_proto_round_trip() -> None:
    convert = pytest.importorskip("graphpar.proto.convert", reason="Caffe2's protos need the protobuf package")
    then_net = core.Net("then")
    then_net.Relu("x", "y")
    else_net = core.Net("else")
    else_net.Scale("x", "y", scale=-1.0)
    net = core.Net("outer")
    net.If(["c", "x"], ["y"], then_net=then_net, else_net=else_net.Proto())  # a Net or a NetDef
    restored = convert.from_proto(convert.to_proto(net.Proto()))
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    for flag, want in ((True, np.maximum(x, 0)), (False, -x)):
        workspace.ResetWorkspace()
        workspace.FeedBlob("c", np.array([flag]))
        workspace.FeedBlob("x", x)
        workspace.RunNetOnce(core.Net(restored))
        np.testing.assert_array_equal(workspace.FetchBlob("y"), want)


def test_a_bad_inner_op_fails_at_create_net() -> None:
    inner = core.NetDef("inner", [core.OperatorDef("NoSuchOp", ["x"], ["y"])])
    net = core.Net("outer")
    net.If(["c", "x"], ["y"], then_net=inner)
    workspace.ResetWorkspace()
    workspace.FeedBlob("c", np.array(True))
    workspace.FeedBlob("x", np.ones(2, np.float32))
    with pytest.raises(OperatorError, match="If.*could not be built: unknown operator type 'NoSuchOp'"):
        workspace.CreateNet(net)


def test_control_flow_errors_name_what_is_wrong() -> None:
    then_model = ModelHelper(name="reads_unknown")
    then_model.net.Copy("secret", "out")
    with pytest.raises(ValueError, match=r"read \['secret'\]"):
        brew.cond(ModelHelper(name="m"), "cond", ["out"], then_model)
    net = core.Net("two_values")
    net.If(["c", "x"], ["x"], then_net=core.Net("noop"))
    workspace.ResetWorkspace()
    workspace.FeedBlob("c", np.array([True, False]))
    workspace.FeedBlob("x", np.ones(2, np.float32))
    with pytest.raises(OperatorError, match=r"the condition must hold one value, got shape \[2\]"):
        workspace.RunNetOnce(net)


def test_clone_renames_blobs_inside_the_nets_of_control_flow_ops() -> None:
    then_net = core.Net("then_relu")
    then_net.Relu("x", "y")
    net = core.Net("cond_relu")
    net.If(["c", "x"], ["y"], then_net=then_net)
    clone = net.Clone("cond_relu_clone", blob_remap={"x": "x2", "y": "y2"})
    inner = clone.Proto().ops[0].args["then_net"].ops[0]
    assert (clone.Proto().ops[0].inputs, inner.inputs, inner.outputs) == (["c", "x2"], ["x2"], ["y2"])
    assert net.Proto().ops[0].args["then_net"].ops[0].inputs == ["x"]  # the original is untouched
    workspace.ResetWorkspace()
    workspace.FeedBlob("c", np.array(True))
    workspace.FeedBlob("x2", np.array([-1.0, 2.0], np.float32))
    workspace.RunNetOnce(clone)
    np.testing.assert_array_equal(workspace.FetchBlob("y2"), [0.0, 2.0])


def _replica_with_control_flow(model: ModelHelper, loss_scale: float) -> list:
    """Per replica: brew.cond clips the data when the fed `flag` is true, brew.loop halves it `LIMIT`
    times (both on the data, before the first layer), then an FC layer and a softmax loss."""
    then_model, else_model = ModelHelper(name="clip"), ModelHelper(name="keep")
    then_model.net.Clip("data", "x", min=-0.5, max=0.5)
    else_model.net.Copy("data", "x")
    brew.cond(model, "flag", ["data", "x"], then_model, else_model)
    model.net.ConstantFill([], "counter", shape=[], value=0, dtype="int64")
    model.net.ConstantFill([], "limit", shape=[], value=2, dtype="int64")
    model.net.ConstantFill([], "one", shape=[], value=1, dtype="int64")
    model.net.ConstantFill([], "go", shape=[], value=True, dtype="bool")
    cond_model, loop_model = ModelHelper(name="below"), ModelHelper(name="halve")
    cond_model.net.LT(["counter", "limit"], "go")
    loop_model.net.Scale("x", "x", scale=0.5)
    loop_model.net.Add(["counter", "one"], "counter")
    brew.loop(model, "go", ["go", "counter", "limit", "one", "x"], loop_model, cond_model)
    pred = brew.fc(model, "x", "pred", dim_in=4, dim_out=3)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def _train_with_control_flow(devices: list[int], flags: list[bool], batches: list) -> dict:
    from graphpar import data_parallel_model as dpm
    from graphpar import optimizer

    workspace.ResetWorkspace()
    model = ModelHelper(name=f"control_flow_{len(devices)}")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_replica_with_control_flow,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.5, momentum=0.9), devices=devices,
                    cpu_device=True)
    assert [op.inputs[0] for op in model.net.Proto().ops if op.type in ("If", "While")] == [
        f"cpu_{d}/{c}" for d in devices for c in ("flag", "go")]  # scoped once, not cpu_0/cpu_0/...
    for step, (flag, (x, y)) in enumerate(zip(flags, batches)):
        for d, xs, ys in zip(devices, np.split(x, len(devices)), np.split(y, len(devices))):
            workspace.FeedBlob(f"cpu_{d}/data", xs)
            workspace.FeedBlob(f"cpu_{d}/label", ys)
            workspace.FeedBlob(f"cpu_{d}/flag", np.array(flag))
        if step == 0:
            dpm.RunInitNet(model)
        dpm.RunNet(model, 1)
        taken = np.clip(xs, -0.5, 0.5) if flag else xs
        np.testing.assert_allclose(workspace.FetchBlob(f"cpu_{devices[-1]}/x"), taken / 4, rtol=1e-6)
    return {name: workspace.FetchBlob(f"cpu_{devices[0]}/{name}") for name in ("pred_w", "pred_b")}


def test_a_replicated_model_with_cond_and_loop_trains_on_n_devices_as_on_one() -> None:
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((8, 4)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32))
               for _ in range(3)]
    flags = [True, False, True]
    one = _train_with_control_flow([0], flags, batches)
    four = _train_with_control_flow([0, 1, 2, 3], flags, batches)
    initial = np.zeros((3, 4), np.float32)
    for name in one:
        np.testing.assert_allclose(four[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert not np.allclose(one["pred_w"], initial)  # it trained
