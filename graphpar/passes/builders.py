"""Passes that run the user's builder functions: per replica inside its scopes, or once, unscoped."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from graphpar.core.ir import BlobReference, NetDef
from graphpar.core.scope import DeviceScope, NameScope
from graphpar.errors import ParallelizeError
from graphpar.passes.common import DeviceLayout
from graphpar.passes.state import ParallelState

log = logging.getLogger(__name__)


@contextmanager
def replica_scope(layout: DeviceLayout, device_id: int) -> Iterator[None]:
    """`DeviceScope` + `NameScope("{prefix}_{id}")` of one replica (the name scope replaces the current one)."""
    with DeviceScope(layout.option(device_id)), NameScope(layout.scope(device_id), reset=True):
        yield


def per_replica(state: ParallelState, builder: Callable[[Any], Any]) -> None:
    """Call `builder(model)` once per device, in device order, inside that replica's scopes."""
    for device_id in state.layout.devices:
        with replica_scope(state.layout, device_id):
            builder(state.model)


def build_replicas(state: ParallelState) -> None:
    """Run the input and forward builders per device and keep each replica's losses.

    Guarantees: every replica's ops are recorded (replica 0's first); `losses_by_device` maps each
    device to its losses. A training model's forward builder must return a list of BlobReferences,
    empty for every replica or for none (ParallelizeError otherwise).
    """
    options, layout = state.options, state.layout
    loss_scale = 1.0 / (len(layout.devices) * options.num_shards)
    for device_id in layout.devices:
        with replica_scope(layout, device_id):
            options.input_builder_fun(state.model)
            result = options.forward_pass_builder_fun(state.model, loss_scale)
        if state.training:
            _check_losses(result, layout.scope(device_id))
            if device_id == layout.master and len(layout.devices) > 1:
                _warn_unscaled(state.model.net.Proto(), result, loss_scale)
        state.losses_by_device[device_id] = list(result) if isinstance(result, list) else []
    with_loss = [d for d, losses in state.losses_by_device.items() if losses]
    if state.training and with_loss and len(with_loss) < len(layout.devices):
        raise ParallelizeError(f"forward_pass_builder_fun returned losses for devices {with_loss} only; every "
                               f"replica returns its losses, or none does (e.g. a barrier-only net): a replica "
                               f"without a loss would get no gradients and drift from the others")


def _warn_unscaled(net: NetDef, losses: list[str], loss_scale: float) -> None:
    """Warn about each loss that no `scale` argument equal to `loss_scale` feeds (e.g. Scale(loss,
    scale=loss_scale)): its gradients, summed over the replicas, would be len(devices) times those of
    one device on the whole batch. A warning, not an error: a loss may be scaled another way (a Mul
    by a filled blob), which this look at the recorded ops cannot tell."""
    for loss in losses:
        scales = _scales_feeding(net, str(loss))
        if not any(math.isclose(scale, loss_scale) for scale in scales):
            found = f"it is scaled by {scales}" if scales else "no op computing it has a `scale` argument"
            log.warning("Parallelize: loss %r does not look multiplied by loss_scale=%g (%s); the gradients of "
                        "the %d replicas are summed, so they would be %gx those of one device on the whole "
                        "batch. Return model.net.Scale(loss, 'scaled_loss', scale=loss_scale) from the forward "
                        "builder (ignore this if you scale the loss another way)", str(loss), loss_scale, found,
                        round(1 / loss_scale), math.prod(scales) / loss_scale)


def _scales_feeding(net: NetDef, blob: str) -> list[float]:
    """The `scale` arguments of the ops that `blob`'s value depends on, last op first."""
    needed, scales = {blob}, []
    for op in reversed(net.ops):
        if needed.intersection(op.outputs):
            if isinstance(op.args.get("scale"), (int, float)):
                scales.append(float(op.args["scale"]))
            needed.update(op.inputs)
    return scales


def _check_losses(losses: Any, scope: str) -> None:
    """A list of loss blobs; an empty one (no loss on that replica, e.g. a barrier-only net) is allowed,
    as in Caffe2."""
    if not isinstance(losses, list) or not all(isinstance(b, BlobReference) for b in losses):
        raise ParallelizeError(f"forward_pass_builder_fun must return a list of loss blobs (BlobReferences, "
                               f"already multiplied by loss_scale; [] for none); for {scope} it returned "
                               f"{losses!r}")


def transform_before_gradients(state: ParallelState) -> None:
    """`pre_grad_net_transformer_fun(model)`, once, before the gradient ops exist."""
    transform = state.options.pre_grad_net_transformer_fun
    if transform is not None:
        transform(state.model)


def transform_nets(state: ParallelState) -> None:
    """`net_transformer_fun(model, num_devices, prefix, device_type)`, exactly once, after the gradients."""
    layout, transform = state.layout, state.options.net_transformer_fun
    if transform is not None:
        transform(state.model, len(layout.devices), layout.prefix, layout.device_type)


def build_updates(state: ParallelState) -> None:
    """The parameter updates: `param_update_builder_fun` per replica, or `optimizer_builder_fun` once
    (unscoped; its result is kept as the model's `_optimizer`). `state.updates_start` records where
    their ops begin in the init and train nets."""
    options = state.options
    state.updates_start = (len(state.model.param_init_net.Proto().ops), len(state.model.net.Proto().ops))
    if options.param_update_builder_fun is not None:
        per_replica(state, options.param_update_builder_fun)
    elif options.optimizer_builder_fun is not None:
        state.optimizer = options.optimizer_builder_fun(state.model)


def build_post_sync(state: ParallelState) -> None:
    """`post_sync_builder_fun(model)` per replica, after the initial sync was added."""
    if state.options.post_sync_builder_fun is not None:
        per_replica(state, state.options.post_sync_builder_fun)
