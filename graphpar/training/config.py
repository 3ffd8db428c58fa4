"""Detectron2-style configs: yacs' `CfgNode` with graphpar's defaults (`get_cfg()`).

    cfg = get_cfg()                              # a copy of the defaults
    cfg.merge_from_file("my_experiment.yaml")   # keys must exist in the defaults
    cfg.merge_from_list(["SOLVER.BASE_LR", "0.02", "SOLVER.MAX_ITER", "300"])   # KEY VALUE pairs
    cfg.freeze()

`DefaultTrainer` (graphpar.defaults) reads it. A key that is not in the defaults is refused by the
merges (yacs: "Non-existent config key"); values from a list are parsed as Python literals and must
keep the default's type. Add keys of your own before merging (`cfg.MY_KEY = ...` on an unfrozen node,
or `CfgNode(new_allowed=True)` for a new section).
"""

from __future__ import annotations

from typing import Any

from yacs.config import CfgNode as _YacsNode

__all__ = ["CfgNode", "get_cfg"]


class CfgNode(_YacsNode):
    """yacs' CfgNode (attribute access, `merge_from_file`, `merge_from_list`, `freeze`, `clone`, `dump`)."""

    def merge_from_list(self, cfg_list: list[Any]) -> None:
        """Merge `KEY VALUE` pairs (a command line's trailing `opts`).

        Raises:
            ValueError: an odd number of items (a key without its value); a value of another type.
            KeyError: a key that is not in the config.
        """
        if len(cfg_list) % 2:
            raise ValueError(f"merge_from_list: needs KEY VALUE pairs, got an odd number of items: {cfg_list}")
        for key in cfg_list[0::2]:  # yacs checks with `assert` (gone under python -O): check here first
            node = self
            for part in str(key).split("."):
                if not isinstance(node, _YacsNode) or part not in node:
                    raise KeyError(f"Non-existent config key: {key} (set only keys of get_cfg(); add a new key "
                                   f"to the config before merging)")
                node = node[part]
        super().merge_from_list(cfg_list)


def _defaults() -> CfgNode:
    c = CfgNode()
    c.MODEL = CfgNode()
    c.MODEL.META_ARCHITECTURE = "mlp"  # a name in graphpar.defaults.MODEL_REGISTRY
    c.MODEL.DEVICE = "cpu"  # "cpu" (logical CPU devices) or "cuda" (this process's GPUs, comm.local_devices)
    c.MODEL.NUM_DEVICES = 1  # devices per process; 0 with cuda: this machine's GPUs shared out over its processes
    c.MODEL.WEIGHTS = ""  # a checkpoint whose params to start from (resume_or_load(resume=False))
    c.MODEL.NUM_CLASSES = 10
    c.MODEL.INPUT_DIM = 16  # mlp: input features
    c.MODEL.HIDDEN = (32,)  # mlp: hidden layer widths

    c.DATASETS = CfgNode()
    c.DATASETS.TRAIN = ()  # names registered in graphpar.loaders.DatasetCatalog
    c.DATASETS.TEST = ()

    c.DATALOADER = CfgNode()
    c.DATALOADER.NUM_WORKERS = 0
    c.DATALOADER.ASPECT_RATIO_GROUPING = False  # batches of images of one orientation (needs width/height)
    c.DATALOADER.SAMPLER_TRAIN = "TrainingSampler"

    c.SOLVER = CfgNode()
    c.SOLVER.IMS_PER_BATCH = 16  # the global batch: over every device of every process
    c.SOLVER.BASE_LR = 0.01
    c.SOLVER.MOMENTUM = 0.9
    c.SOLVER.NESTEROV = False
    c.SOLVER.WEIGHT_DECAY = 0.0001
    c.SOLVER.LR_SCHEDULER_NAME = "WarmupMultiStepLR"  # or "WarmupCosineLR", "WarmupStepWithFixedGammaLR"
    c.SOLVER.STEPS = (30000,)
    c.SOLVER.GAMMA = 0.1
    c.SOLVER.NUM_DECAYS = 3  # WarmupStepWithFixedGammaLR: GAMMA ** k over NUM_DECAYS + 1 equal parts
    c.SOLVER.MAX_ITER = 40000
    c.SOLVER.BASE_LR_END = 0.0  # WarmupCosineLR's LR at MAX_ITER
    c.SOLVER.WARMUP_FACTOR = 1.0 / 1000
    c.SOLVER.WARMUP_ITERS = 1000
    c.SOLVER.WARMUP_METHOD = "linear"  # or "constant"
    c.SOLVER.RESCALE_INTERVAL = False  # the schedule restarts its clock when the warmup ends
    c.SOLVER.CHECKPOINT_PERIOD = 5000
    c.SOLVER.AMP = CfgNode()
    c.SOLVER.AMP.ENABLED = False  # mixed precision (AMPTrainer): float16 + dynamic loss scale on GPUs, bf16 on CPUs
    c.SOLVER.REFERENCE_WORLD_SIZE = 0  # devices IMS_PER_BATCH and BASE_LR were tuned for (0: do not scale)

    c.TEST = CfgNode()
    c.TEST.EVAL_PERIOD = 0  # 0: evaluate after training only

    c.OUTPUT_DIR = "./output"
    c.SEED = 0  # the workspace's random streams and the training sampler (< 0: the workspace's seed is left alone)
    return c


_DEFAULTS = _defaults()


def get_cfg() -> CfgNode:
    """A fresh (unfrozen) copy of graphpar's default config."""
    return _DEFAULTS.clone()
