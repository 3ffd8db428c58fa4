"""The Parallelize pipeline: its passes in Caffe2's order, and the runner that applies them.

Every pass is a function `pass_(state: ParallelState) -> None` that edits the model, its nets and the
state in place, with a docstring stating what it needs and what it guarantees; a `Pass` entry gives
it a name and the condition under which it runs. `PIPELINE` strings the stages (tuples of entries,
each under a name) together; adding a pass is one line in its stage.

How the runner runs them is the current `PassContext` (TVM's): `with PassContext(check=True):
Parallelize(...)` validates every net against the schemas after each pass (the test suite always
does; an error names the pass), `dump_dir=<dir>` writes each net after each pass to
`<dir>/<k>_<pass>_<net>.txt`, `disabled={"name", ...}` skips passes by name.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphpar.core.ir import CPU, CUDA
from graphpar.core.schema import validate_net
from graphpar.passes import (
    accumulate,
    allreduce,
    analyze,
    broadcast_computed,
    bucketing,
    builders,
    channels_last,
    check_losses,
    cpu_update_once,
    distributed,
    finish,
    fuse_updates,
    group_by_device,
    inter_device_bn,
    interleave,
    loss_gradients,
    loss_scale,
    memonger,
    precision,
    reduce_scatter,
    shard_updates,
    shards,
    shared_model,
    sync,
)
from graphpar.passes.state import ParallelState

Condition = Callable[[ParallelState], bool]


def always(_state: ParallelState) -> bool:
    return True


def training(state: ParallelState) -> bool:
    return state.training


def forward_only(state: ParallelState) -> bool:
    return not state.training


def _option(name: str, test: Callable[[Any], bool] = bool) -> Condition:
    """Runs when training and option `name` passes `test` (default: is truthy)."""
    return lambda state: state.training and test(getattr(state.options, name))


def _given(name: str) -> Condition:
    """Runs when the builder function `name` was given."""
    return lambda state: getattr(state.options, name) is not None


@dataclass(frozen=True)
class Pass:
    """One pipeline entry: a name (for messages and dumps), the pass, and when it runs."""

    name: str
    run: Callable[[ParallelState], None]
    when: Condition = always


def _buckets(state: ParallelState) -> bool:
    return state.options.gradient_bucket_bytes is not None


def _update_once(state: ParallelState) -> bool:
    """`cpu_update_once` applies: training CPU replicas of one process, each with its own params and
    whole optimizer state."""
    options = state.options
    return (state.training and options.cpu_update_once and state.layout.device_type == CPU
            and len(state.layout.devices) > 1 and options.num_shards == 1 and not options.shared_model
            and not options.shard_optimizer_state)


def _sharded(state: ParallelState) -> bool:
    """Sharded state applies: shard_optimizer_state with several replicas (`passes.shards`)."""
    return state.training and state.sharding is not None


def _scattered(state: ParallelState) -> bool:
    """The gradients are reduce-scattered (shard_gradients), not all-reduced."""
    return _sharded(state) and state.options.shard_gradients


def _computed_params_sync(state: ParallelState) -> bool:
    options = state.options
    return options.average_computed_params or options.broadcast_computed_params


# The stages, in Caffe2's order: tuples of passes, each under a name, so that a pipeline that differs
# (BMUF's) is written as its edits of PIPELINE (`edited`) rather than as a copy.

SETUP = (
    Pass("configure_train_net", finish.configure_train_net),
    Pass("build_replicas", builders.build_replicas),
    Pass("validate_params", analyze.validate_params),
    Pass("group_params", group_by_device.group_params),
)
FORWARD_REWRITES = (
    Pass("transform_before_gradients", builders.transform_before_gradients, _given("pre_grad_net_transformer_fun")),
    Pass("mixed_precision", precision.mixed_precision, _given("compute_dtype")),
    Pass("keep_channels_last", channels_last.keep_channels_last, lambda s: s.options.channels_last),
    Pass("check_finite_losses", check_losses.check_finite_losses, _option("check_finite_loss")),
)
GRADIENTS = (
    Pass("add_gradients", loss_gradients.add_gradients, training),
    Pass("transform_nets", builders.transform_nets, _given("net_transformer_fun")),
)
FORWARD_ONLY = (  # forward-only models stop here: devices, the cross-replica check, net lists
    Pass("infer_devices_forward_only", analyze.infer_devices, forward_only),
    Pass("analyze_forward_only", analyze.analyze, forward_only),
    Pass("forward_only_sync_names", sync.forward_only_sync_names, forward_only),
)
BATCH_NORM = (
    Pass("interleave", interleave.interleave, _option("combine_spatial_bn")),
    Pass("combine_batch_norm", inter_device_bn.combine_batch_norm, _option("combine_spatial_bn")),
)
REDUCE_GRADIENTS = (  # every replica ends up with the same gradients (and computed params)
    Pass("validate_params_again", analyze.validate_params, training),
    Pass("group_gradients", group_by_device.group_gradients, training),
    Pass("infer_devices", analyze.infer_devices, training),
    Pass("accumulate_gradients", accumulate.accumulate_gradients, _option("accumulate_gradients", lambda k: k > 1)),
    Pass("sync_computed_params", broadcast_computed.sync_computed_params,
         lambda s: s.training and _computed_params_sync(s)),
    Pass("cast_gradients_down", precision.cast_gradients_down, _option("allreduce_dtype")),
    Pass("plan_shards", shards.plan_shards, _option("shard_optimizer_state")),
    Pass("allreduce_gradients", allreduce.allreduce_gradients,
         lambda s: s.training and not _buckets(s) and not _scattered(s)),
    Pass("allreduce_gradient_buckets", bucketing.allreduce_gradient_buckets, lambda s: s.training and _buckets(s)),
    Pass("reduce_scatter_gradients", reduce_scatter.reduce_scatter_gradients, _scattered),
    Pass("cast_gradients_up", precision.cast_gradients_up, _option("allreduce_dtype")),
    Pass("prune_shared_params", shared_model.prune_shared_params, _option("shared_model")),
    Pass("unscale_gradients", loss_scale.unscale_gradients, _option("loss_scale", lambda s: s is not None)),
)
UPDATES = (
    Pass("build_updates", builders.build_updates, training),
    Pass("shard_updates", shard_updates.shard_updates, _sharded),
    Pass("grow_loss_scale", loss_scale.grow_loss_scale, _option("loss_scale", lambda s: s is not None and s.dynamic)),
    Pass("fuse_updates", fuse_updates.fuse_updates, lambda s: s.training and s.layout.device_type == CUDA),
)
INITIAL_SYNC = (
    Pass("compute_sync_blobs", sync.compute_sync_blobs, training),
    Pass("infer_devices_after_updates", analyze.infer_devices, training),
    Pass("analyze", analyze.analyze, training),
    Pass("mark_first_iteration_serial", finish.mark_first_iteration_serial, training),
    Pass("initial_sync", sync.initial_sync, training),
    Pass("build_post_sync", builders.build_post_sync, lambda s: s.training and _given("post_sync_builder_fun")(s)),
)
FINISH = (
    Pass("share_gradient_memory", memonger.share_gradient_memory, _option("optimize_gradient_memory")),
    Pass("update_once_on_cpu", cpu_update_once.update_once, _update_once),
    Pass("free_intermediates", finish.free_intermediates, _option("dynamic_memory_management")),
    Pass("set_net_lists", finish.set_net_lists),
    Pass("remap_shared_params", shared_model.remap_shared_params, _option("shared_model")),
    Pass("check_finite_across_shards", check_losses.check_finite_across_shards,
         lambda s: bool(s.training and s.options.check_finite_loss and s.options.num_shards > 1)),
    Pass("create_common_worlds", distributed.create_common_worlds, lambda s: s.training and s.options.num_shards > 1),
    Pass("order_collectives", finish.order_collectives),
    Pass("declare_inputs", finish.declare_inputs),
)
PIPELINE: tuple[Pass, ...] = (*SETUP, *FORWARD_REWRITES, *GRADIENTS, *FORWARD_ONLY, *BATCH_NORM, *REDUCE_GRADIENTS,
                              *UPDATES, *INITIAL_SYNC, *FINISH)


def edited(pipeline: Sequence[Pass], remove: Iterable[str] = (),
           replace: Mapping[str, Pass] | None = None) -> tuple[Pass, ...]:
    """`pipeline` without the passes named in `remove` and with those named in `replace` swapped, in
    place, for the given entries. ValueError for a name that is not a pass of `pipeline`."""
    replace = dict(replace or {})
    names = [entry.name for entry in pipeline]
    unknown = sorted({*remove, *replace} - set(names))
    if unknown:
        raise ValueError(f"passes {unknown} are not in the pipeline; its passes are {names}")
    dropped = set(remove)
    return tuple(replace.get(entry.name, entry) for entry in pipeline if entry.name not in dropped)


@dataclass(frozen=True)
class PassContext:
    """How `run_pipeline` runs its passes: a context manager (the innermost `with` of the current thread,
    or asyncio task, holds) or an argument of `run_pipeline`.

    Args:
        check: validate every net (structure and schemas) after every pass that ran; the error names
            the pass.
        dump_dir: write every net after every pass that ran to `<dump_dir>/<k>_<pass>_<net>.txt`.
        disabled: names of passes not to run, whatever their condition says (to bisect a problem; a
            pass that later passes rely on makes them fail). A name that is not a pass of the pipeline
            raises ValueError before any pass runs.

    Outside every `with`, the default context holds: `check` is on when the environment variable
    `GRAPHPAR_CHECK_PASSES` was set (not to 0) when graphpar was imported, and `dump_dir` is
    `GRAPHPAR_DUMP_PASSES`. A new thread starts outside every `with` (its own context variables), so
    one thread's `with` neither sees nor ends another's.
    """

    check: bool = False
    dump_dir: str | os.PathLike[str] | None = None
    disabled: frozenset[str] = field(default=frozenset())

    def __post_init__(self) -> None:
        if isinstance(self.disabled, str):
            raise TypeError(f"PassContext: disabled must be a collection of pass names, got {self.disabled!r}")
        object.__setattr__(self, "disabled", frozenset(self.disabled))

    def __enter__(self) -> PassContext:
        _ENTERED.set((*_ENTERED.get(), self))
        return self

    def __exit__(self, *exc_info: object) -> None:
        _ENTERED.set(_ENTERED.get()[:-1])  # `with` blocks nest: this context is the innermost

    @staticmethod
    def current() -> PassContext:
        """The innermost context this thread (or task) entered, else the default one."""
        entered = _ENTERED.get()
        return entered[-1] if entered else _DEFAULT


_DEFAULT = PassContext(check=os.environ.get("GRAPHPAR_CHECK_PASSES", "") not in ("", "0"),
                       dump_dir=os.environ.get("GRAPHPAR_DUMP_PASSES") or None)
# The contexts entered, outermost first: a context variable, so each thread (and asyncio task) has its own.
_ENTERED: contextvars.ContextVar[tuple[PassContext, ...]] = contextvars.ContextVar("graphpar_pass_contexts",
                                                                                 default=())


def run_pipeline(state: ParallelState, pipeline: Sequence[Pass] | None = None,
                 context: PassContext | None = None) -> None:
    """Apply each pass of `pipeline` (default `PIPELINE`) whose condition holds and that `context`
    (default `PassContext.current()`) does not disable, in order; check and dump the nets after each
    if the context asks.

    Raises whatever a pass raises; ValueError for a disabled name that is not a pass of `pipeline`;
    with checking on, a ValueError/TypeError naming the pass whose output breaks a net's structure or
    a schema.
    """
    passes = PIPELINE if pipeline is None else pipeline
    context = PassContext.current() if context is None else context
    unknown = sorted(context.disabled - {entry.name for entry in passes})
    if unknown:
        raise ValueError(f"PassContext: disabled passes {unknown} are not in the pipeline; its passes are "
                         f"{[entry.name for entry in passes]}")
    for k, entry in enumerate(passes):
        if entry.name in context.disabled or not entry.when(state):
            continue
        entry.run(state)
        if context.check:
            check_nets(state, entry.name)
        if context.dump_dir is not None:
            dump_nets(state, f"{k:02d}_{entry.name}", Path(context.dump_dir))


def check_nets(state: ParallelState, pass_name: str) -> None:
    """Validate every model net (structure and schemas), naming the pass in the error."""
    for net in state.netdefs():
        try:
            validate_net(net)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"after Parallelize pass {pass_name!r}: {exc}") from exc


def dump_nets(state: ParallelState, stem: str, directory: Path) -> None:
    """Write each model net as text to `directory/<stem>_<net>.txt`."""
    directory.mkdir(parents=True, exist_ok=True)
    for net in state.netdefs():
        (directory / f"{stem}_{net.name}.txt").write_text(repr(net) + "\n")
