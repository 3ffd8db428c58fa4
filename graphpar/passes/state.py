"""What Parallelize knows and builds: its checked options and the state every pass reads and edits.

`ParallelState` is the one argument of every pipeline pass (`passes.pipeline`). It lives on the
model as `model._parallel`; `ModelHelper` exposes its fields under Caffe2's private attribute names
(`model._devices`, `model._device_grouped_blobs`, ...) as read-only properties, so code written for
Caffe2 keeps reading them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from graphpar.core.ir import DeviceOption, GradientSlice
from graphpar.passes.common import DeviceLayout
from graphpar.passes.loss_scale import LossScale
from graphpar.passes.reducers import Reducer
from graphpar.platform.distributed import Rendezvous

if TYPE_CHECKING:
    from graphpar.model.model_helper import ModelHelper

Builder = Callable[..., Any]
Blob = str | GradientSlice


@dataclass(frozen=True)
class ParallelizeOptions:
    """Parallelize's arguments after checking (see `data_parallel_model.Parallelize`)."""

    input_builder_fun: Builder
    forward_pass_builder_fun: Builder
    param_update_builder_fun: Builder | None = None
    optimizer_builder_fun: Builder | None = None
    post_sync_builder_fun: Builder | None = None
    pre_grad_net_transformer_fun: Builder | None = None
    net_transformer_fun: Builder | None = None
    rendezvous: Rendezvous | None = None
    net_type: str = "dag"
    num_threads_per_device: int = 4
    broadcast_computed_params: bool = True
    average_computed_params: bool = False
    use_nccl: bool = False
    shared_model: bool = False
    combine_spatial_bn: bool | str = False  # True, False or "shard"
    gradient_bucket_bytes: int | None = None
    first_bucket_bytes: int = 1024 * 1024
    dynamic_memory_management: bool = False
    optimize_gradient_memory: bool = False
    blobs_to_keep: tuple[str, ...] = ()
    uneven_batches: bool = False
    check_finite_loss: bool = False
    max_concurrent_distributed_ops: int = 16
    barrier_net_timeout_sec: float = 300.0
    accumulate_gradients: int = 1
    cpu_update_once: bool = False  # Parallelize's default is True; BMUF never uses it
    auto_buckets: bool = False  # gradient_bucket_bytes is the CUDA default: per gradient if sizes are unknown
    compute_dtype: str | None = None  # "bfloat16" | "float16": the mixed-precision pass (passes.precision)
    loss_scale: LossScale | None = None  # passes.loss_scale
    channels_last: bool = False  # passes.channels_last
    allreduce_dtype: str | None = None  # all-reduce fp32 gradients in this low dtype (passes.precision)

    @property
    def num_shards(self) -> int:
        """How many processes train the model together (1 without a rendezvous)."""
        return 1 if self.rendezvous is None else self.rendezvous.num_shards

    @property
    def training(self) -> bool:
        """Whether the model gets gradients and updates (an update builder was given)."""
        return self.param_update_builder_fun is not None or self.optimizer_builder_fun is not None


@dataclass
class ParallelState:
    """A model being (or once) parallelized: the passes' shared state, Caffe2's bookkeeping included.

    `grouped` is Caffe2's `_device_grouped_blobs`: unscoped name -> {device id: blob}, for params,
    computed params, gradients and synced blobs. `blob_to_device` is updated in place (the reducer
    reads it when it builds copies).
    """

    model: ModelHelper
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
    checkpoint_net: Any = None
    feeds: Any = None  # the train net's graphpar.feeds.FeedTracker, made by the first RunNet
    sync_barrier: Any = None  # Synchronize's (timeout, barrier Net) across shards, built on first use
    accumulate_net: Any = None  # accumulate_gradients > 1: forward, backward and the running sums
    lowered: dict[str, dict[int, Blob]] = field(default_factory=dict)  # allreduce_dtype: the fp32 gradients
    skipped_steps: int = 0  # steps RunNet skipped on a gradient overflow (passes.loss_scale)

    @property
    def training(self) -> bool:
        return self.options.training

    def netdefs(self) -> list[Any]:
        """The model's init and train NetDefs, in run order (what the passes rewrite)."""
        return [self.model.param_init_net.Proto(), self.model.net.Proto()]
