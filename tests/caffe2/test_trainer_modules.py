"""The modules Caffe2's resnet50_trainer imports: experiment_util.ModelTrainerLog, timeout_guard,
predictor_exporter / predictor_py_utils / predictor_constants, and the Load op they use."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from graphpar import brew, core, experiment_util, timeout_guard, workspace
from graphpar.errors import CheckpointError
from graphpar.model_helper import ModelHelper
from graphpar.predictor import predictor_exporter as pred_exp
from graphpar.predictor import predictor_py_utils as pred_utils
from graphpar.predictor_constants import predictor_constants
from tests.optional import needs


def test_model_trainer_log_writes_a_header_and_one_line_per_call(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    explog = experiment_util.ModelTrainerLog("exp", {"lr": 0.1})
    first = explog.log(input_count=64, batch_count=2, additional_values={"loss": 1.5, "accuracy": 0.25})
    explog.log(input_count=128, batch_count=4, additional_values={"loss": 1.0, "accuracy": 0.5})
    lines = (tmp_path / explog.filename).read_text().splitlines()
    assert lines[0] == "# {'lr': 0.1}"
    assert lines[1].split(",") == ["time_spent", "cumulative_time_spent", "input_count", "cumulative_input_count",
                                   "cumulative_batch_count", "inputs_per_sec", "accuracy", "loss"]
    assert lines[2].split(",")[2:5] == ["64", "64", "2"] and lines[3].split(",")[2:5] == ["64", "128", "4"]
    assert first["accuracy"] == 0.25 and len(lines) == 4
    with pytest.raises(ValueError, match="differ from the first line"):
        explog.log(input_count=1, batch_count=1, additional_values={"loss": 1.0})


def test_complete_in_time_passes_a_fast_block_and_kills_a_slow_one() -> None:
    with timeout_guard.CompleteInTimeOrDie(5.0):
        time.sleep(0.01)
    code = ("import time\nfrom graphpar import timeout_guard\n"
            "with timeout_guard.CompleteInTimeOrDie(0.2):\n    time.sleep(30)\nprint('not reached')\n")
    start = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 1 and "not reached" not in done.stdout
    assert "did not complete in 0.2 s" in done.stderr and time.time() - start < 20
    with pytest.raises(ValueError, match="positive number"):
        with timeout_guard.CompleteInTimeOrDie(0):
            pass


@needs("google.protobuf", "serializing Caffe2's protos")
def test_an_exported_predictor_loads_and_predicts_like_the_original(tmp_path) -> None:  # noqa: ANN001
    workspace.ResetWorkspace()
    model = ModelHelper("export")
    brew.fc(model, "data", "fc", 3, 2)
    brew.softmax(model, "fc", "softmax")
    workspace.RunNetOnce(model.param_init_net)
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    workspace.FeedBlob("data", x)
    workspace.RunNetOnce(model.net)
    want = workspace.FetchBlob("softmax")
    meta = pred_exp.PredictorExportMeta(predict_net=model.net, parameters=model.GetParams(), inputs=["data"],
                                        outputs=["softmax"], shapes={"data": (4, 3)})
    path = str(tmp_path / "model_1.mdl")
    pred_exp.save_to_db(db_type="minidb", db_destination=path, predictor_export_meta=meta)

    workspace.ResetWorkspace()
    meta_net_def = pred_exp.load_from_db(path, "minidb")
    for key in (predictor_constants.GLOBAL_INIT_NET_TYPE, predictor_constants.PREDICT_INIT_NET_TYPE):
        workspace.RunNetOnce(core.Net(pred_utils.GetNet(meta_net_def, key)))
    assert workspace.FetchBlob("data").shape == (4, 3)  # the predict init net fills the inputs
    workspace.FeedBlob("data", x)
    workspace.RunNetOnce(core.Net(pred_utils.GetNet(meta_net_def, predictor_constants.PREDICT_NET_TYPE)))
    np.testing.assert_array_equal(workspace.FetchBlob("softmax"), want)
    assert pred_utils.GetBlobs(meta_net_def, predictor_constants.PARAMETERS_BLOB_TYPE) == ["fc_b", "fc_w"]
    with pytest.raises(KeyError, match="no net 'nope'"):
        pred_utils.GetNet(meta_net_def, "nope")


@needs("google.protobuf", "exporting a predictor (Caffe2's protos)")
def test_a_trained_parallel_model_exports_and_a_fresh_workspace_predicts(tmp_path) -> None:  # noqa: ANN001
    """Caffe2's train-then-export flow (issue 35 item 2): ExtractPredictorNet's unscoped params are saved
    from the first replica, and prepare_prediction_net loads them and creates the predict net."""
    from graphpar import data_parallel_model as dpm
    from graphpar import optimizer

    def forward(model, loss_scale):  # noqa: ANN001, ANN202
        h = brew.relu(model, brew.fc(model, "data", "fc1", dim_in=4, dim_out=8), "h")
        _, loss = model.net.SoftmaxWithLoss([brew.fc(model, h, "pred", dim_in=8, dim_out=3), "label"],
                                            ["softmax", "loss"])
        return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]

    model = ModelHelper(name="export_trained")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.5), devices=[0, 1], cpu_device=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    for step in range(3):
        for d in (0, 1):
            workspace.FeedBlob(f"cpu_{d}/data", x[d * 4:(d + 1) * 4])
            workspace.FeedBlob(f"cpu_{d}/label", (x[d * 4:(d + 1) * 4, :3].argmax(1)).astype(np.int32))
        if step == 0:
            dpm.RunInitNet(model)
        dpm.RunNet(model, 1)
    params = {n: workspace.FetchBlob(f"cpu_0/{n}") for n in ("fc1_w", "fc1_b", "pred_w", "pred_b")}
    predict_net, export = dpm.ExtractPredictorNet(model, ["data"], ["softmax"], core.DeviceOption(core.CPU, 0))
    meta = pred_exp.PredictorExportMeta(predict_net=predict_net.Proto(), parameters=export, inputs=["data"],
                                        outputs=["softmax"], shapes={"data": (1, 4)})
    path = str(tmp_path / "digits.minidb")
    pred_exp.save_to_db("minidb", path, meta)

    workspace.ResetWorkspace()
    net = pred_exp.prepare_prediction_net(path, "minidb")
    assert workspace.FetchBlob("data").shape == (1, 4)  # the predict init net filled the input
    workspace.FeedBlob("data", x)
    workspace.RunNet(net)
    h = np.maximum(x @ params["fc1_w"].T + params["fc1_b"], 0)
    logits = h @ params["pred_w"].T + params["pred_b"]
    expected = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(workspace.FetchBlob("softmax"), expected / expected.sum(1, keepdims=True),
                               rtol=1e-5, atol=1e-6)
    assert not workspace.HasBlob("label") and sorted(export) == sorted(params)


def test_load_from_db_refuses_a_plain_checkpoint(tmp_path) -> None:  # noqa: ANN001
    from graphpar import checkpoint

    workspace.ResetWorkspace()
    workspace.FeedBlob("w", np.ones(2, np.float32))
    checkpoint.save(str(tmp_path / "plain.safetensors"), ["w"])
    with pytest.raises(CheckpointError, match="without an exported predictor"):
        pred_exp.load_from_db(str(tmp_path / "plain.safetensors"), "minidb")


def test_the_load_op_reads_named_blobs_and_refuses_missing_ones(tmp_path) -> None:  # noqa: ANN001
    from graphpar import checkpoint

    workspace.ResetWorkspace()
    workspace.FeedBlob("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    workspace.FeedBlob("b", np.array([7], np.int64))
    path = str(tmp_path / "ab.safetensors")
    checkpoint.save(path, ["a", "b"])
    workspace.ResetWorkspace()
    net = core.Net("load")
    net.Load([], ["b", "a"], db=path, absolute_path=1)
    workspace.RunNetOnce(net)
    np.testing.assert_array_equal(workspace.FetchBlob("a"), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert workspace.FetchBlob("b").tolist() == [7]
    bad = core.Net("load_missing")
    bad.Load([], ["c"], db=path, absolute_path=1)
    with pytest.raises(Exception, match=r"has no blobs \['c'\]"):
        workspace.RunNetOnce(bad)
