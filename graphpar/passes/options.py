"""Parallelize's options after checking, and the values some of them take (`LossScale`).

The passes read `ParallelizeOptions` as `state.options`; the module imports nothing from the passes,
so any pass module can import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graphpar.distributed import Rendezvous

Builder = Callable[..., Any]


@dataclass(frozen=True)
class LossScale:
    """A loss scale: static (`dynamic=False`: S stays `init_scale`) or dynamic, with GradScaler's defaults."""

    init_scale: float = 2.0 ** 16
    dynamic: bool = True
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


def check_loss_scale(value: Any) -> LossScale | None:
    """`Parallelize`'s loss_scale argument as a LossScale: None, a number > 0 (static), "dynamic", a
    dict of LossScale's fields (dynamic unless it says otherwise) or a LossScale.

    Raises:
        ValueError / TypeError: any other value, a scale <= 0 or not finite, growth_factor <= 1,
            backoff_factor outside (0, 1), growth_interval < 1.
    """
    if value is None or isinstance(value, LossScale):
        scale = value
    elif value == "dynamic":
        scale = LossScale()
    elif isinstance(value, dict):
        unknown = sorted(set(value) - set(LossScale.__dataclass_fields__))
        if unknown:
            raise TypeError(f"loss_scale: unknown keys {unknown}; use {sorted(LossScale.__dataclass_fields__)}")
        scale = LossScale(**value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        scale = LossScale(float(value), dynamic=False)
    else:
        raise TypeError(f"loss_scale={value!r}: use a number > 0 (static), 'dynamic', a dict of "
                        f"graphpar.passes.loss_scale.LossScale fields, or None")
    if scale is not None:
        ok = (0 < scale.init_scale < float("inf") and scale.growth_factor > 1 and 0 < scale.backoff_factor < 1
              and isinstance(scale.growth_interval, int) and scale.growth_interval >= 1)
        if not ok:
            raise ValueError(f"loss_scale: {scale} needs 0 < init_scale < inf, growth_factor > 1, "
                             f"0 < backoff_factor < 1 and an int growth_interval >= 1")
    return scale



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
