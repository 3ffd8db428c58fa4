"""Caffe2's last gaps, tried as a Caffe2 user would: the Print op, `utils`' names, DeviceOption's
assignable node_name, nets created before their blobs fit (partial clones on empty feeds, a run-time
failure with its traceback), `workspace._immediate_root_folder`."""

from __future__ import annotations

import logging
import os
from inspect import currentframe, getframeinfo

import numpy as np
import pytest

from graphpar import core, utils, workspace
from graphpar.errors import ShapeInferenceError
from tests.optional import needs


def test_print_logs_or_writes_a_blob_as_caffe2s_print(caplog, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    workspace.FeedBlob("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    net = core.Net("print")
    net.Print("x", [])
    net.Print("x", [], limit=2, every_n=2, to_file=1)
    workspace.CreateNet(net)
    with caplog.at_level(logging.INFO, logger="graphpar.ops.debug"):
        workspace.RunNet(net.Proto().name, 3)
    assert [r.getMessage() for r in caplog.records] == ["Tensor x of type float32. Dims: (2,3): "
                                                        "0.0,1.0,2.0,3.0,4.0,5.0"] * 3
    assert (tmp_path / "x.log").read_text() == "Tensor x of type float32. Dims: (2,3): 0.0,1.0\n" * 2  # runs 1, 3


@needs("google.protobuf", "Caffe2's TensorProto and Argument messages")
def test_utils_names_that_scripts_and_optimizers_use() -> None:
    from graphpar.proto import caffe2_pb2

    assert (utils.OPTIMIZER_ITERATION_NAME, utils.ITERATION_MUTEX_NAME) == ("optimizer_iteration", "iteration_mutex")
    for array in (np.arange(6, dtype=np.float32).reshape(2, 3), np.array([[1, -2]], np.int32),
                  np.array([3, 4], np.int64), np.array([0.5], np.float64), np.array([1, 0], np.uint8)):
        tensor = utils.NumpyArrayToCaffe2Tensor(array, "t")
        assert isinstance(tensor, caffe2_pb2.TensorProto) and tensor.name == "t" and list(tensor.dims) == list(
            array.shape)
        back = utils.Caffe2TensorToNumpyArray(caffe2_pb2.TensorProto.FromString(tensor.SerializeToString()))
        assert back.dtype == array.dtype
        np.testing.assert_array_equal(back, array)
    with pytest.raises(RuntimeError, match="not supported yet"):
        utils.NumpyArrayToCaffe2Tensor(np.array(["a"]))
    arguments = [utils.MakeArgument(k, v) for k, v in (("f", 0.5), ("i", 3), ("b", True), ("s", "abc"),
                                                       ("floats", [1.0, 2.0]), ("ints", np.array([1, 2])),
                                                       ("strings", ["a", b"b"]), ("f32", np.float32(1.5)))]
    assert utils.ArgsToDict(arguments) == {"f": 0.5, "i": 3, "b": 1, "s": b"abc", "floats": [1.0, 2.0],
                                           "ints": [1, 2], "strings": [b"a", b"b"], "f32": 1.5}
    with pytest.raises(ValueError, match="Unknown argument type"):
        utils.MakeArgument("x", object())
    op = core.CreateOperator("Scale", ["x"], ["y"], scale=2.0)
    assert utils.ArgsToDict(op.arg) == {"scale": 2.0}
    renamed = core.CreateOperator("Scale", ["x"], ["y"], name="other", scale=2.0)
    assert utils.OpAlmostEqual(op, renamed, "name") and not utils.OpAlmostEqual(op, renamed)
    assert utils.NCHW2NHWC(np.zeros((1, 3, 4, 5))).shape == (1, 4, 5, 3)
    assert utils.NHWC2NCHW(np.zeros((1, 4, 5, 3))).shape == (1, 3, 4, 5)


def test_build_unique_mutex_iter_counts_once_per_run_as_in_caffe2s_optimizers() -> None:
    init, net = core.Net("init"), core.Net("train")
    first = utils.BuildUniqueMutexIter(init, net)
    assert utils.BuildUniqueMutexIter(init, net) == first == "optimizer_iteration"  # one counter
    assert [op.type for op in init.Proto().op] == ["ConstantFill", "CreateMutex"]
    workspace.RunNetOnce(init)
    workspace.CreateNet(net)
    workspace.RunNet(net.Proto().name, 3)
    assert workspace.FetchBlob("optimizer_iteration").tolist() == [3]
    utils.ResetBlobs(["optimizer_iteration"])
    assert workspace.HasBlob("optimizer_iteration")
    with pytest.raises(TypeError, match="holds nothing"):
        workspace.FetchBlob("optimizer_iteration")


def test_device_option_node_name_is_assignable_as_on_a_protobuf_message() -> None:
    opt1, opt2 = core.DeviceOption(0), core.DeviceOption(0)
    assert core.device_option_equal(opt1, opt2)
    opt2.node_name = "test"
    assert core.device_option_equal(opt1, opt2)
    assert not core.device_option_equal(opt1, opt2, ignore_node_name=False)
    opt1.node_name = "test"
    assert core.device_option_equal(opt1, opt2, ignore_node_name=False)
    assert {opt1: 1}[core.DeviceOption(0)] == 1  # a key still: the node name is not placement
    with pytest.raises(AttributeError, match="make a new one"):
        opt1.device_id = 2
    with pytest.raises(TypeError, match="node_name must be a str"):
        opt1.node_name = 3


def test_partial_clones_are_created_on_empty_feeds_as_in_caffe2() -> None:
    params = core.Net("params")
    p1 = params.ConstantFill([], ["p1"])
    workspace.RunNetOnce(params)
    n = core.Net("original")
    a1, a2 = n.AddExternalInput("a1"), n.AddExternalInput("a2")
    b1, b2 = n.Concat([a1, a2], ["b1", "b2"], axis=0)
    c1 = n.Sum([b1, p1], ["c1"])
    c2 = n.Sum([b2], ["c2"])
    d = n.Sum([c1, c2], ["d"])
    clone, (d2,) = n.ClonePartial("f1", {a1: "a11", a2: "a22"}, [d])
    part, (c12,) = n.ClonePartial("f3", [b1], [c1])
    for net in (clone, part):
        for blob in net.Proto().external_input:
            if blob != "p1":
                workspace.FeedBlob(blob, np.array([]))  # float64, no values yet: Sum with float32 p1 cannot run
        workspace.CreateNet(net)  # as in Caffe2: created, checked when run
        with pytest.raises(ShapeInferenceError, match="Sum"):
            workspace.RunNet(net.Proto().name)
    workspace.FeedBlob("b1", np.array(2.5, np.float32))  # now fed what fits p1 (a float32 scalar)
    workspace.RunNet(part.Proto().name)
    assert (str(d2), str(c12)) == ("f1/d", "f3/c1") and workspace.FetchBlob("f3/c1") == 2.5


def test_a_run_time_failure_is_raised_by_run_net_with_the_ops_traceback() -> None:
    net = core.Net("test")
    a = net.AddExternalInput("a")
    workspace.blobs[a] = np.array([1, 2, 3], dtype=np.float32)
    net.Split(a, ["b", "c"], axis=0); cf = currentframe(); line = cf.f_lineno  # noqa: E702 - as Caffe2's test
    with pytest.raises(RuntimeError, match="enforce fail"):
        workspace.RunNetOnce(net)
    workspace.CreateNet(net)  # Caffe2 creates it: the Split fails when it runs
    with pytest.raises(RuntimeError, match=r"Split\(a -> b, c\): dim 0 of size 3 does not split into 2"):
        workspace.RunNet(net)
    net.PopulateProtoWithFileName()
    assert net.Proto().op[0].name == f"{getframeinfo(cf).filename}:{line}:{cf.f_code.co_name}"


def test_immediate_mode_root_folder_is_visible_as_in_caffe2() -> None:
    workspace.StartImmediate(i_know=True)
    root = workspace._immediate_root_folder
    assert root and os.path.isdir(root)
    workspace.StopImmediate()
    assert workspace._immediate_root_folder == "" and not os.path.exists(root)
