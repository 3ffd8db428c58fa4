"""Small hand-built nets for the pass tests."""

from __future__ import annotations

from graphpar.core.ir import CPU, CUDA, DeviceOption, NetDef, OperatorDef
from graphpar.passes.common import DeviceLayout
from graphpar.passes.reducers import Reducer, make_reducer


def layout(devices: list[int], gpu: bool = False) -> DeviceLayout:
    return DeviceLayout(tuple(devices), "gpu" if gpu else "cpu")


def fill(blob: str, device: DeviceOption, value: float = 0.0, shape: tuple[int, ...] = (2,)) -> OperatorDef:
    return OperatorDef("ConstantFill", [], [blob], {"shape": list(shape), "value": float(value)}, device)


def grad_net(lay: DeviceLayout, names: list[str], shape: tuple[int, ...] = (3,)) -> NetDef:
    """Per device position i and name k, a fill of `<scope>/<name>` with value 10*k + i + 1."""
    ops = [fill(lay.scoped(d, name), lay.option(d), 10.0 * k + i + 1, shape)
           for k, name in enumerate(names) for i, d in enumerate(lay.devices)]
    return NetDef("grads", ops)


def summary(ops: list[OperatorDef]) -> list[tuple]:
    """(type, inputs, outputs, device, name, control inputs) per op: what the pass tests compare."""
    return [(op.type, op.inputs, op.outputs, op.device_option, op.name, op.control_inputs) for op in ops]


def cpu(device_id: int) -> DeviceOption:
    return DeviceOption(CPU, device_id)


def gpu(device_id: int) -> DeviceOption:
    return DeviceOption(CUDA, device_id)


def reducer(lay: DeviceLayout, blob_devices: dict | None = None, use_nccl: bool = False,
            peer_access=None) -> Reducer:  # noqa: ANN001
    """The reducer Parallelize would build for these options."""
    return make_reducer(lay, {} if blob_devices is None else blob_devices, use_nccl, peer_access)
