"""Pass: mixed precision. The forward ops that gain from it compute in bfloat16 or float16, the rest in fp32.

`Parallelize(compute_dtype="bfloat16" | "float16")` runs `mixed_precision` after the replicas are
built and before the gradient ops exist; a plain `ModelHelper` gets the same rewrite from
`convert_model(model, compute_dtype)`, called before `AddGradientOperators`. Each forward op follows
its `core.schema.PrecisionRule` (the table next to the op traits, or the op's own declaration):

- LOW ops (Conv, FC) read their inputs in the low dtype: fp32 params stay the fp32 master copies and
  are cast down where they are used; activations already low are used as they are.
- FP32 ops (softmax and losses, reductions, exp/log, every update; any op without a rule) read low
  inputs cast up to fp32.
- FOLLOW ops (element-wise, pooling, layout) run in their inputs' dtype; inputs of mixed dtypes are
  promoted to fp32. SpatialBN follows X, while its scale, bias and running statistics stay fp32.

A cast is inserted only where an op needs a blob in a dtype it does not have, right before that op,
and one cast of a blob per dtype serves every later reader until the blob is rewritten, so the net
never holds a cast of a cast (`X -> low -> fp32 -> low`). Autodiff then differentiates the rewritten
net: a Cast's gradient casts back (`CastGradient`), so the gradients of LOW ops are low, every param
gradient has its param's dtype (fp32 masters get fp32 gradients), and the all-reduce and the
optimizer update run in fp32. Shape inference sees the casts like any other op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from graphpar.core.dataflow import dataflow
from graphpar.core.ir import GradientSlice, NetDef, OperatorDef
from graphpar.core.naming import cast_name
from graphpar.core.schema import Precision, PrecisionRule, precision_rule
from graphpar.passes.common import make_op
from graphpar.passes.options import check_compute_dtype

if TYPE_CHECKING:
    from graphpar.passes.state import ModelView, ParallelState

LOW_DTYPES = ("bfloat16", "float16")
FP32 = "float32"
def _dtype_name(value: Any) -> str | None:
    """The float dtype name of a Cast's `to` or a fill's `dtype` argument; None if not a float dtype."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.").lower()
    codes = {1: FP32, 12: "float16", 14: "bfloat16"}  # Caffe2's TensorProto codes
    if isinstance(value, int) and not isinstance(value, bool):
        return codes.get(value)
    return {"float": FP32, "float32": FP32, "float16": "float16", "half": "float16", "bfloat16": "bfloat16"}.get(name)


def init_dtypes(init_net: NetDef) -> dict[str, str]:
    """The blobs an init net makes in a low dtype (PseudoFP16Initializer's params, fills with `dtype`)."""
    dtypes: dict[str, str] = {}
    for op in init_net.ops:
        rule = precision_rule(op.type)
        if rule.compute is Precision.CONVERT:
            made = rule.dtype or _dtype_name(op.args.get("to"))
        else:
            made = _dtype_name(op.args.get("dtype"))
        for blob in op.outputs:
            dtypes.pop(blob, None)
            if made in LOW_DTYPES:
                dtypes[blob] = made
    return dtypes


class _Rewriter:
    """Rewrites one net's ops in order, knowing each blob's dtype (absent: fp32 or not floating)."""

    def __init__(self, net: NetDef, low: str, dtypes: dict[str, str], taken: set[str]) -> None:
        self.low = low
        self.written = set(taken)  # the init net's blobs and earlier outputs: any other blob is fed
        self.input_casts: list[str] = []
        self.dtypes = dict(dtypes)
        self.taken = taken | {b for op in net.ops for b in (*op.inputs, *op.outputs)}
        self.casts: dict[tuple[str, str], str] = {}  # (blob, dtype) -> the blob holding it cast
        self.current: dict[str, str] = {}  # blob -> the blob holding its value after a redirected in-place op
        self.ops: list[OperatorDef] = []

    def dtype(self, blob: str) -> str:
        return self.dtypes.get(blob, FP32)

    def cast(self, blob: str, dtype: str, op: OperatorDef) -> str:
        """`blob` in `dtype`: itself, or the output of one Cast (added before `op` on first need)."""
        if self.dtype(blob) == dtype:
            return blob
        key = (blob, dtype)
        if key not in self.casts:
            name, k = cast_name(blob, dtype), 1
            while name in self.taken:
                name, k = f"{cast_name(blob, dtype)}_{k}", k + 1
            self.taken.add(name)
            self.ops.append(make_op("Cast", [blob], [name], op.device_option, to=dtype))
            self.casts[key] = name
            if blob not in self.written:
                self.input_casts.append(name)
            self._set(name, dtype)
        return self.casts[key]

    def _set(self, blob: str, dtype: str | None) -> None:
        self.dtypes.pop(blob, None)
        if dtype in LOW_DTYPES:
            self.dtypes[blob] = dtype

    def rewrite(self, op: OperatorDef) -> None:
        rule = precision_rule(op.type)
        inputs = [self.current.get(b, b) for b in op.inputs]
        governed = set(range(len(inputs)) if rule.inputs is None else (i for i in rule.inputs if i < len(inputs)))
        compute = self._compute_dtype(rule, op, [inputs[i] for i in sorted(governed)])
        new_inputs = []
        for i, blob in enumerate(inputs):
            if rule.compute is Precision.CONVERT:
                new_inputs.append(blob)
            elif i in governed and rule.compute is Precision.LOW:
                new_inputs.append(self.cast(blob, self.low, op))
            elif i in governed and rule.compute is Precision.FOLLOW and compute != FP32:
                new_inputs.append(blob)
            else:  # FP32 inputs, promoted FOLLOW inputs, inputs outside the rule: low ones go up
                new_inputs.append(self.cast(blob, FP32, op) if self.dtype(blob) in LOW_DTYPES else blob)
        outputs = [self._output(op, o, new_inputs) for o in op.outputs]
        for k, out in enumerate(outputs):
            self._set(out, compute if rule.outputs is None or k in rule.outputs else None)
        self.written.update(outputs)
        if new_inputs != list(op.inputs) or outputs != list(op.outputs):
            op = op.copy()
            op.inputs, op.outputs = new_inputs, outputs
        self.ops.append(op)

    def _compute_dtype(self, rule: PrecisionRule, op: OperatorDef, governed: list[str]) -> str | None:
        if rule.compute is Precision.LOW:
            return self.low
        if rule.compute is Precision.CONVERT:
            return rule.dtype or _dtype_name(op.args.get("to"))
        if rule.compute is Precision.FOLLOW:
            kinds = {self.dtype(b) for b in governed}
            return kinds.pop() if len(kinds) == 1 else FP32
        return FP32

    def _output(self, op: OperatorDef, out: str, new_inputs: list[str]) -> str:
        """The name an output is written to. An in-place output goes where its input's value now is
        (the Cast output, if that input was cast for this op); casts of the old value are forgotten."""
        holder = next((new_inputs[k] for k, blob in enumerate(op.inputs) if blob == out), None)
        for stale in [key for key, cast in self.casts.items() if {key[0], cast} & {out, holder}]:
            del self.casts[stale]
        if holder is None:
            self.current.pop(out, None)
            return out
        if holder != out:
            self.current[out] = holder
        return holder


def rewrite_net(net: NetDef, compute_dtype: str | None, dtypes: dict[str, str] | None = None,
                taken: set[str] | None = None) -> list[str]:
    """Rewrite `net`'s ops in place for `compute_dtype` (see the module docstring).

    Input: a forward net (no gradient ops yet); `dtypes` gives the blobs that exist before it in a
    low dtype (`init_dtypes`), every other blob is fp32 or not floating; `taken` are the blobs the
    init net makes (names the new casts avoid). Guarantees: every op runs in the dtype its rule says,
    with one Cast per (blob value, dtype) inserted before its first reader and no Cast of a Cast's
    output. Returns the casts of fed inputs (blobs neither `taken` nor written by an earlier op):
    like the inputs themselves, they need no gradient.
    """
    low = check_compute_dtype(compute_dtype)
    if low is None:
        return []
    rewriter = _Rewriter(net, low, dtypes or {}, taken or set())
    for op in net.ops:
        rewriter.rewrite(op)
    net.ops[:] = rewriter.ops
    return rewriter.input_casts


def convert_model(model: ModelView, compute_dtype: str) -> None:
    """Mixed precision for a plain ModelHelper: rewrite `model.net` (forward ops only) for `compute_dtype`.

    Call it after building the forward pass and before `model.AddGradientOperators(...)`; params stay
    fp32 masters (or fp16 with PseudoFP16Initializer). See docs/precision.md.

    Raises:
        ValueError: a bad compute_dtype, or a net that already has gradient ops.
    """
    net = model.net.Proto()
    if any(op.is_gradient_op for op in net.ops):
        raise ValueError(f"convert_model: net {net.name!r} already has gradient ops; call convert_model before "
                         f"AddGradientOperators")
    _rewrite_model(model, compute_dtype)


def _rewrite_model(model: ModelView, compute_dtype: str | None) -> None:
    init = model.param_init_net.Proto()
    casts = rewrite_net(model.net.Proto(), compute_dtype, init_dtypes(init), set(dataflow(init).first_write))
    model.add_input_casts(casts)


def mixed_precision(state: ParallelState) -> None:
    """Parallelize's pass: rewrite the train net for `options.compute_dtype`.

    Needs: every replica's forward ops, no gradient op yet. Guarantees: as `rewrite_net`; casts are
    on their reader's device, so each replica casts its own copies; the casts of fed inputs get no
    gradient (`ModelHelper.AddGradientOperators` treats them as the inputs).
    """
    _rewrite_model(state.model, state.options.compute_dtype)


def cast_gradients_down(state: ParallelState) -> None:
    """`allreduce_dtype`: all-reduce the fp32 dense gradients in a low dtype (as DDP's bf16/fp16 compression).

    Needs: grouped gradients, devices inferred, no gradient collective yet. Guarantees: each copy of an
    fp32 data-parallel dense gradient `g` is cast to `g_<low>` on its device, and `state.grouped` names
    the casts, so the all-reduce that follows sums those (half the bytes); `cast_gradients_up` casts the
    sums back into `g` before anything reads the gradients. Sparse gradients and those of low-precision
    params (already low) are left alone.
    """
    low, layout, net = state.options.allreduce_dtype, state.layout, state.model.net.Proto()
    if low is None:  # gradients all-reduced in their own dtype
        return
    lows = init_dtypes(state.model.param_init_net.Proto())
    params = {str(g): str(p) for p, g in state.model.param_to_grad.items()}
    for name in state.grad_names:
        group = state.grouped[name]
        if len(group) < 2 or any(isinstance(g, GradientSlice) or params.get(str(g)) in lows for g in group.values()):
            continue
        state.lowered[name] = dict(group)
        for device, grad in group.items():
            option = layout.option(device)
            net.ops.append(make_op("Cast", [str(grad)], [cast_name(str(grad), low)], option, to=low))
            group[device] = cast = cast_name(str(grad), low)
            state.blob_to_device[cast] = option


FP16_OVERFLOW = ("the float16 all-reduce (allreduce_dtype='float16') overflowed: a gradient or its sum is beyond "
                 "float16's 65504. Use allreduce_dtype='bfloat16' (float32's range), or a loss_scale ('dynamic' "
                 "skips such a step and backs off)")


def cast_gradients_up(state: ParallelState) -> None:
    """After the all-reduce: each low sum back into its fp32 gradient blob; `state.grouped` names those
    again. A float16 all-reduce without a loss scale (whose unscaling checks every gradient) gets one
    `CheckFinite` on the first replica's sums (every replica holds the same): float16 overflows above
    65504, where float32 gradients are finite, and would turn the params into inf; the run then stops
    before any update instead."""
    layout, net = state.layout, state.model.net.Proto()
    for name, original in state.lowered.items():
        for device, grad in original.items():
            net.ops.append(make_op("Cast", [str(state.grouped[name][device])], [str(grad)], layout.option(device),
                                   to=FP32))
        state.grouped[name] = original
    if state.lowered and state.options.allreduce_dtype == "float16" and state.options.loss_scale is None:
        sums = [str(original[layout.master]) for original in state.lowered.values()]
        net.ops.append(make_op("CheckFinite", sums, [], layout.option(layout.master), why=FP16_OVERFLOW))
