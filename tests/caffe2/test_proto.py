"""graphpar.proto: Caffe2's messages, IR <-> proto conversion, wire and text round trips, and a
model-zoo style init_net.pb + predict_net.pb pair loaded and run."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("google.protobuf", reason="graphpar.proto needs the optional protobuf package")

from google.protobuf import text_format  # noqa: E402

from graphpar import brew, core, model_helper, workspace  # noqa: E402
from graphpar.proto import caffe2_pb2  # noqa: E402
from graphpar.proto.convert import from_proto, to_proto  # noqa: E402


def _model() -> model_helper.ModelHelper:
    model = model_helper.ModelHelper("zoo", arg_scope={"order": "NCHW"})
    conv = brew.conv(model, "data", "conv", 3, 4, kernel=3, pad=1)
    pool = brew.max_pool(model, brew.relu(model, conv, "relu"), "pool", kernel=2, stride=2, is_test=True)
    brew.softmax(model, brew.fc(model, pool, "fc", 4 * 4 * 4, 5), "softmax")
    return model


def test_messages_have_caffe2_fields_and_constants() -> None:
    net = caffe2_pb2.NetDef(name="n", external_input=["x"])
    op = net.op.add(type="Relu", input=["x"], output=["y"])
    op.device_option.device_type = caffe2_pb2.CUDA
    op.device_option.device_id = 1
    op.arg.add(name="axis", i=1)
    assert (caffe2_pb2.CPU, caffe2_pb2.CUDA, caffe2_pb2.TensorProto.FLOAT, caffe2_pb2.TensorProto.INT64) == (
        0, 1, 1, 10)
    parsed = caffe2_pb2.NetDef()
    parsed.ParseFromString(net.SerializeToString())
    assert parsed == net
    assert text_format.Parse(text_format.MessageToString(net), caffe2_pb2.NetDef()) == net


def test_ir_to_proto_and_back_is_identity() -> None:
    net = _model().net
    with core.DeviceScope(core.DeviceOption(core.CUDA, 1)):
        net.Scale("softmax", "scaled", scale=0.5)  # a float arg and a device option
    net.Proto().op[-1].control_input.append("fc")
    net.Proto().args["shapes"] = [1, 2, 3]
    message = to_proto(net)
    assert [op.type for op in message.op] == [op.type for op in net.Proto().op]
    assert message.op[-1].device_option.device_id == 1
    assert from_proto(message) == net.Proto()
    assert from_proto(message.SerializeToString()) == net.Proto()
    copy = core.NetDef()
    copy.ParseFromString(net.Proto().SerializeToString())
    assert copy == net.Proto()


def test_argument_kinds_round_trip() -> None:
    inner = core.Net("inner").Proto()
    op = core.OperatorDef("Relu", ["x"], ["y"], {"i": 3, "f": 0.5, "s": "NCHW", "ints": [1, 2], "floats": [0.5, 2.0],
                                                 "strings": ["a", "b"], "n": inner, "flag": True})
    back = from_proto(to_proto(op))
    assert back.args == {**op.args, "flag": 1}  # Caffe2 stores bools as ints
    with pytest.raises(TypeError, match="no Caffe2 encoding"):
        to_proto(core.OperatorDef("Relu", ["x"], ["y"], {"bad": object()}))


def test_model_zoo_pair_loads_and_runs(tmp_path) -> None:  # noqa: ANN001
    model = _model()
    data = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    workspace.FeedBlob("data", data)
    workspace.RunNetOnce(model.param_init_net)
    workspace.RunNetOnce(model.net)
    expected = workspace.FetchBlob("softmax")
    # Export as the model zoo does: the init net fills the trained values, the predict net computes.
    init = caffe2_pb2.NetDef(name="zoo_init")
    for param in model.params:
        value = workspace.FetchBlob(param)
        init.op.add(type="GivenTensorFill", output=[str(param)]).arg.extend([
            caffe2_pb2.Argument(name="shape", ints=value.shape),
            caffe2_pb2.Argument(name="values", floats=value.ravel().tolist())])
    (tmp_path / "init_net.pb").write_bytes(init.SerializeToString())
    (tmp_path / "predict_net.pb").write_bytes(to_proto(model.net).SerializeToString())

    workspace.ResetWorkspace()
    workspace.RunNetOnce((tmp_path / "init_net.pb").read_bytes())
    predict = caffe2_pb2.NetDef()
    predict.ParseFromString((tmp_path / "predict_net.pb").read_bytes())
    workspace.FeedBlob("data", data)
    workspace.CreateNet(predict)
    workspace.RunNet(predict.name)
    np.testing.assert_allclose(workspace.FetchBlob("softmax"), expected, rtol=1e-6)
