"""The training loop around a parallelized model, in the style of Detectron2's trainer and hooks.

    trainer = Trainer(model, loader, [IterationTimer(), LRScheduler(), PeriodicCheckpointer("out", 500),
                                      EvalHook(1000, evaluate), PeriodicWriter("out")], max_iter=5000)
    trainer.resume_or_load(resume=True)
    trainer.train()

`Trainer` feeds the first batch and runs `RunInitNet` (lazily, once), then for every iteration runs
the hooks' `before_step`, feeds the next batch (`graphpar.data.feed`: nested batches, DataContainers,
a `DeviceFeeder`'s prepared batches), runs the train net once, records the losses, and runs the hooks'
`after_step`. The data is iterated once per epoch and again when exhausted (`set_epoch(epoch)` is
called on it, or on its `sampler`, when present). Scalars go to `trainer.storage` (one value per
iteration and name) where the writers read them; under a rendezvous the losses are the global batch's
(gathered from every shard, as Detectron2's `comm.reduce_dict`), the same on every shard, while `time`
is this process's step time. A process the launcher's agent restarted (`--max-restarts`)
continues from the last checkpoint its job's PeriodicCheckpointer wrote (`resume_or_load`, or `train`
on its own). `auto_scale_workers` applies Detectron2's linear scaling rule to a config for a new
device count.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from copy import deepcopy
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphpar.core.ir import CUDA
from graphpar.core.naming import stripBlobName, unscoped_name
from graphpar.errors import CheckpointError
from graphpar.executor import get_executor
from graphpar.parallel import data_parallel_model as dpm
from graphpar.parallel import elastic
from graphpar.platform.devices import cuda_is_simulated
from graphpar.runtime import checkpoint, workspace
from graphpar.training.data import Fed, Prepared, feed
from graphpar.training.feeder import CudaCopier, DeviceFeeder, prepare_copied

__all__ = ["ITERATIONS_DONE", "Config", "EvalHook", "EventStorage", "HookBase", "IterationTimer", "LRScheduler",
           "PeriodicCheckpointer", "PeriodicWriter", "Trainer", "auto_scale_workers", "checkpoint_iteration"]

log = logging.getLogger(__name__)

RECORD_PERIOD = 20  # iterations between host reads of the losses on CUDA replicas (Trainer's record_period)
TOTAL_LOSS = "total_loss"  # the sum of an iteration's losses, recorded beside them (Detectron2's name)


# ---- storage ---------------------------------------------------------------------------------------


class EventStorage:
    """Scalars per iteration: `put_scalar(name, value)` at the trainer's current iteration.

    A value may be a callable returning it (a value still on a device): it is called, and the host
    waits for the device, only when the storage is read (`history`, `latest`, `median`). Reading
    first calls `before_read` (the Trainer's: record the losses it holds on the devices)."""

    def __init__(self) -> None:
        self.iter = 0
        self._history: dict[str, list[tuple[int, float]]] = {}
        self._unread: list[tuple[str, int, Callable[[], float]]] = []
        self.before_read: Callable[[], None] | None = None

    def put_scalar(self, name: str, value: float | Callable[[], float], iteration: int | None = None) -> None:
        """Record `value` (or a callable giving it, read later) at `iteration` (default: `self.iter`)."""
        at = self.iter if iteration is None else iteration
        if callable(value):
            self._unread.append((name, at, value))
            return
        if any(unread == name for unread, _, _ in self._unread):
            self._read_all()  # keep each scalar's values in order
        self._history.setdefault(name, []).append((at, float(value)))

    def _read_all(self) -> None:
        unread, self._unread = self._unread, []
        for name, at, value in unread:
            self._history.setdefault(name, []).append((at, float(value())))

    @property
    def history(self) -> dict[str, list[tuple[int, float]]]:
        """{name: [(iteration, value), ...]}, every value read."""
        if self.before_read is not None:
            self.before_read()
        if self._unread:
            self._read_all()
        return self._history

    def latest(self) -> dict[str, tuple[int, float]]:
        """{name: (iteration, value)} of the last value of every scalar."""
        return {name: values[-1] for name, values in self.history.items()}

    def median(self, name: str, window: int = 20) -> float:
        values = [v for _, v in self.history.get(name, [])[-window:]]
        return float(np.median(values)) if values else math.nan


# ---- hooks -----------------------------------------------------------------------------------------


class HookBase:
    """A hook: any of before_train / after_train / before_step / after_step; `self.trainer` is set
    (a weak proxy) when it is registered."""

    trainer: Trainer

    def before_train(self) -> None: ...

    def after_train(self) -> None: ...

    def before_step(self) -> None: ...

    def after_step(self) -> None: ...


class IterationTimer(HookBase):
    """Times every step (`time`, seconds) after `warmup` iterations, and logs the total at the end."""

    def __init__(self, warmup: int = 3) -> None:
        self.warmup = warmup
        self._start = 0.0
        self._total = 0.0
        self._steps = 0
        self._began = 0

    def before_train(self) -> None:
        self._total, self._steps, self._began = 0.0, 0, self.trainer.iter

    def before_step(self) -> None:
        self._start = time.perf_counter()

    def after_step(self) -> None:
        seconds = time.perf_counter() - self._start
        if self.trainer.iter - self._began >= self.warmup:
            self.trainer.storage.put_scalar("time", seconds)
            self._total += seconds
            self._steps += 1

    def after_train(self) -> None:
        if self._steps:
            log.info("%d timed iterations in %.2f s (%.4f s / it)", self._steps, self._total,
                     self._total / self._steps)


class LRScheduler(HookBase):
    """Records the learning rate (`lr`, the first blob of `GetLearningRateBlobNames`) every step.

    The LR itself follows the optimizer's policy from `optimizer_iteration` (restored by a
    checkpoint). `multiplier(iteration) -> float`, if given, is fed before every step as the
    `lr_injection` blob (a model built with `allow_lr_injection=True`), e.g. a warmup ramp.
    """

    def __init__(self, multiplier: Callable[[int], float] | None = None) -> None:
        self.multiplier = multiplier

    def before_train(self) -> None:
        if not dpm.GetLearningRateBlobNames(self.trainer.model):
            raise ValueError("LRScheduler: the model has no learning-rate blob (parallelize it with an optimizer)")

    def before_step(self) -> None:
        if self.multiplier is not None:
            from graphpar.model.optimizer import set_lr_injection

            set_lr_injection(self.multiplier(self.trainer.iter))

    def after_step(self) -> None:
        name = dpm.GetLearningRateBlobNames(self.trainer.model)[0]
        if not workspace.HasBlob(name):  # the first steps were skipped (loss scaling): no LR computed yet
            return
        tensor = workspace.FetchTensor(name)
        factor = None if self.multiplier is None else self.multiplier(self.trainer.iter)

        model = self.trainer.model
        on_host = model._parallel.layout.device_type != CUDA
        held = _held(tensor, _overwritten(model))

        def lr() -> float:
            value = held.detach().to("cpu", copy=True).numpy().reshape(-1)[0]
            if factor is not None:
                value *= factor
            return abs(float(value))  # the LearningRate op's value is -lr

        # on CUDA replicas the LR is read when the storage is (no host sync per step)
        self.trainer.storage.put_scalar("lr", lr() if on_host else lr)


_CHECKPOINT = re.compile(r"model_(\d+)\.safetensors$")
ITERATIONS_DONE = "iterations_done"  # a periodic checkpoint's metadata: the Trainer iterations run before it


class PeriodicCheckpointer(HookBase):
    """Saves `GetCheckpointParams` every `period` iterations (and at the end) to
    `directory/model_{iteration:07d}.safetensors` (atomic writes), keeping the last `keep` files."""

    def __init__(self, directory: str | os.PathLike[str], period: int, keep: int | None = 3) -> None:
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"PeriodicCheckpointer: period must be an int >= 1, got {period!r}")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"PeriodicCheckpointer: keep must be None or an int >= 1, got {keep!r}")
        self.directory, self.period, self.keep = Path(directory), period, keep

    def after_step(self) -> None:
        done = self.trainer.iter + 1
        if done % self.period == 0 or done == self.trainer.max_iter:
            self.save(done)

    def metadata(self) -> dict[str, Any]:
        """JSON data saved in each checkpoint (`DefaultTrainer`'s: the trainer's state_dict)."""
        return {}

    def save(self, iteration: int) -> Path:
        """Write the checkpoint after `iteration` iterations: `GetCheckpointParams` (which carry
        `optimizer_iteration`, the updates made) and, in the metadata, `metadata()` and the
        iterations done under `ITERATIONS_DONE` (loss-scaled steps that were skipped count: they
        consumed their batches), where `resume_or_load` continues, and the job's id under the launcher
        (`elastic.JOB_KEY`), which a restarted process continues from."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"model_{iteration:07d}.safetensors"
        checkpoint.save(path, sorted(dpm.GetCheckpointParams(self.trainer.model)),
                        metadata={**self.metadata(), ITERATIONS_DONE: iteration, **elastic.job_metadata()})
        if self.keep is not None:
            for old in checkpoints(self.directory)[:-self.keep]:
                old.unlink(missing_ok=True)
        return path


def checkpoint_iteration(path: str | os.PathLike[str]) -> int:
    """The iteration a Trainer resumed from checkpoint `path` starts at: the iterations done when a
    PeriodicCheckpointer saved it (metadata `ITERATIONS_DONE`), else the file's `optimizer_iteration`
    (the updates made; a checkpoint saved otherwise), else 0."""
    header = checkpoint.read_metadata(path)
    done = header.get("metadata", {}).get(ITERATIONS_DONE)
    if isinstance(done, int) and not isinstance(done, bool) and done >= 0:
        return done
    return int(header["iteration"] or 0)


def checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """The periodic checkpoints in `directory`, oldest first (by iteration)."""
    found = [(int(m.group(1)), p) for p in Path(directory).glob("model_*.safetensors")
             if (m := _CHECKPOINT.search(p.name))]
    return [p for _, p in sorted(found)]


class EvalHook(HookBase):
    """Runs `eval_function() -> {name: number}` every `period` iterations and after the last one;
    the results go to the storage. Typically it feeds a forward-only model built with
    `init_params=False` (sharing the train model's params) and computes a metric."""

    def __init__(self, period: int, eval_function: Callable[[], Mapping[str, float]]) -> None:
        self.period, self.eval_function = period, eval_function

    def _evaluate(self) -> None:
        results = self.eval_function()
        if not isinstance(results, Mapping):
            raise TypeError(f"EvalHook: eval_function must return a dict of numbers, got {type(results).__name__}")
        for name, value in results.items():
            self.trainer.storage.put_scalar(name, float(value))

    def after_step(self) -> None:
        done = self.trainer.iter + 1
        if self.period > 0 and done % self.period == 0 and done != self.trainer.max_iter:
            self._evaluate()

    def after_train(self) -> None:
        if self.trainer.iter + 1 >= self.trainer.max_iter:  # not after a crash
            self._evaluate()


class PeriodicWriter(HookBase):
    """Every `period` iterations (and at the end) writes the latest scalars: a console line (the
    iteration, the ETA from the median step time, `total_loss` (and the losses it sums when there are
    several), then the other scalars: `time`, `lr`, ...), a JSON line in `directory/metrics.json`
    (every scalar), and TensorBoard events in `directory` when `tensorboard` is installed
    (`tensorboard=None`: when available)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, period: int = 20,
                 console: bool = True, tensorboard: bool | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.period, self.console, self.tensorboard = period, console, tensorboard
        self._board: Any = None
        self._seen: dict[str, int] = {}  # values written per scalar

    def before_train(self) -> None:
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            if self.tensorboard is not False:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:
                    if self.tensorboard:
                        raise
                else:
                    self._board = SummaryWriter(str(self.directory))

    def after_step(self) -> None:
        done = self.trainer.iter + 1
        if done % self.period == 0 or done == self.trainer.max_iter:
            self.write()

    def after_train(self) -> None:
        self.write()
        if self._board is not None:
            self._board.close()

    def write(self) -> None:
        storage = self.trainer.storage
        latest = {name: values[-1][1] for name, values in storage.history.items()
                  if len(values) > self._seen.get(name, 0)}
        if not latest:
            return
        self._seen = {name: len(values) for name, values in storage.history.items()}
        iteration = storage.iter
        if self.directory is not None:
            with open(self.directory / "metrics.json", "a") as out:
                out.write(json.dumps({"iteration": iteration, **latest}) + "\n")
        if self._board is not None:
            for name, value in latest.items():
                self._board.add_scalar(name, value, iteration)
        if self.console:
            left = self.trainer.max_iter - iteration - 1
            step = storage.median("time")
            eta = f"  eta {_duration(left * step)}" if not math.isnan(step) and left > 0 else ""
            print(f"iter {iteration + 1}/{self.trainer.max_iter}{eta}  {self._console_values(latest)}", flush=True)

    def _console_values(self, latest: dict[str, float]) -> str:
        """`total_loss` first; the losses it sums only if there are several (one equals it); then the rest."""
        losses = getattr(self.trainer, "loss_names", [])
        shown = [TOTAL_LOSS] if TOTAL_LOSS in latest else []
        if len(losses) > 2 or TOTAL_LOSS not in latest:
            shown += [name for name in losses if name in latest and name != TOTAL_LOSS]
        shown += [name for name in latest if name not in losses]
        return "  ".join(f"{name} {latest[name]:.4g}" for name in shown)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# ---- the trainer -----------------------------------------------------------------------------------


class Trainer:
    """Runs a parallelized training model over `data` for `max_iter` iterations with `hooks`.

    Args:
        model: a model parallelized with an optimizer (`data_parallel_model.Parallelize`).
        data: an iterable of batches `graphpar.data.feed` accepts (a DataLoader, a list, a
            `DeviceFeeder`); iterated once per epoch, again when exhausted.
        hooks: HookBase instances, run in order (after_* too, as in Detectron2).
        max_iter: iterations to train in all (a resumed run continues up to it), each one step: an update,
            or a step the loss scale skipped on an overflow; default one epoch of `data` (its length;
            over `accumulate_gradients` with accumulation).
        lean_memory: free every intermediate after its last use and share gradient names (Parallelize's
            `dynamic_memory_management` and `optimize_gradient_memory`, applied before the nets are
            created) unless Parallelize was given them; losses, params and optimizer state stay
            fetchable. Default (None): on for CUDA replicas, where it keeps resident + step peak memory
            near eager PyTorch's instead of holding every intermediate between steps; off for CPU ones.
        record_period: the losses stay on the devices and are read on the host (and, under a
            rendezvous, gathered from every shard) every `record_period` iterations, at the end, and
            (one shard) whenever a hook reads `trainer.storage`; so the host need not wait for the
            devices each step. Default: 1 on CPU replicas, `RECORD_PERIOD` (20, a PeriodicWriter's
            period) on CUDA ones. The values recorded do not depend on it; a non-finite loss raises
            FloatingPointError naming its iteration when it is read.
        copier: how batches that are not prepared already (by a `DeviceFeeder`) reach the devices.
            Default: on real CUDA replicas a `CudaCopier` (through pinned host memory, asynchronously on
            a side stream per device, which the step's stream waits for: no host sync per blob, as a
            plain copy of pageable memory makes); None elsewhere (`feed` copies).

    Raises:
        ValueError: max_iter < 0; a model without losses (forward only); data that yields no batch.
    """

    def __init__(self, model: Any, data: Iterable[Any], hooks: Sequence[HookBase] = (),
                 max_iter: int | None = None, lean_memory: bool | None = None,
                 record_period: int | None = None, copier: Any = None) -> None:
        if not getattr(getattr(model, "_parallel", None), "training", False):
            raise ValueError("Trainer: the model must be parallelized with an optimizer and return its losses "
                             "(data_parallel_model.Parallelize(..., optimizer_builder_fun=...))")
        if max_iter is None:
            length = getattr(data, "__len__", None)
            if length is None:
                raise ValueError("Trainer: pass max_iter (the data has no length to make one epoch of)")
            max_iter = length() // model._parallel.options.accumulate_gradients
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
            raise ValueError(f"Trainer: max_iter must be an int >= 0, got {max_iter!r}")
        on_cuda = model._parallel.layout.device_type == CUDA
        if record_period is None:
            record_period = RECORD_PERIOD if on_cuda else 1
        if isinstance(record_period, bool) or not isinstance(record_period, int) or record_period < 1:
            raise ValueError(f"Trainer: record_period must be an int >= 1, got {record_period!r}")
        self.model, self.data, self.max_iter, self.record_period = model, data, max_iter, record_period
        if copier is None and on_cuda and not cuda_is_simulated() and not isinstance(data, DeviceFeeder):
            copier = CudaCopier()
        self.copier = copier
        self.lean_memory = on_cuda if lean_memory is None else bool(lean_memory)
        self.iter = 0
        self.start_iter = 0
        self.epoch = 0
        self.storage = EventStorage()
        self._unrecorded: list[tuple[int, list[tuple[list[list[torch.Tensor]], list[int]]]]] = []
        if not self._sharded():  # reading the storage records the losses (no collective to join)
            self.storage.before_read = self.record_losses
        self.hooks: list[HookBase] = []
        self._iterator: Iterator[Any] | None = None
        self._in_epoch = 0
        self._pending: Any = None
        self._initialized = False
        self._loaded = False  # resume_or_load ran
        self._done = 0  # iterations run (skipped loss-scaled steps included): where train() starts
        self.last_fed: Fed | None = None  # the last step's Fed: names, rows, host-side fields per device
        self._world: Any = None  # the communicator the losses are gathered on (under a rendezvous)
        self.register_hooks(hooks)

    def register_hooks(self, hooks: Iterable[HookBase | None]) -> None:
        for hook in hooks:
            if hook is None:
                continue
            if not isinstance(hook, HookBase):
                raise TypeError(f"Trainer: hooks must be HookBase instances, got {type(hook).__name__}")
            hook.trainer = weakref.proxy(self)
            self.hooks.append(hook)

    # -- data --

    def _next_batch(self) -> Any:
        if self._pending is not None:
            batch, self._pending = self._pending, None
            return batch
        while True:
            if self._iterator is None:
                for target in (self.data, getattr(self.data, "sampler", None)):
                    set_epoch = getattr(target, "set_epoch", None)
                    if callable(set_epoch):
                        set_epoch(self.epoch)
                        break
                self._iterator, self._in_epoch = iter(self.data), 0
            try:
                batch = next(self._iterator)
            except StopIteration:
                if self._in_epoch == 0:
                    raise ValueError(f"Trainer: the data yielded no batch in epoch {self.epoch}") from None
                self._iterator, self.epoch = None, self.epoch + 1
                continue
            self._in_epoch += 1
            return batch

    def _staged(self, batch: Any) -> Any:
        """`batch` copied to the devices through the copier (when there is one and it is not prepared yet)."""
        if self.copier is None or isinstance(batch, Prepared):
            return batch
        return prepare_copied(self.model, 0, self.copier, batch)

    def _drop_iterator(self) -> None:
        close = getattr(self._iterator, "close", None)
        if callable(close):
            close()
        self._iterator = None

    def initialize(self) -> None:
        """Feed the first batch and run the init net (once; `train` and `resume_or_load` call it)."""
        if self._initialized:
            return
        self._pending = self._staged(self._next_batch())  # the first step feeds it again
        feed(self.model, self._pending)
        if self.lean_memory:
            self._free_memory()
        dpm.RunInitNet(self.model)
        self._initialized = True

    def _free_memory(self) -> None:
        """Turn on the memory options `lean_memory` asks for, before RunInitNet creates the nets."""
        if self.model.net.Proto().name in workspace.get_workspace().nets:
            log.warning("Trainer: lean_memory is ignored, the train net was created already (RunInitNet "
                        "ran); pass the memory options to Parallelize instead")
            return
        # through Parallelize's pipeline; the learning rate, which LRScheduler records, is kept
        dpm.enable_memory_options(self.model, keep=dpm.GetLearningRateBlobNames(self.model))

    def resume_or_load(self, resume: bool = True, path: str | os.PathLike[str] | None = None) -> int:
        """Detectron2's resume_or_load. With `resume`: load `path`, or else the last checkpoint of the
        PeriodicCheckpointer's directory, if there is one, and continue at its iteration. Without
        it: load only the params of `path` (weights to start from) and start at iteration 0.
        Returns the iteration training starts at.

        A resumed run restores every `GetCheckpointParams` blob (optimizer state, and
        `optimizer_iteration`, so the LR schedule), runs `FinalizeAfterCheckpoint`, and, when the
        data has a length, restores the epoch and skips the batches the saved run had consumed in
        it, so data whose order depends only on the epoch gives the same batches.

        A process the launcher's agent restarted (TORCHELASTIC_RESTART_COUNT > 0) continues from the
        last checkpoint its job wrote in the PeriodicCheckpointer's directory, whatever `resume` and
        `path` say (they said how the job began); one that has none does as they say.

        Raises:
            FileNotFoundError: `path` does not exist. CheckpointError: see `checkpoint.load`; without
                `resume`, also a file holding none of the model's params.
        """
        self.initialize()
        self._loaded = True
        restarted = self.restart_checkpoint()
        if restarted is not None:
            resume, path = True, restarted
            log.info("restart %d of this job: continuing from its last checkpoint", elastic.restart_count())
        target = Path(path) if path is not None else None
        if target is None and resume:
            saver = self._checkpointer()
            found = checkpoints(saver.directory) if saver is not None else []
            target = found[-1] if found else None
        if target is None:
            return self.iter
        if not target.exists():
            raise FileNotFoundError(f"resume_or_load: no checkpoint at {target}")
        if not resume:
            self._load_weights(target)
            return self.iter
        iteration = checkpoint_iteration(target)
        checkpoint.load(target, model=self.model)  # onto this model's first device, whatever the file's
        dpm.FinalizeAfterCheckpoint(self.model)
        self.start_iter = self.iter = self.storage.iter = self._done = iteration
        self._skip_to(self.iter)
        log.info("resumed from %s at iteration %d", target, self.iter)
        return self.iter

    def _checkpointer(self) -> PeriodicCheckpointer | None:
        return next((h for h in self.hooks if isinstance(h, PeriodicCheckpointer)), None)

    def restart_checkpoint(self) -> Path | None:
        """In a process the launcher's agent restarted: the last checkpoint this job's PeriodicCheckpointer
        wrote (`graphpar.parallel.elastic`), where training continues; else None."""
        saver = self._checkpointer()
        if elastic.restart_count() == 0 or saver is None:
            return None
        return elastic.last_of_this_job(checkpoints(saver.directory))

    def _load_weights(self, target: Path) -> None:
        """The file's params (scoped under any device, as `checkpoint.load(model=...)` maps them onto
        this model's first device, or unscoped), broadcast to the replicas."""
        params = {stripBlobName(str(p)) for p in self.model.GetParams()}
        names = [b for b in checkpoint.read_metadata(target)["blobs"] if stripBlobName(b) in params]
        if not names:
            raise CheckpointError(f"resume_or_load: checkpoint {str(target)!r} holds none of model "
                                  f"{self.model.name!r}'s params ({sorted(params)[:3]}...)")
        checkpoint.load(target, names, model=self.model)
        dpm.FinalizeAfterCheckpoint(self.model)

    def _skip_to(self, iteration: int) -> None:
        try:
            per_epoch = len(self.data)  # type: ignore[arg-type]
        except TypeError:
            return
        if per_epoch < 1:
            return
        consumed = iteration * self.model._parallel.options.accumulate_gradients  # batches per update
        self._pending = None
        self._drop_iterator()
        self.epoch = consumed // per_epoch
        for _ in range(consumed % per_epoch):
            self._next_batch()

    # -- the loop --

    def train(self) -> None:
        """Train from the iterations done to `max_iter`; hooks' after_train runs even if a step raises.

        Training starts after the last iteration that ran (one whose loss-scaled step was skipped
        counts: it consumed its batches), as restored by `resume_or_load`; so calling again after a
        hook raised continues after that iteration instead of repeating it, and after a step that
        raised (a NaN loss) runs that iteration again on the next batch.
        """
        self.initialize()
        if not self._loaded and (restarted := self.restart_checkpoint()) is not None:
            self.resume_or_load(True, restarted)  # a restarted process continues its job: as resume_or_load
        self.iter = self.storage.iter = self._done
        if self.iter >= self.max_iter:
            print(f"nothing to train: already at iteration {self.iter} of max_iter {self.max_iter}; raise "
                  f"max_iter to train longer", file=sys.stderr)
            return
        self.start_iter = self.iter
        try:
            for hook in self.hooks:
                hook.before_train()
            for iteration in range(self.start_iter, self.max_iter):
                self.iter = self.storage.iter = iteration
                for hook in self.hooks:
                    hook.before_step()
                self.run_step()
                self._done = iteration + 1
                for hook in self.hooks:
                    hook.after_step()
        except BaseException:
            if not self._sharded():  # the other shards would not join a gather now
                self._record_quietly()
            raise
        finally:
            for hook in self.hooks:
                hook.after_train()
        self.iter = self.max_iter
        self.storage.iter = self.iter

    def run_step(self) -> None:
        """Feed the next batch, run the train net once, keep each loss (the global batch's mean) to record.

        With `Parallelize(accumulate_gradients=k)`, first k - 1 micro-batches each through the
        accumulate net (no all-reduce, no update); the losses recorded are the micro-batches' mean.
        A step that raises (a NaN loss, say) drops the micro-batches it accumulated, so the next one
        starts from zero sums.
        The loss tensors stay on their devices until `record_losses` (every `record_period` iterations
        and at `max_iter`). Under a rendezvous the losses are every shard's (one all-gather per
        recording), so every shard records the same values, which equal one process's on the whole batch.
        """
        state = self.model._parallel
        micro = state.accumulate_net
        held: list[tuple[list[list[torch.Tensor]], list[int]]] = []
        try:
            for _ in range(state.options.accumulate_gradients - 1):
                fed = feed(self.model, self._staged(self._next_batch()))
                if micro.Proto().name not in workspace.get_workspace().nets:
                    workspace.CreateNet(micro)
                workspace.RunNet(micro)
                held.append((self._loss_tensors(), list(fed.sizes)))
            fed = self.last_fed = feed(self.model, self._staged(self._next_batch()))
            skipped = dpm.skipped_steps(self.model)
            dpm.RunNet(self.model, 1)
        except BaseException:
            dpm.reset_accumulated_gradients(self.model)  # the step's micro-batches made no update: drop them
            raise
        if dpm.skipped_steps(self.model) == skipped:  # else a loss-scaled step whose gradients overflowed: no loss
            held.append((self._loss_tensors(), list(fed.sizes)))
            self._unrecorded.append((self.iter, held))
        done = self.iter + 1
        if done % self.record_period == 0 or done >= self.max_iter:
            self.record_losses()

    @property
    def loss_names(self) -> list[str]:
        """The names the losses are recorded under: the unscoped names of the blobs the forward builder
        returned (each the mean over the global batch), and `total_loss`, their sum."""
        names = next(iter(self.model._parallel.losses_by_device.values()))
        return [unscoped_name(str(n)) for n in names] + [TOTAL_LOSS]

    def record_losses(self) -> None:
        """Read the losses of the iterations run since the last call on the host (under a rendezvous,
        gathered from every shard: every shard must call it together) and record their global means,
        and `total_loss`, their sum (Detectron2's scalar).

        Raises:
            FloatingPointError: a loss is not finite (the values of earlier iterations are recorded).
        """
        if not self._unrecorded:
            return
        unrecorded, self._unrecorded = self._unrecorded, []
        local = [self._read_losses(tensors, sizes) for _, held in unrecorded for tensors, sizes in held]
        values = iter(self._global_losses(local))
        for iteration, held in unrecorded:
            steps = [next(values) for _ in held]
            total = 0.0
            for name in steps[-1]:
                value = sum(v[name] for v in steps) / len(steps)
                if not math.isfinite(value):
                    raise FloatingPointError(f"loss {name!r} became {value} at iteration {iteration}")
                self.storage.put_scalar(name, value, iteration)
                total += value
            self.storage.put_scalar(TOTAL_LOSS, total, iteration)

    def _record_quietly(self) -> None:
        """record_losses after a failed step: the losses of the iterations before it still count."""
        try:
            self.record_losses()
        except FloatingPointError as exc:
            log.warning("Trainer: %s", exc)

    def _sharded(self) -> bool:
        rendezvous = self.model._parallel.options.rendezvous
        return rendezvous is not None and rendezvous.num_shards > 1

    def losses(self, sizes: Sequence[int]) -> dict[str, float]:
        """Each unscoped loss as the mean over the global batch (every shard's replicas, each weighted
        by its share of the rows); `sizes` are this shard's rows per device. Under a rendezvous every
        shard must call it together."""
        return self._global_losses([self._read_losses(self._loss_tensors(), sizes)])[0]

    def _loss_tensors(self) -> list[list[torch.Tensor]]:
        """[device][loss] the loss tensors of this shard's replicas, left on their devices: the live
        tensors (the next run makes new ones), copies where a CUDA graph's replay would overwrite them."""
        state = self.model._parallel
        overwritten = _overwritten(self.model)
        return [[_held(workspace.FetchTensor(str(name)), overwritten) for name in names]
                for names in state.losses_by_device.values()]

    @staticmethod
    def _read_losses(tensors: list[list[torch.Tensor]], sizes: Sequence[int]) -> np.ndarray:
        """[device, loss, (value summed over the blob, rows)] on the host, as FetchBlob reads them."""
        return np.array([[(float(t.detach().to("cpu", copy=True).numpy().reshape(-1).sum()), rows) for t in losses]
                         for losses, rows in zip(tensors, sizes)], dtype=np.float64)

    def _global_losses(self, local: list[np.ndarray]) -> list[dict[str, float]]:
        """Per micro-batch {loss: global mean} from every shard's `_read_losses`, summed in global
        device order with the same float operations as one process with all the devices (so S shards
        x D devices give 1 x S*D devices' values bit for bit). The losses carry the 1/N loss scale
        (N devices in all), so equal chunks give plain sums."""
        state = self.model._parallel
        stacked = np.stack(local)  # [micro, device, loss, 2]
        if state.options.rendezvous is not None and state.options.rendezvous.num_shards > 1:
            if self._world is None:
                from graphpar.parallel import comm

                self._world = comm.model_world(self.model)
            parts = self._world.allgather(torch.from_numpy(stacked))
            stacked = torch.cat(parts, dim=1).numpy()
        names = [unscoped_name(str(n)) for n in next(iter(state.losses_by_device.values()))]
        count = stacked.shape[1]
        out: list[dict[str, float]] = []
        for step in stacked:
            total = int(sum(int(rows) for rows in step[:, 0, 1]))
            values: dict[str, float] = {}
            for device in step:
                for name, (value, rows) in zip(names, device):
                    values[name] = values.get(name, 0.0) + float(value) * count * int(rows) / total
            out.append(values)
        return out


def _held(tensor: torch.Tensor, overwritten: bool) -> torch.Tensor:
    """A tensor to read later: itself (the next run makes a new one), or where the next run overwrites
    it in place (a replayed CUDA graph) a copy on its device (no host sync)."""
    return tensor.detach().clone() if overwritten else tensor


def _overwritten(model: Any) -> bool:
    """Whether the next run of `model`'s train net overwrites the tensors this run left (`Executor.keeps_outputs`)."""
    proto = model.net.Proto()
    return not get_executor(proto.type).keeps_outputs(proto)


# ---- configs and the linear scaling rule ---------------------------------------------------------


class Config(dict):
    """A nested dict with attribute access (`cfg.SOLVER.BASE_LR`), like Detectron2's CfgNode."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for key, value in self.items():
            if isinstance(value, Mapping) and not isinstance(value, Config):
                self[key] = Config(value)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no field {name!r} (fields: {sorted(self)})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def clone(self) -> Config:
        return Config(deepcopy(dict(self)))


def auto_scale_workers(cfg: Mapping[str, Any], num_workers: int) -> Any:
    """Detectron2's linear scaling rule: the config for `num_workers` devices from one written for
    `SOLVER.REFERENCE_WORLD_SIZE` (0: no scaling). With scale = num_workers / reference:
    IMS_PER_BATCH and BASE_LR are multiplied by it; MAX_ITER, WARMUP_ITERS, STEPS,
    CHECKPOINT_PERIOD and TEST.EVAL_PERIOD divided (rounded); REFERENCE_WORLD_SIZE becomes
    num_workers. Returns a new config of the input's kind (a yacs `CfgNode` from `graphpar.config`
    stays one, frozen if the input was; the input is not changed).

    Raises:
        ValueError: num_workers < 1; IMS_PER_BATCH not divisible by the reference world size, or
            the scaled batch not divisible by num_workers; a period or iteration count rounding to 0.
    """
    is_frozen, clone = getattr(cfg, "is_frozen", None), getattr(cfg, "clone", None)
    frozen = callable(is_frozen) and is_frozen()
    cfg = clone() if callable(clone) and callable(getattr(cfg, "defrost", None)) else Config(deepcopy(dict(cfg)))
    if frozen:
        cfg.defrost()
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"auto_scale_workers: num_workers must be an int >= 1, got {num_workers!r}")
    solver = cfg.SOLVER
    old = int(solver.get("REFERENCE_WORLD_SIZE", 0))
    if old == 0 or old == num_workers:
        return _refreeze(cfg, frozen)
    if solver.IMS_PER_BATCH % old:
        raise ValueError(f"auto_scale_workers: SOLVER.IMS_PER_BATCH={solver.IMS_PER_BATCH} is not divisible by "
                         f"SOLVER.REFERENCE_WORLD_SIZE={old} (invalid REFERENCE_WORLD_SIZE)")
    scale = num_workers / old
    solver.IMS_PER_BATCH = int(round(solver.IMS_PER_BATCH * scale))
    solver.BASE_LR = solver.BASE_LR * scale
    solver.MAX_ITER = int(round(solver.MAX_ITER / scale))
    solver.WARMUP_ITERS = int(round(solver.get("WARMUP_ITERS", 0) / scale))
    solver.STEPS = tuple(int(round(s / scale)) for s in solver.get("STEPS", ()))
    solver.CHECKPOINT_PERIOD = int(round(solver.get("CHECKPOINT_PERIOD", 0) / scale))
    if "TEST" in cfg and "EVAL_PERIOD" in cfg.TEST:
        cfg.TEST.EVAL_PERIOD = int(round(cfg.TEST.EVAL_PERIOD / scale))
    solver.REFERENCE_WORLD_SIZE = num_workers
    if solver.MAX_ITER < 1:
        raise ValueError(f"auto_scale_workers: MAX_ITER rounds to {solver.MAX_ITER} for {num_workers} workers")
    log.info("auto-scaled the config to batch %d, LR %g, max_iter %d, warmup %d for %d workers",
             solver.IMS_PER_BATCH, solver.BASE_LR, solver.MAX_ITER, solver.WARMUP_ITERS, num_workers)
    return _refreeze(cfg, frozen)


def _refreeze(cfg: Any, frozen: bool) -> Any:
    if frozen:
        cfg.freeze()
    return cfg

