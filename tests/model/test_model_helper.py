"""ModelHelper: nets, create_param (scopes, sharing, initialisers), param queries, gradients, forwarding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from graphpar import brew, workspace
from graphpar.core import CUDA, BlobReference, DeviceOption, DeviceScope, NameScope, Net, NetDef
from graphpar.model_helper import ExternalInitializer, Initializer, ModelHelper, ParameterTags


def ops_of(net):
    """(type, inputs, outputs, args) of every op, for exact comparisons."""
    return [(op.type, op.inputs, op.outputs, op.args) for op in net.Proto().ops]


def test_nets_and_defaults():
    model = ModelHelper(name="mh_nets")
    assert model.name == "mh_nets"
    assert model.net.Name().startswith("mh_nets")
    assert model.param_init_net.Name().startswith("mh_nets_init")
    assert model.net.Proto().ops == [] and model.param_init_net.Proto().ops == []
    assert model.params == [] and model._computed_params == [] and model.param_to_grad == {}
    assert model.init_params is True
    assert model.arg_scope == {"order": "NCHW"}
    assert ModelHelper(arg_scope={"order": "NHWC", "foo": 1}).arg_scope == {"order": "NHWC", "foo": 1}


def test_create_param_records_fill_and_registers():
    model = ModelHelper(name="mh_create")
    w = model.create_param("w", [3, 2], Initializer("GaussianFill", std=0.5), tags=ParameterTags.WEIGHT)
    b = model.create_param("b", (3,), Initializer("ConstantFill", value=0.25), tags=[ParameterTags.BIAS])
    assert isinstance(w, BlobReference) and w == "w" and b == "b"
    assert ops_of(model.param_init_net) == [
        ("GaussianFill", [], ["w"], {"shape": [3, 2], "std": 0.5}),
        ("ConstantFill", [], ["b"], {"shape": [3], "value": 0.25}),
    ]
    assert model.params == ["w", "b"] and model.weights == ["w"] and model.biases == ["b"]
    info = model._parameters_info["w"]
    assert (info.name, info.blob, info.shape, info.tags, info.grad) == ("w", "w", (3, 2), ("WEIGHT",), None)
    assert model.net.Proto().ops == []


def test_create_param_scopes():
    model = ModelHelper(name="mh_scopes")
    with NameScope("gpu_1"), DeviceScope(DeviceOption(CUDA, 1)):
        scoped = model.create_param("w", [2], Initializer("XavierFill"))
        as_is = model.create_param(BlobReference("shared/w"), [2], Initializer("XavierFill"))
    assert scoped == "gpu_1/w" and as_is == "shared/w"
    fills = model.param_init_net.Proto().ops
    assert [op.outputs for op in fills] == [["gpu_1/w"], ["shared/w"]]
    assert all(op.device_option == DeviceOption(CUDA, 1) for op in fills)


def test_computed_params_are_not_trainable():
    model = ModelHelper(name="mh_computed")
    model.create_param("rm", [4], Initializer("ConstantFill"), tags=ParameterTags.COMPUTED_PARAM)
    model.create_param("s", [4], Initializer("ConstantFill", value=1.0), tags=ParameterTags.WEIGHT)
    assert model.params == ["s"] and model._computed_params == ["rm"]
    assert model.GetAllParams() == ["s", "rm"]


def test_sharing_returns_existing_blob_and_adds_nothing():
    model = ModelHelper(name="mh_share")
    first = model.create_param("w", [2, 2], Initializer("XavierFill"))
    again = model.create_param("w", [2, 2], Initializer("GaussianFill"))
    assert again is first
    assert len(model.param_init_net.Proto().ops) == 1 and model.params == ["w"]
    with pytest.raises(ValueError, match=r"'w' already exists with shape \[2, 2\].*\[3, 2\]"):
        model.create_param("w", [3, 2], Initializer("XavierFill"))


def test_init_params_false_creates_no_ops():
    model = ModelHelper(name="mh_noinit", init_params=False)
    w = model.create_param("w", [2], Initializer("XavierFill"), tags=ParameterTags.WEIGHT)
    assert w == "w" and model.params == ["w"] and model.weights == ["w"]
    assert model.param_init_net.Proto().ops == []
    assert isinstance(model._parameters_info["w"].initializer, ExternalInitializer)


def test_external_initializer_creates_no_op():
    model = ModelHelper(name="mh_external")
    model.create_param("w", [2], ExternalInitializer())
    assert model.param_init_net.Proto().ops == [] and model.params == ["w"]


@pytest.mark.parametrize("shape", [None, [2, -1], [2.0], ["3"]])
def test_create_param_rejects_bad_shapes(shape):
    with pytest.raises(TypeError, match="create_param\\('w'\\): shape"):
        ModelHelper(name="mh_badshape").create_param("w", shape, Initializer("XavierFill"))


def test_create_param_accepts_numpy_integer_dims():
    model = ModelHelper(name="mh_npshape")
    w = model.create_param("w", [np.int64(3), np.int32(2)], Initializer("XavierFill"))
    assert model._parameters_info[w].shape == (3, 2)
    (fill,) = model.param_init_net.Proto().ops
    assert fill.args["shape"] == [3, 2] and all(type(d) is int for d in fill.args["shape"])


@pytest.mark.parametrize("tags", [5, [ParameterTags.WEIGHT, 3]])
def test_create_param_rejects_bad_tags_before_recording(tags):
    model = ModelHelper(name="mh_badtags")
    with pytest.raises(TypeError, match="tags"):
        model.create_param("w", [2], Initializer("XavierFill"), tags=tags)
    assert model.param_init_net.Proto().ops == [] and model.params == []
    assert "w" not in model._parameters_info


def test_create_param_rejects_bad_names():
    with pytest.raises(TypeError, match="param_name must be"):
        ModelHelper(name="mh_badname").create_param(None, [1], Initializer("XavierFill"))


def test_create_param_rejects_bad_initializers():
    with pytest.raises(TypeError, match="fill operator name"):
        Initializer("")
    with pytest.raises(TypeError, match="initializer must be"):
        ModelHelper(name="mh_badinit").create_param("w", [1], ("XavierFill", {}))


def _scoped_model() -> ModelHelper:
    model = ModelHelper(name="mh_query")
    for scope in ("gpu_0", "gpu_1", "gpu_10"):
        with NameScope(scope):
            model.create_param("w", [1], Initializer("XavierFill"))
            model.create_param("rm", [1], Initializer("ConstantFill"), tags=ParameterTags.COMPUTED_PARAM)
    model.create_param("top", [1], Initializer("XavierFill"))
    return model


def test_get_params_by_namescope():
    model = _scoped_model()
    everything = ["gpu_0/w", "gpu_1/w", "gpu_10/w", "top"]
    assert model.GetParams() == everything and model.GetParams("") == everything
    assert model.GetParams("gpu_1") == ["gpu_1/w"] == model.GetParams("gpu_1/")
    with NameScope("gpu_1"):
        assert model.GetParams() == ["gpu_1/w"]
        assert model.GetComputedParams() == ["gpu_1/rm"]
        assert model.GetAllParams() == ["gpu_1/w", "gpu_1/rm"]
        assert model.GetParams("") == everything
    assert model.GetComputedParams("") == ["gpu_0/rm", "gpu_1/rm", "gpu_10/rm"]
    assert model.GetParams("gpu_2") == []


def test_add_parameter_requires_blob_reference():
    model = ModelHelper(name="mh_addparam")
    with pytest.raises(TypeError, match="BlobReference"):
        model.AddParameter("w")
    model.AddParameter(BlobReference("b"), ParameterTags.BIAS)
    assert model.params == ["b"] and model.biases == ["b"]


def test_op_forwarding_and_unknown_ops():
    model = ModelHelper(name="mh_forward")
    with NameScope("gpu_0"):
        y = model.Relu("x", "y")
    assert y == "gpu_0/y"
    assert ops_of(model.net) == [("Relu", ["gpu_0/x"], ["gpu_0/y"], {})]
    with pytest.raises(AttributeError, match="Relu"):
        model.Rleu("x", "y")
    with pytest.raises(AttributeError):
        model._not_there  # noqa: B018 - private names never forward to the net
    assert model.Proto() is model.net.Proto()  # Caffe2's ModelHelper.Proto, not an op


def test_get_devices():
    model = ModelHelper(name="mh_devices")
    with pytest.raises(RuntimeError, match="Parallelize"):
        model.GetDevices()
    from graphpar import data_parallel_model as dpm

    dpm.Parallelize(model, lambda m: None, lambda m, scale: None, devices=[2, 0], cpu_device=True)
    assert model.GetDevices() == [2, 0] == model._devices
    with pytest.raises(AttributeError):
        model._devices = [0, 1]  # Caffe2's attributes are read-only views of the Parallelize state


def _mlp(name: str) -> ModelHelper:
    model = ModelHelper(name=name)
    h = brew.fc(model, "data", "fc1", dim_in=4, dim_out=3)
    h = brew.relu(model, h, h)
    brew.spatial_bn(model, "img", "bn", dim_in=2)
    pred = brew.fc(model, h, "pred", dim_in=3, dim_out=2)
    model.net.SquaredL2Distance([pred, "target"], "dist")
    model.net.AveragedLoss("dist", "loss")
    return model


def test_add_gradient_operators_fills_param_to_grad_once():
    model = _mlp("mh_grad")
    n_forward = len(model.net.Proto().ops)
    grad_map = model.AddGradientOperators(["loss"])
    assert grad_map is model.grad_map and len(model.net.Proto().ops) > n_forward
    assert model.param_to_grad == {p: p + "_grad" for p in ["fc1_w", "fc1_b", "pred_w", "pred_b"]}
    assert all(isinstance(k, BlobReference) for k in model.param_to_grad)
    assert model._parameters_info["fc1_w"].grad == "fc1_w_grad"
    assert "bn_rm" not in model.param_to_grad and "bn_s" not in model.param_to_grad  # bn is not on the path
    n_after = len(model.net.Proto().ops)
    with pytest.raises(RuntimeError, match="only once"):
        model.AddGradientOperators(["loss"])
    assert len(model.net.Proto().ops) == n_after


def test_duplicate_params_are_refused_before_gradients():
    model = _mlp("mh_dupes")
    model.AddParameter(model.params[0])
    model.AddParameter(model.params[0])
    with pytest.raises(ValueError, match=r"Duplicate entries in params: \['fc1_w'\]"):
        model.Validate()
    n_ops = len(model.net.Proto().ops)
    with pytest.raises(ValueError, match="fc1_w"):
        model.AddGradientOperators(["loss"])
    assert len(model.net.Proto().ops) == n_ops and model.param_to_grad == {}
    assert model.gradient_ops_added is False


def test_param_both_trainable_and_computed_is_a_duplicate():
    model = ModelHelper(name="mh_dupe_kinds")
    model.create_param("w", [1], Initializer("XavierFill"))
    model.AddParameter(BlobReference("w"), ParameterTags.COMPUTED_PARAM)
    with pytest.raises(ValueError, match=r"\['w'\]"):
        model.Validate()


def test_validate_checks_params_without_rescanning_the_nets(monkeypatch: pytest.MonkeyPatch):
    """Ops were checked when recorded (and are again at CreateNet): Validate costs O(params), not O(ops)."""
    model = _mlp("mh_validate_cheap")
    monkeypatch.setattr(NetDef, "validate", lambda self: pytest.fail(f"net {self.name} re-validated"))
    monkeypatch.setattr(Net, "Proto", lambda self: pytest.fail(f"net {self.Name()} proto fetched"))
    model.Validate()



def test_inputs_fed_from_outside_get_no_gradient_unless_asked():
    model = _mlp("mh_inputs")
    grad_map = model.AddGradientOperators(["loss"])
    first_fc = [op for op in model.net.Proto().ops if op.type == "FCGradient"][-1]
    assert (first_fc.inputs, first_fc.outputs) == (["data", "fc1_w", "fc1_grad"], ["fc1_w_grad", "fc1_b_grad"])
    assert first_fc.args["no_gradient_to_input"] is True
    assert not {"data", "target"} & set(grad_map) and grad_map["fc1"] == "fc1_grad"  # intermediates kept
    assert all(isinstance(k, BlobReference) and k.Net() is model.net for k in grad_map)
    assert not any("data_grad" in op.outputs for op in model.net.Proto().ops)

    caffe2 = _mlp("mh_inputs_caffe2")
    grad_map = caffe2.AddGradientOperators(["loss"], input_gradients=True)
    assert grad_map["data"] == "data_grad" and grad_map["target"] == "target_grad"
    assert caffe2.param_to_grad == model.param_to_grad


@pytest.mark.parametrize("input_gradients", [False, True])
def test_mlp_gradients_equal_torch_autograd(input_gradients):
    model = ModelHelper(name="mh_autograd")
    h = brew.fc(model, "data", "fc1", dim_in=6, dim_out=5)
    h = brew.relu(model, h, h)
    pred = brew.fc(model, h, "pred", dim_in=5, dim_out=3)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    model.AddGradientOperators([loss], input_gradients=input_gradients)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 6)).astype(np.float32)
    label = rng.integers(0, 3, size=8).astype(np.int32)
    workspace.FeedBlob("data", x)
    workspace.FeedBlob("label", label)
    workspace.RunNetOnce(model.param_init_net)
    workspace.RunNetOnce(model.net)

    params = {p: workspace.FetchTensor(p).clone().requires_grad_(True) for p in model.params}
    hidden = F.relu(F.linear(torch.from_numpy(x), params["fc1_w"], params["fc1_b"]))
    logits = F.linear(hidden, params["pred_w"], params["pred_b"])
    expected_loss = F.cross_entropy(logits, torch.from_numpy(label).long())
    expected_loss.backward()
    torch.testing.assert_close(workspace.FetchTensor("loss").reshape(()), expected_loss.detach())
    assert set(model.param_to_grad) == set(params)
    for param, grad in model.param_to_grad.items():
        torch.testing.assert_close(workspace.FetchTensor(grad), params[param].grad, rtol=1e-4, atol=1e-5)
    assert workspace.HasBlob("data_grad") == input_gradients
