"""Graph views of a NetDef (networkx): op dependencies, blob lifetimes, blob devices.

The dependency and lifetime facts come from `core.dataflow` (computed once per net version); this
module shapes them as graphs. Control inputs count as reads everywhere (Caffe2's DAG nets treat them so).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import networkx as nx

from graphpar.core.dataflow import dataflow
from graphpar.core.ir import DeviceOption, NetDef, OperatorDef
from graphpar.core.schema import get_schema

EDGE_KINDS = ("raw", "waw", "war")


def dependency_edges(netdef: NetDef) -> dict[tuple[int, int], tuple[str, str]]:
    """{(i, j): (kind, blob)}: op j must run after op i, for the first reason found (see dependency_graph)."""
    return dict(dataflow(netdef).edges)


def dependency_graph(netdef: NetDef) -> nx.DiGraph:
    """The DAG over op indices: edge i -> j means op j must run after op i.

    Edges: read-after-write (j reads, as input or control input, what i last wrote), write-after-write
    (j overwrites what i wrote) and write-after-read (j overwrites what i read since the last write).
    Each edge has `kind` in EDGE_KINDS and `blob`; when one pair has several reasons, the first found
    is kept (op j's reads before its writes, blobs in order). No self-edges: an in-place op reads its
    input before writing it. Every op is a node, even without edges.
    """
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(netdef.ops)))
    graph.add_edges_from((i, j, {"kind": kind, "blob": blob})
                         for (i, j), (kind, blob) in dependency_edges(netdef).items())
    return graph


def predecessors(netdef: NetDef) -> tuple[tuple[int, ...], ...]:
    """For each op, in program order, the sorted indices of the ops it must run after (the DAG's edges)."""
    return dataflow(netdef).predecessors


def blob_lifetimes(netdef: NetDef) -> dict[str, tuple[int, int]]:
    """{blob: (index of the first op that uses it, index of the last)}; uses are reads, control inputs
    and writes. External outputs are not extended to the end of the net: callers that keep blobs
    alive past the net handle that themselves."""
    return dict(dataflow(netdef).lifetimes)


def blob_devices(netdefs: NetDef | Iterable[NetDef],
                 default: DeviceOption | None = None) -> dict[str, DeviceOption]:
    """{blob: the device it lives on}: that of the first op, across `netdefs` in order, that reads or
    writes it.

    An op's device is its own option, else its net's, else `default`, else CPU 0. A schema's
    `device_inference(op, device) -> (input_devices, output_devices)` hook overrides it per blob (Iter
    counters and copies live on the CPU); a None or missing entry means the op's device. Control
    inputs place nothing.
    """
    if isinstance(netdefs, NetDef):
        netdefs = [netdefs]
    placed: dict[str, DeviceOption] = {}
    hooks: dict[str, Callable | None] = {}  # op type -> its schema's device_inference
    for netdef in netdefs:
        net_device = netdef.device_option or default or DeviceOption()
        for op in netdef.ops:
            if op.type not in hooks:
                hooks[op.type] = get_schema(op.type).device_inference
            infer, device = hooks[op.type], op.device_option or net_device
            if infer is None:  # the common case, fast: every blob on the op's device
                for blob in op.inputs:
                    if blob not in placed:
                        placed[blob] = device
                for blob in op.outputs:
                    if blob not in placed:
                        placed[blob] = device
            elif not (all(b in placed for b in op.inputs) and all(b in placed for b in op.outputs)):
                _place_inferred(placed, op, device, infer(op, device))
    return placed


def _place_inferred(placed: dict[str, DeviceOption], op: OperatorDef, device: DeviceOption,
                    inferred: tuple[Sequence, Sequence]) -> None:
    """Place the op's new blobs from its device-inference hook's (input devices, output devices)."""
    for names, devices in zip((op.inputs, op.outputs), inferred):
        for k, blob in enumerate(names):
            if blob not in placed:
                placed[blob] = _pick(devices, k, device)


def _pick(devices: Sequence, k: int, device: DeviceOption) -> DeviceOption:
    """Entry k of a device-inference hook's list; a None or missing entry means the op's device."""
    return (devices[k] if k < len(devices) else None) or device


def output_devices(op: OperatorDef, device: DeviceOption) -> list[DeviceOption]:
    """Where each output of `op`, running on `device`, lives: `blob_devices`' rule for one op's writes."""
    infer = get_schema(op.type).device_inference
    if infer is None:
        return [device] * len(op.outputs)
    devices = infer(op, device)[1]
    return [_pick(devices, k, device) for k in range(len(op.outputs))]
