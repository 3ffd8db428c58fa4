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

import yaml
from yacs.config import CfgNode as _YacsNode

__all__ = ["CfgNode", "get_cfg"]


class CfgNode(_YacsNode):
    """yacs' CfgNode (attribute access, `merge_from_file`, `merge_from_list`, `freeze`, `clone`, `dump`).

    The merges are all or nothing (a merge that raises leaves the config as it was) and refuse a
    frozen config (yacs' item assignment would change it silently)."""

    def merge_from_list(self, cfg_list: list[Any]) -> None:
        """Merge `KEY VALUE` pairs (a command line's trailing `opts`), all or none.

        Raises:
            AttributeError: the config is frozen.
            ValueError: an odd number of items (a key without its value); a value of another type.
            KeyError: a key that is not in the config.
        """
        self._check_not_frozen("merge_from_list")
        if len(cfg_list) % 2:
            raise ValueError(f"merge_from_list: needs KEY VALUE pairs, got an odd number of items: {cfg_list}")
        for key in cfg_list[0::2]:  # yacs checks with `assert` (gone under python -O): check here first
            node = self
            for part in str(key).split("."):
                if not isinstance(node, _YacsNode) or part not in node:
                    raise KeyError(f"Non-existent config key: {key} (set only keys of get_cfg(); add a new key "
                                   f"to the config before merging)")
                node = node[part]
        _YacsNode.merge_from_list(self.clone(), cfg_list)  # every pair on a copy first: a bad one changes nothing
        super().merge_from_list(cfg_list)

    def merge_from_file(self, cfg_filename: str) -> None:
        """Merge a YAML file (or yacs' Python config file), all or nothing.

        Raises:
            AttributeError: the config is frozen.
            ValueError: the file is not YAML, or its top level is not a mapping of keys; a value of
                another type. KeyError: a key that is not in the config.
        """
        self._check_not_frozen("merge_from_file")
        if str(cfg_filename).endswith(".py"):
            super().merge_from_file(cfg_filename)
            return
        with open(cfg_filename) as f:
            text = f.read()
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"config file {str(cfg_filename)!r} is not valid YAML: {exc}") from None
        if loaded is None:  # an empty file merges nothing
            return
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(cfg_filename)!r}: the top level must be a mapping of keys "
                             f"(e.g. 'SOLVER:' then '  BASE_LR: 0.02'), got a {type(loaded).__name__}")
        self.merge_from_other_cfg(self.load_cfg(text))

    def merge_from_other_cfg(self, cfg_other: _YacsNode) -> None:
        """Merge another config, all or nothing.

        Raises:
            AttributeError: the config is frozen. KeyError / ValueError: as `merge_from_list`.
        """
        self._check_not_frozen("merge_from_other_cfg")
        _YacsNode.merge_from_other_cfg(self.clone(), cfg_other)  # on a copy first: a bad key changes nothing
        super().merge_from_other_cfg(cfg_other)

    def _check_not_frozen(self, what: str) -> None:
        if self.is_frozen():
            raise AttributeError(f"{what}: the config is frozen (DefaultTrainer freezes its cfg); merge into "
                                 f"cfg.clone() after defrost(), or defrost() it first")


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
    c.SEED = 0  # the workspace's random streams and the training sampler (< 0: the workspace's seed is left
    # alone and the sampler takes a random seed every process shares)
    return c


_DEFAULTS = _defaults()


def get_cfg() -> CfgNode:
    """A fresh (unfrozen) copy of graphpar's default config."""
    return _DEFAULTS.clone()
