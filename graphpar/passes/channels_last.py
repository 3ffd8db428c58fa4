"""Pass: channels-last activations for NCHW models (`Parallelize(channels_last=True)`).

A convolution (an op with `Trait.CONVOLUTION`, e.g. Conv) whose input is not known to be
channels-last gets a `ChannelsLast` op before it (one per blob value, as the precision pass places
casts). A blob is known to be channels-last when a convolution wrote it, or an op that keeps its input's layout (a FOLLOW or CONVERT precision rule: batch norm,
element-wise, pooling, casts) wrote it from a channels-last input 0. On an NCHW ResNet this converts
the data once and leaves no layout conversion between consecutive convs; torch's kernels then keep
every activation and activation gradient channels-last (cuDNN's fast path on CUDA). Values and shapes
are unchanged (the model stays NCHW); params keep their format (torch adapts the filters).
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


def keep_channels_last(state: ParallelState) -> None:
    """Parallelize's pass: `rewrite_channels_last` on the train net (before the gradient ops exist)."""
    init = state.model.param_init_net.Proto()
    rewrite_channels_last(state.model.net.Proto(), set(dataflow(init).first_write))
