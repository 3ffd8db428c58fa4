"""Caffe2's `workspace_test.py` behaviours that apply to graphpar (its C.Workspace binding objects are not here)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from graphpar import brew, core, model_helper, workspace
from graphpar.caffe2 import immediate
from tests.optional import needs


def _fill_net() -> core.Net:
    net = core.Net("test-net")
    net.ConstantFill([], "testblob", shape=[1, 2, 3, 4], value=1.0)
    return net


def test_missing_blob_is_a_runtime_error() -> None:
    assert not workspace.HasBlob("non-existing")
    with pytest.raises(RuntimeError, match="does not exist"):
        workspace.FetchBlob("non-existing")
    net = core.Net("reads_missing")
    net.Relu("nowhere", "y")
    with pytest.raises(RuntimeError, match="nowhere"):
        workspace.RunNetOnce(net)


def test_fetch_feed_and_blob_dict() -> None:
    assert workspace.RunNetOnce(_fill_net())
    fetched = workspace.FetchBlob("testblob")
    assert fetched.shape == (1, 2, 3, 4) and (fetched == 1.0).all()
    workspace.blobs["testblob"] = fetched * 2
    assert (workspace.blobs["testblob"] == 2.0).all() and list(workspace.blobs) == ["testblob"]
    assert [b.shape for b in workspace.FetchBlobs(["testblob", "testblob"])] == [(1, 2, 3, 4)] * 2


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.bool_, np.int8, np.int16, np.int32,
                                   np.int64, np.uint8])
def test_blob_size_bytes(dtype: type) -> None:
    workspace.FeedBlob("sized", np.zeros((2, 3), dtype=dtype))
    assert workspace.GetBlobSizeBytes("sized") == 6 * np.dtype(dtype).itemsize


def test_fetch_torch_is_the_live_tensor() -> None:
    workspace.RunOperatorOnce(core.CreateOperator("ConstantFill", [], "foo", shape=(4,), value=2, dtype=10))
    tensor = workspace.FetchTorch("foo")
    assert tensor.dtype == torch.int64
    tensor[2] = 777
    assert workspace.FetchBlob("foo").tolist() == [2, 2, 777, 2]


def test_switch_workspace() -> None:
    assert workspace.RunNetOnce(_fill_net())
    assert workspace.SwitchWorkspace("test", True) is None
    assert not workspace.HasBlob("testblob")
    workspace.SwitchWorkspace("default")
    assert workspace.HasBlob("testblob")
    with pytest.raises(RuntimeError):
        workspace.SwitchWorkspace("non-existing")  # Caffe2's default: create_if_missing=False
    assert {"default", "test"} <= set(workspace.Workspaces())


def test_gpu_names() -> None:
    pattern = workspace.GetGpuPeerAccessPattern()
    assert pattern.ndim == 2 and pattern.shape == (workspace.NumGpuDevices(),) * 2
    assert workspace.GpuDeviceType == core.CUDA and workspace.IsGPUDeviceType(workspace.GpuDeviceType)
    assert workspace.has_gpu_support == torch.cuda.is_available() and workspace.has_hip_support is False
    assert workspace.GlobalInit(["python", "--caffe2_log_level=0"])


def test_root_folder(tmp_path) -> None:  # noqa: ANN001
    assert workspace.ResetWorkspace() and workspace.RootFolder() == "."
    root = str(tmp_path / "caffe-workspace-test")
    assert workspace.ResetWorkspace(root) and workspace.RootFolder() == root
    assert (tmp_path / "caffe-workspace-test").is_dir()
    workspace.ResetWorkspace()
    assert workspace.RootFolder() == root  # None keeps it, as in Caffe2


def test_reset_workspace() -> None:
    workspace.RunNetOnce(_fill_net())
    assert workspace.ResetWorkspace() and not workspace.HasBlob("testblob")
    assert workspace.CreateBlob("made") and workspace.HasBlob("made") and "made" in workspace.Blobs()
    with pytest.raises(TypeError, match="holds nothing yet"):
        workspace.FetchTensor("made")


def test_text_blobs_round_trip_and_created_blobs_count_as_present() -> None:
    strings = np.array([b"Hello World!", b"abcd"])
    for name, value in (("plain", b"a \0 b"), ("text", "abc"), ("strings", strings)):
        assert workspace.FeedBlob(name, value)
        fetched = workspace.FetchBlob(name)
        assert type(fetched) is type(value) and np.array_equal(fetched, value)
    assert workspace.GetBlobSizeBytes("strings") == 2 * np.dtype(object).itemsize + 16
    workspace.FeedBlob("plain", np.ones(2, np.float32))  # a tensor replaces the text
    assert workspace.FetchBlob("plain").tolist() == [1.0, 1.0]
    net = core.Net("reads_created")
    net.Relu("later", "out")
    workspace.CreateBlob("later")
    workspace.CreateNet(net)  # "later" exists (Caffe2), though it holds nothing yet
    workspace.FeedBlob("later", np.array([-1.0, 2.0], np.float32))
    workspace.RunNet(net)
    assert workspace.FetchBlob("out").tolist() == [0.0, 2.0]


def test_name_scope_stringify_and_repeated_runs() -> None:
    with core.NameScope("scope"):
        assert workspace.GetNameScope() == "scope/"
    workspace.FeedBlob("x", np.ones(2, np.float32))
    op = core.CreateOperator("Scale", "x", "x", scale=2.0)
    assert workspace.RunOperatorMultiple(op, 3)
    assert workspace.FetchBlob("x").tolist() == [8.0, 8.0]
    assert workspace.StringifyProto("as is") == "as is"
    pytest.importorskip("google.protobuf", reason="serializing needs the optional protobuf package")
    assert workspace.StringifyProto(op) == op.SerializeToString()  # Caffe2's wire format


@needs("google.protobuf", "serializing Caffe2's protos")
def test_predictor_runs_an_init_and_predict_pair_in_its_own_workspace() -> None:
    model = model_helper.ModelHelper(name="predictor_model")
    y = brew.fc(model, "data", "y", dim_in=4, dim_out=2, weight_init=("ConstantFill", {"value": 1.0}),
                bias_init=("ConstantFill", {"value": 0.5}))
    model.net.AddExternalOutput(y)
    predictor = workspace.Predictor(workspace.StringifyProto(model.param_init_net),
                                    workspace.StringifyProto(model.net))
    assert predictor.input_names == ["data"] and not workspace.HasBlob("y_w")
    (out,) = predictor.run([np.array([[1, 3, 256, 256]], np.float32)])
    np.testing.assert_array_equal(out, [[516.5, 516.5]])
    with pytest.raises(ValueError, match="expected 1 inputs"):
        predictor.run([])


def test_immediate_mode_runs_recorded_ops_in_their_own_workspace() -> None:
    workspace.StartImmediate(i_know=True)
    try:
        root = immediate._immediate_root_folder
        assert workspace.IsImmediate() and os.path.isdir(root)
        net = core.Net("immediate")
        net.ConstantFill([], "filled", shape=[2], value=3.0)
        assert workspace.ImmediateBlobs() == ["filled"] and not workspace.HasBlob("filled")
        np.testing.assert_array_equal(workspace.FetchImmediate("filled"), [3.0, 3.0])
        assert workspace.FeedImmediate("filled", np.zeros(2, np.float32))
        assert workspace.FetchImmediate("filled").tolist() == [0.0, 0.0]
    finally:
        workspace.StopImmediate()
    assert not workspace.IsImmediate() and not os.path.exists(root)
    with pytest.raises(RuntimeError):
        workspace.FetchImmediate("filled")
    assert workspace.CurrentWorkspace() == "default"


def test_plans_run_steps_and_substeps_num_iter_times() -> None:
    pytest.importorskip("google.protobuf", reason="plans are caffe2_pb2 messages (optional protobuf package)")
    init, body = core.Net("plan_init"), core.Net("plan_body")
    init.ConstantFill([], "count", shape=[1], value=0, dtype="int64")
    body.Iter(["count"], ["count"])
    outer = core.ExecutionStep("outer", init)
    outer.AddSubstep(core.ExecutionStep("loop", body, num_iter=3))
    plan = core.Plan("counting")
    plan.AddStep(outer)
    assert [n.Name() for n in plan.Nets()] == [init.Name(), body.Name()]
    assert workspace.RunPlan(plan.Proto().SerializeToString())  # the wire format, as Caffe2's C++ API took
    assert workspace.FetchBlob("count").tolist() == [3]
    assert workspace.RunPlan(core.ExecutionStep("again", body, num_iter=2))
    assert workspace.FetchBlob("count").tolist() == [5]
    background = workspace.RunPlanInBackground(plan)
    background.wait()
    assert background.is_done() and background.is_succeeded() and workspace.FetchBlob("count").tolist() == [3]
    with_criteria = plan.Proto()
    with_criteria.execution_step[0].should_stop_blob = "stop"
    with pytest.raises(NotImplementedError, match="should_stop_blob"):
        workspace.RunPlan(with_criteria)


def test_caffe2_only_functions_live_in_graphpar_caffe2_and_workspace_gives_them() -> None:
    from graphpar.caffe2 import run_plan, workspace_extras

    assert workspace.RunPlan is run_plan.RunPlan and workspace.StartImmediate is immediate.StartImmediate
    assert workspace.Predictor is workspace_extras.Predictor and workspace.GlobalInit is workspace_extras.GlobalInit
    assert {"RunPlan", "FeedImmediate", "StringifyProto", "FeedBlob"} <= set(dir(workspace))
    with pytest.raises(AttributeError, match="no attribute 'RunPlans'"):
        workspace.RunPlans  # noqa: B018
