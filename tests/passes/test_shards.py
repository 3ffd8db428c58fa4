"""Sharded state: the cut of each param, and the reducers' reduce-scatter, gather and scatter run on data.

The reduce-scatter's parts must hold the all-reduce's bits (every element added in the same order), for
a tree count (8) and a flat one (3), and NCCL's (4), with uneven parts; the gather and the scatter must
give back exactly what was cut.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphpar import workspace
from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.naming import shard_name
from graphpar.devices import cuda_on_cpu
from graphpar.passes.shards import split_sizes
from tests.passes.helpers import layout, reducer


def test_split_sizes_are_contiguous_and_differ_by_at_most_one_longer_first():
    assert split_sizes(10, 4) == (3, 3, 2, 2)
    assert split_sizes(8, 4) == (2, 2, 2, 2)
    assert split_sizes(3, 4) == (1, 1, 1, 0)  # a param smaller than the replica count
    assert split_sizes(0, 3) == (0, 0, 0)
    assert split_sizes(1, 1) == (1,)


def _filled(lay, name: str, values: np.ndarray) -> list[OperatorDef]:  # noqa: ANN001
    """Per device position i a GivenTensorFill of `<scope>/<name>` with values[i]."""
    return [OperatorDef("GivenTensorFill", [], [lay.scoped(d, name)],
                        {"shape": list(values[i].shape), "values": values[i].reshape(-1).tolist()}, lay.option(d))
            for i, d in enumerate(lay.devices)]


@pytest.mark.parametrize("count, use_nccl", [(3, False), (8, False), (4, True)])
def test_reduce_scatter_parts_hold_the_all_reduces_bits(count, use_nccl):
    lay = layout(list(range(1, 1 + count)), gpu=use_nccl)
    rng = np.random.default_rng(count)
    values = rng.standard_normal((count, 3, 7)).astype(np.float32) * 10.0 ** rng.integers(-3, 4, (count, 3, 7))
    sizes = split_sizes(21, count)
    red = reducer(lay, use_nccl=use_nccl)
    group = [lay.scoped(d, "g") for d in lay.devices]
    parts = [shard_name(b) for b in group]
    scatter = NetDef("scatter", [*_filled(lay, "g", values), *red.reduce_scatter("g", group, parts, sizes)])
    reduce = NetDef("reduce", [*_filled(lay, "g", values), *red.allreduce("g", group)])
    with cuda_on_cpu():
        workspace.RunNetOnce(reduce)
        whole = workspace.FetchBlob(group[0]).reshape(-1)
        workspace.RunNetOnce(scatter)
        got = [workspace.FetchBlob(p) for p in parts]
    assert [len(p) for p in got] == list(sizes)
    np.testing.assert_array_equal(np.concatenate(got), whole)


@pytest.mark.parametrize("count", [3])
def test_scatter_then_gather_gives_back_the_first_devices_blob_on_every_device(count):
    lay = layout(list(range(count)))
    value = np.arange(10, dtype=np.float32).reshape(2, 5) * 1.5
    sizes = split_sizes(10, count)
    red = reducer(lay)
    parts = [shard_name(lay.scoped(d, "w")) for d in lay.devices]
    wholes = [lay.scoped(d, "w") for d in lay.devices]
    net = NetDef("roundtrip", [_filled(lay, "w", value[None].repeat(count, 0))[0],
                               *red.scatter_shards("w", wholes[0], parts, sizes),
                               *red.gather_shards("w", parts, wholes, sizes, [2, 5])])
    workspace.RunNetOnce(net)
    assert [workspace.FetchBlob(p).tolist() for p in parts] == [
        part.tolist() for part in np.split(value.reshape(-1), np.cumsum(sizes)[:-1])]
    for whole in wholes:
        np.testing.assert_array_equal(workspace.FetchBlob(whole), value)
