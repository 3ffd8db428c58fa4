"""Pass: the gradient ops, seeded with ones for every replica's losses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graphpar.core.ir import NetDef
from graphpar.naming import grad_name
from graphpar.passes.common import DeviceLayout, make_op
from graphpar.passes.state import ParallelState


def add_loss_gradient_seeds(net: NetDef, losses_by_device: Mapping[int, Sequence[str]],
                            layout: DeviceLayout) -> dict[str, str]:
    """Append `ConstantFill(loss) -> <loss>_grad` (value 1.0, shaped like the loss) per loss, on its device.

    Input: `net` computes every loss; `losses_by_device` maps each device id to its replica's losses.
    Guarantees: one fill per loss, in device order then loss order. Returns `{loss: seed gradient}`,
    the map to pass to ONE `AddGradientOperators` call covering every replica (Caffe2 does the same:
    the user already scaled each loss by 1/len(devices)).
    """
    seeds: dict[str, str] = {}
    ops = []
    for device in layout.devices:
        for loss in losses_by_device.get(device, ()):
            seeds[str(loss)] = grad_name(str(loss))
            ops.append(make_op("ConstantFill", [loss], [seeds[str(loss)]], layout.option(device), value=1.0))
    net.ops.extend(ops)
    return seeds


def add_gradients(state: ParallelState) -> None:
    """Seed every replica's losses and add the gradient ops with one `AddGradientOperators` call."""
    model = state.model
    model.AddGradientOperators(add_loss_gradient_seeds(model.net.Proto(), state.losses_by_device, state.layout))
