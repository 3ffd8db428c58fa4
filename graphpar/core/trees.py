"""The Sum tree every reduction uses, over device positions in one process and over shard positions
across processes, so that shards x devices add in the order one process adds over all devices."""

from __future__ import annotations


def tree_levels(count: int) -> list[list[tuple[int, ...]]]:
    """The Sum tree over `count` positions (devices, or shards): levels of position tuples, root first in each.

    4, 8 and 16 devices reduce pairwise, doubling the stride each level (16: (0,1)…(14,15), then
    (0,2),(4,6),(8,10),(12,14), then (0,4),(8,12), then (0,8)), as Caffe2 did; any other count is
    one flat Sum of every position onto position 0. The root of the last level is position 0.
    """
    if count not in (4, 8, 16):
        return [[tuple(range(count))]]
    levels: list[list[tuple[int, ...]]] = []
    stride = 1
    while stride < count:
        levels.append([(i, i + stride) for i in range(0, count, 2 * stride)])
        stride *= 2
    return levels
