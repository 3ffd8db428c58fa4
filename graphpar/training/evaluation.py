"""Detectron2's evaluation surface: evaluators (`reset` / `process` / `evaluate`) fed by
`inference_on_dataset`, with every process's results gathered to the main process.

    evaluator = ClassificationEvaluator()                  # or a DatasetEvaluator of your own
    results = inference_on_dataset(test_model, test_loader, evaluator)   # {"accuracy": {"top1": ...}}

`inference_on_dataset` feeds each batch of the loader (this process's part of the dataset) to a
forward-only parallelized model, runs it, and hands the evaluator the batch and the outputs it asks
for (`output_names`), gathered over the model's devices in batch order. `evaluate` gathers what every
process saw (`graphpar.comm.gather`) and returns the results on the main process, {} on the others,
as Detectron2's evaluators do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from graphpar.parallel import comm
from graphpar.parallel import data_parallel_model as dpm
from graphpar.runtime import workspace
from graphpar.training.batches import pad_to_devices
from graphpar.training.data import feed, gather

__all__ = ["ClassificationEvaluator", "DatasetEvaluator", "DatasetEvaluators", "flatten_results_dict",
           "inference_on_dataset"]

log = logging.getLogger(__name__)


class DatasetEvaluator:
    """Accumulates a metric over batches: `reset()`, then `process(inputs, outputs)` per batch, then
    `evaluate()` -> {task: {metric: value}} on the main process ({} elsewhere, or None for nothing).
    `output_names` are the model outputs `inference_on_dataset` gathers for it."""

    output_names: Sequence[str] = ()
    group: Any = None  # the processes to gather over (comm's group argument; None: the default group)

    def reset(self) -> None: ...

    def process(self, inputs: Any, outputs: Mapping[str, np.ndarray]) -> None: ...

    def evaluate(self) -> dict[str, Any] | None:
        return None


class DatasetEvaluators(DatasetEvaluator):
    """Several evaluators as one (their results merged; a task name twice is an error)."""

    def __init__(self, evaluators: Iterable[DatasetEvaluator]) -> None:
        self.evaluators = list(evaluators)
        self.output_names = sorted({n for e in self.evaluators for n in e.output_names})

    def reset(self) -> None:
        for e in self.evaluators:
            e.reset()

    def process(self, inputs: Any, outputs: Mapping[str, np.ndarray]) -> None:
        for e in self.evaluators:
            e.process(inputs, outputs)

    def evaluate(self) -> dict[str, Any]:
        results: dict[str, Any] = {}
        for e in self.evaluators:
            for task, value in (e.evaluate() or {}).items():
                if task in results:
                    raise ValueError(f"DatasetEvaluators: two evaluators return the task {task!r}")
                results[task] = value
        return results


class ClassificationEvaluator(DatasetEvaluator):
    """Top-1 (and top-k) accuracy of `scores` (a model output, default `softmax`) against the batch's
    `label`, over the whole dataset: every process's counts, summed on the main process."""

    def __init__(self, scores: str = "softmax", label: str = "label", topk: Sequence[int] = (1,),
                 group: Any = None) -> None:
        self.scores, self.label, self.topk, self.group = scores, label, tuple(topk), group
        self.output_names = (scores,)
        self.reset()

    def reset(self) -> None:
        self._correct = dict.fromkeys(self.topk, 0)
        self._count = 0

    def process(self, inputs: Any, outputs: Mapping[str, np.ndarray]) -> None:
        labels = np.asarray(inputs[self.label]).reshape(-1)
        ranked = np.argsort(-np.asarray(outputs[self.scores]), axis=1, kind="stable")
        for k in self.topk:
            self._correct[k] += int((ranked[:, :k] == labels[:, None]).any(axis=1).sum())
        self._count += len(labels)

    def evaluate(self) -> dict[str, Any]:
        parts = comm.gather((self._correct, self._count), group=self.group)
        if not parts:
            return {}
        count = sum(n for _, n in parts)
        if count == 0:
            log.warning("ClassificationEvaluator: no samples were processed")
            return {}
        return {"accuracy": {f"top{k}": sum(c[k] for c, _ in parts) / count for k in self.topk}}


def inference_on_dataset(model: Any, data_loader: Iterable[Any], evaluator: DatasetEvaluator | None) -> dict:
    """Run the forward-only parallelized `model` on every batch of `data_loader` and return
    `evaluator.evaluate()` ({} without an evaluator, or on a process that is not the main one). A model
    whose nets are not created yet gets `RunInitNet` first (its params shared with a trained model,
    `init_params=False`).

    Every sample is evaluated once: a batch with fewer rows than the model has devices (a dataset's
    short last batch) is run with its last row copied onto the devices left over, and the evaluator
    gets the outputs of the batch's own rows only (the first devices' parts of each output)."""
    if evaluator is None:
        evaluator = DatasetEvaluators([])
    evaluator.reset()
    start, batches = time.perf_counter(), 0
    count = len(model.GetDevices())
    for inputs in data_loader:
        fed, rows = pad_to_devices(inputs, count)  # a short last batch: one row per device, the copies dropped
        feed(model, fed)
        if model.net.Proto().name not in workspace.get_workspace().nets:
            dpm.RunInitNet(model)
        dpm.RunNet(model, 1)
        names = list(evaluator.output_names)
        outputs = gather(model, names) if names else {}
        if rows is not None:
            outputs = {name: value[:len(value) // count * rows] for name, value in outputs.items()}
        evaluator.process(inputs, outputs)
        batches += 1
    log.info("inference on %d batches took %.2f s", batches, time.perf_counter() - start)
    return evaluator.evaluate() or {}


def flatten_results_dict(results: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """{"accuracy": {"top1": 0.9}} -> {"accuracy/top1": 0.9} (the scalars a writer records)."""
    flat: dict[str, float] = {}
    for key, value in results.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_results_dict(value, f"{name}/"))
        else:
            flat[name] = float(value)
    return flat
