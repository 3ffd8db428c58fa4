"""Graph views: exact dependency edges (in-place ops, control inputs), lifetimes, predecessors, devices."""

from __future__ import annotations

from collections.abc import Iterator

import networkx as nx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphpar.core import CPU, CUDA, DeviceOption, DeviceScope, Net, NetDef, OperatorDef
from graphpar.core.graph import (
    EDGE_KINDS,
    blob_devices,
    blob_lifetimes,
    dependency_graph,
    predecessors,
)
from graphpar.core.schema import get_schema, register_op, scoped_registry

CPU0, GPU0, GPU1 = DeviceOption(CPU, 0), DeviceOption(CUDA, 0), DeviceOption(CUDA, 1)

@pytest.fixture(autouse=True, scope="module")
def _test_ops() -> Iterator[None]:
    """This module's test-only operators, registered for its tests only."""
    with scoped_registry():
        register_op("_TestGraphIter", inputs=1, outputs=1, enforce_inplace={(0, 0)},
                    device_inference=lambda op, dev: ([CPU0], [CPU0]),
                    kernel=lambda a, ctx: lambda it: it + 1, doc="Test op: a counter that lives on the CPU.")
        register_op("_TestGraphToCPU", inputs=1, outputs=1, device_inference=lambda op, dev: ([None], [CPU0]),
                    kernel=lambda a, ctx: lambda x: x.cpu(), doc="Test op: copies its input to the CPU.")
        yield



def _program() -> NetDef:
    net = Net("test_graph_program")
    net.ConstantFill([], "w", shape=[2, 2], value=1.0)  # 0
    net.Relu("x", "h")  # 1
    net.FC(["h", "w", "b"], "y")  # 2
    net.Relu("h", "h")  # 3: in place
    net.Sum(["y", "h"], "y")  # 4: in place
    net.Relu("x", "z", control_input="y")  # 5: y only as a control input
    net.ConstantFill([], "x", shape=[2, 2], value=0.0)  # 6: overwrites an external input
    net.Relu("z", "w")  # 7: overwrites w, which op 2 read
    return net.Proto()


def _edges(graph: nx.DiGraph) -> dict[tuple[int, int], tuple[str, str]]:
    return {(u, v): (d["kind"], d["blob"]) for u, v, d in graph.edges(data=True)}


def test_dependency_graph_exact_edges() -> None:
    graph = dependency_graph(_program())
    assert sorted(graph.nodes) == list(range(8))
    assert _edges(graph) == {
        (0, 2): ("raw", "w"), (1, 2): ("raw", "h"),
        (1, 3): ("raw", "h"),  # also a write-after-write on h: the read is found first
        (2, 3): ("war", "h"),
        (2, 4): ("raw", "y"), (3, 4): ("raw", "h"),
        (4, 5): ("raw", "y"),  # control input
        (1, 6): ("war", "x"), (5, 6): ("war", "x"),
        (5, 7): ("raw", "z"), (0, 7): ("waw", "w"), (2, 7): ("war", "w"),
    }
    assert nx.is_directed_acyclic_graph(graph)
    assert not any(u == v for u, v in graph.edges)


def _check_ordering(netdef: NetDef) -> None:
    """Two ops that touch a common blob, one of them writing it, are ordered by a path, and every
    edge joins an earlier op to a later one that conflicts with it."""
    graph = dependency_graph(netdef)
    closure = nx.transitive_closure_dag(graph)

    def conflict(i: int, j: int) -> set[str]:
        earlier, later = netdef.ops[i], netdef.ops[j]
        earlier_reads = {*earlier.inputs, *earlier.control_inputs}
        later_uses = {*later.inputs, *later.control_inputs, *later.outputs}
        return (set(earlier.outputs) & later_uses) | (earlier_reads & set(later.outputs))

    for j in range(len(netdef.ops)):
        for i in range(j):
            assert not conflict(i, j) or closure.has_edge(i, j), (i, j)
    for i, j, data in graph.edges(data=True):
        assert i < j and data["blob"] in conflict(i, j) and data["kind"] in EDGE_KINDS


def test_dependency_graph_orders_every_conflicting_pair() -> None:
    _check_ordering(_program())


_BLOBS = st.sampled_from(["a", "b", "c", "d"])
_OPS = st.builds(lambda ins, outs, ctl: OperatorDef("Relu", ins, outs, control_inputs=ctl),
                 st.lists(_BLOBS, max_size=3), st.lists(_BLOBS, min_size=1, max_size=2),
                 st.lists(_BLOBS, max_size=1))


@given(st.lists(_OPS, max_size=12))
def test_dependency_graph_on_random_nets(ops: list[OperatorDef]) -> None:
    _check_ordering(NetDef("random", ops))


def test_dependency_graph_of_independent_ops_has_no_edges() -> None:
    netdef = NetDef("flat", [OperatorDef("Relu", [f"x{i}"], [f"y{i}"]) for i in range(3)])
    graph = dependency_graph(netdef)
    assert sorted(graph.nodes) == [0, 1, 2] and graph.number_of_edges() == 0
    assert dependency_graph(NetDef("empty")).number_of_nodes() == 0


def test_blob_lifetimes() -> None:
    netdef = _program()
    assert blob_lifetimes(netdef) == {"w": (0, 7), "x": (1, 6), "h": (1, 4), "y": (2, 5), "b": (2, 2),
                                      "z": (5, 7)}


def test_predecessors_are_the_dependency_graphs_edges() -> None:
    netdef = _program()
    graph = dependency_graph(netdef)
    assert predecessors(netdef) == tuple(tuple(sorted(graph.predecessors(j))) for j in range(len(netdef.ops)))
    assert predecessors(NetDef("empty")) == ()


def test_blob_devices_first_use_wins_across_nets() -> None:
    init = Net("test_graph_init")
    with DeviceScope(GPU1):
        init.ConstantFill([], "w", shape=[1], value=0.0)
        init._TestGraphIter("it", "it")  # device inference: the counter lives on the CPU
    main = Net("test_graph_main")
    main.Relu("w", "a")  # w already placed by the init net
    main._TestGraphToCPU("a", "a_cpu")  # input on the op's device, output on the CPU
    with DeviceScope(GPU1):
        main.Relu("fresh", "out")
    main.RunAllOnGPU(0)
    plain = NetDef("test_graph_plain", [OperatorDef("Relu", ["q"], ["r"])])
    devices = blob_devices([init.Proto(), main.Proto(), plain])
    assert devices == {"w": GPU1, "it": CPU0, "a": GPU0, "a_cpu": CPU0, "fresh": GPU1, "out": GPU1,
                       "q": CPU0, "r": CPU0}
    assert blob_devices(plain, default=GPU1) == {"q": GPU1, "r": GPU1}
    assert blob_devices(main.Proto())["w"] == GPU0  # a single NetDef is accepted


def _reference_blob_devices(netdefs: list[NetDef], default: DeviceOption | None) -> dict[str, DeviceOption]:
    """The definition, run literally: every op, in order; the first placement of a blob wins."""
    placed: dict[str, DeviceOption] = {}
    for netdef in netdefs:
        for op in netdef.ops:
            device = op.device_option or netdef.device_option or default or CPU0
            infer = get_schema(op.type).device_inference
            in_devs, out_devs = infer(op, device) if infer is not None else ((), ())
            for blobs, devs in ((op.inputs, in_devs), (op.outputs, out_devs)):
                for k, blob in enumerate(blobs):
                    placed.setdefault(blob, (devs[k] if k < len(devs) else None) or device)
    return placed


_DEVICES = st.sampled_from([None, CPU0, GPU0, GPU1])
_PLACED_OPS = st.one_of(
    st.builds(lambda ins, outs, dev: OperatorDef("Sum", ins, outs, device_option=dev),
              st.lists(_BLOBS, min_size=1, max_size=3), st.lists(_BLOBS, min_size=1, max_size=1), _DEVICES),
    st.builds(lambda blob, dev: OperatorDef("_TestGraphIter", [blob], [blob], device_option=dev), _BLOBS, _DEVICES),
    st.builds(lambda x, y, dev: OperatorDef("_TestGraphToCPU", [x], [y], device_option=dev), _BLOBS, _BLOBS,
              _DEVICES))
_PLACED_NETS = st.lists(st.builds(lambda ops, dev: NetDef("random", ops, device_option=dev),
                                  st.lists(_PLACED_OPS, max_size=8), _DEVICES), min_size=1, max_size=3)


@given(_PLACED_NETS, _DEVICES)
def test_blob_devices_on_random_nets_match_the_definition(netdefs: list[NetDef], default) -> None:
    """Device hooks, net and op devices, in-place and repeated blobs: as the literal definition places them."""
    assert blob_devices(netdefs, default=default) == _reference_blob_devices(netdefs, default)


def test_first_op_places_a_blob_and_iter_counters_live_on_the_cpu():
    init = NetDef("init", [OperatorDef("ConstantFill", [], ["gpu_1/w"], {"shape": [2]}, GPU1),
                           OperatorDef("ConstantFill", [], ["gpu_1/ITER"],
                                       {"shape": [1], "value": 0, "dtype": "int64"}, CPU0)])
    net = NetDef("net", [OperatorDef("Iter", ["gpu_1/ITER"], ["gpu_1/ITER"], {}, GPU1),
                         OperatorDef("Copy", ["gpu_1/w"], ["gpu_0/w"], {}, GPU0),
                         OperatorDef("Relu", ["gpu_0/w"], ["gpu_0/y"], {}, DeviceOption(CUDA, 3))])
    devices = blob_devices([init, net])
    assert devices == {"gpu_1/w": GPU1, "gpu_1/ITER": CPU0, "gpu_0/w": GPU0, "gpu_0/y": DeviceOption(CUDA, 3)}


def test_iter_created_in_the_train_net_is_still_on_the_cpu():
    net = NetDef("net", [OperatorDef("Iter", ["gpu_1/ITER"], ["gpu_1/ITER"], {}, GPU1)])
    assert blob_devices([net])["gpu_1/ITER"] == CPU0
