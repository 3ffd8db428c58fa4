from __future__ import annotations

import pytest

from graphpar.core.ir import GradientSlice
from graphpar.errors import ParallelizeError
from graphpar.passes.group_by_device import group_by_device
from tests.passes.helpers import layout


def test_groups_by_unscoped_name_in_creation_order():
    lay = layout([3, 1], gpu=True)
    grouped = group_by_device(["gpu_3/fc_w", "gpu_3/fc_b", "gpu_1/fc_w", "gpu_1/fc_b", "gpu_3/sub/x"], lay)
    assert list(grouped) == ["fc_w", "fc_b", "sub/x"]
    assert grouped["fc_w"] == {3: "gpu_3/fc_w", 1: "gpu_1/fc_w"}
    assert list(grouped["fc_b"]) == [3, 1]


def test_gradient_slices_group_under_indices_colon_values():
    lay = layout([0, 1])
    slices = [GradientSlice(f"cpu_{d}/idx", f"cpu_{d}/val") for d in (0, 1)]
    assert group_by_device(slices, lay) == {"idx:val": {0: slices[0], 1: slices[1]}}


@pytest.mark.parametrize("blob", ["fc_w", "gpu_0/fc_w", "cpu_2/fc_w", GradientSlice("cpu_0/i", "cpu_1/v")])
def test_blobs_outside_the_replica_scopes_are_refused(blob):
    with pytest.raises(ParallelizeError, match="not in a replica name scope"):
        group_by_device(["cpu_0/ok", blob], layout([0, 1]))
