"""Detectron2's `DefaultTrainer` for graphpar: a config-driven `engine.Trainer`.

    cfg = get_cfg()
    cfg.merge_from_file(args.config_file)
    cfg.merge_from_list(args.opts)
    trainer = DefaultTrainer(cfg)
    trainer.resume_or_load(resume=args.resume)
    trainer.train()

Every part comes from a classmethod a subclass overrides: `build_model` (the parallelized model, from
`MODEL_REGISTRY[cfg.MODEL.META_ARCHITECTURE]`, on this process's devices), `build_optimizer` (SGD with
momentum and weight decay, the LR multiplied by the scheduler through `lr_injection`),
`build_lr_scheduler` (Detectron2's warmup + multi-step, cosine or fixed-gamma multiplier of BASE_LR),
`precision_options` (SOLVER.AMP.ENABLED: mixed precision, float16 on GPUs and bfloat16 on CPUs),
`build_train_loader` / `build_test_loader` (`graphpar.loaders` over DATASETS.TRAIN / TEST with
`mapper`), `build_evaluator` and `test`. `SOLVER.IMS_PER_BATCH` is the global batch over every device
of every process; with `SOLVER.REFERENCE_WORLD_SIZE` the config is first scaled to the device count
(`auto_scale_workers`). Checkpoints (every SOLVER.CHECKPOINT_PERIOD, in OUTPUT_DIR) carry the params,
the optimizer state and `state_dict()`: the iteration, the scheduler and the hooks' state.
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from graphpar import models
from graphpar.model import optimizer
from graphpar.model.model_helper import ModelHelper
from graphpar.parallel import comm, launch
from graphpar.parallel import data_parallel_model as dpm
from graphpar.platform.devices import cuda_is_simulated, num_cuda_devices
from graphpar.runtime import checkpoint, workspace
from graphpar.training.config import CfgNode
from graphpar.training.engine import (
    EvalHook,
    HookBase,
    IterationTimer,
    LRScheduler,
    PeriodicCheckpointer,
    PeriodicWriter,
    Trainer,
    auto_scale_workers,
    checkpoints,
)
from graphpar.training.evaluation import (
    ClassificationEvaluator,
    DatasetEvaluator,
    flatten_results_dict,
    inference_on_dataset,
)
from graphpar.training.loaders import DatasetCatalog, build_test_loader, build_train_loader
from graphpar.training.lr_schedules import LRMultiplier

__all__ = ["MODEL_REGISTRY", "DefaultTrainer", "LRMultiplier", "default_argument_parser", "default_mapper",
           "devices_of"]

log = logging.getLogger(__name__)

MODEL_REGISTRY: dict[str, Callable[[CfgNode], Callable[..., Any]]] = {
    "mlp": lambda cfg: functools.partial(models.mlp, dim_in=cfg.MODEL.INPUT_DIM, hidden=tuple(cfg.MODEL.HIDDEN),
                                         num_classes=cfg.MODEL.NUM_CLASSES),
    "lenet": lambda cfg: functools.partial(models.lenet, num_classes=cfg.MODEL.NUM_CLASSES),
    "resnet18": lambda cfg: functools.partial(models.resnet18, num_classes=cfg.MODEL.NUM_CLASSES),
    "resnet50": lambda cfg: functools.partial(models.resnet50, num_classes=cfg.MODEL.NUM_CLASSES),
}


def devices_of(cfg: CfgNode) -> tuple[list[int], bool]:
    """(this process's device ids, whether they are CPU devices): MODEL.NUM_DEVICES CPU devices, or this
    process's GPUs (`comm.local_devices`; NUM_DEVICES 0: the machine's GPUs shared out). With
    MODEL.DEVICE "cuda" on a machine without GPUs it raises (torch's DataParallel would fall back to the
    CPU silently), unless CUDA devices are placed on the CPU (`GRAPHPAR_CUDA_ON_CPU=1`, the opt-in
    fallback): then MODEL.NUM_DEVICES (at least 1) logical CUDA devices."""
    if cfg.MODEL.DEVICE not in ("cpu", "cuda"):
        raise ValueError(f"MODEL.DEVICE must be 'cpu' or 'cuda', got {cfg.MODEL.DEVICE!r}")
    count = cfg.MODEL.NUM_DEVICES
    if cfg.MODEL.DEVICE == "cpu":
        if count < 1:
            raise ValueError(f"MODEL.NUM_DEVICES must be >= 1 for CPU devices, got {count}")
        return list(range(count)), True
    if num_cuda_devices() == 0:
        if cuda_is_simulated():
            return list(range(max(count, 1))), False
        raise ValueError("MODEL.DEVICE is 'cuda' but no GPU is visible (torch.cuda.is_available() is False): set "
                         "MODEL.DEVICE to 'cpu' to train on MODEL.NUM_DEVICES CPU devices, or GRAPHPAR_CUDA_ON_CPU=1 "
                         "to run the CUDA devices on the CPU (graphpar does not fall back silently, as torch's "
                         "DataParallel does)")
    return comm.local_devices(count or None), False


def default_mapper(sample: Mapping[str, Any]) -> dict[str, Any] | None:
    """{"image": array, "label": int} -> {"data": float32 array, "label": int32} (None: no image)."""
    import numpy as np

    if sample.get("image") is None:
        return None
    return {"data": np.asarray(sample["image"], dtype=np.float32), "label": np.int32(sample["label"])}


class _Checkpointer(PeriodicCheckpointer):
    """PeriodicCheckpointer that also saves the trainer's state_dict, on the main process only."""

    def metadata(self) -> dict[str, Any]:
        state_dict = getattr(self.trainer, "state_dict", None)  # a DefaultTrainer's
        return {"trainer": state_dict()} if callable(state_dict) else {}

    def after_step(self) -> None:
        if comm.is_main_process():
            super().after_step()


class DefaultTrainer(Trainer):
    """A Trainer built from a config (see the module docstring). Attributes: `cfg` (after scaling),
    `model` (training), `test_model` (forward-only, sharing the params), `scheduler`, `data` (the
    train loader). The workspace's random streams are seeded with SEED (unless it is < 0) and the
    training sampler too, so a config trains the same way wherever it runs."""

    def __init__(self, cfg: CfgNode) -> None:
        cfg = cfg.clone()
        devices, _ = devices_of(cfg)
        cfg = self.auto_scale_workers(cfg, len(devices) * comm.get_world_size())
        cfg.freeze()
        self.cfg = cfg
        if cfg.SEED >= 0:  # Detectron2's default_setup seeds every generator: the same config, the same run
            workspace.SetSeed(cfg.SEED)
        self.scheduler = self.build_lr_scheduler(cfg)
        model = self.build_model(cfg)
        super().__init__(model, self.build_train_loader(cfg), max_iter=cfg.SOLVER.MAX_ITER)
        self.test_model = self.build_model(cfg, training=False)
        self.register_hooks(self.build_hooks())

    # -- builders (override in a subclass) --

    @classmethod
    def build_model(cls, cfg: CfgNode, training: bool = True) -> ModelHelper:
        """The parallelized model (`training`: with the optimizer; else forward-only, sharing the
        training model's params, any batch size)."""
        name = cfg.MODEL.META_ARCHITECTURE
        if name not in MODEL_REGISTRY:
            raise ValueError(f"MODEL.META_ARCHITECTURE {name!r} is not in MODEL_REGISTRY ({sorted(MODEL_REGISTRY)}); "
                             f"register a builder or override DefaultTrainer.build_model")
        devices, cpu = devices_of(cfg)
        forward = MODEL_REGISTRY[name](cfg)
        rendezvous = launch.rendezvous()
        if not training:
            test = ModelHelper(name=f"{name}_test", init_params=False)
            dpm.Parallelize(test, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward, devices=devices,
                            cpu_device=cpu, uneven_batches=True)
            return test
        model = ModelHelper(name=f"{name}_train")
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                        optimizer_builder_fun=lambda m: cls.build_optimizer(cfg, m), devices=devices, cpu_device=cpu,
                        rendezvous=rendezvous, **cls.precision_options(cfg, cpu))
        return model

    @classmethod
    def precision_options(cls, cfg: CfgNode, cpu: bool) -> dict[str, Any]:
        """Parallelize's mixed-precision options for SOLVER.AMP.ENABLED (Detectron2's AMPTrainer, which
        needs CUDA): on CUDA devices float16 with torch.amp.GradScaler's dynamic loss scale (a step whose
        gradients overflow is skipped and the scale halves); on CPU devices bfloat16, which needs no
        loss scale (it has float32's range; CPU float16 kernels are slow). None of them when AMP is off.
        The evaluation model computes in float32."""
        if not cfg.SOLVER.AMP.ENABLED:
            return {}
        options = {"compute_dtype": "bfloat16"} if cpu else {"compute_dtype": "float16", "loss_scale": "dynamic"}
        log.info("SOLVER.AMP.ENABLED: training in %s%s", options["compute_dtype"],
                 "" if cpu else " with a dynamic loss scale")
        return options

    @classmethod
    def build_optimizer(cls, cfg: CfgNode, model: ModelHelper) -> Any:
        """SGD (SOLVER.BASE_LR, MOMENTUM, NESTEROV, WEIGHT_DECAY) whose LR the scheduler multiplies
        (`lr_injection`, fed before every step by the LRScheduler hook)."""
        return optimizer.build_sgd(model, cfg.SOLVER.BASE_LR, momentum=cfg.SOLVER.MOMENTUM,
                                   nesterov=cfg.SOLVER.NESTEROV, weight_decay=cfg.SOLVER.WEIGHT_DECAY,
                                   allow_lr_injection=True)

    @classmethod
    def build_lr_scheduler(cls, cfg: CfgNode) -> LRMultiplier:
        """Detectron2's `build_lr_scheduler`: BASE_LR's multiplier per iteration (`training.lr_schedules`)."""
        s = cfg.SOLVER
        return LRMultiplier(s.LR_SCHEDULER_NAME, s.MAX_ITER, tuple(s.STEPS), s.GAMMA, s.WARMUP_FACTOR,
                            s.WARMUP_ITERS, s.WARMUP_METHOD, end_value=s.BASE_LR_END / s.BASE_LR,
                            num_decays=s.NUM_DECAYS, rescale_interval=s.RESCALE_INTERVAL)

    @classmethod
    def build_train_loader(cls, cfg: CfgNode) -> Any:
        """An infinite loader of this process's share of each SOLVER.IMS_PER_BATCH batch from every
        dataset of DATASETS.TRAIN, through `default_mapper`."""
        if not cfg.DATASETS.TRAIN:
            raise ValueError("DATASETS.TRAIN is empty: name datasets registered in graphpar.loaders.DatasetCatalog")
        dataset = [d for name in cfg.DATASETS.TRAIN for d in DatasetCatalog.get(name)]
        devices, _ = devices_of(cfg)
        return build_train_loader(dataset, default_mapper, cfg.SOLVER.IMS_PER_BATCH,
                                  seed=cfg.SEED if cfg.SEED >= 0 else None,  # < 0: a random seed, shared
                                  aspect_ratio_grouping=cfg.DATALOADER.ASPECT_RATIO_GROUPING,
                                  num_workers=cfg.DATALOADER.NUM_WORKERS, num_devices=len(devices))

    @classmethod
    def build_test_loader(cls, cfg: CfgNode, dataset_name: str) -> Any:
        """This process's part of dataset `dataset_name`, in batches of this process's share of
        SOLVER.IMS_PER_BATCH, through `default_mapper`."""
        return build_test_loader(DatasetCatalog.get(dataset_name), default_mapper,
                                 batch_size=max(1, cfg.SOLVER.IMS_PER_BATCH // comm.get_world_size()),
                                 num_workers=cfg.DATALOADER.NUM_WORKERS)

    @classmethod
    def build_evaluator(cls, cfg: CfgNode, dataset_name: str) -> DatasetEvaluator:
        """Top-1 accuracy of `softmax` against `label` (override for other metrics)."""
        return ClassificationEvaluator()

    @staticmethod
    def auto_scale_workers(cfg: CfgNode, num_workers: int) -> CfgNode:
        return auto_scale_workers(cfg, num_workers)

    def build_hooks(self) -> list[HookBase]:
        """IterationTimer, LRScheduler (the scheduler), the checkpointer (OUTPUT_DIR, every
        SOLVER.CHECKPOINT_PERIOD), EvalHook (TEST.EVAL_PERIOD, `test`), and on the main process a
        PeriodicWriter (OUTPUT_DIR/metrics.json, and a console line every 20 iterations: iteration,
        ETA, total_loss, time, lr)."""
        cfg = self.cfg
        hooks: list[HookBase] = [IterationTimer(), LRScheduler(self.scheduler),
                                 _Checkpointer(cfg.OUTPUT_DIR, max(1, cfg.SOLVER.CHECKPOINT_PERIOD))]
        if cfg.DATASETS.TEST:
            hooks.append(EvalHook(cfg.TEST.EVAL_PERIOD,
                                  lambda: flatten_results_dict(self.test(self.cfg, self.test_model))))
        if comm.is_main_process():  # a console line every 20 iterations, as Detectron2's CommonMetricPrinter
            hooks.append(PeriodicWriter(cfg.OUTPUT_DIR, period=20, console=True, tensorboard=False))
        return hooks

    # -- evaluation and state --

    @classmethod
    def test(cls, cfg: CfgNode, model: ModelHelper,
             evaluators: DatasetEvaluator | list[DatasetEvaluator] | None = None) -> dict[str, Any]:
        """Evaluate the forward-only `model` on every dataset of DATASETS.TEST: {dataset: results} on
        the main process ({} on the others; one dataset: its results alone)."""
        if isinstance(evaluators, DatasetEvaluator):
            evaluators = [evaluators]
        if evaluators is not None and len(evaluators) != len(cfg.DATASETS.TEST):
            raise ValueError(f"DefaultTrainer.test: {len(evaluators)} evaluators for {len(cfg.DATASETS.TEST)} "
                             f"datasets in DATASETS.TEST")
        results: dict[str, Any] = {}
        for k, name in enumerate(cfg.DATASETS.TEST):
            evaluator = evaluators[k] if evaluators is not None else cls.build_evaluator(cfg, name)
            found = inference_on_dataset(model, cls.build_test_loader(cfg, name), evaluator)
            if found:
                results[name] = found
                log.info("evaluation on %s: %s", name, found)
        return next(iter(results.values())) if len(results) == 1 else results

    def state_dict(self) -> dict[str, Any]:
        """{"iteration": the last iteration run (as Detectron2), "scheduler", "hooks": {hook class: its
        state_dict()}}, JSON-serialisable."""
        saving = {type(h).__name__: getattr(h, "state_dict", None) for h in self.hooks}
        hooks = {name: state_dict() for name, state_dict in saving.items() if callable(state_dict)}
        return {"iteration": self.iter, "scheduler": self.scheduler.state_dict(), "hooks": hooks}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`: training continues after its iteration; the scheduler's and the
        hooks' state (hooks missing from it keep theirs). The params come from a checkpoint."""
        self.iter = self.start_iter = self.storage.iter = self._done = int(state["iteration"]) + 1
        self._load_states(state)

    def _load_states(self, state: Mapping[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        for hook in self.hooks:
            saved = state.get("hooks", {}).get(type(hook).__name__)
            load = getattr(hook, "load_state_dict", None)
            if saved is not None and callable(load):
                load(saved)

    def resume_or_load(self, resume: bool = True, path: Any = None) -> int:
        """With `resume` and a checkpoint in OUTPUT_DIR: continue from the last one (params, optimizer
        state, and `state_dict`). Otherwise start from MODEL.WEIGHTS' params, if set, at iteration 0.
        A process the launcher's agent restarted continues from the last checkpoint its job wrote in
        OUTPUT_DIR (see `Trainer.resume_or_load`). Returns the iteration training starts at."""
        restarted = self.restart_checkpoint()
        if restarted is not None:
            resume, path = True, restarted
        found = checkpoints(self.cfg.OUTPUT_DIR) if resume and path is None else []
        target = path if path is not None else (found[-1] if found else None)
        if resume and target is not None:
            iteration = super().resume_or_load(True, target)
            saved = checkpoint.read_metadata(target)["metadata"].get("trainer")
            if saved is not None:  # the iteration is the checkpoint's (`checkpoint_iteration`)
                self._load_states(saved)
            return iteration
        weights = target or self.cfg.MODEL.WEIGHTS
        if weights:
            return super().resume_or_load(False, Path(weights))
        self.initialize()
        return self.iter


def default_argument_parser(epilog: str | None = None) -> argparse.ArgumentParser:
    """Detectron2's command line: --config-file, --resume, --eval-only, --num-gpus (processes per
    machine), --num-machines, --machine-rank, --dist-url, and trailing `KEY VALUE` config overrides."""
    parser = argparse.ArgumentParser(epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-file", default="", metavar="FILE", help="a YAML config to merge")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUTPUT_DIR")
    parser.add_argument("--eval-only", action="store_true", help="evaluate only")
    parser.add_argument("--num-gpus", type=int, default=1, help="processes per machine (one per GPU)")
    parser.add_argument("--num-machines", type=int, default=1)
    parser.add_argument("--machine-rank", type=int, default=0)
    parser.add_argument("--dist-url", default="auto", help="'auto' or tcp://HOST:PORT of machine 0")
    parser.add_argument("opts", nargs=argparse.REMAINDER, default=None,
                        help="config overrides as KEY VALUE pairs, e.g. SOLVER.BASE_LR 0.02")
    return parser
