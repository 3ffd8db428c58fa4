"""Pass (`shard_optimizer_state`, ZeRO stage 1; stage 2 with `shard_gradients`): each replica updates
only its part of every param, with its part of the optimizer state; then the params are all-gathered.

The optimizer records its updates as usual (`build_updates`); this pass rewrites them. Per replica and
param p with gradient g, every update op that works element by element (`Effects.elementwise`) and
touches p, g or a blob such an op wrote runs on parts instead: each of its tensor inputs and outputs
becomes `<blob>_shard`, the replica's part (`passes.shards`); scalar inputs (learning rate, counters,
weights) stay. A tensor input that is none of these must be optimizer state: a blob the optimizer
created in param_init_net with a fill that draws no random numbers, which is rewritten to fill the
part only (a replica holds 1/N of the state). The parts of p, and in stage 1 of the all-reduced g, are
cut at the start of the updates (`FlattenToVec`, `Slice`); stage 2's parts of g come from the
reduce-scatter (`passes.reduce_scatter`). After the updates, the reducer gathers every updated param's
parts back into each replica's param (`Reducer.gather_shards`).

An update op that is not element-wise may still read blobs that are whole and current: p before its
update and, in stage 1, the all-reduced g before an element-wise op rewrote it (LARS, gradient
clipping's norm). Anything else raises ParallelizeError naming the op, before the model changes
(Parallelize restores it): reading a blob that only parts hold now (stage 2's gradients among them),
writing a param-shaped blob whole, mixing two params' blobs, state created another way, a param
updated on some replicas only.

Element-wise kernels give the same bits on a part as on the whole (tests/ops/test_elementwise.py), so
the sharded params equal the unsharded run's whenever the gradients are the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.naming import flat_name, shard_name, stripBlobName
from graphpar.core.schema import Trait, effects_of, has_trait
from graphpar.core.shapes import infer_specs
from graphpar.errors import ParallelizeError
from graphpar.passes.common import make_op
from graphpar.passes.shards import Sharding
from graphpar.passes.state import ParallelState

_WHERE = "Parallelize(shard_optimizer_state=True)"


def shard_updates(state: ParallelState) -> None:
    """Rewrite the update ops onto each replica's parts, cut the parts they read, gather the params.

    Input: `build_updates` recorded the updates after `state.updates_start`; the gradients are
    all-reduced (stage 1) or reduce-scattered (stage 2, `state.sharding.grads`). Guarantees: every
    element-wise update of a param runs on parts; every sharded optimizer state blob exists only as
    its parts (`state.sharding.state` names them; the train net neither reads nor declares it whole);
    each updated param is whole again on every replica at the end of the train net.

    Raises:
        ParallelizeError: an update that sharding cannot split (see the module docstring).
    """
    sharding = state.sharding
    if sharding is None:
        return
    net, init = state.model.net.Proto(), state.model.param_init_net.Proto()
    init_start, start = state.updates_start
    rewrite = _Rewrite(state, sharding, init.ops[init_start:])
    updates = [rewrite.op(op) for op in net.ops[start:]]
    rewrite.check_done([*net.ops[:start], *updates], init)
    net.ops[start:] = [*rewrite.cuts(), *updates, *rewrite.gathers()]
    # the Net builder declared each state blob an input of the net when the optimizer recorded its update;
    # no op reads it whole now, and a declared input a run does not read would look like fed data
    net.external_inputs = [b for b in net.external_inputs if b not in rewrite.state_fills]
    rewrite.fill_parts(init)


class _Rewrite:
    """The rewrite of one train net's updates (see the module docstring)."""

    def __init__(self, state: ParallelState, sharding: Sharding, init_ops: Iterable[OperatorDef]) -> None:
        self.state, self.sharding, self.layout = state, sharding, state.layout
        self.owner: dict[str, tuple[str, int]] = {}  # a whole blob of ours -> (its unscoped param, device)
        self.cut: dict[str, None] = {}  # whole blobs whose parts are cut before the updates, in order
        self.parted: set[str] = set()  # whole blobs whose part exists (written, cut, state, reduce-scattered)
        self.stale: set[str] = set()  # whole blobs whose current value only their parts hold
        self.state_fills: dict[str, OperatorDef] = {}  # sharded state blob -> the fill that creates it
        self.updated: dict[str, set[int]] = {}  # param -> devices whose part of it was updated
        self.unsummed: set[str] = set()  # stage 2: each replica's own gradients (only their parts are summed)
        self.writers: dict[str, list[OperatorDef]] = {}
        for op in init_ops:
            for blob in op.outputs:
                self.writers.setdefault(blob, []).append(op)
        for grad, param in sharding.param_of_grad.items():
            for device in self.layout.devices:
                self.owner[self.layout.scoped(device, param)] = (param, device)
                self.owner[str(state.grouped[grad][device])] = (param, device)
        for grad, parts in sharding.grads.items():  # stage 2: the gradients' parts are the sums; wholes are not
            for device in parts:
                whole = str(state.grouped[grad][device])
                self.parted.add(whole)
                self.stale.add(whole)
                self.unsummed.add(whole)

    # ---- one op

    def op(self, op: OperatorDef) -> OperatorDef:
        """`op` on parts, `op` itself when it touches no blob of ours; raises for what cannot be split."""
        ours = [b for b in (*op.inputs, *op.outputs) if b in self.owner]
        rule = effects_of(op).elementwise
        if rule is None:
            if ours:
                self._check_whole(op)
            return op
        if not ours:
            return op
        owners = {self.owner[b] for b in ours}
        if len(owners) > 1:
            raise ParallelizeError(f"{_WHERE}: {_label(op)} mixes blobs of {sorted(owners)} (param, device); an "
                                   f"element-wise update reads one param's blobs on one replica")
        param, device = owners.pop()
        tensors, rewritten = set(rule.of(len(op.inputs))), op.copy()
        for i, blob in enumerate(op.inputs):
            if i not in tensors:
                if blob in self.owner:
                    raise ParallelizeError(f"{_WHERE}: {_label(op)} reads {blob!r}, shaped like param {param!r}, as "
                                           f"a scalar input; it cannot be cut into parts")
                continue
            if blob not in self.owner:
                self._adopt_state(op, blob, param, device)
            if blob not in self.parted:
                self.cut[blob] = None
                self.parted.add(blob)
            rewritten.inputs[i] = shard_name(blob)
        for k, blob in enumerate(op.outputs):
            if self.owner.setdefault(blob, (param, device)) != (param, device):
                raise ParallelizeError(f"{_WHERE}: {_label(op)} writes {blob!r}, a blob of another param or "
                                       f"replica {self.owner[blob]}")
            self.parted.add(blob)
            self.stale.add(blob)
            rewritten.outputs[k] = shard_name(blob)
        if self.layout.scoped(device, param) in op.outputs:
            self.updated.setdefault(param, set()).add(device)
        return rewritten

    def _check_whole(self, op: OperatorDef) -> None:
        """An op that is not element-wise may read our blobs while they are whole and current."""
        stale = [b for b in op.inputs if b in self.stale]
        if stale:
            blob = stale[0]
            if blob in self.unsummed:
                why, fix = ("with shard_gradients=True only each replica's part of the summed gradient exists",
                            "shard_gradients=False (whole summed gradients)")
            elif blob in self.state_fills:
                why, fix = "it is optimizer state, of which each replica keeps only its part", "no state sharding"
            else:
                why, fix = ("an element-wise update before it wrote only each replica's part of it",
                            "no state sharding")
            raise ParallelizeError(
                f"{_WHERE}: {_label(op)} reads the whole of {blob!r}, but {why}; {op.type} does not work element "
                f"by element (Effects.elementwise), so it cannot run on parts. Use {fix} "
                f"(shard_optimizer_state=False), or an optimizer without it (LARS and gradient clipping read "
                f"whole gradients)")
        written = [b for b in op.outputs if b in self.owner]
        if written:
            raise ParallelizeError(f"{_WHERE}: {_label(op)} writes {written[0]!r} whole, but {op.type} does not work "
                                   f"element by element (Effects.elementwise), so it cannot update parts; use "
                                   f"shard_optimizer_state=False for this optimizer")

    def _adopt_state(self, op: OperatorDef, blob: str, param: str, device: int) -> None:
        """Take `blob`, a tensor input of an element-wise update of `param`, as optimizer state to shard."""
        writers = self.writers.get(blob, [])
        fill = writers[0] if len(writers) == 1 else None
        whole_param = self.layout.scoped(device, param)
        if fill is None or not (self.layout.replica_of(blob) == device and has_trait(fill, Trait.FILL)
                                and not has_trait(fill, Trait.RANDOM) and not fill.args.get("input_as_shape")
                                and not fill.args.get("extra_shape") and set(fill.inputs) <= {whole_param}):
            made = (f"created by {len(writers)} ops" if len(writers) > 1 else
                    f"created by {_label(fill)}" if fill is not None else
                    "not created by the update builder in param_init_net")
            raise ParallelizeError(
                f"{_WHERE}: {_label(op)} updates {blob!r} with param {whole_param!r} element by element, so it "
                f"is optimizer state to shard, but it is {made}; sharded state must be created, on its "
                f"replica, by one fill that draws no random numbers (e.g. ConstantFill([param], state, "
                f"value=0.0)), so each replica can fill its own part. Use shard_optimizer_state=False for "
                f"this optimizer")
        self.owner[blob] = (param, device)
        self.parted.add(blob)
        self.stale.add(blob)
        self.state_fills[blob] = fill

    # ---- after every op

    def check_done(self, train_ops: Iterable[OperatorDef], init: NetDef) -> None:
        """Nothing but the rewritten updates reads the sharded state whole, and each updated param is
        updated on every replica."""
        fills = {id(op) for op in self.state_fills.values()}
        for op in [*train_ops, *(op for op in init.ops if id(op) not in fills)]:
            for blob in (*op.inputs, *op.outputs, *op.control_inputs):
                if blob in self.state_fills:
                    raise ParallelizeError(f"{_WHERE}: {_label(op)} uses optimizer state {blob!r} whole, but "
                                           f"sharding keeps only each replica's part of it (an update reading it "
                                           f"must work element by element); use shard_optimizer_state=False")
        for param, devices in self.updated.items():
            if len(devices) != len(self.layout.devices):
                raise ParallelizeError(f"{_WHERE}: param {param!r} is updated on devices {sorted(devices)} only; "
                                       f"sharded updates need every replica to update it")

    def cuts(self) -> list[OperatorDef]:
        """The parts the updates read before any op wrote them: `FlattenToVec`, `Slice` per blob."""
        ops = []
        for blob in self.cut:
            param, device = self.owner[blob]
            start, end = self.sharding.bounds(param, self.layout.devices.index(device))
            option = self.layout.option(device)
            ops += [make_op("FlattenToVec", [blob], [flat_name(blob)], option),
                    make_op("Slice", [flat_name(blob)], [shard_name(blob)], option, starts=[start], ends=[end])]
        return ops

    def gathers(self) -> list[OperatorDef]:
        """Every updated param gathered whole onto every replica, in param creation order."""
        ops, layout = [], self.layout
        for param in self.sharding.sizes:
            if param in self.updated:
                wholes = [layout.scoped(d, param) for d in layout.devices]
                ops += self.state.reducer.gather_shards(param, [shard_name(b) for b in wholes], wholes,
                                                        self.sharding.sizes[param], self.sharding.shapes[param])
        return ops

    def fill_parts(self, init: NetDef) -> None:
        """Each sharded state blob's fill fills only its replica's part (same value, dtype and device);
        `sharding.state` names them."""
        specs = infer_specs(init, wanted=list(self.state_fills))
        position = {id(op): i for i, op in enumerate(init.ops)}
        for blob, fill in self.state_fills.items():
            param, device = self.owner[blob]
            spec = specs.get(blob)
            if spec is None or tuple(spec.shape) != self.sharding.shapes[param]:
                raise ParallelizeError(f"{_WHERE}: optimizer state {blob!r} is not shaped like its param "
                                       f"{self.layout.scoped(device, param)!r}; it cannot be cut into its parts")
            start, end = self.sharding.bounds(param, self.layout.devices.index(device))
            args = {**fill.args, "shape": [end - start], "dtype": str(spec.dtype).removeprefix("torch.")}
            part = make_op(fill.type, [], [shard_name(blob)], fill.device_option, fill.name, **args)
            init.ops[position[id(fill)]] = part
            self.sharding.state[stripBlobName(blob)] = param


def _label(op: OperatorDef) -> str:
    where = f" (recorded at {op.source})" if op.source else ""
    return f"{op.type}({', '.join(op.inputs)} -> {', '.join(op.outputs)}){where}"
