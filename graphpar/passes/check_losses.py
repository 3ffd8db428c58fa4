"""Pass: stop a step whose loss is NaN or infinite before it changes any param (`check_finite_loss`)."""

from __future__ import annotations

from graphpar.passes.common import make_op
from graphpar.passes.state import ParallelState


def check_finite_losses(state: ParallelState) -> None:
    """Append `CheckFinite(losses)` per replica that has losses, on its device (a forward builder that
    returns no loss, e.g. a barrier-only net, gets no check).

    Needs: `build_replicas` (each replica's losses), and no gradient or update op yet.
    Guarantees: one check op per device, in device order, before every gradient and update op; since
    executors start no in-place update before every op preceding the first update has finished, and
    a failed run writes nothing back, a NaN or infinite loss fails the run with params, optimizer
    state and counters unchanged.
    """
    layout = state.layout
    state.model.net.Proto().ops.extend(
        make_op("CheckFinite", [str(b) for b in state.losses_by_device[device]], [], layout.option(device))
        for device in layout.devices if state.losses_by_device[device])
