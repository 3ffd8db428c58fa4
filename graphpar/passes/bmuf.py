"""BMUF (blockwise model-update filtering): the passes and pipeline behind `Parallelize_BMUF`.

Every replica trains on its own for a block of local steps (`param_update_builder_fun` per device,
no gradient all-reduce); then the global net averages the replicas' params and filters the average
through block momentum on the master device (default the first), in Caffe2's blobs `{p}_g` (global model),
`{p}_v` (block momentum) and `{p}_prev` (the previous `v`, Nesterov):

    avg = sum_d p_d / N
    d   = avg - g                       (the block gradient, clipped by its global norm if asked)
    v   = block_momentum v + block_learning_rate d
    g   = g + v                         (Nesterov: g + v - block_momentum (v - prev); prev = v)
    p_d = g                             (broadcast to every replica)

The replicas' builders, gradients and devices come from the ordinary Parallelize passes; this module
adds the BMUF-only steps and the pipeline that strings them together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from graphpar.core.ir import DeviceOption, NetDef, OperatorDef
from graphpar.core.net import Net
from graphpar.core.schema import effects_of
from graphpar.errors import ParallelizeError
from graphpar.passes import group_by_device, sync
from graphpar.passes.common import BlobDevices, DeviceLayout, declare_external_inputs, make_op
from graphpar.passes.finish import chain_collectives
from graphpar.passes.pipeline import PIPELINE, REDUCE_GRADIENTS, Pass, edited
from graphpar.passes.reducers import PeerAccess, Reducer, copies
from graphpar.passes.state import BmufNets, ParallelState
from graphpar.passes.sync import check_unprefixed


@dataclass(frozen=True)
class BmufOptions:
    """Parallelize_BMUF's own arguments, checked (see `data_parallel_model.Parallelize_BMUF`)."""

    block_learning_rate: float
    block_momentum: float
    nesterov: bool
    master_device: int
    warmup_iterations: int | None
    reset_momentum_sgd: bool
    add_blobs_to_sync: tuple[str, ...]
    max_gradient_norm: float | None
    reducer: Reducer  # over the replicas with the master first: its sums land on the master


def global_name(param: str) -> str:
    """The global model's copy of master param `param` (Caffe2's `_g`)."""
    return f"{param}_g"


def block_momentum_name(param: str) -> str:
    """The block momentum of master param `param` (Caffe2's `_v`)."""
    return f"{param}_v"


def previous_name(param: str) -> str:
    """The previous block momentum of master param `param` (Caffe2's `_prev`, Nesterov only)."""
    return f"{param}_prev"


def group_bmuf_params(state: ParallelState) -> None:
    """Group the data-parallel params (not computed params, as in Caffe2's BMUF) by device."""
    model = state.model
    params = group_by_device.group_by_device([p for p in model.params if str(p) not in state.non_datapar],
                                             state.layout)
    state.grouped.update(params)
    state.param_names = list(params)


def initial_sync(state: ParallelState) -> None:
    """Beyond Caffe2: broadcast every blob the init net creates in a replica scope (params, optimizer
    state) from the first device at the end of `param_init_net`, so every replica starts identical."""
    init_net = state.model.param_init_net.Proto()
    params = [str(b) for name in state.param_names for b in state.grouped[name].values()]
    _, names = sync.compute_blobs_to_sync(init_net, state.layout, params, [])
    state.sync_names = names
    sync.sync_blobs(init_net, names, state.reducer)


def _new_net(state: ParallelState, name: str) -> Net:
    """An empty net with the train net's executor type and worker count."""
    train = state.model.net.Proto()
    proto = NetDef(name)
    proto.type, proto.num_workers = train.type, train.num_workers
    return Net(proto)


def _finish(net: NetDef) -> None:
    chain_collectives(net.ops)
    declare_external_inputs(net)


def _master_param(state: ParallelState, name: str, master: int) -> str:
    return str(state.grouped[name][master])


def build_global_init(state: ParallelState, bmuf: BmufOptions) -> Net:
    """`_global_model_init_net`: on the master, v = 0, g = p, and prev = 0 with Nesterov."""
    net = _new_net(state, "global_model_init")
    device = state.layout.option(bmuf.master_device)
    for name in state.param_names:
        p = _master_param(state, name, bmuf.master_device)
        ops = [make_op("ConstantFill", [p], [block_momentum_name(p)], device, value=0.0),
               make_op("Copy", [p], [global_name(p)], device)]
        if bmuf.nesterov:
            ops.append(make_op("ConstantFill", [p], [previous_name(p)], device, value=0.0))
        net.Proto().ops.extend(ops)
    _finish(net.Proto())
    return net


def _block_gradient_clip(params: Sequence[str], device: DeviceOption, max_norm: float) -> list[OperatorDef]:
    """Scale every block gradient (held in the master params) by min(1, max_norm / their global norm)."""
    if not params:
        return []
    squares = [make_op("SumSqrElements", [p], [f"{p}_block_sqr_sum"], device) for p in params]
    total, norm = f"{params[0]}_block_sqr_total", f"{params[0]}_block_norm"
    ops = [*squares, make_op("Sum", [op.outputs[0] for op in squares], [total], device),
           make_op("Sqrt", [total], [norm], device)]
    ops += [make_op("ClipTensorByScaling", [p, norm], [p], device, threshold=float(max_norm)) for p in params]
    return ops


def build_global_update(state: ParallelState, bmuf: BmufOptions) -> Net:
    """`_global_model_param_updates_net`: average, block momentum, broadcast (see the module doc)."""
    net = _new_net(state, "global_model")
    ops = net.Proto().ops
    reducer, master = bmuf.reducer, bmuf.master_device
    layout = reducer.layout
    device = layout.option(master)
    names = state.param_names
    params = [_master_param(state, n, master) for n in names]
    for name, p in zip(names, params):
        group = [str(state.grouped[name][d]) for d in layout.devices]
        ops.extend(reducer.allreduce(name, group, to_all=False))
        ops.append(make_op("Scale", [p], [p], device, scale=1.0 / copies(reducer)))
        ops.append(make_op("Sub", [p, global_name(p)], [p], device))
    if bmuf.max_gradient_norm is not None:
        ops.extend(_block_gradient_clip(params, device, bmuf.max_gradient_norm))
    for p in params:
        ops.extend(_momentum_step(p, device, bmuf))
    ops.extend(op for name in names for op in reducer.broadcast(layout.group(name)))
    ops.extend(_reset_momenta(state) if bmuf.reset_momentum_sgd else [])
    ops.extend(op for name in bmuf.add_blobs_to_sync for op in reducer.broadcast(layout.group(name)))
    _finish(net.Proto())
    return net


def _momentum_step(p: str, device: DeviceOption, bmuf: BmufOptions) -> list[OperatorDef]:
    """v = bm v + blr d (d is held in p); g += v (Nesterov: - bm (v - prev), then prev = v); p = g."""
    v, g, prev = block_momentum_name(p), global_name(p), previous_name(p)
    ops = [make_op("Scale", [v], [v], device, scale=bmuf.block_momentum),
           make_op("Scale", [p], [p], device, scale=bmuf.block_learning_rate),
           make_op("Add", [v, p], [v], device),
           make_op("Add", [g, v], [g], device)]
    if bmuf.nesterov:
        ops += [make_op("Sub", [v, prev], [prev], device),
                make_op("Scale", [prev], [prev], device, scale=bmuf.block_momentum),
                make_op("Sub", [g, prev], [g], device),
                make_op("Copy", [v], [prev], device)]
    ops.append(make_op("Copy", [g], [p], device))
    return ops


def _reset_momenta(state: ParallelState) -> list[OperatorDef]:
    """Zero every local momentum buffer (the input an update op declares as `Effects.momentum`) of the
    train net, in place (Scale by 0: the buffers are finite unless training diverged)."""
    ops = []
    for op in state.model.net.Proto().ops:
        index = effects_of(op).momentum
        if index is not None:
            momentum = op.inputs[index]
            ops.append(make_op("Scale", [momentum], [momentum], op.device_option, scale=0.0))
    return ops


def build_warmup(state: ParallelState, bmuf: BmufOptions) -> Net:
    """`_warmup_broadcast`: every param from the master to the replicas, and g = p on the master."""
    net = _new_net(state, "warmup_broadcast")
    reducer, master = bmuf.reducer, bmuf.master_device
    device = reducer.layout.option(master)
    ops = net.Proto().ops
    for name in state.param_names:
        p = _master_param(state, name, master)
        ops.extend(reducer.broadcast(reducer.layout.group(name)))
        ops.append(make_op("Copy", [p], [global_name(p)], device))
    _finish(net.Proto())
    return net


def add_global_nets(state: ParallelState, bmuf: BmufOptions) -> None:
    """Build the global nets (and the warmup net) into `state.bmuf`, and set the net lists: init
    `[param_init_net, global_model_init]`, run `[net, (global_model, 1)]`."""
    model = state.model
    nets = BmufNets(build_global_init(state, bmuf), build_global_update(state, bmuf), bmuf.warmup_iterations,
                    build_warmup(state, bmuf) if bmuf.warmup_iterations else None)
    state.bmuf = nets
    state.init_nets = [model.param_init_net, nets.global_init]
    state.nets = [model.net, (nets.global_update, 1)]


def bmuf_pipeline(bmuf: BmufOptions) -> tuple[Pass, ...]:
    """Parallelize's pipeline for BMUF: replicas, gradients and local updates without reducing the
    gradients (each replica trains alone) or fusing the updates; BMUF's own param grouping and initial
    sync; the global nets, which set the net lists."""
    return edited(PIPELINE, remove=(*(entry.name for entry in REDUCE_GRADIENTS), "fuse_updates",
                                    "compute_sync_blobs", "mark_first_iteration_serial"),
                  replace={"group_params": Pass("group_params", group_bmuf_params),
                           "initial_sync": Pass("initial_sync", initial_sync),
                           "set_net_lists": Pass("global_nets", lambda s: add_global_nets(s, bmuf))})


def bmuf_options(layout: DeviceLayout, make_reducer: Callable[..., Reducer], blob_devices: BlobDevices,
                 use_nccl: bool, peer_access: PeerAccess | None, block_learning_rate: Any, block_momentum: Any,
                 nesterov: bool, master_device: Any, warmup_iterations: Any, reset_momentum_sgd: bool,
                 add_blobs_to_sync: tuple[str, ...], max_gradient_norm: Any, num_shards: int = 1) -> BmufOptions:
    """Parallelize_BMUF's block arguments checked, defaults filled in (block_momentum 1 - 1/N for N
    replicas over all `num_shards` shards, the first device as master), with a reducer over the
    replicas ordered master first.

    Raises:
        TypeError: a non-number, or a non-int master_device or warmup_iterations.
        ParallelizeError: block_momentum outside [0, 1), block_learning_rate or max_gradient_norm <= 0,
            warmup_iterations < 1, a master_device that is not one of the devices, a prefixed blob name.
    """
    momentum = 1.0 - 1.0 / (len(layout.devices) * num_shards) if block_momentum is None else block_momentum
    _number("block_momentum", momentum, 0.0, 1.0)
    _number("block_learning_rate", block_learning_rate, 0.0)
    if max_gradient_norm is not None:
        _number("max_gradient_norm", max_gradient_norm, 0.0)
    master = layout.master if master_device is None else _int("master_device", master_device, 0)
    if master not in layout.devices:
        raise ParallelizeError(f"Parallelize_BMUF: master_device {master} is not one of the devices "
                               f"{list(layout.devices)}")
    if warmup_iterations is not None:
        _int("warmup_iterations", warmup_iterations, 1)
    names = tuple(check_unprefixed(add_blobs_to_sync, layout))
    ordered = DeviceLayout((master, *(d for d in layout.devices if d != master)), layout.prefix)
    return BmufOptions(float(block_learning_rate), float(momentum), bool(nesterov), master, warmup_iterations,
                       bool(reset_momentum_sgd), names,
                       None if max_gradient_norm is None else float(max_gradient_norm),
                       make_reducer(ordered, blob_devices, use_nccl, peer_access))


def _number(name: str, value: Any, low: float, below: float | None = None) -> None:
    """`value` is a finite real > low (>= low when `below` is given) and < below."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"Parallelize_BMUF: {name} must be a finite number, got {value!r}")
    ok = (low <= value < below) if below is not None else value > low
    if not ok:
        bound = f"in [{low}, {below})" if below is not None else f"> {low}"
        raise ParallelizeError(f"Parallelize_BMUF: {name} must be {bound}, got {value!r}")


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Parallelize_BMUF: {name} must be an int, got {value!r}")
    if value < low:
        raise ParallelizeError(f"Parallelize_BMUF: {name} must be >= {low}, got {value}")
    return value
