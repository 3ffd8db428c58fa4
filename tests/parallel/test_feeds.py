"""graphpar.parallel.feeds: which inputs of a train net count as fed, checked across replicas."""

from __future__ import annotations

import pytest
import torch

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.parallel.feeds import FeedTracker
from tests.passes.helpers import cpu, fill, layout


def test_fed_inputs_are_what_the_net_reads_not_what_it_declares():
    """A declared input no op reads (optimizer state a pass now keeps in parts) is not fed data: changing
    it on one replica only is no stale batch."""
    lay = layout([0, 1])
    ops = [OperatorDef("Relu", [lay.scoped(d, "data")], [lay.scoped(d, "h")], {}, cpu(d)) for d in lay.devices]
    declared = [lay.scoped(d, blob) for d in lay.devices for blob in ("data", "w_moment")]
    tracker = FeedTracker(lay, NetDef("train", ops, declared), [NetDef("init", [fill("cpu_0/w", cpu(0))])], ["w"])
    assert tracker.groups == {"data": ["cpu_0/data", "cpu_1/data"]}
    blobs = {name: torch.zeros(2) for name in declared}
    tracker.remember(blobs)
    blobs["cpu_0/w_moment"] = torch.ones(2)  # e.g. GetCheckpointParams gathering the state on cpu_0
    tracker.check(blobs, "RunNet")
    blobs["cpu_0/data"] = torch.ones(2)
    with pytest.raises(RuntimeError, match="'cpu_0/data' was fed since the last run but 'cpu_1/data' was not"):
        tracker.check(blobs, "RunNet")
