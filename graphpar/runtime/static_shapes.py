"""Caffe2's `static_shapes`: a net that promises fixed input shapes, and the check that holds it to it.

A net with the argument `static_shapes` (`core.naming.STATIC_SHAPES_ARG`; `Parallelize(static_shapes=True)`
sets it on the nets RunNet runs) is fed inputs of one shape and dtype on every run, so an executor may
compile it for those shapes. Its *fed inputs* are the blobs it reads and never writes (data, labels,
a forward-only net's params); each one's shape and dtype are recorded when the net is created, or at
its first successful run for one that did not hold a tensor yet (`CreateBlob`), and every later run
refuses, before anything runs, an input that differs. A few dictionary look-ups per input and run.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graphpar.core.dataflow import dataflow
from graphpar.core.naming import STATIC_SHAPES_ARG
from graphpar.executor import CompiledNet

Spec = tuple[torch.Size, torch.dtype]


def promises_static_shapes(plan: CompiledNet) -> bool:
    """Whether `plan`'s net carries the `static_shapes` argument."""
    return bool(plan.netdef.args.get(STATIC_SHAPES_ARG))


class ShapePromise:
    """The fed inputs of one compiled net and the shape and dtype each must keep."""

    def __init__(self, plan: CompiledNet, blobs: Mapping[str, torch.Tensor]) -> None:
        written = dataflow(plan.netdef).first_write
        self.net = plan.name
        self.inputs = tuple(load.name for load in plan.frame.loads if load.name not in written)
        self.specs: dict[str, Spec] = {name: _spec(blobs[name]) for name in self.inputs if name in blobs}

    def check(self, blobs: Mapping[str, torch.Tensor]) -> dict[str, Spec]:
        """Raise ValueError naming the first fed input whose shape or dtype differs from its recorded one;
        return the specs of the inputs seen for the first time (to record once the run succeeded)."""
        for name, (shape, dtype) in self.specs.items():
            tensor = blobs.get(name)  # a missing one: the run reports it
            if tensor is not None and (tensor.shape != shape or tensor.dtype != dtype):
                raise ValueError(
                    f"RunNet({self.net!r}): input {name!r} is {_show(_spec(tensor))} but was {_show((shape, dtype))} "
                    f"when the net was created (or first ran), and the net promises static shapes (Parallelize("
                    f"static_shapes=True), net argument {STATIC_SHAPES_ARG!r}). Feed it with that shape and "
                    f"dtype (full batches: a loader's drop_last=True), or build the model without "
                    f"static_shapes; nothing ran")
        if len(self.specs) == len(self.inputs):
            return {}
        return {name: _spec(blobs[name]) for name in self.inputs if name not in self.specs and name in blobs}

    def record(self, specs: Mapping[str, Spec]) -> None:
        """Keep the specs `check` returned, after the run that read them succeeded."""
        self.specs.update(specs)


def _spec(tensor: torch.Tensor) -> Spec:
    return tensor.shape, tensor.dtype


def _show(spec: Spec) -> str:
    return f"{list(spec[0])} {str(spec[1]).removeprefix('torch.')}"
