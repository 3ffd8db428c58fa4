"""What Parallelize builds: the state every pass reads and edits.

`ParallelState` is the one argument of every pipeline pass (`passes.pipeline`). It lives on the
model as `model._parallel`; `ModelHelper` exposes its fields under Caffe2's private attribute names
(`model._devices`, `model._device_grouped_blobs`, ...) as read-only properties, so code written for
Caffe2 keeps reading them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphpar.core.ir import DeviceOption, GradientSlice
from graphpar.passes.common import DeviceLayout
from graphpar.passes.options import ParallelizeOptions
from graphpar.passes.reducers import Reducer

Blob = str | GradientSlice


@dataclass
class ParallelState:
    """A model being (or once) parallelized: the passes' shared state, Caffe2's bookkeeping included.

    `grouped` is Caffe2's `_device_grouped_blobs`: unscoped name -> {device id: blob}, for params,
    computed params, gradients and synced blobs. `blob_to_device` is updated in place (the reducer
    reads it when it builds copies). What running the model builds and counts (the fed-input check,
    Synchronize's barrier, skipped steps) is not the passes' and lives in `data_parallel_model.RunState`.
    """

    model: Any  # the graphpar.model_helper.ModelHelper (the model layer sits above the passes)
    options: ParallelizeOptions
    layout: DeviceLayout
    reducer: Reducer
    blob_to_device: dict[str, DeviceOption]
    non_datapar: frozenset[str]  # params created before Parallelize: not replicated
    losses_by_device: dict[int, list[str]] = field(default_factory=dict)
    grouped: dict[str, dict[int, Blob]] = field(default_factory=dict)
    param_names: list[str] = field(default_factory=list)
    computed_param_names: list[str] = field(default_factory=list)
    grad_names: list[str] = field(default_factory=list)
    sync_names: list[str] = field(default_factory=list)
    all_params: list[str] = field(default_factory=list)  # every replica's params, before shared-model pruning
    optimizer: Any = None
    init_nets: list[Any] = field(default_factory=list)
    nets: list[Any] = field(default_factory=list)
    accumulate_net: Any = None  # accumulate_gradients > 1: forward, backward and the running sums
    reset_accumulated_net: Any = None  # accumulate_gradients > 1: the running sums made zeros again
    lowered: dict[str, dict[int, Blob]] = field(default_factory=dict)  # allreduce_dtype: the fp32 gradients
    # communicators over a group of shards only (combine_spatial_bn's groups): blob -> the group's shard ids
    group_worlds: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def training(self) -> bool:
        return self.options.training

    def netdefs(self) -> list[Any]:
        """The model's init and train NetDefs, in run order (what the passes rewrite)."""
        return [self.model.param_init_net.Proto(), self.model.net.Proto()]
