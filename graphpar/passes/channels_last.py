"""Pass: channels-last activations for NCHW models (`Parallelize(channels_last=True)`).

A convolution (an op with `Trait.CONVOLUTION`, e.g. Conv) whose input is not known to be
channels-last gets a `ChannelsLast` op before it (one per blob value, as the precision pass places
casts). A blob is known to be channels-last when a convolution wrote it, or an op that keeps its input's layout (a FOLLOW or CONVERT precision rule: batch norm,
element-wise, pooling, casts) wrote it from a channels-last input 0. On an NCHW ResNet this converts
the data once and leaves no layout conversion between consecutive convs; torch's kernels then keep
every activation and activation gradient channels-last (cuDNN's fast path on CUDA). Values and shapes
are unchanged (the model stays NCHW).

The 4-D filters those Convs read (through casts and other layout-keeping ops) are made channels-last
at the end of `param_init_net` (as eager's `module.to(memory_format=...)`): torch's Conv would
otherwise convert each filter to the input's layout and its gradient back, every step, and the
update would see channels-last gradients beside NCHW params (off the multi-tensor fast path).
Optimizer state filled from a filter takes its layout (`ConstantFill` follows its input's, as
`zeros_like`), and the updates keep it. A param fed or loaded later in NCHW trains the same (torch
converts it per step, as before).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphpar.core.dataflow import dataflow
from graphpar.core.ir import NetDef
from graphpar.core.schema import Precision, Trait, has_trait, precision_rule
from graphpar.passes.common import make_op

if TYPE_CHECKING:
    from graphpar.passes.state import ParallelState

_KEEPS_LAYOUT = (Precision.FOLLOW, Precision.CONVERT)


def rewrite_channels_last(net: NetDef, taken: set[str] | None = None) -> NetDef:
    """Insert `ChannelsLast` before each convolution reading a blob not known to be channels-last;
    returns `net`.

    Input: a forward net (no gradient ops yet). Guarantees: every NCHW convolution's input 0 is
    channels-last at run time; one conversion per blob value.
    """
    taken = (taken or set()) | {b for op in net.ops for b in (*op.inputs, *op.outputs)}
    last: set[str] = set()  # blobs known channels-last
    converted: dict[str, str] = {}  # blob -> its channels-last copy
    ops = []
    for op in net.ops:
        conv = has_trait(op, Trait.CONVOLUTION)
        if conv and op.inputs[0] not in last and op.args.get("order", "NCHW") == "NCHW":
            blob = op.inputs[0]
            if blob not in converted:
                name, k = f"{blob}_cl", 1
                while name in taken:
                    name, k = f"{blob}_cl_{k}", k + 1
                taken.add(name)
                ops.append(make_op("ChannelsLast", [blob], [name], op.device_option))
                converted[blob] = name
                last.add(name)
            op = op.copy()
            op.inputs[0] = converted[op.inputs[0]]
        keeps = precision_rule(op.type).compute in _KEEPS_LAYOUT and op.inputs and op.inputs[0] in last
        for out in op.outputs:
            converted.pop(out, None)
            last.discard(out)
        if conv or keeps:
            last.update(op.outputs[:1])
        ops.append(op)
    net.ops[:] = ops
    return net


def conv_filters(net: NetDef) -> list[str]:
    """The blobs whose values the NCHW convolutions of `net` read as their filter: input 1, or what a chain of
    layout-keeping ops (casts, FOLLOW/CONVERT precision rules) made it from."""
    made = {out: op for op in net.ops for out in op.outputs[:1]}
    found: dict[str, None] = {}
    for op in net.ops:
        if not has_trait(op, Trait.CONVOLUTION) or op.args.get("order", "NCHW") != "NCHW" or len(op.inputs) < 2:
            continue
        blob, seen = op.inputs[1], set()
        while blob in made and blob not in seen and precision_rule(made[blob].type).compute in _KEEPS_LAYOUT \
                and made[blob].inputs:
            seen.add(blob)
            blob = made[blob].inputs[0]
        found[blob] = None
    return list(found)


def filters_channels_last(init: NetDef, filters: list[str]) -> None:
    """At the end of `init`, convert each of `filters` it creates to channels-last in place
    (`ChannelsLast` leaves tensors of other ranks as they are). At the end: the ops before keep their
    indices, so random fills draw what they drew."""
    written = {out: op.device_option for op in init.ops for out in op.outputs}
    init.ops.extend(make_op("ChannelsLast", [blob], [blob], written[blob]) for blob in filters if blob in written)


def keep_channels_last(state: ParallelState) -> None:
    """Parallelize's pass: `rewrite_channels_last` on the train net (before the gradient ops exist), and
    its Convs' filters channels-last from the init net on (`filters_channels_last`)."""
    init, net = state.model.param_init_net.Proto(), state.model.net.Proto()
    rewrite_channels_last(net, set(dataflow(init).first_write))
    filters_channels_last(init, conv_filters(net))
