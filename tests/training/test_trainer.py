"""graphpar.engine: the Trainer and its hooks, resume from a periodic checkpoint, auto_scale_workers.

References: a hand-written loop (feed, RunNet) for the trainer's steps; the uninterrupted run for a
resumed one (LR schedule included); Detectron2's formulas, transcribed, for auto_scale_workers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from graphpar import brew, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.data import feed
from graphpar.devices import cuda_on_cpu
from graphpar.engine import (
    Config,
    EvalHook,
    HookBase,
    IterationTimer,
    LRScheduler,
    PeriodicCheckpointer,
    PeriodicWriter,
    Trainer,
    auto_scale_workers,
)
from graphpar.errors import OperatorError
from graphpar.model_helper import ModelHelper
from graphpar.naming import DYNAMIC_MEMORY_ARG

_names = iter(range(10**6))


def _mlp(model: ModelHelper, loss_scale: float) -> list:
    h = brew.relu(model, brew.fc(model, "data", "fc1", dim_in=4, dim_out=8), "h")
    pred = brew.fc(model, h, "pred", dim_in=8, dim_out=3)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def _model(devices=(0, 1), check_finite_loss=None, **sgd) -> ModelHelper:
    model = ModelHelper(name=f"trainer_{next(_names)}")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(
                        m, 0.2, policy="step", stepsize=3, gamma=0.5, momentum=0.9, **sgd),
                    devices=list(devices), cpu_device=True, check_finite_loss=check_finite_loss)
    return model


def _batches(count: int = 4, size: int = 8) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"data": rng.standard_normal((size, 4)).astype(np.float32),
             "label": rng.integers(0, 3, size).astype(np.int32), "ids": list(range(size))} for _ in range(count)]


def _params(model: ModelHelper) -> dict[str, np.ndarray]:
    return {name: workspace.FetchBlob(name) for name in sorted(dpm.GetCheckpointParams(model))}


def test_trainer_steps_equal_a_hand_written_loop_and_record_losses():
    data = _batches()
    workspace.ResetWorkspace()
    workspace.SetSeed(1)
    reference = _model()
    feed(reference, data[0])
    dpm.RunInitNet(reference)
    losses = []
    for step in range(6):  # 1.5 epochs
        feed(reference, data[step % 4])
        dpm.RunNet(reference, 1)
        losses.append(sum(float(workspace.FetchBlob(f"cpu_{d}/scaled_loss")) for d in (0, 1)))
    expected = _params(reference)

    workspace.ResetWorkspace()
    workspace.SetSeed(1)
    trainer = Trainer(_model(), data, [LRScheduler()], max_iter=6)
    trainer.train()
    for name, value in _params(trainer.model).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    np.testing.assert_allclose([v for _, v in trainer.storage.history["scaled_loss"]], losses, rtol=1e-6)
    assert [v for _, v in trainer.storage.history["lr"]] == pytest.approx([0.2, 0.2, 0.1, 0.1, 0.1, 0.05])  # step k sees iter k
    assert trainer.epoch == 1 and trainer.iter == 6


def _train(tmp_path, max_iter: int, resume: bool, period: int = 2, keep: int = 2) -> Trainer:
    workspace.ResetWorkspace()
    workspace.SetSeed(1)
    hooks = [LRScheduler(), PeriodicCheckpointer(tmp_path / "ckpt", period, keep=keep)]
    trainer = Trainer(_model(), _batches(), hooks, max_iter=max_iter)
    trainer.resume_or_load(resume=resume)
    trainer.train()
    return trainer


def test_resumed_from_a_periodic_checkpoint_equals_the_uninterrupted_run(tmp_path):
    full = _train(tmp_path / "full", 7, resume=False)
    expected, lrs = _params(full.model), full.storage.history["lr"]
    _train(tmp_path / "cut", 5, resume=False)  # the "crash": stopped after 5 iterations
    saved = sorted(p.name for p in (tmp_path / "cut" / "ckpt").iterdir())
    assert saved == ["model_0000004.safetensors", "model_0000005.safetensors"]  # every 2, the end, last 2 kept
    resumed = _train(tmp_path / "cut", 7, resume=True)
    assert resumed.start_iter == 5 and resumed.epoch == 1
    for name, value in _params(resumed.model).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    assert resumed.storage.history["lr"] == lrs[5:]  # the LR schedule continues where it was
    assert int(workspace.FetchBlob("optimizer_iteration")[0]) == 7


@pytest.mark.parametrize("calls_resume_or_load", [True, False])
def test_a_restarted_process_continues_from_the_last_checkpoint_its_job_wrote(tmp_path, monkeypatch,
                                                                              calls_resume_or_load):
    """Issue 33 item 3: a process the launcher's agent restarts (TORCHELASTIC_RESTART_COUNT > 0) runs the
    same script, resume=False included; it continues where its job's checkpoints are, not from scratch,
    and not from a checkpoint another job left further along in the same directory."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")
    full = _train(tmp_path / "full", 7, resume=False)
    expected, lrs = _params(full.model), full.storage.history["lr"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "this-job")
    _train(tmp_path / "cut", 5, resume=False)  # the attempt that died after its checkpoint at 5
    foreign = tmp_path / "cut" / "ckpt" / "model_0000006.safetensors"
    foreign.write_bytes((tmp_path / "full" / "ckpt" / "model_0000006.safetensors").read_bytes())

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    workspace.ResetWorkspace()
    workspace.SetSeed(1)
    hooks = [LRScheduler(), PeriodicCheckpointer(tmp_path / "cut" / "ckpt", 2, keep=None)]
    restarted = Trainer(_model(), _batches(), hooks, max_iter=7)
    if calls_resume_or_load:
        assert restarted.resume_or_load(resume=False) == 5
    restarted.train()
    assert restarted.start_iter == 5 and restarted.storage.history["lr"] == lrs[5:]
    for name, value in _params(restarted.model).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_a_finished_run_resumed_says_there_is_nothing_to_do(tmp_path, capsys):
    _train(tmp_path, 3, resume=False)
    trainer = _train(tmp_path, 3, resume=True)
    assert trainer.iter == 3
    assert "nothing to train: already at iteration 3 of max_iter 3; raise max_iter" in capsys.readouterr().err


def test_hooks_run_in_order_and_writers_write(tmp_path, capsys):
    calls = []

    class Recorder(HookBase):
        def before_train(self):
            calls.append(("before_train", self.trainer.iter))

        def before_step(self):
            calls.append(("before_step", self.trainer.iter))

        def after_step(self):
            calls.append(("after_step", self.trainer.iter))

        def after_train(self):
            calls.append(("after_train", self.trainer.iter))

    evaluations = []

    def evaluate():
        evaluations.append(int(workspace.FetchBlob("optimizer_iteration")[0]))
        return {"accuracy": 0.5}

    workspace.ResetWorkspace()
    hooks = [Recorder(), IterationTimer(warmup=1), LRScheduler(), EvalHook(2, evaluate),
             PeriodicWriter(tmp_path, period=2, tensorboard=False)]
    trainer = Trainer(_model(), _batches(), hooks, max_iter=3)
    trainer.train()
    assert calls == [("before_train", 0), ("before_step", 0), ("after_step", 0), ("before_step", 1),
                     ("after_step", 1), ("before_step", 2), ("after_step", 2), ("after_train", 2)]
    assert evaluations == [2, 3]  # every 2 iterations and at the end
    lines = [json.loads(line) for line in (tmp_path / "metrics.json").read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [1, 2, 2]  # every 2 iterations, the end, the final eval
    assert set(lines[0]) == {"iteration", "scaled_loss", "total_loss", "lr", "time", "accuracy"} and lines[2] == {
        "iteration": 2, "accuracy": 0.5}
    assert len(trainer.storage.history["time"]) == 2  # after one warmup step
    out = capsys.readouterr().out
    assert "iter 2/3" in out and "iter 3/3" in out and "accuracy 0.5" in out
    assert " total_loss " in out and "scaled_loss" not in out  # one loss: shown once, as Detectron2's total_loss


def test_trainer_refuses_a_forward_only_model_empty_data_and_a_diverging_loss():
    workspace.ResetWorkspace()
    forward = ModelHelper(name=f"trainer_fwd_{next(_names)}", init_params=False)
    dpm.Parallelize(forward, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                    devices=[0], cpu_device=True)
    with pytest.raises(ValueError, match="parallelized with an optimizer"):
        Trainer(forward, _batches(), max_iter=1)
    with pytest.raises(ValueError, match="max_iter must be an int >= 0"):
        Trainer(_model(), _batches(), max_iter=-1)
    assert Trainer(_model(), _batches(3)).max_iter == 3  # default: one epoch
    with pytest.raises(ValueError, match="pass max_iter"):
        Trainer(_model(), iter(_batches(3)))
    with pytest.raises(ValueError, match="yielded no batch in epoch 0"):
        Trainer(_model(), [], max_iter=1).train()
    bad = _batches(1)
    bad[0]["data"][0, 0] = np.inf
    with pytest.raises(OperatorError, match="CheckFinite"):  # CPU replicas check their losses by default
        Trainer(_model(), bad, max_iter=2).train()
    with pytest.raises(FloatingPointError, match="loss 'scaled_loss' became nan at iteration 0"):
        Trainer(_model(check_finite_loss=False), bad, max_iter=2).train()  # the Trainer's own check


def test_set_epoch_is_called_on_the_data_each_epoch():
    epochs = []

    class Loader:
        def __init__(self):
            self.batches = _batches(2)

        def set_epoch(self, epoch):
            epochs.append(epoch)

        def __iter__(self):
            return iter(self.batches)

    workspace.ResetWorkspace()
    Trainer(_model(), Loader(), max_iter=5).train()
    assert epochs == [0, 1, 2]


# ---- auto_scale_workers against Detectron2's formulas ------------------------------------------------


def _cfg(reference: int = 8) -> Config:
    return Config({"SOLVER": {"IMS_PER_BATCH": 16, "BASE_LR": 0.1, "REFERENCE_WORLD_SIZE": reference,
                              "MAX_ITER": 5000, "WARMUP_ITERS": 1000, "STEPS": (4000, 4500),
                              "CHECKPOINT_PERIOD": 1000}, "TEST": {"EVAL_PERIOD": 500}})


@pytest.mark.parametrize("workers", [16, 4, 2, 3])
def test_auto_scale_workers_follows_detectron2(workers):
    cfg = _cfg()
    scaled = auto_scale_workers(cfg, workers)
    scale = workers / 8  # detectron2.engine.defaults.DefaultTrainer.auto_scale_workers
    assert scaled.SOLVER.IMS_PER_BATCH == int(round(16 * scale))
    assert scaled.SOLVER.BASE_LR == 0.1 * scale
    assert scaled.SOLVER.MAX_ITER == int(round(5000 / scale))
    assert scaled.SOLVER.WARMUP_ITERS == int(round(1000 / scale))
    assert scaled.SOLVER.STEPS == tuple(int(round(s / scale)) for s in (4000, 4500))
    assert scaled.SOLVER.CHECKPOINT_PERIOD == int(round(1000 / scale))
    assert scaled.TEST.EVAL_PERIOD == int(round(500 / scale))
    assert scaled.SOLVER.REFERENCE_WORLD_SIZE == workers
    assert cfg.SOLVER.IMS_PER_BATCH == 16  # the input is not changed


def test_auto_scale_workers_without_reference_or_with_a_bad_one():
    assert auto_scale_workers(_cfg(0), 4) == _cfg(0)
    assert auto_scale_workers(_cfg(8), 8) == _cfg(8)
    with pytest.raises(ValueError, match="IMS_PER_BATCH=16 is not divisible by SOLVER.REFERENCE_WORLD_SIZE=3"):
        auto_scale_workers(_cfg(3), 4)
    with pytest.raises(ValueError, match="num_workers must be an int >= 1"):
        auto_scale_workers(_cfg(), 0)
    with pytest.raises(AttributeError, match="config has no field 'MISSING'"):
        _cfg().MISSING  # noqa: B018


def test_resume_false_with_a_path_loads_only_the_weights(tmp_path):
    trained = _train(tmp_path, 3, resume=False)
    params = {name: value for name, value in _params(trained.model).items() if name.endswith(("_w", "_b"))}
    path = tmp_path / "ckpt" / "model_0000003.safetensors"
    workspace.ResetWorkspace()
    trainer = Trainer(_model(), _batches(), max_iter=1)
    assert trainer.resume_or_load(resume=False, path=path) == 0
    for name, value in params.items():
        np.testing.assert_array_equal(workspace.FetchBlob(name), value, err_msg=name)
        np.testing.assert_array_equal(workspace.FetchBlob(name.replace("cpu_0", "cpu_1")), value)
    assert int(workspace.FetchBlob("optimizer_iteration")[0]) == 0
    assert not workspace.FetchBlob("cpu_0/fc1_w_momentum").any()
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        trainer.resume_or_load(resume=True, path=tmp_path / "missing.safetensors")


def test_lr_scheduler_multiplier_feeds_lr_injection():
    workspace.ResetWorkspace()
    model = ModelHelper(name=f"trainer_inject_{next(_names)}")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.2, allow_lr_injection=True),
                    devices=[0, 1], cpu_device=True)
    frozen = Trainer(model, _batches(), [LRScheduler(lambda it: 0.0 if it < 2 else 0.5)], max_iter=2)
    frozen.initialize()
    before = _params(model)
    frozen.train()
    for name, value in _params(model).items():  # LR x 0: nothing moved but the counter
        if name != "optimizer_iteration":
            np.testing.assert_array_equal(value, before[name], err_msg=name)
    frozen.max_iter = 4
    frozen.train()
    assert [v for _, v in frozen.storage.history["lr"]] == pytest.approx([0.0, 0.0, 0.1, 0.1])
    assert workspace.FetchBlob("lr_injection")[0] == 0.5
    assert not np.array_equal(_params(model)["cpu_0/fc1_w"], before["cpu_0/fc1_w"])


def test_periodic_writer_sends_scalars_to_tensorboard_when_installed(tmp_path, monkeypatch):
    import sys
    import types

    events = []

    class SummaryWriter:
        def __init__(self, logdir):
            events.append(("open", logdir))

        def add_scalar(self, name, value, step):
            events.append((name, step))

        def close(self):
            events.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    workspace.ResetWorkspace()
    Trainer(_model(), _batches(), [PeriodicWriter(tmp_path, period=2, console=False)], max_iter=3).train()
    assert events == [("open", str(tmp_path)), ("scaled_loss", 1), ("total_loss", 1), ("scaled_loss", 2),
                      ("total_loss", 2), ("close",)]
    with pytest.raises(ImportError):  # asked for explicitly, but not installed
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
        Trainer(_model(), _batches(), [PeriodicWriter(tmp_path, tensorboard=True)], max_iter=1).train()


@pytest.mark.parametrize("saved_on", [(1, 2), (5,)])
def test_resume_false_maps_the_weights_onto_the_first_device_whatever_the_files(tmp_path, saved_on):
    """Issue 23 item 8: weights saved on devices (1, 2) went to replica 1 only; saved on device 5 they
    failed with 'no blob names given'."""
    workspace.ResetWorkspace()
    workspace.SetSeed(1)
    saver = Trainer(_model(saved_on), _batches(), max_iter=2)
    saver.train()
    path = tmp_path / "weights.safetensors"
    dpm.save_checkpoint(saver.model, path)
    first = saver.model._devices[0]
    params = {name.split("/", 1)[1]: value for name, value in _params(saver.model).items()
              if name.startswith(f"cpu_{first}/") and name.endswith(("_w", "_b"))}
    workspace.ResetWorkspace()
    trainer = Trainer(_model((0, 1)), _batches(), max_iter=1)
    assert trainer.resume_or_load(resume=False, path=path) == 0
    for name, value in params.items():
        for d in (0, 1):
            np.testing.assert_array_equal(workspace.FetchBlob(f"cpu_{d}/{name}"), value, err_msg=f"cpu_{d}/{name}")
    assert int(workspace.FetchBlob("optimizer_iteration")[0]) == 0
    trainer.train()


def test_a_hook_that_raises_does_not_make_train_repeat_the_iteration():
    """Issue 23 item 6: after_step raised at iteration 5, train() again ran 11 updates for max_iter=10."""
    workspace.ResetWorkspace()
    workspace.SetSeed(1)
    full = Trainer(_model(), _batches(), max_iter=10)
    full.train()
    expected = _params(full.model)

    class FailOnce(HookBase):
        def __init__(self):
            self.steps, self.failed = [], False

        def after_step(self):
            self.steps.append(self.trainer.iter)
            if self.trainer.iter == 5 and not self.failed:
                self.failed = True
                raise RuntimeError("hook failed")

    workspace.ResetWorkspace()
    workspace.SetSeed(1)
    hook = FailOnce()
    trainer = Trainer(_model(), _batches(), [hook], max_iter=10)
    with pytest.raises(RuntimeError, match="hook failed"):
        trainer.train()
    trainer.train()
    assert hook.steps == list(range(10))
    assert trainer.iter == 10 == int(workspace.FetchBlob("optimizer_iteration")[0])
    for name, value in _params(trainer.model).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def _gpu_model() -> ModelHelper:
    model = ModelHelper(name=f"trainer_{next(_names)}")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.2, momentum=0.9), devices=[0, 1])
    return model


def test_on_cuda_replicas_the_trainer_frees_intermediates_and_trains_the_same():
    """lean_memory's default on CUDA: Parallelize's two memory options, same params as keeping every blob."""
    results = {}
    for lean in (None, False):
        with cuda_on_cpu():
            workspace.ResetWorkspace()
            trainer = Trainer(_gpu_model(), _batches(), max_iter=5, lean_memory=lean)
            trainer.train()
            results[lean] = (_params(trainer.model), set(workspace.Blobs()),
                             trainer.model.net.Proto().args.get(DYNAMIC_MEMORY_ARG))
    (lean_params, lean_blobs, freeing), (full_params, full_blobs, keeping) = results[None], results[False]
    assert freeing == 1 and not keeping
    assert {b for b in lean_blobs if b.startswith("SgdOptimizer")}  # the LR, which LRScheduler records
    lean_blobs, full_blobs = ({b for b in blobs if not b.startswith("SgdOptimizer")} for blobs in (lean_blobs, full_blobs))
    assert "gpu_0/h" in full_blobs and "gpu_0/h" not in lean_blobs and lean_blobs < full_blobs
    assert {"gpu_0/scaled_loss", "gpu_1/scaled_loss"} <= lean_blobs
    for name, value in full_params.items():
        np.testing.assert_array_equal(lean_params[name], value, err_msg=name)


def test_on_cpu_replicas_the_trainer_keeps_every_blob_by_default():
    workspace.ResetWorkspace()
    trainer = Trainer(_model(), _batches(), max_iter=1)
    trainer.train()
    assert not trainer.lean_memory and workspace.HasBlob("cpu_0/h")


def test_on_cuda_replicas_the_losses_are_read_every_record_period_with_the_same_values():
    """The losses stay on the devices between recordings; a hook reading the storage reads them at
    once (one shard); the values equal reading every iteration; a bad record_period is refused."""
    seen = []

    class Reader(HookBase):
        def after_step(self):
            if self.trainer.iter == 2:
                seen.append(list(self.trainer.storage.history["scaled_loss"]))

    histories = []
    for period, hooks in ((1, []), (None, [Reader()]), (4, [])):
        with cuda_on_cpu():
            workspace.ResetWorkspace()
            workspace.SetSeed(1)
            trainer = Trainer(_gpu_model(), _batches(), hooks, max_iter=6, record_period=period)
            assert trainer.record_period == (20 if period is None else period)
            trainer.train()
        histories.append(trainer.storage.history["scaled_loss"])
    assert histories[0] == histories[1] == histories[2] and [at for at, _ in histories[0]] == list(range(6))
    assert seen == [histories[0][:3]]
    with pytest.raises(ValueError, match="record_period must be an int >= 1"):
        Trainer(_model(), _batches(), record_period=0)


def test_on_cuda_replicas_a_diverging_loss_is_reported_with_its_iteration_when_read():
    bad = _batches(3)
    bad[1]["data"][0, 0] = np.inf  # iteration 1 (the loss check is off on CUDA: it reads the host)
    with cuda_on_cpu():
        workspace.ResetWorkspace()
        trainer = Trainer(_gpu_model(), bad, max_iter=3, record_period=3)
        with pytest.raises(FloatingPointError, match="loss 'scaled_loss' became nan at iteration 1"):
            trainer.train()
    assert [at for at, _ in trainer.storage.history["scaled_loss"]] == [0]


def test_with_gradient_accumulation_the_held_micro_batch_losses_record_the_same_means():
    histories = []
    for period in (1, 4):
        with cuda_on_cpu():
            workspace.ResetWorkspace()
            workspace.SetSeed(1)
            model = ModelHelper(name=f"trainer_{next(_names)}")
            dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                            optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.2, momentum=0.9),
                            devices=[0, 1], accumulate_gradients=2)
            trainer = Trainer(model, _batches(6), max_iter=3, record_period=period)
            trainer.train()
        histories.append(trainer.storage.history["scaled_loss"])
    assert histories[0] == histories[1] and [at for at, _ in histories[0]] == [0, 1, 2]


def _fp16_model() -> ModelHelper:
    """Float16 compute with a dynamic loss scale that starts too high: the first steps overflow and are
    skipped (5 of them for these batches), as GradScaler's first steps often are."""
    model = ModelHelper(name=f"trainer_{next(_names)}")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_mlp,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.2, policy="step", stepsize=3, gamma=0.5,
                                                                        momentum=0.9),
                    devices=[0, 1], cpu_device=True, compute_dtype="float16", loss_scale={"init_scale": 2.0 ** 22})
    return model


def _fp16_trainer(directory, max_iter: int, resume: bool, hooks=()) -> Trainer:
    workspace.ResetWorkspace()
    workspace.SetSeed(1)
    trainer = Trainer(_fp16_model(), _batches(5), [LRScheduler(), PeriodicCheckpointer(directory, 2), *hooks],
                      max_iter=max_iter)
    trainer.resume_or_load(resume=resume)
    return trainer


def _fp16_train(directory, max_iter: int, resume: bool) -> Trainer:
    trainer = _fp16_trainer(directory, max_iter, resume)
    trainer.train()
    return trainer


def test_resume_after_skipped_loss_scaled_steps_equals_the_uninterrupted_run(tmp_path):
    """Issue 32 item 3: resume_or_load restarted at optimizer_iteration (updates, 1 after 6 iterations of
    which 5 were skipped), so iterations 1-5 ran twice and the params differed. The checkpoint keeps
    the iterations done; the resumed run consumes the same batches and records each iteration once."""
    full = _fp16_train(tmp_path / "full", 9, resume=False)
    assert dpm.skipped_steps(full.model) == 5
    expected, losses, lrs = _params(full.model), full.storage.history["scaled_loss"], full.storage.history["lr"]
    _fp16_train(tmp_path / "cut", 6, resume=False)
    assert int(workspace.FetchBlob("optimizer_iteration")[0]) == 1
    resumed = _fp16_train(tmp_path / "cut", 9, resume=True)
    assert resumed.start_iter == 6 and resumed.epoch == 1
    for name, value in _params(resumed.model).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    assert resumed.storage.history["scaled_loss"] == [(i, v) for i, v in losses if i >= 6]
    assert resumed.storage.history["lr"] == [(i, v) for i, v in lrs if i >= 6]


def test_train_again_after_a_hook_error_following_skipped_steps_repeats_nothing(tmp_path):
    """Issue 32 item 3: train() after a hook error restarted at optimizer_iteration, repeating the
    iterations whose steps the loss scale had skipped."""
    expected = _params(_fp16_train(tmp_path / "full", 8, resume=False).model)

    class FailOnce(HookBase):
        def __init__(self):
            self.steps, self.failed = [], False

        def after_step(self):
            self.steps.append(self.trainer.iter)
            if self.trainer.iter == 6 and not self.failed:
                self.failed = True
                raise RuntimeError("hook failed")

    hook = FailOnce()
    trainer = _fp16_trainer(tmp_path / "cut", 8, resume=False, hooks=[hook])
    with pytest.raises(RuntimeError, match="hook failed"):
        trainer.train()
    trainer.train()
    assert hook.steps == list(range(8))
    for name, value in _params(trainer.model).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_several_losses_are_recorded_with_their_total_and_each_shown(capsys):
    """total_loss is the sum of the losses the builder returned (Detectron2's scalar, issue 35 item 8)."""
    def two_losses(model, loss_scale):
        scaled = _mlp(model, loss_scale)[0]
        return [scaled, model.net.Scale(scaled, "half_loss", scale=0.5)]

    workspace.ResetWorkspace()
    model = ModelHelper(name=f"trainer_{next(_names)}")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=two_losses,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=[0, 1], cpu_device=True)
    trainer = Trainer(model, _batches(), [PeriodicWriter(period=2, console=True)], max_iter=2)
    trainer.train()
    assert trainer.loss_names == ["scaled_loss", "half_loss", "total_loss"]
    history = trainer.storage.history
    for (_, total), (_, loss), (_, half) in zip(history["total_loss"], history["scaled_loss"], history["half_loss"]):
        assert total == pytest.approx(loss + half) and half == pytest.approx(loss / 2)
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iter 2/2")][0]
    assert line.split()[2:7:2] == ["total_loss", "scaled_loss", "half_loss"]
