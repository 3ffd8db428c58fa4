"""Passes: loss scaling for low-precision gradients, static (Caffe2's `loss_scale`) or dynamic (as
`torch.amp.GradScaler`).

`Parallelize(loss_scale=S)` (static) or `loss_scale="dynamic"` / a `LossScale`:

- `param_init_net` creates, per replica, `_loss_scale` (a float32 scalar S) and, when dynamic,
  `_loss_scale_good_steps` (int64). Both are replica state: synced at init, saved by checkpoints
  (`GetCheckpointParams`) and broadcast by `FinalizeAfterCheckpoint`, like the params.
- `add_gradients` seeds each loss gradient with S instead of 1, so every gradient is S times larger
  and small low-precision gradients do not flush to zero.
- `unscale_gradients`, after the all-reduce and before any update: per replica one
  `UnscaleGradients` divides that replica's summed gradients by S and raises `GradientOverflowError`
  if any is inf or NaN. Every replica (and every shard) reads the same all-reduced sums, so an
  overflow in any replica's gradients shows in all of them: all agree. With `shard_gradients` each
  replica unscales its part of the sums; one process runs every replica's check in one run, so
  they agree too (Parallelize refuses loss scaling with shard_gradients across shards). The run fails before any
  update started, and a failed run changes nothing: params, optimizer state and the iteration
  counter (so the learning-rate schedule) are as before the step, which is skipped.
  `data_parallel_model.RunNet` catches the error, logs a warning and, when dynamic, runs
  the backoff net (`model._loss_scale_backoff_net`: S *= backoff_factor, good steps = 0 on every replica).
- `grow_loss_scale` (dynamic), after the updates: `UpdateLossScale` counts good steps and multiplies
  S by growth_factor after growth_interval of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphpar.core.ir import GradientSlice, NetDef
from graphpar.core.naming import LOSS_SCALE, LOSS_SCALE_GOOD_STEPS
from graphpar.core.net import Net
from graphpar.passes.common import make_op
from graphpar.passes.options import LossScale, check_loss_scale  # noqa: F401 - the option's value, named here

if TYPE_CHECKING:
    from graphpar.passes.state import ParallelState


def create_scale_state(state: ParallelState) -> None:
    """Per replica, `_loss_scale` = init_scale (and `_loss_scale_good_steps` = 0 when dynamic) in param_init_net."""
    scale, layout = state.options.loss_scale, state.layout
    if scale is None:  # no loss scaling asked for
        return
    init = state.model.param_init_net.Proto()
    for device in layout.devices:
        option = layout.option(device)
        init.ops.append(make_op("ConstantFill", [], [layout.scoped(device, LOSS_SCALE)], option, shape=[],
                                value=float(scale.init_scale)))
        if scale.dynamic:
            init.ops.append(make_op("ConstantFill", [], [layout.scoped(device, LOSS_SCALE_GOOD_STEPS)], option,
                                    shape=[], value=0, dtype="int64"))


def unscale_gradients(state: ParallelState) -> None:
    """Per replica, `UnscaleGradients(its gradients..., _loss_scale)` in place (see the module docstring).

    Needs: the gradients all-reduced (every replica holds the sums), no update op yet. Guarantees:
    one op per device, in device order, before every update; sparse gradients are checked and
    unscaled through their values.
    """
    layout, net = state.layout, state.model.net.Proto()
    parts = state.sharding.grads if state.sharding is not None else {}
    for device in layout.devices:
        grads = []
        for name in state.grad_names:
            grad = (parts.get(name) or state.grouped[name]).get(device)
            if grad is not None:
                grads.append(str(grad.values) if isinstance(grad, GradientSlice) else str(grad))
        if grads:
            net.ops.append(make_op("UnscaleGradients", [*grads, layout.scoped(device, LOSS_SCALE)], grads,
                                   layout.option(device)))


def grow_loss_scale(state: ParallelState) -> None:
    """Dynamic scaling: per replica, `UpdateLossScale` after the updates; and `state.loss_scale_backoff_net`,
    the net `RunNet` runs after a skipped step."""
    scale, layout, model = state.options.loss_scale, state.layout, state.model
    if scale is None or not scale.dynamic:  # a static scale never changes
        return
    backoff = NetDef(f"{model.net.Proto().name}_loss_scale_backoff")
    for device in layout.devices:
        blobs = [layout.scoped(device, LOSS_SCALE), layout.scoped(device, LOSS_SCALE_GOOD_STEPS)]
        model.net.Proto().ops.append(make_op("UpdateLossScale", blobs, blobs, layout.option(device),
                                             growth_factor=float(scale.growth_factor),
                                             growth_interval=int(scale.growth_interval)))
        backoff.ops.append(make_op("BackoffLossScale", blobs, blobs, layout.option(device),
                                   backoff_factor=float(scale.backoff_factor)))
        backoff.external_inputs.extend(blobs)
    state.loss_scale_backoff_net = Net(backoff)
