"""Caffe2's `model_helper_test.py` cases: GetCompleteNet / ConstructInitTrainNetfromNet round trip."""

from __future__ import annotations

from graphpar import brew, model_helper


def _model() -> model_helper.ModelHelper:
    model = model_helper.ModelHelper("test_orig")
    conv = brew.conv(model, "input", "conv", dim_in=3, dim_out=16, weight_init=("MSRAFill", {}), kernel=3,
                     stride=1, pad=0)
    conv = brew.spatial_bn(model, conv, "conv_bn", 16, epsilon=1e-3, is_test=False)
    conv = brew.relu(model, conv, "conv_relu")
    brew.softmax(model, brew.fc(model, conv, "pred", dim_in=16 * 3 * 3, dim_out=10), "softmax")
    return model


def test_complete_net_keeps_the_net_type() -> None:
    model = _model()
    model.net.Proto().type = "async_scheduling"
    rebuilt = model_helper.ModelHelper("test_new")
    rebuilt.ConstructInitTrainNetfromNet(model.GetCompleteNet())
    assert rebuilt.net.Proto().type == rebuilt.param_init_net.Proto().type == "async_scheduling"


def test_complete_net_splits_back_into_equal_ops() -> None:
    model = _model()
    complete = model.GetCompleteNet()
    assert len(complete.Proto().op) == len(model.param_init_net.Proto().op) + len(model.net.Proto().op)
    rebuilt = model_helper.ModelHelper("test_new")
    rebuilt.ConstructInitTrainNetfromNet(complete)
    assert list(rebuilt.param_init_net.Proto().op) == list(model.param_init_net.Proto().op)
    assert list(rebuilt.net.Proto().op) == list(model.net.Proto().op)
    assert sorted(map(str, rebuilt.net.external_inputs)) == sorted(map(str, model.net.external_inputs))
    assert rebuilt.param_init_net.Proto().external_input == []


def test_extract_predictor_net_from_a_net_proto() -> None:
    model = model_helper.ModelHelper(name="test", arg_scope={"order": "NCHW"})
    cnv = brew.conv(model, "xx/data", "cnv", 3, 4, kernel=3)
    pred = brew.fc(model, brew.fc(model, cnv, "a", 4, 6), "pred", 6, 5)
    brew.softmax(model, pred, "softmax")
    predict_net, export = model_helper.ExtractPredictorNet(
        net_proto=model.net.Proto(), input_blobs=["xx/data"], output_blobs=["pred"], renames={"xx/data": "image"})
    ops = list(predict_net.Proto().op)
    assert [op.type for op in ops] == ["Conv", "FC", "FC"] and ops[0].input[0] == "image"
    assert set(export) == {str(p) for p in model.params}
    assert set(predict_net.Proto().external_input) - set(export) == {"image"}
    assert list(predict_net.Proto().external_output) == ["pred"]
