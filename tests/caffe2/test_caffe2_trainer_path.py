"""The calls Caffe2's resnet50_trainer makes, in its order (written for graphpar, not copied): a ResNeXt
from `resnet.create_resnext` under `brew.arg_scope(..., enable_tensor_core=...)`, Parallelize with
post-sync ops reading `GetOptimizationParamInfo`, steps under `timeout_guard`, an experiment log, the
model exported with `predictor_exporter.save_to_db`, then loaded back as the trainer's `LoadModel`
does and trained on. On 2 logical GPUs placed on the CPU, and on 2 CPU devices with shared_model."""

from __future__ import annotations

import numpy as np
import pytest

from graphpar import (
    brew,
    core,
    data_parallel_model,
    experiment_util,
    model_helper,
    optimizer,
    timeout_guard,
    workspace,
)
from graphpar.devices import cuda_on_cpu
from graphpar.model_helper import Initializer
from graphpar.models import resnet
from graphpar.predictor import predictor_exporter as pred_exp
from graphpar.predictor import predictor_py_utils as pred_utils
from graphpar.predictor_constants import predictor_constants


def _input(model: model_helper.ModelHelper) -> None:
    model.param_init_net.GaussianFill([], ["data"], shape=[2, 3, 32, 32])
    model.param_init_net.ConstantFill([], ["label"], shape=[2], value=1, dtype=core.DataType.INT32)


def _forward(model: model_helper.ModelHelper, loss_scale: float) -> list:
    with brew.arg_scope([brew.conv, brew.fc], WeightInitializer=Initializer, BiasInitializer=Initializer,
                        enable_tensor_core=True, float16_compute=False):
        pred = resnet.create_resnext(model, "data", num_input_channels=3, num_labels=10, num_layers=18,
                                     num_groups=2, num_width_per_group=4, no_bias=True, no_loss=True)
    softmax, loss = model.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    loss = model.Scale(loss, scale=loss_scale)
    brew.accuracy(model, [softmax, "label"], "accuracy", top_k=1)
    brew.accuracy(model, [softmax, "label"], "accuracy_top5", top_k=5)
    return [loss]


def _optimizer(model: model_helper.ModelHelper) -> optimizer.Optimizer:
    optimizer.add_weight_decay(model, 1e-4)
    return optimizer.build_multi_precision_sgd(model, 0.1, momentum=0.9, nesterov=1, policy="step", stepsize=30,
                                               gamma=0.1)


def _post_sync(model: model_helper.ModelHelper) -> None:
    for info in model.GetOptimizationParamInfo(model.GetParams()):
        if info.blob_copy is not None:
            model.param_init_net.HalfToFloat(info.blob, info.blob_copy[core.DataType.FLOAT])


def _model(use_cpu: bool) -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name="resnext18", arg_scope={
        "order": "NCHW", "use_cudnn": True, "cudnn_exhaustive_search": True, "ws_nbytes_limit": 64 << 20})
    data_parallel_model.Parallelize(
        model, input_builder_fun=_input, forward_pass_builder_fun=_forward, optimizer_builder_fun=_optimizer,
        post_sync_builder_fun=_post_sync, devices=[0, 1], rendezvous=None, optimize_gradient_memory=False,
        use_nccl=False, cpu_device=use_cpu, ideep=False, shared_model=use_cpu, combine_spatial_bn=use_cpu)
    data_parallel_model.OptimizeGradientMemory(model, {}, set(), False)
    workspace.RunNetOnce(model.param_init_net)
    workspace.CreateNet(model.net)
    return model


def _epoch(model: model_helper.ModelHelper, explog: experiment_util.ModelTrainerLog, epoch: int) -> float:
    for _ in range(2):
        with timeout_guard.CompleteInTimeOrDie(600):
            workspace.RunNet(model.net.Proto().name)
    prefix = f"{model._device_prefix}_{model._devices[0]}"
    loss = float(workspace.FetchBlob(prefix + "/loss"))
    lr = workspace.FetchBlob(data_parallel_model.GetLearningRateBlobNames(model)[0])
    explog.log(input_count=8 * (epoch + 1), batch_count=2 * (epoch + 1), additional_values={
        "loss": loss, "accuracy": workspace.FetchBlob(prefix + "/accuracy"), "learning_rate": lr, "epoch": epoch})
    return loss


def _save(model: model_helper.ModelHelper, path: str) -> dict[str, np.ndarray]:
    prefix = f"{model._device_prefix}_{model._devices[0]}"
    params = data_parallel_model.GetCheckpointParams(model)
    meta = pred_exp.PredictorExportMeta(predict_net=model.net.Proto(), parameters=params, inputs=[prefix + "/data"],
                                        outputs=[prefix + "/softmax"],
                                        shapes={prefix + "/softmax": (1, 10), prefix + "/data": (3, 32, 32)})
    pred_exp.save_to_db(db_type="minidb", db_destination=path, predictor_export_meta=meta)
    return {p: workspace.FetchBlob(p) for p in params}


def _load(model: model_helper.ModelHelper, path: str) -> None:
    meta_net_def = pred_exp.load_from_db(path, "minidb")
    init_net = core.Net(pred_utils.GetNet(meta_net_def, predictor_constants.GLOBAL_INIT_NET_TYPE))
    predict_init_net = core.Net(pred_utils.GetNet(meta_net_def, predictor_constants.PREDICT_INIT_NET_TYPE))
    predict_init_net.RunAllOnGPU()
    init_net.RunAllOnGPU()
    assert workspace.RunNetOnce(predict_init_net)
    assert workspace.RunNetOnce(init_net)
    itercnt = workspace.FetchBlob("optimizer_iteration")
    from graphpar.proto import caffe2_pb2

    workspace.FeedBlob("optimizer_iteration", itercnt, device_option=core.DeviceOption(caffe2_pb2.CPU, 0))
    data_parallel_model.FinalizeAfterCheckpoint(model)


@pytest.mark.slow
@pytest.mark.parametrize("use_cpu", [False, True], ids=["2-logical-gpus", "use_cpu"])
def test_the_trainers_calls_train_save_and_resume(tmp_path, monkeypatch, use_cpu: bool) -> None:  # noqa: ANN001
    pytest.importorskip("google.protobuf", reason="the trainer's resume uses Caffe2's protos (the protobuf package)")
    monkeypatch.chdir(tmp_path)
    workspace.ResetWorkspace()
    with cuda_on_cpu(not use_cpu):
        model = _model(use_cpu)
        explog = experiment_util.ModelTrainerLog("resnext18", {"use_cpu": use_cpu})
        assert np.isfinite(_epoch(model, explog, 0))
        assert int(workspace.FetchBlob("optimizer_iteration")[0]) == 2
        saved = _save(model, str(tmp_path / "resnext_model_1.mdl"))
        if use_cpu:
            return  # the trainer's LoadModel places the loaded nets on GPU: resumed on logical GPUs only
        workspace.ResetWorkspace()
        model = _model(use_cpu)
        _load(model, str(tmp_path / "resnext_model_1.mdl"))
        for name, value in saved.items():
            np.testing.assert_array_equal(workspace.FetchBlob(name), value, err_msg=name)
        np.testing.assert_array_equal(workspace.FetchBlob("gpu_1/comp_0_conv_2_w"), saved["gpu_0/comp_0_conv_2_w"])
        assert np.isfinite(_epoch(model, explog, 1))
        assert int(workspace.FetchBlob("optimizer_iteration")[0]) == 4
    assert len((tmp_path / explog.filename).read_text().splitlines()) == 4
