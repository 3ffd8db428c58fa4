"""Pass (`cpu_update_once`): CPU replicas update their params once, on the first device, and share them.

After the all-reduce every CPU replica holds the same summed gradient, param and optimizer state, so
N replicas running N identical updates (and copying the sum back to every replica) only multiply the
memory traffic. On replicas that are all CPU devices of one process this pass:

1. turns each Copy of a first-device blob back to the other replicas (the reducer's broadcast) into an
   `Alias` (the same tensor under the other name, no copy), unless an in-place update could write into
   that tensor;
2. replaces every update op of another replica (Trait.INPLACE_UPDATE, or an op rewriting in place a
   blob the run loads, such as plain SGD's `WeightedSum([p, one, g, lr], p)`) that provably computes
   what the first device's twin update computed by `Alias` ops binding its outputs (param, optimizer
   state, gradient) to the twin's outputs; from the second step on every replica reads the first
   device's tensors (which the twin updates in place, or replaces: the aliases rebind every step);
3. drops the other replicas' ops whose every output is overwritten before anything reads it (the
   weight decay feeding a replaced update, the broadcast of its gradient);
4. orders the hazard the names hide: from the second step on, `cpu_k/p` and `cpu_0/p` are one tensor
   that the first device's update changes in place, so every op reading `cpu_k/p` as it was loaded
   becomes a control input of that update (write-after-read through an alias).

"Provably computes the same" is value numbering: blobs get value ids (the init net's and the train
net's ops are numbered in order; an op with the same type, engine, arguments and input values as an
earlier one produces the same values, so per-replica iteration counters that start equal stay
equal; copies and aliases keep their input's value; random and collective ops always produce new
values), and the values a run starts with are assumed equal
only where the init net made them equal and one train-net run keeps them so (a fixpoint that splits
a class by the values a run leaves in it); blobs that the model's other nets write between steps
(the accumulate net) are assumed equal to nothing. Kernels are functional (docs/extending.md) and
run with the same thread count on every CPU replica, so equal values are equal bits.

Results are bit-identical to the option off: every replica's params, optimizer state and gradients.
The replicas' rebound state is listed in the net's `aliased_state` argument (kept by freeing runs;
a checkpoint that loaded it counts as read). A blob fed to one replica only (rather than to all, as
checkpoints and FinalizeAfterCheckpoint do) is overwritten by the first device's value at the next
update.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any

from graphpar.core.dataflow import Dataflow, dataflow, facts
from graphpar.core.ir import CPU, NetDef, OperatorDef
from graphpar.core.naming import ALIASED_STATE_ARG, KEEP_ARG, stripBlobName
from graphpar.core.schema import Trait, effects_of, has_trait
from graphpar.passes.common import DeviceLayout, make_op
from graphpar.passes.state import ParallelState

_FRESH = (Trait.RANDOM, Trait.COLLECTIVE, Trait.DISTRIBUTED)  # new values every time
_SIDE_EFFECTS = (Trait.INPLACE_UPDATE, Trait.COUNTER, Trait.COLLECTIVE, Trait.DISTRIBUTED, Trait.RANDOM)


class _Numbering:
    """Value ids: `fresh()` for a new value, `outputs(op, ids)` for an op's outputs (hash-consed)."""

    def __init__(self) -> None:
        self._next = itertools.count()
        self.table: dict[Hashable, tuple[int, tuple[int, ...]]] = {}  # op key -> (first op, output ids)
        self._copying: dict[str, bool] = {}  # op type -> whether its output 0 is input 0's value

    def fresh(self) -> int:
        return next(self._next)

    def outputs(self, index: int, op: OperatorDef, inputs: tuple[int, ...]) -> tuple[Hashable | None, tuple[int, ...]]:
        """(the op's key, or None for ops that always make new values; its output ids)."""
        if _copies(op, self._copying):
            return None, inputs
        key = _key(op, inputs)
        if key is None:
            return None, tuple(self.fresh() for _ in op.outputs)
        found = self.table.get(key)
        if found is None:
            found = self.table[key] = (index, tuple(self.fresh() for _ in op.outputs))
        return key, found[1]


def _copies(op: OperatorDef, memo: dict[str, bool]) -> bool:
    """Whether `op`'s one output is its one input's value (`Effects.same_value`: copies, aliases);
    `memo` keeps the answer per op type (these checks run once per op of big nets)."""
    if len(op.inputs) != 1 or len(op.outputs) != 1:
        return False
    found = memo.get(op.type)
    if found is None:
        found = memo[op.type] = (0, 0) in effects_of(op).same_value
    return found


def _frozen(value: Any) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    hash(value)
    return value


def _key(op: OperatorDef, inputs: tuple[int, ...]) -> Hashable | None:
    if any(has_trait(op, trait) for trait in _FRESH) or op.control_inputs:
        return None
    try:
        args = tuple(sorted((k, _frozen(v)) for k, v in op.args.items()))
    except TypeError:  # an argument that is not a plain value (a net, an object)
        return None
    return op.type, op.engine, args, len(op.outputs), inputs


def _number(net: NetDef, start: Mapping[str, int], numbering: _Numbering) -> tuple[dict[str, int], list]:
    """Number `net` from `start` (blob -> value id; an unknown blob gets a fresh id): (final ids, per op
    (key, output ids))."""
    current = dict(start)
    per_op = []
    for index, op in enumerate(net.ops):
        ids = []
        for blob in op.inputs:
            if blob not in current:
                current[blob] = numbering.fresh()
            ids.append(current[blob])
        key, outs = numbering.outputs(index, op, tuple(ids))
        per_op.append((key, outs))
        current.update(zip(op.outputs, outs))
    return current, per_op


def _analyze(init: NetDef, net: NetDef, flow: Dataflow, others: Collection[NetDef] = ()) -> tuple[list, _Numbering]:
    """Per op of `net` (whose facts are `flow`): (key, output ids), numbered from the values the init
    net leaves, keeping only the equalities between loaded blobs that a run of `net` preserves (a
    fixpoint); blobs that the model's `others` nets write (run between steps) are assumed equal to nothing."""
    loaded = flow.loads
    numbering = _Numbering()
    after_init, _ = _number(init, {}, numbering)
    unstable = {b for other in others for b in dataflow(other).writers}
    start = {blob: after_init[blob] for blob in loaded if blob in after_init and blob not in unstable}
    while True:
        numbering.table.clear()
        end, per_op = _number(net, start, numbering)
        classes: dict[int, list[str]] = {}
        for blob, value in start.items():
            classes.setdefault(value, []).append(blob)
        broken = [blobs for blobs in classes.values() if len({end[b] for b in blobs}) > 1]
        if not broken:
            return per_op, numbering
        for blobs in broken:  # split each class by the values a run leaves (partition refinement)
            split: dict[int, int] = {}
            start.update((b, split.setdefault(end[b], numbering.fresh())) for b in blobs)


def _inplace_written(op: OperatorDef) -> set[str]:
    """The blobs whose storage an in-place update op may write."""
    if not has_trait(op, Trait.INPLACE_UPDATE):
        return set()
    unwritten = effects_of(op).rebinds  # in-place inputs the kernel rebinds instead of writing
    outputs = set(op.outputs)
    return {b for k, b in enumerate(op.inputs) if b in outputs and k not in unwritten}


def _updates_state(op: OperatorDef, index: int, flow: Dataflow) -> bool:
    """Whether `op` (op `index` of the net whose facts are `flow`) updates state: an in-place update (not a
    counter), or an op that writes in place a blob it loads (that no earlier op writes)."""
    if has_trait(op, Trait.INPLACE_UPDATE):
        return not has_trait(op, Trait.COUNTER)
    return any(b in op.outputs and flow.last_write_before(b, index) is None for b in op.inputs) and not any(
        has_trait(op, trait) for trait in _SIDE_EFFECTS)


def update_once_on_cpu(net: NetDef, init: NetDef, layout: DeviceLayout, others: Collection[NetDef] = ()) -> int:
    """Rewrite `net` (CPU replicas' train net, `init` its param init net, `others` the model's nets
    that run between its steps) as the module docstring says; returns how many updates were replaced."""
    master = layout.master
    flow = dataflow(net)  # of the net before the rewrite
    per_op, numbering = _analyze(init, net, flow, others)
    ops = net.ops

    def replica(op: OperatorDef) -> int | None:
        device = net.op_device(op)
        return device.device_id if device.device_type == CPU else None

    # 2. updates of other replicas that compute what an earlier first-device update computed (and whose
    # twin's outputs are still the twin's when they run)
    replaced: dict[int, int] = {}  # replica update -> its first-device twin
    for j, op in enumerate(ops):
        key = per_op[j][0]
        if key is not None and replica(op) not in (None, master) and _updates_state(op, j, flow):
            twin = numbering.table[key][0]
            if twin != j and replica(ops[twin]) == master and \
                    all(flow.last_write_before(b, j) == twin for b in ops[twin].outputs):
                replaced[j] = twin
    while True:
        rewritten, aliases = _rewrite(net, replaced, layout, replica)
        after = facts(rewritten)
        position = {id(op): i for i, op in enumerate(rewritten)}
        unsafe = [j for j in replaced if not _safe(rewritten, after, position, ops[replaced[j]], aliases[j])]
        if not unsafe:
            break
        for j in unsafe:
            del replaced[j]
    for j, twin in replaced.items():  # 4.
        _order_after_readers(rewritten, after, ops[twin], set(ops[j].outputs))
    net.ops = rewritten
    # the replicas' optimizer state is now written, not read: keep it (a freeing run would drop it),
    # and a checkpoint that loaded it is not thrown away (it is the first device's, as every replica's)
    state = sorted({b for j in replaced for b in ops[j].outputs} & set(flow.loads))
    net.args[KEEP_ARG] = list(dict.fromkeys([*net.args.get(KEEP_ARG, ()), *state]))
    net.args[ALIASED_STATE_ARG] = state
    return len(replaced)


def _rewrite(net: NetDef, replaced: Mapping[int, int], layout: DeviceLayout,
             replica: Any) -> tuple[list[OperatorDef], dict[int, list[OperatorDef]]]:
    """The ops of `net` with `replaced` updates turned into aliases of their twins' outputs (1.-3.);
    and per replaced update, its aliases."""
    ops, master = net.ops, layout.master
    aliases = {j: [make_op("Alias", [src], [dst], ops[j].device_option)
                   for src, dst in zip(ops[twin].outputs, ops[j].outputs)] for j, twin in replaced.items()}
    written_in_place = set().union(*(_inplace_written(op) for j, op in enumerate(ops) if j not in replaced))
    copying: dict[str, bool] = {}
    flat: list[OperatorDef] = []
    for j, op in enumerate(ops):
        if j in aliases:
            flat.extend(aliases[j])
        elif _copies(op, copying) and replica(op) not in (None, master) and \
                layout.replica_of(op.inputs[0]) == master and layout.replica_of(op.outputs[0]) == replica(op) and \
                stripBlobName(op.inputs[0]) == stripBlobName(op.outputs[0]) and \
                not written_in_place.intersection((op.inputs[0], op.outputs[0])):
            flat.append(make_op("Alias", op.inputs, op.outputs, op.device_option))
        else:
            flat.append(op)
    return _without_dead(flat, set(net.external_outputs), lambda op: replica(op) not in (None, master)), aliases


def _writers_in_place(ops: list[OperatorDef], flow: Dataflow, blobs: set[str]) -> set[int]:
    """The ops (of `ops`, whose facts are `flow`) that may write one of `blobs`' tensors in place."""
    return {i for b in blobs for i in flow.writers.get(b, ()) if b in _inplace_written(ops[i])}


def _loaded_readers(flow: Dataflow, blobs: set[str]) -> set[int]:
    return {i for b in blobs for i in flow.loaded_readers(b)}


def _touched_between(positions: Mapping[str, Sequence[int]], blobs: set[str], start: int, stop: int) -> bool:
    """Whether an op strictly between positions `start` and `stop` is among `positions` of `blobs` (a
    fact of `Dataflow`: its readers or writers)."""
    for blob in blobs:
        found = positions.get(blob, ())
        k = bisect.bisect_right(found, start)
        if k < len(found) and found[k] < stop:
            return True
    return False


def _safe(ops: list[OperatorDef], flow: Dataflow, position: Mapping[int, int], twin: OperatorDef,
          aliases: list[OperatorDef]) -> bool:
    """Whether, in the rewritten `ops`, a replaced update's aliases see what it would have computed and
    no op can see its blobs change under it: no op between the twin and the aliases writes the twin's
    outputs or touches the aliased blobs (reads are fine when the twin never writes its tensors in
    place), and every op reading an aliased blob as loaded comes before every update writing the
    twin's tensors in place (so control inputs can order it)."""
    start, stop = position[id(twin)], position[id(aliases[0])]
    blobs, shared = {a.outputs[0] for a in aliases}, set(twin.outputs)
    # a twin that never writes its inputs' tensors (it makes new ones, or reuses one only where no
    # other name holds it: never once aliased) leaves the aliased names their old values until the
    # aliases run
    mutates = bool(_inplace_written(twin))
    if (mutates and _touched_between(flow.readers, blobs, start, stop)) or \
            _touched_between(flow.writers, blobs | shared, start, stop):
        return False
    first_mutator = min(_writers_in_place(ops, flow, shared), default=len(ops))
    return all(r < first_mutator for r in _loaded_readers(flow, blobs))


def _order_after_readers(ops: list[OperatorDef], flow: Dataflow, twin: OperatorDef, blobs: set[str]) -> None:
    """Give every update writing `twin`'s tensors in place a control input on each op (before it, as
    `_safe` checked) that reads one of `blobs` as loaded: the reader's first output, whose last writer
    before the update is the reader or an op after it."""
    readers = sorted(_loaded_readers(flow, blobs))
    for position in sorted(_writers_in_place(ops, flow, set(twin.outputs))):
        update = ops[position]
        for r in readers:
            first = ops[r].outputs[0]
            if first not in update.control_inputs:
                update.control_inputs.append(first)


def _without_dead(ops: list[OperatorDef], keep: set[str], removable: Any) -> list[OperatorDef]:
    """`ops` without the `removable` ops free of side effects whose every output is written again
    before anything reads it (from the last op back: removing an op can kill the ops feeding it)."""
    flow = facts(ops)
    dead: set[int] = set()
    for j in range(len(ops) - 1, -1, -1):
        op = ops[j]
        if removable(op) and op.outputs and not any(has_trait(op, t) for t in _SIDE_EFFECTS) and \
                all(b not in keep and _overwritten_unread(flow, b, j, dead) for b in op.outputs):
            dead.add(j)
    return [op for j, op in enumerate(ops) if j not in dead]


def _overwritten_unread(flow: Dataflow, blob: str, index: int, dead: Collection[int]) -> bool:
    """Whether an op after op `index` writes `blob` before any op (but the `dead` ones) reads it or waits
    on it (an op reading and writing it reads it first)."""
    def next_live(positions: Sequence[int]) -> int | None:
        k = bisect.bisect_right(positions, index)
        while k < len(positions) and positions[k] in dead:
            k += 1
        return positions[k] if k < len(positions) else None

    write = next_live(flow.writers.get(blob, ()))
    if write is None:
        return False
    uses = (next_live(flow.readers.get(blob, ())), next_live(flow.waiters.get(blob, ())))
    return all(use is None or write < use for use in uses)


def update_once(state: ParallelState) -> None:
    """`update_once_on_cpu` on the train net (CPU replicas of one process, not a shared model)."""
    others = [] if state.accumulate_net is None else [state.accumulate_net.Proto()]
    update_once_on_cpu(state.model.net.Proto(), state.model.param_init_net.Proto(), state.layout, others)
