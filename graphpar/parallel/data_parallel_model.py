"""Data parallelism over the devices of one host, in the style of Caffe2's `data_parallel_model`.

`Parallelize` calls the user's builder functions once per device, inside `DeviceScope` +
`NameScope("gpu_<id>")` (or `cpu_<id>`), then rewrites the model with the passes in
`graphpar.passes`, in Caffe2's order: gradients, inter-device batch norm (`combine_spatial_bn`),
all-reduce in reverse creation order, the updates, and the initial broadcast of every replica's
state from the first device. The model is left unchanged if anything fails (a misuse raises before
the model changes).

Differences from Caffe2, each deliberate: misuse raises `ParallelizeError` / `TypeError` rather than
`AssertionError`; nonexistent CUDA device ids raise instead of warning; forward-only models get
their net lists (so `RunInitNet` / `RunNet` work on test models); `FinalizeAfterCheckpoint` accepts
unscoped names and refuses names of devices that are not replicas (a checkpoint saved with other
devices, whose values Caffe2 silently left unused); `GetLearningRateBlobNames` works for both
update-builder styles; collectives and copies land in the net they were asked for, and every NCCL
collective of a net (batch-norm statistics and computed params included, not only gradients) is in
one chain of control inputs; the cross-replica check covers CPU replicas too; `combine_spatial_bn`
works with any device ids and with host-side ops in GPU replicas; `ExtractPredictorNet` takes only the
first replica's ops (interleaved replicas are not swept in); the initial sync runs in a fixed (not
hash) order.

Beyond Caffe2: `gradient_bucket_bytes` / `bucket_cap_mb` all-reduce gradients in DDP-style buckets
(`passes.bucketing`; DDP's 25 MiB by default on real CUDA devices, opt-in elsewhere), and the opt-in
`average_computed_params` averages batch-norm running statistics over the replicas instead of
copying the first device's.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial, wraps
from typing import TYPE_CHECKING, Any, ParamSpec

from graphpar.core.ir import CPU, CUDA, DeviceOption, NetDef
from graphpar.core.naming import KEEP_ARG, device_prefix, parse_device_scope, shard_name, stripBlobName
from graphpar.core.net import Net
from graphpar.core.schema import Trait, has_trait
from graphpar.core.scope import CurrentDeviceScope
from graphpar.errors import (
    CheckpointError,
    DeviceScopeError,
    GradientOverflowError,
    MissingBlobError,
    ParallelizeError,
)
from graphpar.executor import net_types
from graphpar.executor.plan import check_inputs_exist
from graphpar.model.model_helper import ModelHelper
from graphpar.parallel.feeds import FeedTracker
from graphpar.passes.bmuf import bmuf_options, bmuf_pipeline
from graphpar.passes.common import DeviceLayout, declare_external_inputs, make_op
from graphpar.passes.distributed import SYNC_WORLD, barrier_net, store_of
from graphpar.passes.finish import chain_collectives
from graphpar.passes.memonger import optimize_memory
from graphpar.passes.model_state import parallel_state as _state_of
from graphpar.passes.options import (
    CompileOptions,
    LossScale,
    ParallelizeOptions,
    args_doc,
    blob_names,
    checked,
)
from graphpar.passes.pipeline import PIPELINE, edited, run_pipeline
from graphpar.passes.predictor import extract_predictor_net
from graphpar.passes.reducers import DistributedReducer, PeerAccess, make_reducer
from graphpar.passes.shards import state_gather_net, state_scatter_net
from graphpar.passes.state import Blob, ParallelState
from graphpar.passes.sync import (
    check_unprefixed,
    checkpoint_sync_names,
    checkpoint_sync_net,
    replica_init_outputs,
    sync_blobs,
)
from graphpar.platform import distributed
from graphpar.platform.devices import (
    can_access_peer,
    check_balance,
    cuda_is_simulated,
    current_device_map,
    num_cuda_devices,
    physical_gpu,
    shares_a_gpu,
)
from graphpar.platform.distributed import Rendezvous, default_engine, parse_rendezvous
from graphpar.runtime import checkpoint, workspace
from graphpar.runtime.resume import check_run

__all__ = [
    "AddBlobSync", "AddDistributedBlobSync", "ConvertNetForDevice", "CreateNet", "ExtractPredictorNet",
    "FinalizeAfterCheckpoint", "GetCheckpointParams", "GetDevices", "GetLearningRateBlobNames",
    "OptimizeGradientMemory", "Parallelize", "Parallelize_BMUF", "Parallelize_CPU", "Parallelize_CPU_BMUF",
    "Parallelize_GPU", "Parallelize_GPU_BMUF", "Parallelize_iDeep", "RunInitNet", "RunNet", "RunWarmup",
    "Synchronize", "save_checkpoint", "stripBlobName",
]

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Builder = Callable[[ModelHelper], Any]
P = ParamSpec("P")


def _documented(fun: Callable[P, None]) -> Callable[P, None]:
    """Fill Parallelize's docstring with the Args entries its options declare (`passes.options`)."""
    if fun.__doc__:  # None under python -OO
        fun.__doc__ = fun.__doc__.replace("        <the options>\n", args_doc() + "\n")
    return fun


@_documented
def Parallelize(  # noqa: N802 - Caffe2 name
    model_helper_obj: ModelHelper,
    input_builder_fun: Builder,
    forward_pass_builder_fun: Callable[[ModelHelper, float], Any],
    param_update_builder_fun: Builder | None = None,
    optimizer_builder_fun: Builder | None = None,
    post_sync_builder_fun: Builder | None = None,
    pre_grad_net_transformer_fun: Builder | None = None,
    net_transformer_fun: Callable[..., Any] | None = None,
    devices: Iterable[int] | None = None,
    rendezvous: Mapping[str, Any] | None = None,
    net_type: str = "dag",
    broadcast_computed_params: bool = True,
    optimize_gradient_memory: bool = False,
    dynamic_memory_management: bool = False,
    blobs_to_keep: Iterable[str] | None = None,
    use_nccl: bool = False,
    max_concurrent_distributed_ops: int = 16,
    cpu_device: bool = False,
    ideep: bool = False,
    num_threads_per_device: int = 4,
    shared_model: bool = False,
    combine_spatial_bn: bool | str | Sequence[Sequence[int]] = False,
    barrier_net_timeout_sec: float = 300,
    static_shapes: bool = False,
    # graphpar's own options
    gradient_bucket_bytes: int | None = None,
    first_bucket_bytes: int = 1024 * 1024,
    bucket_cap_mb: float | None = None,
    average_computed_params: bool = False,
    uneven_batches: bool = False,
    check_finite_loss: bool | None = None,
    accumulate_gradients: int = 1,
    cpu_update_once: bool = True,
    cuda_graph: bool = False,
    compile: bool | str | Mapping[str, Any] | CompileOptions | None = None,
    compute_dtype: str | torch.dtype | None = None,
    loss_scale: float | str | Mapping[str, Any] | LossScale | None = None,
    channels_last: bool = False,
    allreduce_dtype: str | torch.dtype | None = None,
    shard_optimizer_state: bool = False,
    shard_gradients: bool = False,
) -> None:
    """Replicate the model over `devices` and add gradients, all-reduce, updates and the initial sync.

    The signature is Caffe2's, `Parallelize(model_helper_obj, input_builder_fun,
    forward_pass_builder_fun, param_update_builder_fun=None, ..., barrier_net_timeout_sec=300)`, then
    graphpar's own options; each option is declared in `graphpar.passes.options.ParallelizeOptions`.

    Args:
        model_helper_obj: the ModelHelper to fill (not parallelized before).
        <the options>

    Warns (UserWarning) on real CUDA devices that differ a lot in memory or multiprocessor count
    (`devices.check_balance`, as `DataParallel` does).

    Raises:
        ParallelizeError: inside a non-CPU DeviceScope, no devices, duplicate or negative device ids,
            nonexistent CUDA device ids, use_nccl with two replicas on one GPU (a device map, see
            `graphpar.devices`), a bad net_type or num_threads_per_device, both update
            builders, shared_model on CUDA, a builder returning something other than a list of loss
            blobs, duplicate params, replicas that differ (combine_spatial_bn), a param not created
            in param_init_net, an op reading another replica's blob, a model parallelized twice,
            gradient_bucket_bytes or first_bucket_bytes < 1, a param whose size bucketing cannot tell,
            a bad rendezvous (unknown key, bad value) or one combined with an unsupported option,
            cuda_graph with cpu_device or with compile, a bad compile mode, a bad compute_dtype, loss_scale or allreduce_dtype value,
            loss_scale with shared_model, allreduce_dtype with a rendezvous, shard_optimizer_state with
            shared_model, sparse gradients or an update it cannot split (`passes.shard_updates`),
            shard_gradients with buckets, allreduce_dtype or (across shards) loss_scale. The model is
            left as it was.
        TypeError: a model that is not a ModelHelper, non-int (or bool) device ids, builders that are not
            callable (or None, where optional), a flag that is not True or False, non-int
            gradient_bucket_bytes or first_bucket_bytes, a loss_scale of another type (or a dict with
            unknown keys).
    """
    given = dict(locals())  # every argument by name: the first statement, so nothing else is in locals()
    _check_no_device_scope("Parallelize")
    model = _check_model(given.pop("model_helper_obj"))
    given = checked(given, "Parallelize")
    cpu_device = given["cpu_device"] or bool(given["ideep"])
    cuda = not cpu_device and not cuda_is_simulated()
    if given["cuda_graph"] and cpu_device:
        raise ParallelizeError("Parallelize: cuda_graph=True captures CUDA work; it needs CUDA devices, not "
                               "cpu_device=True")
    if given["cuda_graph"] and given["compile"]:
        raise ParallelizeError("Parallelize: cuda_graph=True and compile=... both replace the train net's executor; "
                               "use compile='reduce-overhead' for inductor's CUDA graphs, or cuda_graph=True alone")
    net_type = "cuda_graph" if given["cuda_graph"] else "compiled" if given["compile"] else given["net_type"]
    if given["compile"]:
        given["dynamic_memory_management"] = True  # intermediates stay inside the compiled program
    _check_options(cpu_device, given["param_update_builder_fun"], given["optimizer_builder_fun"],
                   given["shared_model"], net_type)
    given["shard_optimizer_state"] = given["shard_optimizer_state"] or given["shard_gradients"]  # stage 2 has 1's
    _check_combinations(given)
    bucket_bytes, auto_buckets = _bucket_bytes(given["gradient_bucket_bytes"], given["bucket_cap_mb"],
                                               cuda and not given["shard_gradients"])
    rdv = _check_rendezvous(given["rendezvous"], shared_model=given["shared_model"],
                            default_engine=default_engine(not cpu_device))
    _check_bn_groups(given["combine_spatial_bn"], rdv)
    layout = DeviceLayout(_resolve_devices(given["devices"], cpu_device), device_prefix(cpu_device))
    if not cpu_device and given["use_nccl"] and shares_a_gpu(layout.devices):
        raise ParallelizeError(f"Parallelize: use_nccl=True needs a distinct GPU per replica, but the device map "
                               f"places CUDA devices {list(layout.devices)} on GPUs "
                               f"{[physical_gpu(d) for d in layout.devices]}; use the tree all-reduce "
                               f"(use_nccl=False) or a map with one replica per GPU")
    if cuda:
        check_balance(layout.devices)
    training = given["optimizer_builder_fun"] is not None or given["param_update_builder_fun"] is not None
    options = ParallelizeOptions(**{
        **given, "devices": layout.devices, "rendezvous": rdv, "net_type": net_type, "cpu_device": cpu_device,
        "gradient_bucket_bytes": bucket_bytes, "auto_buckets": auto_buckets,
        "check_finite_loss": _finite_loss_check(given["check_finite_loss"], cpu_device, training)})
    if not options.training and model.init_params:
        log.warning("Parallelize: model %r has no parameter updates but init_params=True; a test/eval "
                    "model that shares the params of a training model in this workspace should use "
                    "ModelHelper(init_params=False), or running its init net will overwrite the trained "
                    "params (to predict from a checkpoint in a fresh process, see docs/inference.md)",
                    model.name)
    with _gc_paused(), _unchanged_on_error(model):
        blob_to_device: dict[str, DeviceOption] = {}
        reducer = make_reducer(layout, blob_to_device, options.use_nccl, _peer_access(layout), options.num_shards,
                               options.max_concurrent_distributed_ops, rdv.reduce_order if rdv else "ring",
                               rdv.shard_id if rdv else 0)
        model._parallel = ParallelState(model, options, layout, reducer, blob_to_device,
                                        non_datapar=frozenset(str(p) for p in model.GetAllParams("")))
        model._parallel_runs = RunState()
        run_pipeline(model._parallel)
        _set_caffe2_attributes(model, model._parallel)
    _log_built(model._parallel)


def _set_caffe2_attributes(model: ModelHelper, state: ParallelState) -> None:
    """The one place that puts what the passes built (kept on `state`) where Caffe2's code and scripts
    read it: the model's attributes `_accumulate_net` and `_loss_scale_backoff_net` (when built) and
    BMUF's `_global_model_init_net`, `_global_model_param_updates_net`, `_warmup_iterations`,
    `_warmup_broadcast` (None without warmup, as Caffe2's). graphpar itself reads the state."""
    built = {"_accumulate_net": state.accumulate_net, "_loss_scale_backoff_net": state.loss_scale_backoff_net}
    attributes: dict[str, Any] = {name: net for name, net in built.items() if net is not None}
    if state.bmuf is not None:
        attributes.update(_global_model_init_net=state.bmuf.global_init,
                          _global_model_param_updates_net=state.bmuf.global_update,
                          _warmup_iterations=state.bmuf.warmup_iterations,
                          _warmup_broadcast=state.bmuf.warmup_broadcast)
    for name, value in attributes.items():
        setattr(model, name, value)


def _finite_loss_check(check_finite_loss: bool | None, cpu_device: bool, training: bool) -> bool:
    """check_finite_loss as given, else on for training CPU replicas (a host read of a CPU loss is free;
    an evaluation model keeps reporting a NaN loss instead of raising)."""
    return bool(cpu_device and training) if check_finite_loss is None else bool(check_finite_loss)


def _check_combinations(given: dict[str, Any]) -> None:
    """The checked options that do not go together (ParallelizeError)."""
    if given["loss_scale"] is not None and given["shared_model"]:
        raise ParallelizeError("Parallelize: loss_scale is not supported with shared_model")
    if given["allreduce_dtype"] is not None and given["rendezvous"] is not None:
        raise ParallelizeError("Parallelize: allreduce_dtype is not supported with a rendezvous (one process only)")
    if given["shard_optimizer_state"] and given["shared_model"]:
        raise ParallelizeError("Parallelize: shard_optimizer_state is not supported with shared_model (the replicas "
                               "share one copy of the params and state, which the first device updates)")
    if not given["shard_gradients"]:
        return
    stage2 = "Parallelize: shard_gradients=True (each replica keeps only its part of the summed gradients)"
    if given["gradient_bucket_bytes"] is not None or given["bucket_cap_mb"] is not None:
        raise ParallelizeError(f"{stage2} does not go with gradient buckets, which all-reduce whole flat buffers; "
                               f"drop gradient_bucket_bytes / bucket_cap_mb, or use shard_optimizer_state=True "
                               f"alone (ZeRO stage 1 all-reduces the gradients, in buckets too)")
    if given["allreduce_dtype"] is not None:
        raise ParallelizeError(f"{stage2} does not go with allreduce_dtype; use shard_optimizer_state=True alone")
    if given["loss_scale"] is not None and given["rendezvous"] is not None:
        raise ParallelizeError(f"{stage2} does not go with loss_scale across shards: a gradient overflow in one "
                               f"shard's parts would skip the step there only; use shard_optimizer_state=True "
                               f"alone (every shard then checks the whole summed gradients)")


def _check_bn_groups(combine: Any, rdv: Rendezvous | None) -> None:
    """combine_spatial_bn's groups of shards name shards of the rendezvous, this one among them."""
    if not isinstance(combine, tuple):
        return
    shard, shards = (0, 1) if rdv is None else (rdv.shard_id, rdv.num_shards)
    outside = sorted(r for group in combine for r in group if r >= shards)
    if outside or not any(shard in group for group in combine):
        raise ParallelizeError(f"Parallelize: combine_spatial_bn's groups {[list(g) for g in combine]} must name "
                               f"shards 0..{shards - 1} of the rendezvous ({shards} shard(s)), this shard "
                               f"({shard}) among them" + (f"; {outside} are not shards" if outside else ""))


def _variant(base: Callable[P, None], name: str, doc: str, **fixed: bool) -> Callable[P, None]:
    """`base` with the options `fixed` set whatever the caller passes, under `name`; same signature."""
    @wraps(base)
    def variant(*args: P.args, **kwargs: P.kwargs) -> None:
        base(*args, **{**kwargs, **fixed})  # type: ignore[arg-type]

    variant.__name__ = variant.__qualname__ = name
    variant.__doc__ = doc
    return variant


Parallelize_CPU = _variant(  # noqa: N816 - Caffe2 name
    Parallelize, "Parallelize_CPU", "`Parallelize` with `cpu_device=True` (replicas `cpu_<id>`); same arguments and "
                                    "errors.", cpu_device=True)
Parallelize_GPU = _variant(  # noqa: N816
    Parallelize, "Parallelize_GPU", "`Parallelize` with `cpu_device=False` (replicas `gpu_<id>` on CUDA); same "
                                    "arguments and errors.", cpu_device=False)
Parallelize_iDeep = _variant(  # noqa: N816
    Parallelize, "Parallelize_iDeep", "Caffe2's MKL-DNN variant: `Parallelize` with `ideep=True` (CPU replicas); "
                                      "same arguments and errors.", ideep=True)


def Parallelize_BMUF(  # noqa: N802 - Caffe2 name
    model_helper_obj: ModelHelper,
    input_builder_fun: Builder,
    forward_pass_builder_fun: Callable[[ModelHelper, float], Any],
    param_update_builder_fun: Builder,
    block_learning_rate: float = 1.0,
    block_momentum: float | None = None,
    devices: Iterable[int] | None = None,
    rendezvous: dict | None = None,
    net_type: str = "dag",
    master_device: int | None = None,
    use_nccl: bool = False,
    nesterov: bool = False,
    optimize_gradient_memory: bool = False,
    reset_momentum_sgd: bool = False,
    warmup_iterations: int | None = None,
    max_concurrent_distributed_ops: int = 4,
    add_blobs_to_sync: Iterable[str] | None = None,
    num_threads_per_device: int = 4,
    cpu_device: bool = False,
    barrier_net_timeout_sec: int = 300,
    max_gradient_norm: float | None = None,
    check_finite_loss: bool | None = None,
    shard_optimizer_state: bool = False,
    shard_gradients: bool = False,
) -> None:
    """Blockwise model-update filtering (Caffe2's `Parallelize_BMUF`, see `graphpar.passes.bmuf`).

    Each replica trains alone with `param_update_builder_fun` (per device, scoped; no gradient
    all-reduce). `RunNet(model, n)` runs `n` local steps, then `model._global_model_param_updates_net`
    once: on `master_device` it averages the replicas' params into the block gradient avg - g,
    updates the block momentum `{p}_v` and the global model `{p}_g`, and broadcasts g to every
    replica. `RunInitNet` runs `param_init_net` (ending, beyond Caffe2, with a broadcast of every
    replica's init state from the first device, so replicas start identical) and
    `model._global_model_init_net` (v = 0, g = p, prev = 0). `RunWarmup(model)` runs
    `warmup_iterations` local steps, then broadcasts the master's params (and sets g to them).

    Args (the others are Parallelize's):
        block_learning_rate: the block gradient's weight in v.
        block_momentum: default 1 - 1/len(devices), in [0, 1).
        nesterov: Nesterov block momentum, g += v - block_momentum (v - prev) with `{p}_prev`.
        master_device: the device (one of `devices`, default the first) holding v and g.
        reset_momentum_sgd: zero every local MomentumSGDUpdate's momentum after each global update.
        warmup_iterations: local steps `RunWarmup` runs (None: no warmup net).
        add_blobs_to_sync: unprefixed blobs broadcast from the master after each global update.
        max_gradient_norm: clip the block gradients by their global L2 norm before the momentum.
        check_finite_loss: as Parallelize's (default on for CPU replicas): a NaN or infinite loss on
            any replica makes RunNet raise before any local update, and the global update does not
            run (no replica, no global model changes).
        shard_optimizer_state, shard_gradients: refused (ParallelizeError): each replica trains alone
            between global updates, with its whole optimizer state, and the global update averages
            whole params.
        rendezvous, max_concurrent_distributed_ops, barrier_net_timeout_sec: as Parallelize's: with
            several shards the global net averages the params of every replica of every shard (local
            sum on the master, cross-shard all-reduce, / (devices * num_shards)) and every shard's
            master computes the same global model; block_momentum defaults to 1 - 1/(devices *
            num_shards) and loss_scale is 1/(devices * num_shards), as in Caffe2.

    Raises:
        ParallelizeError / TypeError: as Parallelize, and a bad block argument or master_device.
    """
    _check_no_device_scope("Parallelize_BMUF")
    if shard_optimizer_state or shard_gradients:
        raise ParallelizeError("Parallelize_BMUF: shard_optimizer_state / shard_gradients are not supported: each "
                               "replica runs its own local updates with its whole optimizer state between "
                               "the global updates, so there is no state to share out; use Parallelize")
    rdv = _check_rendezvous(rendezvous, "Parallelize_BMUF", default_engine=default_engine(not cpu_device))
    model = _check_model(model_helper_obj)
    if not callable(param_update_builder_fun):
        raise TypeError(f"Parallelize_BMUF: param_update_builder_fun must be a function, got "
                        f"{type(param_update_builder_fun).__name__}")
    given = checked(dict(input_builder_fun=input_builder_fun, forward_pass_builder_fun=forward_pass_builder_fun,
                         param_update_builder_fun=param_update_builder_fun, net_type=net_type,
                         num_threads_per_device=num_threads_per_device, use_nccl=use_nccl, cpu_device=cpu_device,
                         optimize_gradient_memory=optimize_gradient_memory,
                         max_concurrent_distributed_ops=max_concurrent_distributed_ops,
                         barrier_net_timeout_sec=barrier_net_timeout_sec, devices=devices,
                         check_finite_loss=check_finite_loss), "Parallelize_BMUF")
    cpu_device = given["cpu_device"]
    _check_options(cpu_device, param_update_builder_fun, None, False, net_type)
    layout = DeviceLayout(_resolve_devices(given["devices"], cpu_device), device_prefix(cpu_device))
    options = ParallelizeOptions(**{
        **given, "devices": layout.devices, "rendezvous": rdv, "cpu_update_once": False,
        "check_finite_loss": _finite_loss_check(given["check_finite_loss"], cpu_device, True)})
    blob_to_device: dict[str, DeviceOption] = {}
    reducers = partial(make_reducer, num_shards=options.num_shards, max_concurrent=max_concurrent_distributed_ops,
                       order=rdv.reduce_order if rdv else "ring")
    bmuf = bmuf_options(layout, reducers, blob_to_device, use_nccl, _peer_access(layout), block_learning_rate,
                        block_momentum, nesterov, master_device, warmup_iterations, reset_momentum_sgd,
                        blob_names(add_blobs_to_sync, "add_blobs_to_sync"), max_gradient_norm, options.num_shards)
    with _gc_paused(), _unchanged_on_error(model):
        reducer = reducers(layout, blob_to_device, use_nccl, _peer_access(layout))
        model._parallel = ParallelState(model, options, layout, reducer, blob_to_device,
                                        non_datapar=frozenset(str(p) for p in model.GetAllParams("")))
        model._parallel_runs = RunState()
        run_pipeline(model._parallel, bmuf_pipeline(bmuf))
        _set_caffe2_attributes(model, model._parallel)
    _log_built(model._parallel)


Parallelize_CPU_BMUF = _variant(  # noqa: N816 - Caffe2 name
    Parallelize_BMUF, "Parallelize_CPU_BMUF", "`Parallelize_BMUF` with `cpu_device=True`; same arguments and errors.",
    cpu_device=True)
Parallelize_GPU_BMUF = _variant(  # noqa: N816
    Parallelize_BMUF, "Parallelize_GPU_BMUF", "`Parallelize_BMUF` with `cpu_device=False`; same arguments and "
                                              "errors.", cpu_device=False)


def RunWarmup(model: ModelHelper) -> None:  # noqa: N802
    """BMUF: run the train net `warmup_iterations` times, then the warmup broadcast net once.

    Raises:
        ParallelizeError: the model was not parallelized with Parallelize_BMUF(warmup_iterations=...).
    """
    bmuf = _state_of(model).bmuf
    if bmuf is None or bmuf.warmup_broadcast is None or bmuf.warmup_iterations is None:
        raise ParallelizeError(f"model {model.name!r} has no warmup: pass warmup_iterations to "
                               f"Parallelize_BMUF")
    workspace.RunNet(model.net, bmuf.warmup_iterations)
    workspace.RunNetOnce(bmuf.warmup_broadcast)


def Synchronize(model: ModelHelper, timeout_sec: int = 300) -> None:  # noqa: N802
    """Wait until every shard has called Synchronize (a barrier across shards). Returns at once on one
    process (no rendezvous, or one shard), as in Caffe2.

    Raises:
        ParallelizeError: the model was not parallelized, or `timeout_sec` differs from the first call's.
        OperatorError: a shard did not arrive within `timeout_sec` (naming this shard and the barrier).
    """
    rdv, runs = _state_of(model).options.rendezvous, _runs_of(model)
    if rdv is None or rdv.num_shards <= 1:
        return
    if runs.sync_barrier is None:
        init = barrier_net("sync_barrier_init", rdv, timeout_sec, store_of(rdv), world=SYNC_WORLD)
        net = NetDef("sync_barrier", [init.ops.pop()], [SYNC_WORLD])
        with distributed.creations_kept_on_error():  # a timed-out first call can be retried
            workspace.RunNetOnce(init)
        runs.sync_barrier = (timeout_sec, Net(net))
    elif runs.sync_barrier[0] != timeout_sec:
        raise ParallelizeError(f"Synchronize: use one timeout for every call (the first used {runs.sync_barrier[0]} "
                               f"s, this one {timeout_sec} s)")
    workspace.RunNetOnce(runs.sync_barrier[1])


def AddDistributedBlobSync(model: ModelHelper, blobs: Iterable[str]) -> None:  # noqa: N802
    """Append to `model.net` an all-reduce (sum) of each blob across shards, not across local devices
    (as Caffe2; names are used as given, e.g. `cpu_0/x` or a global `x`). Nothing without a rendezvous
    or with one shard. Call it before `RunInitNet` creates the nets.

    Raises:
        ParallelizeError: the model was not parallelized.
        TypeError: `blobs` is not a list of blob names.
    """
    state = _state_of(model)
    names = blob_names(blobs, "AddDistributedBlobSync: blobs")
    reducer = state.reducer
    if not isinstance(reducer, DistributedReducer) or not names:
        return
    netdef = model.net.Proto()
    for name in names:
        device = state.blob_to_device.get(name) or state.layout.option(state.layout.replica_of(name)
                                                                       or state.layout.master)
        netdef.ops.append(make_op("Allreduce", [reducer.world(), name], [name], device))
    chain_collectives(netdef.ops)
    declare_external_inputs(netdef)


def OptimizeGradientMemory(model: ModelHelper, input_shapes: dict, excluded_blobs: Iterable[str],  # noqa: N802
                           recycle_activations: bool) -> None:
    """Share blob names within each replica of a parallelized model (Caffe2's memonger).

    Call it after Parallelize and before RunInitNet creates the nets. Gradient blobs whose lifetimes
    do not overlap share one name; with `recycle_activations`, forward activations too. Param
    gradients, params, losses, blobs touched by cross-device ops and `excluded_blobs` (unscoped names,
    kept on every replica) are never shared. Results are unchanged.

    Args:
        input_shapes: {unscoped input blob: shape}, as Caffe2 took it (graphpar needs no shapes here).

    Raises:
        ParallelizeError: the model was not parallelized.
        TypeError: `excluded_blobs` is not a list of blob names.
    """
    state = _state_of(model)
    optimize_memory(state, blob_names(excluded_blobs, "excluded_blobs"), recycle_activations)


def enable_memory_options(model: ModelHelper, optimize_gradient_memory: bool = True,
                          dynamic_memory_management: bool = True, keep: Iterable[str] = ()) -> None:
    """Turn on Parallelize's memory options for a model it built, before RunInitNet creates the nets:
    the pipeline's passes for the options not on yet run (under the current PassContext, as
    Parallelize's), and the model's options record them. Same results, less memory.

    Args:
        optimize_gradient_memory, dynamic_memory_management: the options to turn on (one already on is
            left as it is).
        keep: more blobs, named as in the train net (e.g. `GetLearningRateBlobNames(model)`), that a
            freeing run keeps when this call turns dynamic_memory_management on.

    Raises:
        ParallelizeError: the model was not parallelized, or is not a training model.
        RuntimeError: its train net was created already (RunInitNet or CreateNet ran).
        TypeError: `keep` is not a list of blob names.
    """
    state = _state_of(model)
    kept = blob_names(keep, "keep")
    if not state.training:
        raise ParallelizeError(f"enable_memory_options: model {model.name!r} has no updates; its memory options "
                               f"concern training")
    if model.net.Proto().name in workspace.get_workspace().nets:
        raise RuntimeError(f"enable_memory_options: the train net of model {model.name!r} was created already; "
                           f"turn the options on before RunInitNet, or pass them to Parallelize")
    options = state.options
    new = dataclasses.replace(options, optimize_gradient_memory=options.optimize_gradient_memory or optimize_gradient_memory,
                              dynamic_memory_management=options.dynamic_memory_management or dynamic_memory_management)
    passes = {"optimize_gradient_memory": "share_gradient_memory", "dynamic_memory_management": "free_intermediates"}
    wanted = {entry for name, entry in passes.items() if getattr(new, name) and not getattr(options, name)}
    if not wanted:
        return
    nets = [(net, copy.deepcopy(vars(net))) for net in (model.net, model.param_init_net)]
    try:
        state.options = new
        run_pipeline(state, edited(PIPELINE, remove=[entry.name for entry in PIPELINE if entry.name not in wanted]))
    except BaseException:  # as it was: the options and the nets (the same Net objects)
        state.options = options
        for net, saved in nets:
            vars(net).clear()
            vars(net).update(saved)
        raise
    if "free_intermediates" in wanted and kept:
        args = model.net.Proto().args
        args[KEEP_ARG] = list(dict.fromkeys([*args.get(KEEP_ARG, ()), *kept]))


# ---- running ------------------------------------------------------------------------------------


def RunInitNet(model: ModelHelper) -> None:  # noqa: N802
    """Run every init net of a parallelized model once (fills, then the broadcast), then create its nets.

    With a rendezvous the init net first creates the communicators and checks that every shard built
    the same model (an OperatorError naming the shards otherwise), the broadcast comes from shard 0,
    and a barrier (`barrier_net_timeout_sec`) ends it.

    Everything that can be checked is checked before the first init net runs (the model's nets must
    not exist yet: a second RunInitNet would reset trained params, optimizer state and counters;
    every input must exist once the init nets ran; no blob loaded from a checkpoint may be
    overwritten); if anything still fails, the workspace is put back as it was.

    Raises:
        ParallelizeError: the model was not parallelized.
        RuntimeError: the model's nets were created already (RunInitNet or CreateNet was called).
        MissingBlobError: an input of a net is neither fed nor created by an init net (for a model
            built with init_params=False: its params, which no init net creates).
        CheckpointError: a checkpoint was loaded before RunInitNet (`graphpar.resume`).
        Workspace errors of the runs propagate, with the workspace unchanged.
    """
    state = _state_of(model)
    ws = workspace.get_workspace()
    defined = {*ws.blobs, *ws.objects}
    _check_shared_params(model, defined, "RunInitNet")
    for net in state.init_nets:
        netdef = net.Proto()
        check_inputs_exist(netdef, defined, ws.name, "RunInitNet")
        check_run(netdef.name, (), [b for op in netdef.ops for b in op.outputs], ws.loaded)
    _check_can_create(model, ws, defined, False, "RunInitNet")
    with ws.unchanged_on_error(), distributed.creations_kept_on_error():  # a timed-out rendezvous can be retried
        for net in state.init_nets:
            ws.run_net_once(net)
        CreateNet(model)
    _log_init(model)


def CreateNet(model: ModelHelper, overwrite: bool = False) -> None:  # noqa: N802
    """Create (compile) every net of a parallelized model in the current workspace (all or none).

    Raises:
        ParallelizeError: the model was not parallelized.
        RuntimeError: a net exists and `overwrite` is False. MissingBlobError: a missing input blob.
        Other workspace errors propagate; no net is created then.
    """
    ws = workspace.get_workspace()
    _check_can_create(model, ws, set(ws.blobs), overwrite, "CreateNet")
    with ws.unchanged_on_error():
        for entry in _state_of(model).nets:
            ws.create_net(entry[0] if isinstance(entry, tuple) else entry, overwrite)


def _check_can_create(model: ModelHelper, ws: workspace.Workspace, defined: set[str], overwrite: bool,
                      what: str) -> None:
    """Raise before acting if a net of the model exists (without `overwrite`) or misses an input."""
    netdefs = [(entry[0] if isinstance(entry, tuple) else entry).Proto() for entry in _state_of(model).nets]
    taken = [netdef.name for netdef in netdefs if netdef.name in ws.nets]
    if taken and not overwrite:
        raise RuntimeError(f"{what}({model.name!r}): nets {taken} already exist in workspace {ws.name!r}: the "
                           f"model was initialised already (a second RunInitNet would reset its trained params, "
                           f"optimizer state and counters). To start again, ResetWorkspace() first; to only "
                           f"recompile, CreateNet(model, overwrite=True)")
    _check_shared_params(model, defined, what)
    for netdef in netdefs:
        check_inputs_exist(netdef, set(defined), ws.name, what)


def _check_shared_params(model: ModelHelper, defined: set[str], what: str) -> None:
    """A model built with init_params=False creates none of its params: they must exist already."""
    if model.init_params:
        return
    missing = [name for name in map(str, model.GetParams("")) if name not in defined]
    if missing:
        raise MissingBlobError(
            f"{what}({model.name!r}): its params do not exist ({', '.join(map(repr, missing[:3]))}"
            f"{' ...' if len(missing) > 3 else ''}), and the model was built with init_params=False, so no init "
            f"net creates them. init_params=False is for a model that shares the params of a training model "
            f"in this workspace: run that model's RunInitNet first. To predict from a checkpoint in a fresh "
            f"process, extract a forward-only net and load the checkpoint's params into it (docs/inference.md)")


def RunNet(model: ModelHelper, num_iterations: int) -> None:  # noqa: N802
    """Run the model's nets `num_iterations` times (a `(net, n)` entry runs n times).

    Each run that fails leaves the persistent blobs as after the last run that succeeded (with one
    net and one iteration: as before the call). With `num_iterations` 0 nothing runs (BMUF's global
    update, too, needs at least one local step). With sharded optimizer state, the whole copies a
    `GetCheckpointParams` call gathered are removed first: the run updates the parts only.

    Raises:
        ParallelizeError: the model was not parallelized.
        RuntimeError: a net of the model was not created in the current workspace (RunInitNet was not
            called there), or some replicas were fed a new batch since the last run and others not
            (`graphpar.feeds`); nothing runs then. Other workspace errors propagate.
        ValueError: a replica's fed inputs all have zero rows (an empty batch); nothing runs.
    """
    state = _state_of(model)
    # a fixed-count entry (BMUF's global update) follows local steps: RunNet(model, 0) runs nothing
    entries = [(entry[0], entry[1] if num_iterations else 0) if isinstance(entry, tuple)
               else (entry, num_iterations) for entry in state.nets]
    ws = workspace.get_workspace()
    missing = [net.Proto().name for net, _ in entries if net.Proto().name not in ws.nets]
    if missing:
        raise RuntimeError(f"RunNet: net(s) {missing} of model {model.name!r} do not exist in workspace "
                           f"{ws.name!r}: call data_parallel_model.RunInitNet(model) first (it runs the init "
                           f"nets, which create the params, then creates the model's nets)")
    runs = _runs_of(model)
    if runs.feeds is None:
        runs.feeds = FeedTracker(state.layout, model.net.Proto(), [net.Proto() for net in state.init_nets],
                                 state.param_names)
    runs.feeds.check(ws.blobs, f"RunNet({model.name!r})")
    runs.feeds.check_rows(ws.blobs, f"RunNet({model.name!r})")
    _drop_gathered(model)  # the run updates the parts: a whole copy GetCheckpointParams left would go stale
    for net, count in entries:
        if state.options.loss_scale is None and getattr(state.optimizer, "loss_scale", 1.0) == 1.0:
            workspace.RunNet(net, count)
        else:
            for _ in range(count):
                _run_loss_scaled(model, runs, net)
    runs.feeds.remember(ws.blobs)


def skipped_steps(model: ModelHelper) -> int:
    """How many steps RunNet skipped on a gradient overflow (`loss_scale`; `passes.loss_scale`).

    Raises:
        ParallelizeError: the model was not parallelized.
    """
    return _runs_of(model).skipped_steps


STARTUP_SKIPS_WARNED = 32  # a dynamic scale still skipping every step after this many: said once, as a warning


def _run_loss_scaled(model: ModelHelper, runs: RunState, net: Net) -> None:
    """One run of a loss-scaled net (Parallelize's loss_scale, or build_multi_precision_sgd's): a gradient
    overflow skips the step (the failed run changed nothing), with a dynamic scale shrinks it
    (`passes.loss_scale`), and with gradient accumulation drops the step's micro-batches (the running
    sums, which may hold an inf, are zeros again).

    Logging: a dynamic scale's start-up back-off (the skips before the first step that trains, normal
    while a scale set high comes down, as GradScaler's silent first steps) is one INFO line when it
    starts and one when the scale settles; a warning only if it has skipped `STARTUP_SKIPS_WARNED`
    steps and still trains none. Any other skip (a static scale, or an overflow after training began)
    is a warning."""
    backoff = _state_of(model).loss_scale_backoff_net
    try:
        workspace.RunNet(net, 1)
    except Exception as exc:
        if not isinstance(exc.__cause__, GradientOverflowError):
            raise
        runs.skipped_steps += 1
        if backoff is None or runs.trained:
            log.warning("RunNet(%r): step skipped: %s", model.name, exc.__cause__)
        elif runs.skipped_steps == 1:
            log.info("RunNet(%r): the loss scale backs off until the gradients fit; the steps skipped meanwhile "
                     "are not logged one by one (first: %s)", model.name, exc.__cause__)
        elif runs.skipped_steps == STARTUP_SKIPS_WARNED:
            log.warning("RunNet(%r): %d steps in a row skipped and none trained yet; the gradients overflow at "
                        "every scale so far (the last: %s): a NaN or inf in the batch or the forward?",
                        model.name, runs.skipped_steps, exc.__cause__)
        if backoff is not None:
            workspace.RunNetOnce(backoff)
        reset_accumulated_gradients(model)
        return
    if not runs.trained:
        runs.trained = True
        if runs.skipped_steps and backoff is not None:
            log.info("RunNet(%r): the loss scale settled after %d skipped steps; training", model.name,
                     runs.skipped_steps)


def reset_accumulated_gradients(model: ModelHelper) -> None:
    """With `accumulate_gradients` > 1: make the running sums of the micro-batches' gradients zeros
    again, dropping the micro-batches run since the last update (after a step that raised: its
    micro-batches were added, its update did not run). Without accumulation: nothing.

    Raises:
        ParallelizeError: the model was not parallelized.
    """
    reset = _state_of(model).reset_accumulated_net
    if reset is not None:
        workspace.RunNetOnce(reset)


# ---- checkpoints and syncing ----------------------------------------------------------------------


def GetCheckpointParams(model: ModelHelper) -> set[str]:  # noqa: N802
    """The blobs a checkpoint needs: the first device's replica state and the unscoped iteration counters.

    Replica state is every blob `param_init_net` creates in the first device's scope (params,
    computed params, optimizer state such as `_momentum`), and for BMUF the master's global model
    (`_g`, `_v`, `_prev`, from `_global_model_init_net`); counters are the outputs of counter ops
    (`Iter`, `AtomicIter`: Trait.COUNTER) outside every replica scope (e.g. `optimizer_iteration`).

    With sharded optimizer state (`shard_optimizer_state`) the names are the same as without: each
    state blob whole under the first device's name (`cpu_0/fc_w_momentum`). Once `RunInitNet` has
    run in the current workspace, this call gathers every replica's part into those blobs (across
    shards a collective: call it on every shard), so the checkpoint has one format for sharded and
    unsharded runs. The gathered blobs stay in the workspace for the caller to save (the train net
    never reads them) until `save_checkpoint` or the next `RunNet` drops them: after a step only the
    parts hold the current state.

    Raises:
        ParallelizeError: the model was not parallelized.
    """
    state = _state_of(model)
    layout = state.layout
    first = {b for b in replica_init_outputs(model.param_init_net.Proto(), layout)
             if layout.replica_of(b) == layout.master}
    first |= {b for net in state.init_nets[1:] for b in replica_init_outputs(net.Proto(), layout)}  # BMUF g, v
    sharded = _sharded_state(state)
    if sharded:
        first -= {shard_name(layout.scoped(layout.master, name)) for name in sharded}
        first |= {layout.scoped(layout.master, name) for name in sharded}
        _gather_state(model, sharded)
    return first | set(iteration_counters(model))


def _sharded_state(state: ParallelState) -> list[str]:
    """The model's sharded optimizer state blobs (unscoped, unsharded names); [] without sharding."""
    return [] if state.sharding is None else list(state.sharding.state)


def _gather_state(model: ModelHelper, names: list[str]) -> None:
    """Write each sharded state blob whole under the first device's name, if the parts exist here."""
    state, runs, ws = _state_of(model), _runs_of(model), workspace.get_workspace()
    layout = state.layout
    if not all(ws.has_blob(shard_name(layout.scoped(d, n))) for d in layout.devices for n in names):
        return  # not initialised in this workspace: the names are all the caller gets
    if runs.state_gather is None:
        runs.state_gather = Net(state_gather_net(f"{model.net.Proto().name}_gather_state", state, names))
    with ws.unchanged_on_error():
        ws.create_net(runs.state_gather, overwrite=True)
        ws.run_net(runs.state_gather.Proto().name)
    runs.gathered = {name: ws.blobs[name] for name in (layout.scoped(layout.master, n) for n in names)}


def iteration_counters(model: ModelHelper) -> list[str]:
    """The outputs of the train net's counter ops (Trait.COUNTER) outside every replica scope, e.g.
    `optimizer_iteration`: how many updates the model has made."""
    layout = _state_of(model).layout
    return list(dict.fromkeys(op.outputs[0] for op in model.net.Proto().ops
                              if has_trait(op, Trait.COUNTER) and layout.replica_of(op.outputs[0]) is None))


def save_checkpoint(model: ModelHelper, path: str | os.PathLike[str], metadata: dict | None = None) -> bool:
    """Write `GetCheckpointParams(model)` to `path` (graphpar.checkpoint.save, atomic) on one shard
    only: shard 0 of the model's rendezvous, or the only process. Every shard may then load it and call
    `FinalizeAfterCheckpoint`; call `Synchronize(model)` first if other shards read it right away.
    With sharded optimizer state every shard must call it (the state is gathered from all of them);
    the gathered whole blobs are removed again afterwards. Returns whether this process wrote the file.

    Raises:
        ParallelizeError: the model was not parallelized. checkpoint.save's errors on the writer.
    """
    rdv = _state_of(model).options.rendezvous
    names = GetCheckpointParams(model)  # every shard: with sharded state, the gather is a collective
    try:
        if rdv is not None and rdv.shard_id != 0:
            return False
        checkpoint.save(path, names, metadata=metadata)
        return True
    finally:
        _drop_gathered(model)


def _drop_gathered(model: ModelHelper) -> None:
    """Remove the whole state blobs GetCheckpointParams gathered (the parts hold the state)."""
    ws, runs = workspace.get_workspace(), _runs_of(model)
    for name, tensor in runs.gathered.items():
        if ws.blobs.get(name) is tensor:
            ws.remove_blob(name)
    runs.gathered = {}


def FinalizeAfterCheckpoint(model: ModelHelper, blobs: Iterable[str] | None = None,  # noqa: N802
                            cpu_mode: bool = False) -> None:
    """Broadcast loaded blobs from the first device to every replica (call after loading a checkpoint);
    with several shards, from shard 0's first device, and the model's unscoped counters
    (`optimizer_iteration`) from shard 0 too, so every shard resumes at shard 0's iteration.

    The first call builds `model._checkpoint_net` for `blobs` (default: every synced blob); every
    call runs it in the current workspace (as in Caffe2, `blobs` of later calls are not looked at).
    Names may be scoped (`cpu_0/fc_w`) or unscoped (`fc_w`); an unscoped name that is not a
    replicated blob of the model is a global blob that needs no broadcast (`GetCheckpointParams`
    also returns `optimizer_iteration`; Caffe2 raised on it). `cpu_mode` is accepted for Caffe2
    compatibility: each copy already runs on its blob's device.

    The blobs loaded from a checkpoint for this model count as used afterwards (`graphpar.resume`).

    With sharded optimizer state (`shard_optimizer_state`), each state blob present whole under the
    first device's name (loaded from a checkpoint, sharded or not, or fed; not one GetCheckpointParams
    gathered) is cut into every replica's part instead (across shards from shard 0's, so every shard
    must call it with the same state loaded) and then removed: the parts hold it.

    Raises:
        ParallelizeError: the model was not parallelized, or a name is in the scope of a device that is
            not a replica (a checkpoint saved with other devices); nothing is built then.
        CheckpointError: blobs of the model were loaded under another device's scope (a checkpoint saved
            with another first device: load it with `checkpoint.load(path, model=model)`).
        MissingBlobError: a first-device blob is missing.
        The model and workspace are left as they were when it raises.
    """
    state = _state_of(model)
    net, layout = model._checkpoint_net, state.layout
    ws = workspace.get_workspace()
    grouped = dict(state.grouped)
    sharded = _sharded_state(state)
    if net is None:
        names = state.sync_names if blobs is None else checkpoint_sync_names(blobs, grouped, layout)
        names = [name for name in names if name not in sharded]  # cut into parts below, not copied whole
        for name in names:
            group: dict[int, Blob] = dict(layout.group(name))
            grouped.setdefault(name, group)
        net = Net(checkpoint_sync_net("checkpoint_sync_net", names, state.reducer, iteration_counters(model)))
    _check_loaded_for(model, ws, grouped)
    scatter = _state_to_scatter(model, ws, sharded)
    with ws.unchanged_on_error():
        for name in [n for n in ws.loaded if layout.replica_of(n) is not None or parse_device_scope(n) is None]:
            del ws.loaded[name]  # this model's loaded blobs: broadcast now, or global (counters)
        ws.create_net(net, overwrite=True)  # also right after a workspace switch or reset
        ws.run_net(net.Proto().name)
        if scatter is not None:
            ws.create_net(scatter, overwrite=True)
            ws.run_net(scatter.Proto().name)
            for name in scatter.Proto().external_inputs:
                if layout.replica_of(name) == layout.master and ws.has_blob(name):
                    ws.remove_blob(name)  # the whole state: its parts hold it now
    model._checkpoint_net = net
    state.grouped.update(grouped)
    log.info("FinalizeAfterCheckpoint(%r): broadcast %d blobs from %s to %s in workspace %r", model.name,
             len(net.Proto().external_inputs), layout.scoped(layout.master, ""), _replica_scopes(layout, 1),
             ws.name)


def _state_to_scatter(model: ModelHelper, ws: workspace.Workspace, sharded: list[str]) -> Net | None:
    """The net cutting the sharded state blobs present whole on the first device (not as GetCheckpointParams
    gathered them) into their parts, built once per set of blobs; None when there are none."""
    state, runs = _state_of(model), _runs_of(model)
    first = {name: state.layout.scoped(state.layout.master, name) for name in sharded}
    names = tuple(n for n in sharded if ws.has_blob(first[n]) and runs.gathered.get(first[n]) is not ws.blobs[first[n]])
    if not names:
        return None
    if names not in runs.state_scatter:
        runs.state_scatter[names] = Net(state_scatter_net(f"{model.net.Proto().name}_scatter_state_"
                                                          f"{len(runs.state_scatter)}", state, names))
    return runs.state_scatter[names]


def _check_loaded_for(model: ModelHelper, ws: workspace.Workspace, grouped: dict) -> None:
    """Refuse to broadcast a model's initial values while its checkpoint sits under another device's scope
    (a non-first replica's or a device's that is not a replica)."""
    layout = _state_of(model).layout
    first = layout.scoped(layout.master, "")
    orphans = [n for n in ws.loaded if parse_device_scope(n) is not None and not n.startswith(first)
               and stripBlobName(n) in grouped and first + stripBlobName(n) not in ws.loaded]
    if orphans:
        raise CheckpointError(
            f"FinalizeAfterCheckpoint({model.name!r}): blobs {orphans[:3]} were loaded from checkpoint "
            f"{ws.loaded[orphans[0]]!r} under the scope of another device than the model's first one "
            f"({layout.scope(layout.master)}), which holds no loaded value: the checkpoint was saved with "
            f"another first device, and the broadcast would make every replica train from the initial "
            f"values. Load it with checkpoint.load(path, model=model), which maps its names onto the "
            f"model's first device")


def AddBlobSync(model: ModelHelper, blobs: Iterable[str], net: Net | NetDef | None = None) -> None:  # noqa: N802
    """Append to `net` (default `model.net`) copies of each blob from the first device to the others.

    Call it before `RunInitNet` creates the nets: as in Caffe2, ops added to a net that was already
    created run only once it is created again (`CreateNet(model, overwrite=True)`).

    Args:
        blobs: unprefixed names (`"sync_num"` names `cpu_0/sync_num`, `cpu_1/sync_num`, ...).
        net: the Net or NetDef to append to (e.g. `model.param_init_net`); default `model.net`.

    Raises:
        ParallelizeError: a prefixed name, or a model that was not parallelized.
    """
    blobs = list(blobs)
    if not blobs:
        return
    state = _state_of(model)
    names = check_unprefixed(blobs, state.layout)
    for name in names:
        group: dict[int, Blob] = dict(state.layout.group(name))
        state.grouped[name] = group
    target = net if net is not None else model.net
    netdef = target.Proto() if isinstance(target, Net) else target
    sync_blobs(netdef, names, state.reducer)
    chain_collectives(netdef.ops)
    declare_external_inputs(netdef)
    log.info("AddBlobSync(%r): net %r copies %s from %s to %s", model.name, netdef.name, names,
             state.layout.scoped(state.layout.master, ""), _replica_scopes(state.layout, 1))


# ---- nets for other uses -----------------------------------------------------------------------


def ConvertNetForDevice(net: Net | NetDef, device: DeviceOption | None = None) -> Net:  # noqa: N802
    """A copy of `net` for one replica: every blob prefixed with `gpu_<id>/` (or `cpu_<id>/`), every op
    placed on `device` (default: the current DeviceScope). Meant for `AppendNet` inside a builder.

    Raises:
        ValueError: no device given and no DeviceScope active.
        TypeError: `net` is not a Net or NetDef, or `device` is not a DeviceOption.
    """
    device = device if device is not None else CurrentDeviceScope()
    if device is None:
        raise ValueError("ConvertNetForDevice needs a device: pass device= or call it inside a DeviceScope "
                         "(e.g. inside a Parallelize builder function)")
    if not isinstance(device, DeviceOption):
        raise TypeError(f"ConvertNetForDevice: device must be a DeviceOption, got {device!r}")
    if not isinstance(net, (Net, NetDef)):
        raise TypeError(f"ConvertNetForDevice takes a Net or a NetDef, got {type(net).__name__}")
    scope = f"{device_prefix(device.device_type == CPU)}_{device.device_id}/"
    converted = Net(net.Proto() if isinstance(net, Net) else net)
    proto = converted.Proto()
    for op in proto.ops:
        op.inputs = [scope + b for b in op.inputs]
        op.outputs = [scope + b for b in op.outputs]
        op.control_inputs = [scope + b for b in op.control_inputs]
        op.device_option = device
    proto.external_inputs = [scope + b for b in proto.external_inputs]
    proto.external_outputs = [scope + b for b in proto.external_outputs]
    return converted


def ExtractPredictorNet(model: ModelHelper, inputs: Sequence[str], outputs: Sequence[str],  # noqa: N802
                        device: DeviceOption | None = None) -> tuple[Net, list[str]]:
    """A forward-only prediction net of the first replica, with unscoped blob names.

    Args:
        inputs, outputs: unscoped names (e.g. ["data"], ["softmax"]).
        device: where the predictor's ops run (default: where they ran in the model).

    Returns:
        (the Net, the unscoped blobs it needs besides `inputs`: its params, to export).

    Raises:
        ParallelizeError: the model was not parallelized. ValueError: see `passes.predictor`.
    """
    layout = _state_of(model).layout
    scope = layout.scoped(layout.master, "")
    proto = model.net.Proto()
    # Only the first replica's ops: other replicas' ops read external inputs too and, interleaved
    # (combine_spatial_bn), sit between the first replica's, so the extraction would take them along.
    ops = [op for op in proto.ops
           if all(layout.replica_of(b) in (None, layout.master) for b in (*op.inputs, *op.outputs))]
    renames = {b: b[len(scope):] for op in ops for b in (*op.inputs, *op.outputs) if b.startswith(scope)}
    predictor, params = extract_predictor_net(NetDef(proto.name, ops, list(proto.external_inputs)),
                                              [scope + str(b) for b in inputs],
                                              [scope + str(b) for b in outputs], device, renames)
    return Net(predictor), params


def GetLearningRateBlobNames(model: ModelHelper) -> list[str]:  # noqa: N802
    """The learning-rate blobs of `model.net`: the outputs of its learning-rate ops (`LearningRate`:
    Trait.LEARNING_RATE), in net order.

    One per device (`<Optimizer>_<n>_lr_gpu<id>`, or a per-device builder's own names) or one blob
    shared by CPU replicas (`<Optimizer>_<n>_lr_cpu`), as Caffe2 returned for its optimizers; the
    blob before any `allow_lr_injection` multiplier. Works whichever update builder was used (Caffe2
    raised for `param_update_builder_fun`). Raises nothing: a model without one gives [].
    """
    return list(dict.fromkeys(op.outputs[0] for op in model.net.Proto().ops
                              if has_trait(op, Trait.LEARNING_RATE)))


def GetDevices(model: ModelHelper) -> list[int]:  # noqa: N802
    """The device ids the model was parallelized over.

    Raises:
        ParallelizeError: the model was not parallelized (use data_parallel_model.Parallelize).
    """
    return list(_state_of(model).layout.devices)


# ---- Parallelize's steps ------------------------------------------------------------------------


def _check_no_device_scope(what: str) -> None:
    scope = CurrentDeviceScope()
    if scope is not None and scope.device_type != CPU:
        raise DeviceScopeError(f"{what} must be called without a device scope (it sets one per device); "
                               f"it was called inside DeviceScope({scope})")


def _check_model(model: Any) -> ModelHelper:
    if not isinstance(model, ModelHelper):
        raise TypeError(f"Parallelize needs a graphpar.model_helper.ModelHelper, got {type(model).__name__}")
    if getattr(model, "_parallel", None) is not None:
        raise ParallelizeError(f"model {model.name!r} was already parallelized; build a new ModelHelper")
    return model


def _resolve_devices(devices: tuple[int, ...] | None, cpu_device: bool) -> tuple[int, ...]:
    """The checked device ids (option `devices`), or the default ones; ParallelizeError for none, or for
    CUDA ids that do not exist (unless simulated on the CPU)."""
    defaulted = devices is None
    ids = tuple(range(os.cpu_count() or 1) if cpu_device else range(num_cuda_devices())) if devices is None \
        else devices
    if not ids:
        why = "no CUDA device was found" if defaulted else "devices is empty"
        raise ParallelizeError(f"Parallelize: no devices ({why}); pass devices=[...], cpu_device=True, or "
                               f"GRAPHPAR_CUDA_ON_CPU=1 to simulate CUDA devices")
    if not cpu_device and (not cuda_is_simulated() or current_device_map() is not None):
        missing = [d for d in ids if d >= num_cuda_devices()]  # with a device map: outside the map
        if missing:
            raise ParallelizeError(f"Parallelize: CUDA device(s) {missing} do not exist ({num_cuda_devices()} "
                                   f"visible); use existing ids, cpu_device=True, GRAPHPAR_CUDA_ON_CPU=1, or a device "
                                   f"map (GRAPHPAR_DEVICE_MAP=0,0,0,0: several replicas on one GPU)")
    return ids


def _check_options(cpu_device: bool, param_update_builder_fun: Any, optimizer_builder_fun: Any,
                   shared_model: bool, net_type: str) -> None:
    if param_update_builder_fun is not None and optimizer_builder_fun is not None:
        raise ParallelizeError("Parallelize: pass only one of param_update_builder_fun (per device) and "
                               "optimizer_builder_fun (once, for all devices)")
    if shared_model and not cpu_device:
        raise ParallelizeError("Parallelize: shared_model is only supported on CPU devices (cpu_device=True)")
    if net_type not in net_types():
        raise ParallelizeError(f"Parallelize: net_type must be one of {', '.join(map(repr, net_types()))}, "
                               f"got {net_type!r}")


DEFAULT_BUCKET_CAP_MB = 25  # DDP's bucket_cap_mb, the default bucket size on real CUDA devices


def _bucket_bytes(gradient_bucket_bytes: int | None, bucket_cap_mb: float | None,
                  cuda: bool) -> tuple[int | None, bool]:
    """(bucket size in bytes or None for none, whether it is the CUDA default) from the checked options."""
    if bucket_cap_mb is not None:
        if gradient_bucket_bytes is not None:
            raise ParallelizeError("Parallelize: pass gradient_bucket_bytes or bucket_cap_mb, not both")
        gradient_bucket_bytes = max(1, int(bucket_cap_mb * 1024 * 1024))
    if gradient_bucket_bytes is None and cuda:
        return DEFAULT_BUCKET_CAP_MB * 1024 * 1024, True
    return (gradient_bucket_bytes or None), False


def _check_rendezvous(rendezvous: Any, what: str = "Parallelize", default_engine: str = "GLOO",
                      **unsupported: bool) -> Rendezvous | None:
    """The parsed rendezvous, after checking it and the options it does not go with (before any change)."""
    rdv = parse_rendezvous(rendezvous, what, default_engine)
    used = [name for name, on in unsupported.items() if on]
    if rdv is not None and rdv.num_shards > 1 and used:
        raise ParallelizeError(f"{what}: {', '.join(used)} across shards (rendezvous) is not supported yet")
    return rdv


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while building (the caller's setting is restored).

    Parallelize creates ~1e5 long-lived objects (ops, names) for a large model; each full collection
    rescans all of them, which made the build time grow quadratically with the device count (ResNet-50:
    2.8x from 8 to 16 devices, 2.1x with the collector paused). No cycles need collecting meanwhile.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def _unchanged_on_error(model: ModelHelper) -> Iterator[None]:
    """Restore the model (and its Nets, keeping their identity) if the block raises."""
    nets = [value for value in vars(model).values() if isinstance(value, Net)]
    memo: dict[int, Any] = {id(net): net for net in nets}
    net_states = [(net, copy.deepcopy(vars(net), memo)) for net in nets]
    model_state = copy.deepcopy(vars(model), memo)
    try:
        yield
    except BaseException:
        for net, state in net_states:
            vars(net).clear()
            vars(net).update(state)
        vars(model).clear()
        vars(model).update(model_state)
        raise


def _peer_access(layout: DeviceLayout) -> PeerAccess | None:
    """P2P access between real CUDA devices (`devices.can_access_peer`, through the device map); None
    (full access) on CPU or simulated CUDA."""
    if layout.device_type != CUDA or cuda_is_simulated():
        return None
    return can_access_peer


def _replica_scopes(layout: DeviceLayout, start: int = 0) -> str:
    """'cpu_1/, cpu_2/' for the replicas from position `start` on (for log messages)."""
    return ", ".join(layout.scoped(d, "") for d in layout.devices[start:]) or "no other replica"


def _log_built(state: ParallelState) -> None:
    """INFO: what Parallelize built (replicas, reducer, collectives, nets); DEBUG: each net's ops by type."""
    if not log.isEnabledFor(logging.INFO):
        return
    layout, options = state.layout, state.options
    train, init = state.model.net.Proto(), state.model.param_init_net.Proto()
    moves = [op for op in train.ops if has_trait(op, Trait.CROSS_DEVICE)]
    collectives = sum(has_trait(op, Trait.COLLECTIVE) for op in moves)
    log.info("Parallelize(%r): %d replica(s) %s on %s; %s", state.model.name, len(layout.devices),
             _replica_scopes(layout), layout.device_type.name,
             "training" if state.training else "forward only")
    reduced = "no gradients" if not state.training else (
        f"{len(state.grad_names)} gradients all-reduced by {type(state.reducer).__name__} ("
        + (f"buckets closing at {options.gradient_bucket_bytes} bytes)" if options.gradient_bucket_bytes
           else "one collective per gradient)"))
    log.info("Parallelize(%r): %d params, %d computed params, %s; %d cross-device ops in net %r (%d "
             "collectives), %d ops in all, type %r, %d workers", state.model.name, len(state.param_names),
             len(state.computed_param_names), reduced, len(moves), train.name, collectives, len(train.ops),
             train.type, train.num_workers)
    log.info("Parallelize(%r): init net %r: %d ops, then broadcasts %d blobs from %s to %s",
             state.model.name, init.name, len(init.ops), len(state.sync_names), layout.scoped(layout.master, ""),
             _replica_scopes(layout, 1))
    if log.isEnabledFor(logging.DEBUG):
        for net in state.netdefs():
            counts: dict[str, int] = {}
            for op in net.ops:
                counts[op.type] = counts.get(op.type, 0) + 1
            log.debug("Parallelize(%r): net %r ops by type: %s", state.model.name, net.name, counts)


def _log_init(model: ModelHelper) -> None:
    """INFO: what RunInitNet ran and created."""
    state = _state_of(model)
    log.info("RunInitNet(%r): ran %s (fills, then every replica's state broadcast from %s) and created %s "
             "in workspace %r", model.name, [net.Proto().name for net in state.init_nets],
             state.layout.scoped(state.layout.master, ""),
             [(entry[0] if isinstance(entry, tuple) else entry).Proto().name for entry in state.nets],
             workspace.CurrentWorkspace())


@dataclass
class RunState:
    """What running a parallelized model builds and counts, apart from what the passes decided
    (`ParallelState`): kept on the model as `model._parallel_runs`, made empty by Parallelize."""

    feeds: FeedTracker | None = None  # the train net's check of fed inputs, made by the first RunNet
    sync_barrier: tuple[int, Net] | None = None  # Synchronize's (timeout, barrier Net), built on first use
    skipped_steps: int = 0  # steps RunNet skipped on a gradient overflow (passes.loss_scale)
    trained: bool = False  # a loss-scaled step of this model was not skipped (its start-up back-off is over)
    state_gather: Net | None = None  # GetCheckpointParams' gather of sharded state, built on first use
    gathered: dict[str, Any] = field(default_factory=dict)  # the whole state blobs it wrote -> their tensors
    state_scatter: dict[tuple[str, ...], Net] = field(default_factory=dict)  # FinalizeAfterCheckpoint's cuts


def _runs_of(model: ModelHelper) -> RunState:
    _state_of(model)
    return model._parallel_runs
