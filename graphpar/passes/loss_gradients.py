"""Pass: the gradient ops, seeded with ones for every replica's losses (times the fed batch weight
with `uneven_batches`, and the loss scale with `loss_scale`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graphpar.core.ir import NetDef
from graphpar.core.naming import BATCH_WEIGHT, LOSS_SCALE, grad_name
from graphpar.passes.common import DeviceLayout, make_op
from graphpar.passes.loss_scale import create_scale_state
from graphpar.passes.state import ParallelState


def add_loss_gradient_seeds(net: NetDef, losses_by_device: Mapping[int, Sequence[str]],
                            layout: DeviceLayout, weighted: bool = False, scaled: bool = False) -> dict[str, str]:
    """Append `ConstantFill(loss) -> <loss>_grad` (value 1.0, shaped like the loss) per loss, on its device.

    Input: `net` computes every loss; `losses_by_device` maps each device id to its replica's losses.
    With `weighted`, each seed is then multiplied in place by the replica's `BATCH_WEIGHT` blob, which
    `graphpar.data.feed` writes every step: N·n_d/n for a device fed n_d of n rows, so the 1/N loss
    scale becomes n_d/n (1.0 for equal chunks: the same gradients). Guarantees: one fill (and Mul) per
    loss, in device order then loss order. Returns `{loss: seed gradient}`, the map to pass to ONE
    `AddGradientOperators` call covering every replica (Caffe2 does the same: the user already scaled
    each loss by 1/len(devices)). With `scaled`, each seed is also multiplied in place by the replica's
    `LOSS_SCALE` blob (`passes.loss_scale`).
    """
    seeds: dict[str, str] = {}
    ops = []
    for device in layout.devices:
        for loss in losses_by_device.get(device, ()):
            seeds[str(loss)] = grad_name(str(loss))
            ops.append(make_op("ConstantFill", [loss], [seeds[str(loss)]], layout.option(device), value=1.0))
            for factor, wanted in ((BATCH_WEIGHT, weighted), (LOSS_SCALE, scaled)):
                if wanted:
                    ops.append(make_op("Mul", [seeds[str(loss)], layout.scoped(device, factor)],
                                       [seeds[str(loss)]], layout.option(device)))
    net.ops.extend(ops)
    return seeds


def add_gradients(state: ParallelState) -> None:
    """Seed every replica's losses and add the gradient ops with one `AddGradientOperators` call (with a
    loss scale, after creating its state: `passes.loss_scale`)."""
    model, scaled = state.model, state.options.loss_scale is not None
    if scaled:
        create_scale_state(state)
    model.AddGradientOperators(add_loss_gradient_seeds(model.net.Proto(), state.losses_by_device, state.layout,
                                                       state.options.uneven_batches, scaled))
