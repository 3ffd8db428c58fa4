"""What Parallelize builds: the state every pass reads and edits, and the model as the passes see it.

`ParallelState` is the one argument of every pipeline pass (`passes.pipeline`). The passes see the
model through `ModelView`, the part of a `graphpar.model_helper.ModelHelper` they read and edit (its
nets, params and gradients), and keep what they build besides the model's two nets on the state
(`accumulate_net`, `loss_scale_backoff_net`, `bmuf`), never as attributes of the model. The state lives
on the model as `model._parallel`; `ModelHelper` exposes its fields under Caffe2's private attribute
names (`model._devices`, `model._device_grouped_blobs`, ...) as read-only properties, and
`data_parallel_model` sets the other attributes Caffe2's code reads (`model._global_model_init_net`,
...) from the state, in one place, so code written for Caffe2 keeps reading them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from graphpar.core.ir import BlobReference, DeviceOption, GradientSlice, NetDef
from graphpar.core.net import Net
from graphpar.passes.common import DeviceLayout
from graphpar.passes.options import ParallelizeOptions
from graphpar.passes.reducers import Reducer

if TYPE_CHECKING:
    from graphpar.passes.shards import Sharding

Blob = str | GradientSlice


class ModelView(Protocol):
    """What the passes read and edit of the model they parallelize: a `graphpar.model_helper.ModelHelper`
    (the model layer sits above the passes, so they name it by this view; mypy checks that it fits).
    User builder functions get the model itself."""

    name: str
    net: Net
    param_init_net: Net
    params: list[BlobReference]
    weights: list[BlobReference]
    biases: list[BlobReference]
    param_to_grad: dict[BlobReference, str | GradientSlice]

    def GetParams(self, namescope: str | None = None, top_scope: bool = False) -> list[BlobReference]: ...  # noqa: N802

    def GetComputedParams(self, namescope: str | None = None) -> list[BlobReference]: ...  # noqa: N802

    def GetAllParams(self, namescope: str | None = None) -> list[BlobReference]: ...  # noqa: N802

    def Validate(self) -> None: ...  # noqa: N802

    def AddGradientOperators(self, ys: list | dict,  # noqa: N802
                             input_gradients: bool = False) -> dict[BlobReference, str | GradientSlice]: ...

    def add_input_casts(self, casts: Iterable[str]) -> None: ...


@dataclass
class BmufNets:
    """What Parallelize_BMUF builds besides the train net: the global model's init and update nets, and
    the warmup (Caffe2's `_global_model_init_net`, `_global_model_param_updates_net`,
    `_warmup_iterations`, `_warmup_broadcast`)."""

    global_init: Net
    global_update: Net
    warmup_iterations: int | None = None
    warmup_broadcast: Net | None = None


@dataclass
class ParallelState:
    """A model being (or once) parallelized: the passes' shared state, Caffe2's bookkeeping included.

    `grouped` is Caffe2's `_device_grouped_blobs`: unscoped name -> {device id: blob}, for params,
    computed params, gradients and synced blobs. `blob_to_device` is updated in place (the reducer
    reads it when it builds copies). What running the model builds and counts (the fed-input check,
    Synchronize's barrier, skipped steps) is not the passes' and lives in `data_parallel_model.RunState`.
    """

    model: ModelView
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
    optimizer: Any = None  # optimizer_builder_fun's result (a graphpar.optimizer.Optimizer, or what it returns)
    init_nets: list[Net] = field(default_factory=list)  # what RunInitNet runs
    nets: list[Net | tuple[Net, int]] = field(default_factory=list)  # what RunNet runs (BMUF's global net once)
    accumulate_net: Net | None = None  # accumulate_gradients > 1: forward, backward and the running sums
    reset_accumulated_net: Net | None = None  # accumulate_gradients > 1: the running sums made zeros again
    loss_scale_backoff_net: Net | None = None  # dynamic loss_scale: what RunNet runs after a skipped step
    bmuf: BmufNets | None = None  # Parallelize_BMUF's global nets
    lowered: dict[str, dict[int, Blob]] = field(default_factory=dict)  # allreduce_dtype: the fp32 gradients
    updates_start: tuple[int, int] = (0, 0)  # init and train net op counts before build_updates: the updates follow
    sharding: Sharding | None = None  # shard_optimizer_state with several replicas (passes.shards)
    # communicators over a group of shards only (combine_spatial_bn's groups): blob -> the group's shard ids
    group_worlds: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def training(self) -> bool:
        return self.options.training

    def netdefs(self) -> list[NetDef]:
        """The model's init and train NetDefs, in run order (what the passes rewrite)."""
        return [self.model.param_init_net.Proto(), self.model.net.Proto()]
