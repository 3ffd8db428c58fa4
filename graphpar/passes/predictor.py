"""Pass: cut a forward-only prediction net out of a training net (Caffe2's `ExtractPredictorNet`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graphpar.core.dataflow import facts
from graphpar.core.ir import DeviceOption, NetDef, OperatorDef
from graphpar.core.schema import get_schema, stops_gradient


def extract_predictor_net(net: NetDef, inputs: Sequence[str], outputs: Sequence[str],
                          device: DeviceOption | None = None,
                          renames: Mapping[str, str] | None = None) -> tuple[NetDef, list[str]]:
    """The ops of `net` that compute `outputs` from `inputs` and the blobs they also need.

    Input: a train net whose forward ops read `inputs` and write `outputs`. Guarantees: a new NetDef
    `<net>_predict` with the forward ops (no gradient ops) from the first op reading an input to the
    last op writing an output whose inputs are all known (inputs, the net's external inputs, or
    earlier outputs), an op whose outputs its registration's `predict_as` names are unused replaced by
    the op it names (a SoftmaxWithLoss whose loss is unused by its Softmax, so labels are neither read
    nor listed), placed on `device` if given and with blobs renamed through `renames`;
    and the list of blobs (renamed) the predictor needs besides `inputs` (its params), in first-use order.

    Raises:
        ValueError: no op reads an input or writes an output, or an op has `is_test` set to 0
            (extract from a test model, built with is_test=True).
    """
    inputs, outputs = [str(b) for b in inputs], [str(b) for b in outputs]
    ops = [op for op in net.ops if not op.is_gradient_op]
    flow = facts(ops)
    start = min((i for b in inputs for i in flow.readers.get(b, ()) if not stops_gradient(ops[i])), default=None)
    stop = max((i for b in outputs for i in flow.writers.get(b, ())), default=None)
    if start is None or stop is None:
        raise ValueError(f"net {net.name!r}: no op reads {inputs} or none writes {outputs}")
    known = set(inputs) | set(net.external_inputs)
    chosen = []
    for op in ops[start:stop + 1]:
        if known.issuperset(op.inputs):
            _check_test_mode(op, net.name)
            chosen.append(op)
            known.update(op.outputs)
    return _renamed(net.name, _without_losses(chosen, outputs), inputs, outputs, device, renames or {})


def _without_losses(ops: list[OperatorDef], outputs: list[str]) -> list[OperatorDef]:
    """Each op whose `predict_as` outputs nothing in the predictor reads becomes the op it names (a
    SoftmaxWithLoss whose loss is unused becomes the Softmax it computes), so the predictor neither
    reads nor lists the inputs (labels) only those outputs needed."""
    read = set(outputs).union(facts(ops).readers)
    return [_predicted(op, read) for op in ops]


def _predicted(op: OperatorDef, read: set[str]) -> OperatorDef:
    rule = get_schema(op.type).predict_as
    if rule is None or any(i < len(op.outputs) and op.outputs[i] in read for i in rule.unused):
        return op
    return OperatorDef(rule.type, [op.inputs[i] for i in rule.inputs], [op.outputs[i] for i in rule.outputs],
                       {name: op.args[name] for name in rule.args if name in op.args}, op.device_option, op.name,
                       op.engine, list(op.control_inputs), source=op.source)


def _check_test_mode(op: OperatorDef, net_name: str) -> None:
    if "is_test" in op.args and not op.args["is_test"]:
        raise ValueError(f"net {net_name!r}: op {op.type} ({op.outputs}) has is_test=0; extract the "
                         f"predictor from a test model (built with is_test=True), not a training model")


def _renamed(name: str, ops: list[OperatorDef], inputs: list[str], outputs: list[str],
             device: DeviceOption | None, renames: Mapping[str, str]) -> tuple[NetDef, list[str]]:
    def rename(blobs: list[str]) -> list[str]:
        return [renames.get(b, b) for b in blobs]

    predict = NetDef(f"{name}_predict")
    for op in ops:
        new = op.copy()
        new.inputs, new.outputs, new.control_inputs = rename(op.inputs), rename(op.outputs), rename(
            op.control_inputs)
        new.device_option = device if device is not None else op.device_option
        predict.ops.append(new)
    predict.external_inputs = rename(list(facts(ops).loads))  # what the ops read before writing it
    predict.external_outputs = rename(outputs)
    params = [b for b in predict.external_inputs if b not in set(rename(inputs))]
    return predict, params
