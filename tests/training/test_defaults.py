"""graphpar.config and graphpar.defaults, in the style of Detectron2's config and trainer tests: yacs
defaults and merges, the LR schedule against its formula, DefaultTrainer's steps against torch eager
SGD on the same batches, evaluation, and state_dict / resume."""

from __future__ import annotations

import bisect
import itertools
import math
import re

import numpy as np
import pytest
import torch

pytest.importorskip("yacs", reason="graphpar.config is yacs' CfgNode (the yacs package)")

from graphpar import workspace  # noqa: E402
from graphpar.config import CfgNode, get_cfg  # noqa: E402
from graphpar.defaults import DefaultTrainer, LRMultiplier, default_argument_parser  # noqa: E402
from graphpar.engine import HookBase, auto_scale_workers  # noqa: E402
from graphpar.evaluation import ClassificationEvaluator, DatasetEvaluators, flatten_results_dict  # noqa: E402
from graphpar.loaders import DatasetCatalog, TrainingSampler  # noqa: E402

RNG = np.random.default_rng(0)
X = RNG.normal(size=(48, 16)).astype(np.float32)
Y = (X[:, 0] + X[:, 1] > 0).astype(np.int32)
if "defaults_train" not in DatasetCatalog:
    DatasetCatalog.register("defaults_train", lambda: [{"image": x, "label": int(y)} for x, y in zip(X[:32], Y[:32])])
    DatasetCatalog.register("defaults_test", lambda: [{"image": x, "label": int(y)} for x, y in zip(X[32:], Y[32:])])


def _cfg(tmp_path, *opts: str) -> CfgNode:
    cfg = get_cfg()
    cfg.merge_from_list(["DATASETS.TRAIN", "('defaults_train',)", "DATASETS.TEST", "('defaults_test',)",
                         "SOLVER.MAX_ITER", "6", "SOLVER.IMS_PER_BATCH", "8", "SOLVER.WARMUP_ITERS", "3",
                         "SOLVER.STEPS", "(4,)", "SOLVER.BASE_LR", "0.2", "SOLVER.MOMENTUM", "0.0",
                         "MODEL.NUM_CLASSES", "2", "MODEL.HIDDEN", "(8,)", "OUTPUT_DIR", str(tmp_path / "out"),
                         "SOLVER.CHECKPOINT_PERIOD", "3", "SEED", "5", *opts])
    return cfg


def test_get_cfg_merges_yaml_and_key_value_lists_and_refuses_unknown_keys(tmp_path) -> None:
    cfg = get_cfg()
    assert cfg.SOLVER.IMS_PER_BATCH == 16 and cfg.MODEL.DEVICE == "cpu" and not get_cfg().is_frozen()
    path = tmp_path / "exp.yaml"
    path.write_text("SOLVER:\n  BASE_LR: 0.5\n  STEPS: (10, 20)\nMODEL:\n  META_ARCHITECTURE: lenet\n")
    cfg.merge_from_file(str(path))
    cfg.merge_from_list(["SOLVER.MAX_ITER", "300", "DATASETS.TRAIN", "('a', 'b')"])
    assert (cfg.SOLVER.BASE_LR, cfg.SOLVER.STEPS, cfg.MODEL.META_ARCHITECTURE) == (0.5, (10, 20), "lenet")
    assert cfg.SOLVER.MAX_ITER == 300 and cfg.DATASETS.TRAIN == ("a", "b")
    assert get_cfg().SOLVER.BASE_LR == 0.01  # the defaults are untouched
    with pytest.raises(KeyError, match="Non-existent config key: SOLVER.BASE_LRR"):
        cfg.merge_from_list(["SOLVER.BASE_LRR", "1"])
    with pytest.raises(ValueError, match="KEY VALUE pairs"):
        cfg.merge_from_list(["SOLVER.BASE_LR"])
    with pytest.raises(ValueError, match="Type mismatch"):
        cfg.merge_from_list(["SOLVER.MAX_ITER", "'many'"])
    args = default_argument_parser().parse_args(["--config-file", str(path), "--num-gpus", "2", "SOLVER.GAMMA", "0.5"])
    assert args.num_gpus == 2 and args.opts == ["SOLVER.GAMMA", "0.5"]


def test_auto_scale_workers_keeps_a_cfgnode_and_its_frozen_state() -> None:
    cfg = get_cfg()
    cfg.merge_from_list(["SOLVER.REFERENCE_WORLD_SIZE", "8", "SOLVER.IMS_PER_BATCH", "16", "SOLVER.MAX_ITER", "1000"])
    cfg.freeze()
    scaled = auto_scale_workers(cfg, 4)
    assert isinstance(scaled, CfgNode) and scaled.is_frozen()
    assert (scaled.SOLVER.IMS_PER_BATCH, scaled.SOLVER.MAX_ITER, scaled.SOLVER.BASE_LR) == (8, 2000, 0.005)
    assert cfg.SOLVER.IMS_PER_BATCH == 16


class _Composite:
    """fvcore's CompositeParamScheduler, as written there: a list of (schedule, length, rescaled)."""

    def __init__(self, parts) -> None:  # noqa: ANN001
        self.parts = parts

    def __call__(self, where: float) -> float:
        i, total = 0, self.parts[0][1]
        while where + 1e-6 > total and i < len(self.parts) - 1:
            i += 1
            total += self.parts[i][1]
        schedule, length, rescaled = self.parts[i]
        return schedule((where - (total - length)) / length if rescaled else where)


def _detectron2_multiplier(name: str, max_iter: int, steps=(30, 60), gamma=0.1, factor=0.01, warmup=10,
                           method="linear", end=0.0, decays=3, rescale=False):  # noqa: ANN001
    """Detectron2's build_lr_scheduler with fvcore's param schedulers, written from their code: the
    multiplier as a function of the iteration."""
    if name == "WarmupMultiStepLR":
        values = [gamma ** k for k in range(len(steps) + 1)]
        def base(w): return values[bisect.bisect_right(list(steps), int((w + 1e-6) * max_iter))]  # noqa: E704
    elif name == "WarmupCosineLR":
        def base(w): return end + 0.5 * (1 - end) * (1 + math.cos(math.pi * w))  # noqa: E704
    else:
        values = [1.0]
        for _ in range(decays):
            values.append(values[-1] * gamma)
        def base(w): return values[int((w + 1e-6) * len(values))]  # noqa: E704
    length = min(warmup / max_iter, 1.0)
    start, stop = factor * base(0.0), base(length)
    ramp = (lambda w: stop * w + start * (1 - w)) if method == "linear" else (lambda w: start)
    schedule = _Composite([(ramp, length, True), (base, 1 - length, rescale)])
    return lambda it: schedule(it / max_iter)


@pytest.mark.parametrize("name, method, rescale", [
    ("WarmupMultiStepLR", "linear", False), ("WarmupCosineLR", "linear", False), ("WarmupCosineLR", "constant", False),
    ("WarmupMultiStepLR", "constant", False), ("WarmupStepWithFixedGammaLR", "linear", False),
    ("WarmupCosineLR", "linear", True), ("WarmupMultiStepLR", "linear", True)])
def test_lr_multiplier_is_detectron2s_per_iteration(name, method, rescale) -> None:
    schedule = LRMultiplier(name, 100, (30, 60), 0.1, 0.01, 10, method, end_value=0.05, rescale_interval=rescale)
    expected = _detectron2_multiplier(name, 100, method=method, end=0.05, rescale=rescale)
    assert [schedule(it) for it in range(100)] == [expected(it) for it in range(100)]  # to the last bit
    if name == "WarmupCosineLR" and method == "linear" and not rescale:  # the warmup ends at the cosine's value
        assert schedule(9) == pytest.approx(0.01 + (0.05 + 0.475 * (1 + math.cos(math.pi * 0.1)) - 0.01) * 0.9)
        assert schedule(10) == pytest.approx(0.05 + 0.475 * (1 + math.cos(math.pi * 0.1)))


def test_lr_multiplier_equals_fvcores_schedulers() -> None:
    ps = pytest.importorskip("fvcore.common.param_scheduler")

    def detectron2(scheduler, length, method, rescale):  # noqa: ANN001, ANN202 - WarmupParamScheduler
        start, end = 0.01 * scheduler(0.0), scheduler(length)
        warm = ps.LinearParamScheduler(start, end) if method == "linear" else ps.ConstantParamScheduler(start)
        return ps.CompositeParamScheduler([warm, scheduler], [length, 1 - length],
                                          ["rescaled", "rescaled" if rescale else "fixed"])

    cases = [("WarmupMultiStepLR", ps.MultiStepParamScheduler([0.1 ** k for k in range(3)], 1000, [300, 600])),
             ("WarmupCosineLR", ps.CosineParamScheduler(1, 0.05)),
             ("WarmupStepWithFixedGammaLR", ps.StepWithFixedGammaParamScheduler(1.0, 3, 0.1, 1000))]
    for name, base in cases:
        for method, rescale, warmup in (("linear", False, 100), ("constant", False, 7), ("linear", True, 33)):
            ours = LRMultiplier(name, 1000, (300, 600), 0.1, 0.01, warmup, method, end_value=0.05,
                                rescale_interval=rescale)
            theirs = detectron2(base, warmup / 1000, method, rescale)
            assert [ours(it) for it in range(1000)] == [theirs(it / 1000) for it in range(1000)], (name, method)


def test_lr_multiplier_refuses_what_detectron2_refuses() -> None:
    with pytest.raises(ValueError, match="LR_SCHEDULER_NAME"):
        LRMultiplier("Poly", 10)
    with pytest.raises(ValueError, match="increasing"):
        LRMultiplier("WarmupMultiStepLR", 10, (5, 2))
    with pytest.raises(ValueError, match=r"in \(0, MAX_ITER=10\)"):
        LRMultiplier("WarmupMultiStepLR", 10, (5, 10))
    assert LRMultiplier("WarmupMultiStepLR", 10, (5, 11))(6) == pytest.approx(0.1)  # past MAX_ITER: dropped
    with pytest.raises(ValueError, match=r"BASE_LR_END / SOLVER.BASE_LR must be in \[0, 1\]"):
        LRMultiplier("WarmupCosineLR", 10, end_value=2.0)
    with pytest.raises(ValueError, match="WARMUP_METHOD"):
        LRMultiplier("WarmupCosineLR", 10, warmup_method="exp")


def _eager_reference(params: dict[str, np.ndarray], cfg: CfgNode, steps: int) -> dict[str, torch.Tensor]:
    """The MLP trained by torch eager SGD (weight decay on every param) on the batches the loader draws."""
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    order = list(itertools.islice(TrainingSampler(32, seed=cfg.SEED, rank=0, world=1), steps * 8))
    schedule = DefaultTrainer.build_lr_scheduler(cfg)
    for it in range(steps):
        rows = order[it * 8:(it + 1) * 8]
        x, y = torch.from_numpy(X[rows]), torch.from_numpy(Y[rows]).long()
        h = torch.relu(x @ p["fc1_w"].T + p["fc1_b"])
        loss = torch.nn.functional.cross_entropy(h @ p["pred_w"].T + p["pred_b"], y)
        grads = torch.autograd.grad(loss, list(p.values()))
        with torch.no_grad():
            lr = cfg.SOLVER.BASE_LR * schedule(it)
            for value, g in zip(p.values(), grads):
                value -= lr * (g + cfg.SOLVER.WEIGHT_DECAY * value)
    return p


def _params(prefix: str = "cpu_0") -> dict[str, np.ndarray]:
    return {n: workspace.FetchBlob(f"{prefix}/{n}") for n in ("fc1_w", "fc1_b", "pred_w", "pred_b")}


@pytest.mark.parametrize("devices", [1, 2])
def test_default_trainer_trains_as_eager_sgd_with_the_scheduled_lr(tmp_path, devices) -> None:
    workspace.ResetWorkspace()
    workspace.SetSeed(0)
    trainer = DefaultTrainer(_cfg(tmp_path, "MODEL.NUM_DEVICES", str(devices)))
    trainer.resume_or_load(resume=False)
    start = _params()
    trainer.train()
    expected = _eager_reference(start, trainer.cfg, 6)
    for name, value in _params().items():
        np.testing.assert_allclose(value, expected[name].detach().numpy(), rtol=2e-5, atol=1e-6, err_msg=name)
    lrs = [v for _, v in trainer.storage.history["lr"]]
    np.testing.assert_allclose(lrs, [0.2 * trainer.scheduler(it) for it in range(6)], rtol=1e-6)
    assert lrs[0] == pytest.approx(0.2 * 0.001) and lrs[5] == pytest.approx(0.02)
    # EvalHook ran DefaultTrainer.test after the last step: the accuracy of the test split, from NumPy
    p = _params()
    scores = np.maximum(X[32:] @ p["fc1_w"].T + p["fc1_b"], 0) @ p["pred_w"].T + p["pred_b"]
    accuracy = float((scores.argmax(1) == Y[32:]).mean())
    assert trainer.storage.latest()["accuracy/top1"][1] == pytest.approx(accuracy)
    assert DefaultTrainer.test(trainer.cfg, trainer.test_model) == {"accuracy": {"top1": pytest.approx(accuracy)}}


class Counter(HookBase):
    def __init__(self) -> None:
        self.steps = 0

    def after_step(self) -> None:
        self.steps += 1

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def test_state_dict_and_resume_restore_iteration_scheduler_and_hooks(tmp_path) -> None:
    workspace.ResetWorkspace()
    first = DefaultTrainer(_cfg(tmp_path, "SOLVER.MAX_ITER", "4", "SOLVER.STEPS", "(3,)"))
    first.register_hooks([Counter()])
    first.resume_or_load(resume=True)  # nothing to resume: starts at 0
    first.train()
    state = first.state_dict()
    assert state["iteration"] == 4 and state["hooks"] == {"Counter": {"steps": 4}}
    assert state["scheduler"]["last_iter"] == 3
    saved = _params()

    workspace.ResetWorkspace()
    second = DefaultTrainer(_cfg(tmp_path, "SOLVER.MAX_ITER", "6"))
    counter = Counter()
    second.register_hooks([counter])
    assert second.resume_or_load(resume=True) == 4  # the checkpoint written after iteration 4
    assert counter.steps == 3 and second.scheduler.last_iter == 3  # saved at 3 steps, with the checkpoint
    for name, value in saved.items():
        np.testing.assert_array_equal(_params()[name], value)
    second.train()
    assert [it for it, _ in second.storage.history["lr"]] == [4, 5] and counter.steps == 5
    third = DefaultTrainer.__new__(DefaultTrainer)
    third.hooks, third.scheduler, third.storage = [Counter()], LRMultiplier("WarmupMultiStepLR", 6), second.storage
    third.load_state_dict(state)
    assert third.iter == third.start_iter == 5 and third.hooks[0].steps == 4 and third.scheduler.last_iter == 3


class Crash(HookBase):
    def __init__(self, at: int) -> None:
        self.at = at

    def after_step(self) -> None:
        if self.trainer.iter == self.at:
            raise RuntimeError("the process dies")


def test_a_restarted_default_trainer_continues_its_job_with_its_state(tmp_path, monkeypatch) -> None:
    """Issue 33 item 3: restarted by the launcher's agent, `resume_or_load(resume=False)` (how the job
    began) continues from the job's last checkpoint in OUTPUT_DIR, scheduler and hooks included (the
    data, as Detectron2's infinite loader, starts its sampler over)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    workspace.ResetWorkspace()
    workspace.SetSeed(0)
    first = DefaultTrainer(_cfg(tmp_path))  # the attempt that dies in iteration 5, after its checkpoint at 3
    first.register_hooks([Counter(), Crash(at=4)])
    first.resume_or_load(resume=False)
    with pytest.raises(RuntimeError, match="the process dies"):
        first.train()
    workspace.ResetWorkspace()
    DefaultTrainer(_cfg(tmp_path)).resume_or_load(resume=True)  # the params of that checkpoint
    saved = _params()

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    workspace.ResetWorkspace()
    workspace.SetSeed(0)
    again = DefaultTrainer(_cfg(tmp_path))
    counter = Counter()
    again.register_hooks([counter])
    assert again.resume_or_load(resume=False) == 3 and counter.steps == 2 and again.scheduler.last_iter == 2
    for name, value in saved.items():
        np.testing.assert_array_equal(_params()[name], value, err_msg=name)
    again.train()
    assert [it for it, _ in again.storage.history["lr"]] == [3, 4, 5]


def test_evaluators_combine_and_classification_counts_top_k() -> None:
    evaluator = ClassificationEvaluator(topk=(1, 2))
    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3], [0.2, 0.3, 0.5]])
    evaluator.process({"label": np.array([1, 2, 1])}, {"softmax": scores})
    assert evaluator.evaluate() == {"accuracy": {"top1": pytest.approx(1 / 3), "top2": pytest.approx(1.0)}}
    both = DatasetEvaluators([evaluator, ClassificationEvaluator(scores="other")])
    assert both.output_names == ["other", "softmax"]
    with pytest.raises(ValueError, match="two evaluators return the task 'accuracy'"):
        both.process({"label": np.array([0])}, {"softmax": scores[:1], "other": scores[:1]})
        both.evaluate()
    assert flatten_results_dict({"a": {"b": 1, "c": {"d": 2}}}) == {"a/b": 1.0, "a/c/d": 2.0}


def test_a_bad_config_is_refused_with_the_key(tmp_path) -> None:
    with pytest.raises(ValueError, match="META_ARCHITECTURE 'nope' is not in MODEL_REGISTRY"):
        DefaultTrainer(_cfg(tmp_path, "MODEL.META_ARCHITECTURE", "nope"))
    with pytest.raises(ValueError, match="MODEL.DEVICE must be 'cpu' or 'cuda'"):
        DefaultTrainer(_cfg(tmp_path, "MODEL.DEVICE", "tpu"))
    with pytest.raises(ValueError, match="IMS_PER_BATCH=8 must be a multiple of the 3 devices"):
        DefaultTrainer(_cfg(tmp_path, "MODEL.NUM_DEVICES", "3"))


def test_the_config_is_scaled_to_the_devices_and_weights_start_a_new_run(tmp_path) -> None:
    workspace.ResetWorkspace()
    first = DefaultTrainer(_cfg(tmp_path, "SOLVER.REFERENCE_WORLD_SIZE", "1", "MODEL.NUM_DEVICES", "2",
                                "SOLVER.IMS_PER_BATCH", "4", "SOLVER.MAX_ITER", "8", "SOLVER.CHECKPOINT_PERIOD", "2"))
    solver = first.cfg.SOLVER  # linear scaling from 1 device to 2
    assert (solver.IMS_PER_BATCH, solver.BASE_LR, solver.MAX_ITER, solver.STEPS) == (8, 0.4, 4, (2,))
    assert first.cfg.is_frozen() and first.max_iter == 4
    first.resume_or_load(resume=False)
    first.train()
    trained = _params()

    workspace.ResetWorkspace()
    weights = tmp_path / "out" / "model_0000004.safetensors"
    second = DefaultTrainer(_cfg(tmp_path, "MODEL.WEIGHTS", str(weights), "OUTPUT_DIR", str(tmp_path / "other")))
    assert second.resume_or_load(resume=True) == 0  # nothing in its OUTPUT_DIR: MODEL.WEIGHTS, from iteration 0
    for name, value in trained.items():
        np.testing.assert_array_equal(_params()[name], value)


def test_the_seed_of_the_config_makes_the_run_repeatable(tmp_path) -> None:
    workspace.ResetWorkspace()
    DefaultTrainer(_cfg(tmp_path)).initialize()
    first = _params()
    workspace.ResetWorkspace()
    workspace.SetSeed(123)  # whatever the workspace was seeded with before
    DefaultTrainer(_cfg(tmp_path)).initialize()
    for name, value in first.items():
        np.testing.assert_array_equal(_params()[name], value)
    workspace.ResetWorkspace()
    DefaultTrainer(_cfg(tmp_path, "SEED", "1")).initialize()
    assert not np.array_equal(_params()["fc1_w"], first["fc1_w"])


def _autocast_reference(params: dict[str, np.ndarray], cfg: CfgNode, steps: int) -> dict[str, torch.Tensor]:
    """As `_eager_reference`, under torch.autocast("cpu", bfloat16): what Detectron2's AMPTrainer does on a
    GPU in float16, in the dtype a CPU has."""
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    order = list(itertools.islice(TrainingSampler(32, seed=cfg.SEED, rank=0, world=1), steps * 8))
    schedule = DefaultTrainer.build_lr_scheduler(cfg)
    for it in range(steps):
        rows = order[it * 8:(it + 1) * 8]
        x, y = torch.from_numpy(X[rows]), torch.from_numpy(Y[rows]).long()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(torch.nn.functional.linear(x, p["fc1_w"], p["fc1_b"]))
            logits = torch.nn.functional.linear(h, p["pred_w"], p["pred_b"])
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        grads = torch.autograd.grad(loss, list(p.values()))
        with torch.no_grad():
            lr = cfg.SOLVER.BASE_LR * schedule(it)
            for value, g in zip(p.values(), grads):
                value -= lr * (g + cfg.SOLVER.WEIGHT_DECAY * value)
    return p


def test_amp_trains_in_bfloat16_on_cpu_devices_as_torch_autocast(tmp_path) -> None:
    workspace.ResetWorkspace()
    workspace.SetSeed(0)
    trainer = DefaultTrainer(_cfg(tmp_path, "MODEL.NUM_DEVICES", "2", "SOLVER.AMP.ENABLED", "True"))
    options = trainer.model._parallel.options
    assert (options.compute_dtype, options.loss_scale) == ("bfloat16", None)
    assert trainer.test_model._parallel.options.compute_dtype is None  # evaluation in float32
    trainer.resume_or_load(resume=False)
    start = _params()
    trainer.train()
    amp, fp32 = _autocast_reference(start, trainer.cfg, 6), _eager_reference(start, trainer.cfg, 6)
    fcs = [op for op in trainer.model.net.Proto().ops if op.type == "FC"]
    assert fcs and all(b.endswith("_bf16") for op in fcs for b in op.inputs[1:])  # bf16 copies of fp32 masters
    assert workspace.FetchTensor("cpu_0/pred_w_bf16_grad").dtype == torch.bfloat16
    for name, value in _params().items():
        np.testing.assert_allclose(value, amp[name].detach().numpy(), atol=5e-4, err_msg=name)
        assert value.dtype == np.float32
    assert not all(np.array_equal(value, fp32[name].detach().numpy()) for name, value in _params().items())


def test_amp_on_cuda_devices_is_float16_with_a_dynamic_loss_scale() -> None:
    cfg = get_cfg()
    assert DefaultTrainer.precision_options(cfg, cpu=False) == {}
    cfg.SOLVER.AMP.ENABLED = True
    assert DefaultTrainer.precision_options(cfg, cpu=False) == {"compute_dtype": "float16", "loss_scale": "dynamic"}
    assert DefaultTrainer.precision_options(cfg, cpu=True) == {"compute_dtype": "bfloat16"}


def test_cuda_asked_without_a_gpu_raises_with_the_fix_or_runs_on_logical_gpus(monkeypatch) -> None:
    """torch's DataParallel falls back to the CPU silently; graphpar says what to do, and
    GRAPHPAR_CUDA_ON_CPU=1 is the opt-in fallback (the same program on logical CUDA devices)."""
    from graphpar.devices import cuda_on_cpu
    from graphpar.training.defaults import devices_of
    from tests.fake_gpus import fake_gpus

    fake_gpus(monkeypatch, 0)
    cfg = get_cfg()
    cfg.merge_from_list(["MODEL.DEVICE", "cuda", "MODEL.NUM_DEVICES", "2"])
    with pytest.raises(ValueError, match="no GPU is visible .* MODEL.DEVICE to 'cpu' .* GRAPHPAR_CUDA_ON_CPU=1"):
        devices_of(cfg)
    with cuda_on_cpu():
        assert devices_of(cfg) == ([0, 1], False)


if "defaults_test17" not in DatasetCatalog:
    DatasetCatalog.register("defaults_test17", lambda: [{"image": x, "label": int(y)} for x, y in zip(X[31:], Y[31:])])
    DatasetCatalog.register("defaults_test10", lambda: [{"image": x, "label": int(y)} for x, y in zip(X[:10], Y[:10])])


def _scores(rows: slice) -> np.ndarray:
    p = _params()
    return np.maximum(X[rows] @ p["fc1_w"].T + p["fc1_b"], 0) @ p["pred_w"].T + p["pred_b"]


def test_default_trainer_evaluates_a_last_batch_smaller_than_the_device_count(tmp_path) -> None:
    """Issue 32 item 5 / issue 34 item 3: 17 test rows in batches of 8 on 2 devices: the last batch
    (1 row) raised 'a batch of 1 rows cannot give each of 2 devices at least one row' at train()'s
    final evaluation. Every row is now evaluated once."""
    workspace.ResetWorkspace()
    trainer = DefaultTrainer(_cfg(tmp_path, "MODEL.NUM_DEVICES", "2", "DATASETS.TEST", "('defaults_test17',)",
                                  "SOLVER.MAX_ITER", "2"))
    trainer.train()
    accuracy = float((_scores(slice(31, 48)).argmax(1) == Y[31:]).mean())
    assert trainer.storage.latest()["accuracy/top1"][1] == pytest.approx(accuracy)
    assert DefaultTrainer.test(trainer.cfg, trainer.test_model) == {"accuracy": {"top1": pytest.approx(accuracy)}}


def test_inference_on_dataset_gives_the_evaluator_each_sample_once_whatever_the_last_batch(tmp_path) -> None:
    """Issue 32 item 5: 10 samples in batches of 8 on 4 devices: the last batch (2 rows) raised. The
    evaluator now sees 8 then 2 rows, each with its own scores (the softmax of the NumPy forward)."""
    from graphpar.evaluation import DatasetEvaluator, inference_on_dataset

    class Recorder(DatasetEvaluator):
        output_names = ("softmax",)

        def reset(self) -> None:
            self.labels, self.scores = [], []

        def process(self, inputs, outputs) -> None:
            self.labels.append(np.asarray(inputs["label"]))
            self.scores.append(outputs["softmax"])

    workspace.ResetWorkspace()
    trainer = DefaultTrainer(_cfg(tmp_path, "MODEL.NUM_DEVICES", "4", "DATASETS.TEST", "('defaults_test10',)"))
    trainer.initialize()
    recorder = Recorder()
    inference_on_dataset(trainer.test_model, DefaultTrainer.build_test_loader(trainer.cfg, "defaults_test10"), recorder)
    assert [len(labels) for labels in recorder.labels] == [8, 2]
    np.testing.assert_array_equal(np.concatenate(recorder.labels), Y[:10])
    expected = torch.softmax(torch.from_numpy(_scores(slice(0, 10))), dim=1).numpy()
    np.testing.assert_allclose(np.concatenate(recorder.scores), expected, rtol=1e-5, atol=1e-6)


def test_a_frozen_config_refuses_merges_and_a_failed_merge_changes_nothing(tmp_path) -> None:
    """Issue 32 item 9: merge_from_list / merge_from_file changed a frozen config (DefaultTrainer's)
    without error, and a merge that raised kept the entries applied before the bad one."""
    good = tmp_path / "good.yaml"
    good.write_text("SOLVER:\n  BASE_LR: 0.5\n")
    frozen = get_cfg()
    frozen.freeze()
    for merge in (lambda c: c.merge_from_list(["SOLVER.BASE_LR", "0.5"]), lambda c: c.merge_from_file(str(good))):
        with pytest.raises(AttributeError, match="the config is frozen"):
            merge(frozen)
        assert frozen.SOLVER.BASE_LR == 0.01
    bad = tmp_path / "bad.yaml"
    bad.write_text("SOLVER:\n  BASE_LR: 0.5\n  MAX_ITER: many\n")
    cfg = get_cfg()
    with pytest.raises(ValueError, match="Type mismatch"):
        cfg.merge_from_list(["SOLVER.BASE_LR", "0.5", "SOLVER.MAX_ITER", "'many'"])
    with pytest.raises(ValueError, match="Type mismatch"):
        cfg.merge_from_file(str(bad))
    typo = tmp_path / "typo.yaml"
    typo.write_text("SOLVER:\n  BASE_LR: 0.5\n  BASE_LRR: 1.0\n")
    with pytest.raises(KeyError, match="Non-existent config key"):
        cfg.merge_from_file(str(typo))
    assert cfg == get_cfg()  # nothing of the failed merges was kept
    cfg.merge_from_file(str(good))
    assert cfg.SOLVER.BASE_LR == 0.5


def test_a_yaml_config_whose_top_level_is_not_a_mapping_is_refused_naming_the_file(tmp_path) -> None:
    """Issue 32 item 14: a YAML list at the top level failed with yacs' internal AttributeError."""
    path = tmp_path / "list.yaml"
    path.write_text("- SOLVER.BASE_LR\n- 0.5\n")
    cfg = get_cfg()
    with pytest.raises(ValueError, match=r"list.yaml'.*top level must be a mapping of keys .*got a list"):
        cfg.merge_from_file(str(path))
    (tmp_path / "empty.yaml").write_text("")
    cfg.merge_from_file(str(tmp_path / "empty.yaml"))
    assert cfg == get_cfg()


def test_training_prints_a_line_every_20_iterations_with_the_total_loss(tmp_path, capsys) -> None:
    """Detectron2's CommonMetricPrinter (issue 35 item 8): iteration, ETA, the loss under Detectron2's
    name `total_loss` (the model's one loss is `scaled_loss`, a blob name: not shown twice), time, lr."""
    trainer = DefaultTrainer(_cfg(tmp_path, "SOLVER.MAX_ITER", "40", "TEST.EVAL_PERIOD", "0"))
    trainer.resume_or_load(resume=False)
    capsys.readouterr()
    trainer.train()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iter ")]
    assert [line.split()[1] for line in lines[:2]] == ["20/40", "40/40"]  # then the evaluation's, at the end
    assert re.fullmatch(r"iter 20/40  eta \d+:\d\d:\d\d  total_loss [0-9.]+  (lr|time) [0-9.e-]+  (lr|time) [0-9.e-]+",
                        lines[0]) and " time " in lines[0] and " lr " in lines[0]
    assert "scaled_loss" not in lines[1] and " total_loss " in lines[1]
    history = trainer.storage.history
    assert history["total_loss"] == history["scaled_loss"] and len(history["total_loss"]) == 40
    assert float(lines[1].split("total_loss ")[1].split()[0]) == pytest.approx(history["total_loss"][-1][1], rel=1e-3)
