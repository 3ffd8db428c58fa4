"""Reverse-mode automatic differentiation over the IR (Caffe2's `core.IR.GetBackwardPass`).

`backward_pass(forward_ops, ys)` follows Caffe2's algorithm and blob names:

1. Replay the forward ops in SSA form: every read records the blob's current version, every write
   bumps it (a name first seen as an input is version 0, so its first write makes version 1).
2. Seed each y with `ConstantFill([y], [y_grad], value=1.0)` (shaped like y), or with the blob the
   caller gives. Caffe2 named the automatic seed `y_autogen_grad`; graphpar uses `y_grad` (SPEC §4).
3. Walk the ops in reverse. An op none of whose outputs has a gradient is skipped; otherwise its
   schema's gradient maker returns gradient ops and one gradient per input. Every blob a gradient op
   reads is checked: a forward value must still hold the version the forward op read or wrote,
   otherwise a later op overwrote it and the gradient would be silently wrong, so GradientError.
4. A blob version read by several ops gets one partial gradient per reader ("generators"). When the
   walk reaches the earliest reader, the first gradient op keeps `x_grad`, later ones are renamed
   `_x_grad_autosplit_k`, pass-through gradients (Sum, Alias) join as they are, and one `Sum` into
   `x_grad` is emitted after that reader's gradient ops. Sparse gradients (GradientSlice) are
   concatenated instead (`Concat`, axis 0, no deduplication), as in Caffe2.

Where graphpar deliberately differs from Caffe2 (each difference has a test):
- An in-place op whose gradient reads its *input* (SpatialBN or Mul in place) raises: the check knows
  which forward position a gradient op's input came from, not just its name (Caffe2 took the output's).
- Gradient blobs are never overwritten while a gradient that a later gradient op still reads lives in
  them. Caffe2 reused names, so a pass-through gradient (an in-place residual `Sum`, or a `Sum` whose
  output name is written twice) could be clobbered silently: such a write now goes to a fresh
  `_x_grad_autosplit_k` blob. The `k` of these names counts per gradient name over the whole pass (Caffe2
  restarted it at every Sum), so two of them never share a name.
- The gradient map holds one version's gradient per name; a version whose readers produced no
  gradient gets None, where Caffe2 handed its writer the later version's gradient (which a
  pass-through maker such as Alias then propagated silently).
- An op reading one blob at several positions (Mul(x, x)) gets every position's gradient summed
  (Caffe2 kept only the last one written).
- A seed blob given in `ys` is accumulated with the gradients from y's other readers (Caffe2 silently
  dropped it), and never overwritten when the caller feeds it.
- Blobs are visited in input order, never set order, so the emitted ops are reproducible.

Unwanted gradients (`no_gradient_to`, e.g. the data and labels fed from outside, as PyTorch leaves
inputs without gradient) are removed after the walk by dead-gradient elimination over the emitted ops:
a gradient blob is live if it is the final gradient of a wanted blob (every blob in the map but the
unwanted ones) or a later live gradient op reads it; a gradient op with no live output is dropped. A
live op's dead last output is dropped when its schema has Caffe2's `no_gradient_to_input` argument
(FCGradient, ConvGradient: that output is dX, which the kernel then skips). So only gradients that
flow solely into unwanted blobs disappear; an intermediate's gradient (Caffe2's tests read
`tanh_grad`) is kept. An op without a gradient maker (or not differentiable) that reads only values
computed from unwanted blobs and constants (a `brew.cond` preprocessing the data) stops the gradient
where it would otherwise raise: nothing it could pass on is wanted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphpar.core.ir import BlobReference, DeviceOption, GradientSlice, OperatorDef, same_device
from graphpar.core.naming import autosplit_grad_name, grad_name
from graphpar.core.schema import NO_GRADIENT, NOT_DIFFERENTIABLE, check_operator, get_schema, stops_gradient
from graphpar.errors import GradientError

Gradient = str | GradientSlice | None
Maker = Callable[[OperatorDef, list], tuple[list, list]]

_PROBE = "\x00autodiff-probe:"  # prefix of the stand-in names used to tell an input from an output
NO_GRADIENT_TO_INPUT = "no_gradient_to_input"  # Caffe2's argument: a gradient op omits its last output, dX


def backward_pass(forward_ops: Sequence[OperatorDef], ys: Sequence[str] | dict[str, Any],
                  no_gradient_to: Iterable[str] = ()) -> tuple[list[OperatorDef], dict]:
    """The gradient ops of `forward_ops` for the outputs `ys`, and the map of every gradient.

    Args:
        forward_ops: the recorded forward ops, in program order (they are not modified).
        ys: a list of blobs, each seeded with ones (`ConstantFill([y], [y_grad], value=1.0)` on the
            device of the op that wrote y), or a dict `{y: seed}` where the seed is a gradient blob
            name, a GradientSlice, or None for the automatic ones.
        no_gradient_to: blobs whose gradients nobody wants (e.g. data and labels). They get no map
            entry, and the gradient computation that serves only them is eliminated (module docstring).

    Returns:
        `(grad_ops, grad_map)`: the gradient ops to append to the net (seed fills first, then the
        gradient ops in reverse forward order with the accumulating `Sum`s/`Concat`s in place), and a
        dict from every blob that received a gradient to its gradient (a BlobReference or a
        GradientSlice of BlobReferences). As in Caffe2 the map is by name: a blob written several
        times maps to the gradient of its earliest version that received one, and the entry of an
        intermediate blob may name a gradient blob that later gradient ops reuse.

    Raises:
        GradientError: a y that no forward op writes; a gradient reaching an op that is not
            differentiable or has no gradient maker; a gradient op that would read a value a later op
            (or the op itself, in place) overwrote; a version of a blob that nothing reads while a
            later version of it receives a gradient (two ops writing one name by mistake); a
            StopGradient whose output nothing reads; partial gradients of one blob that mix dense and
            sparse or live on different devices; a gradient maker that breaks its contract.
        TypeError: `ys` is neither a list nor a dict, a seed is not a blob name or GradientSlice, or
            `no_gradient_to` is not a list of blob names.
        ValueError, TypeError: a gradient op that does not fit its schema (raised by check_operator,
            naming the forward op).
    """
    unwanted = _blob_names(no_gradient_to)
    backward = _BackwardPass(list(forward_ops), _fed_only(forward_ops, unwanted))
    grad_ops = backward.seed(ys)
    for index in reversed(range(len(backward.ops))):
        grad_ops += backward.differentiate(index)
        grad_ops += backward.accumulate(index)
    grad_map = backward.grad_map()
    if not unwanted:
        return grad_ops, grad_map
    grad_map = {blob: g for blob, g in grad_map.items() if blob not in unwanted}
    return eliminate_dead_gradients(grad_ops, [part for g in grad_map.values() for part in _parts(g)]), grad_map


def _fed_only(ops: Sequence[OperatorDef], unwanted: set[str]) -> frozenset[int]:
    """The ops all of whose inputs hold values computed from unwanted blobs (data, labels) and constants
    alone: no gradient they could pass on is wanted, so one without a gradient maker (an `If` choosing
    how to preprocess the data) stops the gradient instead of raising."""
    if not unwanted:
        return frozenset()
    derived: set[str] = set()  # blobs whose current value comes from unwanted blobs alone
    written: set[str] = set()
    found = []
    for index, op in enumerate(ops):
        fed = all(b in derived if b in written else b in unwanted for b in op.inputs)  # a fill: a constant
        if fed:
            found.append(index)
        for blob in op.outputs:
            written.add(blob)
            (derived.add if fed else derived.discard)(blob)
    return frozenset(found)


def eliminate_dead_gradients(grad_ops: Sequence[OperatorDef], wanted: Iterable[str]) -> list[OperatorDef]:
    """The gradient ops needed to compute the final values of the `wanted` blobs.

    One reverse sweep: an op is kept if it writes a blob that is live after it (wanted at the end, or
    read by a later kept op before being overwritten); a kept op's dead last output is dropped when its
    schema takes `no_gradient_to_input` (the op then skips computing dX). Ops without outputs are kept.
    The kept ops are modified in place and returned in program order.
    """
    live = set(wanted)
    kept = []
    for grad_op in reversed(grad_ops):
        if grad_op.outputs and not live.intersection(grad_op.outputs):
            continue
        if grad_op.outputs[-1:] and grad_op.outputs[-1] not in live and _can_drop_input_gradient(grad_op):
            grad_op.outputs = grad_op.outputs[:-1]
            grad_op.args = {**grad_op.args, NO_GRADIENT_TO_INPUT: True}
        live.difference_update(grad_op.outputs)
        live.update(grad_op.inputs)
        live.update(grad_op.control_inputs)
        kept.append(grad_op)
    return kept[::-1]


def _can_drop_input_gradient(grad_op: OperatorDef) -> bool:
    return NO_GRADIENT_TO_INPUT in get_schema(grad_op.type).args and not grad_op.args.get(NO_GRADIENT_TO_INPUT)


def _blob_names(blobs: Iterable[str]) -> set[str]:
    if isinstance(blobs, str) or not isinstance(blobs, Iterable):
        raise TypeError(f"no_gradient_to must be a list of blob names, got {type(blobs).__name__} {blobs!r}")
    names = set()
    for blob in blobs:
        if not isinstance(blob, str):
            raise TypeError(f"no_gradient_to must hold blob names, got {type(blob).__name__} {blob!r}")
        names.add(str(blob))
    return names


def _parts(gradient: str | GradientSlice) -> list[str]:
    """The blob names a gradient consists of: one dense blob, or a slice's indices and values."""
    return [gradient.indices, gradient.values] if isinstance(gradient, GradientSlice) else [gradient]


def _as_gradient(value: Any, where: str) -> Gradient:
    """A maker's or caller's gradient as a plain str, a GradientSlice of plain strs, or None."""
    if value is None:
        return None
    if isinstance(value, str):
        return str(value)
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return GradientSlice(str(value[0]), str(value[1]))
    raise TypeError(f"{where}: a gradient must be a blob name, a GradientSlice or None, got {value!r}")


def _replace(gradient: Gradient, old: str, new: str) -> Gradient:
    if isinstance(gradient, GradientSlice):
        return GradientSlice(*(new if b == old else b for b in gradient))
    return new if gradient == old else gradient


def _rename_in(grad_ops: list[OperatorDef], old: str, new: str) -> None:
    """Rename every write of `old` by these gradient ops, and every read after the first write.

    A read before the first write (an in-place ReluGradient reading its output's gradient) is of
    the blob that already existed, so it keeps its name.
    """
    written = False
    for grad_op in grad_ops:
        if written:
            grad_op.inputs = [new if b == old else b for b in grad_op.inputs]
        written = written or old in grad_op.outputs
        grad_op.outputs = [new if b == old else b for b in grad_op.outputs]


@dataclass
class _Generator:
    """One partial gradient of a blob version (Caffe2's GradGenMeta / SparseGradGenMeta).

    `writers[p]` is the gradient op and output slot writing part p of `gradient` (one part when dense;
    indices and values when sparse), or None when the forward op passes an existing blob through.
    `grad_ops` are all the gradient ops of that forward op, renamed together with the writer.
    """

    gradient: str | GradientSlice
    writers: list[tuple[OperatorDef, int] | None]
    device: DeviceOption | None
    grad_ops: list[OperatorDef] = field(default_factory=list)

    def part_name(self, p: int) -> str:
        writer = self.writers[p]
        return writer[0].outputs[writer[1]] if writer else _parts(self.gradient)[p]


class _BackwardPass:
    """The SSA replay of the forward ops and the state of the reverse walk over them."""

    def __init__(self, ops: list[OperatorDef], fed_only: frozenset[int] = frozenset()) -> None:
        for i, op in enumerate(ops):
            if not isinstance(op, OperatorDef):
                raise TypeError(f"forward op #{i} must be an OperatorDef, got {type(op).__name__}")
        self.ops = ops
        self.fed_only = fed_only  # ops reading only values computed from unwanted blobs (`_fed_only`)
        self.ssa: list[tuple[dict[str, int], dict[str, int]]] = []  # (input versions, output versions)
        self.frontier: dict[str, int] = {}  # blob -> its final forward version
        self.writer_of: dict[tuple[str, int], int] = {}  # (blob, version) -> the op that wrote it
        self.usages: dict[tuple[str, int], list[int]] = defaultdict(list)  # (blob, version) -> readers
        self.grads: dict[str, Gradient] = {}  # blob -> gradient of version grad_version[blob]
        self.grad_version: dict[str, int] = {}
        self.holders: dict[str, set[tuple[str, int]]] = defaultdict(set)  # gradient blob -> the blob
        # versions whose gradient (or a partial gradient awaiting accumulation) it ever held
        self.generators: dict[tuple[str, int], list[_Generator]] = defaultdict(list)
        self.split_count: dict[str, int] = defaultdict(int)
        self.fresh: set[str] = set()  # gradient blob names made unique by this pass
        self.fed_seeds: set[str] = set()  # seed blobs no forward op writes (fed by the caller)
        for index, op in enumerate(ops):
            self._play(index, op)
        self._check_stop_gradients()

    def _play(self, index: int, op: OperatorDef) -> None:
        in_versions = {}
        for blob in op.inputs:
            in_versions[blob] = self.frontier.setdefault(blob, 0)
            self.usages[(blob, in_versions[blob])].append(index)
        out_versions = {}
        for blob in op.outputs:
            self.frontier[blob] = self.frontier[blob] + 1 if blob in self.frontier else 0
            out_versions[blob] = self.frontier[blob]
            self.writer_of[(blob, out_versions[blob])] = index
        self.ssa.append((in_versions, out_versions))

    def _check_stop_gradients(self) -> None:
        read = {blob for op in self.ops for blob in op.inputs}
        for index, op in enumerate(self.ops):
            if stops_gradient(op) and op.outputs and op.outputs[0] not in read:
                raise GradientError(
                    f"{self._describe(index)}: its output {op.outputs[0]!r} is never read, so it stops "
                    f"no gradient. Run it in place (StopGradient({op.inputs[0]!r}, {op.inputs[0]!r})) or "
                    f"read {op.outputs[0]!r} instead of {op.inputs[0]!r} downstream.")

    def _written(self, blob: str) -> bool:
        """Whether some forward op writes `blob`."""
        return (blob, self.frontier.get(blob, -1)) in self.writer_of

    def _describe(self, index: int) -> str:
        op = self.ops[index]
        where = f" recorded at {op.source}" if op.source else ""
        return f"forward op #{index} {op.type}{where}"

    def _history(self, blob: str) -> str:
        lines = []
        for index, (in_versions, out_versions) in enumerate(self.ssa):
            if blob in in_versions:
                lines.append(f"  version {in_versions[blob]} read by {self._describe(index)}")
            if blob in out_versions:
                lines.append(f"  version {out_versions[blob]} written by {self._describe(index)}")
        return f"Version history of {blob!r}:\n" + "\n".join(lines)

    # -- the gradient map ----------------------------------------------------------------------

    def _set_gradient(self, blob: str, gradient: Gradient, version: int) -> None:
        self.grads[blob] = gradient
        if gradient is not None:
            self.grad_version[blob] = version
            self._hold(gradient, blob, version)

    def _hold(self, gradient: str | GradientSlice, blob: str, version: int) -> None:
        for part in _parts(gradient):
            self.holders[part].add((blob, version))

    def _in_use(self, name: str, index: int, owner: str | None) -> bool:
        """Whether writing `name` at forward op `index` would destroy something still needed.

        That is a seed the caller feeds, or a (partial) gradient of a version of a blob other than
        `owner` that is written by an op not yet differentiated, or by none (a parameter or net input:
        its gradient is a result). Versions whose writer was differentiated need nothing any more.
        """
        if name in self.fed_seeds:
            return True
        for blob, version in self.holders.get(name, ()):
            writer = self.writer_of.get((blob, version))
            if blob != owner and (writer is None or writer < index):
                return True
        return False

    def _fresh_name(self, name: str) -> str:
        """A new `_name_autosplit_k` that nothing in this pass has used."""
        fresh = autosplit_grad_name(name, self.split_count[name])
        self.split_count[name] += 1
        self.fresh.add(fresh)
        return fresh

    # -- seeds ---------------------------------------------------------------------------------

    def seed(self, ys: Sequence[str] | dict[str, Any]) -> list[OperatorDef]:
        """Register each y's seed gradient; return the automatic seed fills."""
        if isinstance(ys, dict):
            items = list(ys.items())
        elif isinstance(ys, (list, tuple)):
            items = [(y, None) for y in dict.fromkeys(ys)]
        else:
            raise TypeError(f"ys must be a list of blobs or a dict {{blob: seed gradient}}, got "
                            f"{type(ys).__name__}")
        fills = []
        for y, seed in items:
            fill = self._seed_one(self._checked_y(y), _as_gradient(seed, f"the seed gradient of {y!r}"))
            fills += [fill] if fill is not None else []
        return fills

    def _checked_y(self, y: Any) -> str:
        if not isinstance(y, str):
            raise TypeError(f"ys must hold blob names, got {type(y).__name__}: {y!r}")
        if not self._written(y):
            raise GradientError(f"cannot differentiate {y!r}: no forward op writes it. Pass a blob the "
                                f"net computes (with its name scope, e.g. 'gpu_0/loss').")
        return str(y)

    def _seed_one(self, y: str, seed: Gradient) -> OperatorDef | None:
        version = self.frontier[y]
        producer = self.ops[self.writer_of[(y, version)]]
        self.usages[(y, version)].append(len(self.ops))  # the caller "reads" y after the net
        if seed is None:
            fill = OperatorDef("ConstantFill", [y], [grad_name(y)], {"value": 1.0}, producer.device_option,
                               is_gradient_op=True, source=f"{producer.source} (gradient seed)".lstrip())
            generator = _Generator(fill.outputs[0], [(fill, 0)], producer.device_option, [fill])
        else:
            fill, generator = None, _Generator(seed, [None] * len(_parts(seed)), producer.device_option)
            self.fed_seeds.update(b for b in _parts(seed) if not self._written(b))
        self.generators[(y, version)].append(generator)
        self._set_gradient(y, generator.gradient, version)
        return fill

    # -- one forward op ------------------------------------------------------------------------

    def differentiate(self, index: int) -> list[OperatorDef]:
        """The gradient ops of forward op `index` (none if no output has a gradient)."""
        op = self.ops[index]
        grad_outputs = [self._output_gradient(index, blob) for blob in op.outputs]
        if all(g is None for g in grad_outputs):
            return []
        maker = self._maker(index, grad_outputs)
        grad_ops: list[OperatorDef]
        grad_inputs: list[Gradient]
        if maker is NO_GRADIENT:
            grad_ops, grad_inputs = [], [None] * len(op.inputs)
        else:
            grad_ops, grad_inputs = self._call_maker(index, maker, grad_outputs)
            self._check_reads(index, maker, grad_ops, grad_outputs)
            grad_inputs = self._split_repeated_inputs(op, grad_ops, grad_inputs)
            grad_inputs = self._protect(index, grad_ops, grad_inputs)
            for grad_op in grad_ops:  # after the renames: Mul(x, x)'s two x_grad outputs are split by then
                check_operator(grad_op, f"gradient op {grad_op.type} of {self._describe(index)}")
        self._record_generators(index, grad_ops, grad_inputs)
        self._merge(index, grad_inputs)
        return grad_ops

    def _output_gradient(self, index: int, blob: str) -> Gradient:
        """The gradient of the version of `blob` that op `index` wrote.

        The map holds the gradient of one version per name. When it holds a later version's, no reader
        of this version produced a gradient, so it is zero (None); Caffe2 handed the later version's
        gradient on, which a pass-through maker then propagated silently. A version nothing reads at
        all is a dead write, most likely two ops writing one name by mistake: that raises, as in Caffe2.
        """
        gradient, version = self.grads.get(blob), self.ssa[index][1][blob]
        if gradient is None or self.grad_version[blob] == version:
            return gradient
        if self.usages.get((blob, version)):
            return None
        raise GradientError(
            f"{self._describe(index)} writes {blob!r} (version {version}), but nothing reads that version "
            f"before {self._describe(self.writer_of[(blob, version + 1)])} overwrites it, while a later "
            f"version of {blob!r} receives a gradient. Do two ops write {blob!r} by mistake? Give one of "
            f"them another name.\n{self._history(blob)}")

    def _maker(self, index: int, grad_outputs: list[Gradient]) -> Any:
        op = self.ops[index]
        maker = get_schema(op.type).gradient
        if maker is not None and maker is not NOT_DIFFERENTIABLE:
            return maker
        if index in self.fed_only:
            return NO_GRADIENT
        o = next(k for k, g in enumerate(grad_outputs) if g is not None)
        why = "must not be differentiated" if maker is NOT_DIFFERENTIABLE else "has no gradient maker"
        raise GradientError(
            f"{self._describe(index)} {why}, but the gradient {grad_outputs[o]!r} of its output "
            f"{op.outputs[o]!r} reaches it. Stop the gradient before it (StopGradient on "
            f"{op.outputs[o]!r}, in place) or differentiate a loss that does not depend on it.")

    def _call_maker(self, index: int, maker: Maker, grad_outputs: list[Gradient]) -> tuple[list, list]:
        op = self.ops[index]
        where = f"the gradient maker of {self._describe(index)}"
        grad_ops, grad_inputs = maker(op.copy(), list(grad_outputs))
        if len(grad_inputs) != len(op.inputs):
            raise GradientError(f"{where} returned {len(grad_inputs)} input gradients for "
                                f"{len(op.inputs)} inputs")
        copy_args = get_schema(op.type).copy_args_to_gradient
        for grad_op in grad_ops:
            if not isinstance(grad_op, OperatorDef):
                raise GradientError(f"{where} returned {grad_op!r} instead of an OperatorDef")
            _stamp(grad_op, op, copy_args)
        return list(grad_ops), [_as_gradient(g, where) for g in grad_inputs]

    def _split_repeated_inputs(self, op: OperatorDef, grad_ops: list[OperatorDef],
                               grad_inputs: list[Gradient]) -> list[Gradient]:
        """Give each position of an input the op reads twice (Mul(x, x)) its own gradient blob.

        A maker names both positions' gradients `x_grad`, so the second write would replace the
        first; when gradient ops write that name once per position, the later writes get fresh names
        and accumulation sums the partial gradients.
        """
        result = list(grad_inputs)
        for name in dict.fromkeys(g for g in grad_inputs if isinstance(g, str)):
            positions = [k for k, g in enumerate(result) if g == name]
            writes = [(grad_op, slot) for grad_op in grad_ops for slot, b in enumerate(grad_op.outputs)
                      if b == name]
            if len(positions) < 2 or len(writes) != len(positions):
                continue
            for k, (grad_op, slot) in zip(positions[1:], writes[1:]):
                result[k] = grad_op.outputs[slot] = self._fresh_name(name)
        return result

    def _protect(self, index: int, grad_ops: list[OperatorDef], grad_inputs: list[Gradient]) -> list[Gradient]:
        """Rename gradient op outputs that would overwrite a gradient another blob still needs."""
        op = self.ops[index]
        owners = {part: op.inputs[k] for k, g in reversed(list(enumerate(grad_inputs))) if g is not None
                  for part in _parts(g)}
        for grad_op in grad_ops:
            for slot in range(len(grad_op.outputs)):
                name = grad_op.outputs[slot]
                if self._in_use(name, index, owners.get(name)):
                    fresh = self._fresh_name(name)
                    _rename_in(grad_ops, name, fresh)
                    grad_inputs = [_replace(g, name, fresh) for g in grad_inputs]
        return grad_inputs

    # -- the overwrite check -------------------------------------------------------------------

    def _check_reads(self, index: int, maker: Maker, grad_ops: list[OperatorDef],
                     grad_outputs: list[Gradient]) -> None:
        """Raise if a gradient op reads a forward value that no longer holds the version it needs."""
        op = self.ops[index]
        gradient_names = {b for g in grad_outputs if g is not None for b in _parts(g)}
        in_place = (set(op.inputs) & set(op.outputs)) - gradient_names
        kinds: list[list[str]] = []
        if any(b in in_place for grad_op in grad_ops for b in grad_op.inputs):
            kinds = self._probe_kinds(index, maker, grad_ops, grad_outputs)
        local: set[str] = set()
        for k, grad_op in enumerate(grad_ops):
            for j, blob in enumerate(grad_op.inputs):
                kind = kinds[k][j] if blob in in_place else self._kind(index, blob, gradient_names)
                self._check_read(index, grad_op, blob, kind, local)
            local.update(grad_op.outputs)

    def _kind(self, index: int, blob: str, gradient_names: set[str]) -> str:
        """Caffe2's reading of a gradient op input by name: output gradient, output, input, or local."""
        in_versions, out_versions = self.ssa[index]
        if blob in gradient_names:
            return "gradient"
        if blob in out_versions:
            return "output"
        return "input" if blob in in_versions else "local"

    def _probe_kinds(self, index: int, maker: Maker, grad_ops: list[OperatorDef],
                     grad_outputs: list[Gradient]) -> list[list[str]]:
        """For an in-place op: which forward position each gradient op input came from.

        The maker runs again on a copy whose inputs, outputs and output gradients have distinct
        stand-in names, so a name shared by an input and an output is told apart by position.
        """
        op = self.ops[index]
        probe = op.copy()
        probe.inputs = [f"{_PROBE}input:{i}" for i in range(len(op.inputs))]
        probe.outputs = [f"{_PROBE}output:{o}" for o in range(len(op.outputs))]
        probe_grads = [None if g is None else _probe_gradient(g, o) for o, g in enumerate(grad_outputs)]
        probe_ops, _ = maker(probe, probe_grads)
        kinds = [[_probe_kind(b) for b in p.inputs] for p in probe_ops]
        if [len(k) for k in kinds] != [len(g.inputs) for g in grad_ops]:
            raise GradientError(f"{self._describe(index)} runs in place, and its gradient maker builds "
                                f"different ops when the names differ, so autodiff cannot tell whether "
                                f"its gradient reads the input or the output; run it out of place")
        return kinds

    def _check_read(self, index: int, grad_op: OperatorDef, blob: str, kind: str, local: set[str]) -> None:
        if kind == "gradient" or (kind == "local" and blob in local):
            return
        if kind == "local":
            raise GradientError(
                f"gradient op {grad_op.type} of {self._describe(index)} reads {blob!r}, which is not an "
                f"input, output or output gradient of the forward op, nor written by an earlier gradient "
                f"op of it; the gradient maker of {self.ops[index].type} is wrong")
        in_versions, out_versions = self.ssa[index]
        version = (in_versions if kind == "input" else out_versions)[blob]
        if self.frontier[blob] != version:
            raise self._overwritten(index, grad_op, blob, kind, version)

    def _overwritten(self, index: int, grad_op: OperatorDef, blob: str, kind: str,
                     version: int) -> GradientError:
        over = self.writer_of[(blob, version + 1)]
        op = self.ops[index]
        if over == index:
            return GradientError(
                f"{self._describe(index)} writes {blob!r} in place, but its gradient op {grad_op.type} "
                f"reads the input {blob!r} as it was before the op ran (version {version}), which is gone. "
                f"{op.type} may not run in place on {blob!r} because its gradient needs its input: give "
                f"the output a new name.\n{self._history(blob)}")
        return GradientError(
            f"gradient op {grad_op.type} of {self._describe(index)} reads the {kind} {blob!r} at version "
            f"{version}, but {self._describe(over)} overwrites it later (version {version + 1}), so the "
            f"gradient would use the wrong value. Give that op's output a new name instead of "
            f"{blob!r}.\n{self._history(blob)}")

    # -- bookkeeping after an op ---------------------------------------------------------------

    def _record_generators(self, index: int, grad_ops: list[OperatorDef], grad_inputs: list[Gradient]) -> None:
        """Note who produces each input gradient, for accumulation."""
        op = self.ops[index]
        in_versions, _ = self.ssa[index]
        written = {b: (grad_op, slot) for grad_op in grad_ops for slot, b in enumerate(grad_op.outputs)}
        seen: set = set()
        for blob, gradient in zip(op.inputs, grad_inputs):
            if gradient is None:
                continue
            writers = [written.get(part) for part in _parts(gradient)]
            if any(writers) and gradient in seen:
                continue  # one gradient op output for an input read twice: one generator
            seen.add(gradient)
            device = next((w[0].device_option for w in writers if w), op.device_option)
            self.generators[(blob, in_versions[blob])].append(_Generator(gradient, writers, device, grad_ops))
            self._hold(gradient, blob, in_versions[blob])

    def _merge(self, index: int, grad_inputs: list[Gradient]) -> None:
        """Caffe2's rule: None never replaces a gradient, unless the input is also written (in place)."""
        op = self.ops[index]
        in_versions, _ = self.ssa[index]
        found: dict[str, Gradient] = {}
        for blob, gradient in zip(op.inputs, grad_inputs):
            if gradient is not None or blob not in found:
                found[blob] = gradient
        for blob, gradient in found.items():
            if gradient is not None or blob not in self.grads or blob in op.outputs:
                self._set_gradient(blob, gradient, in_versions[blob])

    # -- accumulation --------------------------------------------------------------------------

    def accumulate(self, index: int) -> list[OperatorDef]:
        """Sum the partial gradients of the input versions whose earliest reader is op `index`."""
        op = self.ops[index]
        in_versions, _ = self.ssa[index]
        sum_ops: list[OperatorDef] = []
        for blob in dict.fromkeys(op.inputs):
            key = (blob, in_versions[blob])
            readers = self.usages[key]
            generators = self.generators.get(key, [])
            if len(readers) < 2 or readers[0] != index or len(generators) < 2:
                continue
            self._check_generators(index, blob, generators)
            sparse = isinstance(generators[0].gradient, GradientSlice)
            ops, gradient = (self._concat if sparse else self._sum)(index, blob, generators)
            for acc in ops:
                acc.device_option, acc.is_gradient_op = generators[0].device, True
                acc.source = f"{op.source} (gradient accumulation)".lstrip()
            sum_ops += ops
            self._set_gradient(blob, gradient, key[1])
        return sum_ops

    def _check_generators(self, index: int, blob: str, generators: list[_Generator]) -> None:
        if len({isinstance(g.gradient, GradientSlice) for g in generators}) > 1:
            raise GradientError(f"{blob!r} (read by {self._describe(index)} and later ops) gets both dense "
                                f"and sparse gradients; summing a mix is not supported")
        devices = [g.device for g in generators]
        if not all(same_device(d, devices[0]) for d in devices[1:]):
            raise GradientError(f"the partial gradients of {blob!r} (read by {self._describe(index)} and "
                                f"later ops) are on different devices {devices}; copy {blob!r} to each "
                                f"device explicitly so each copy has its own gradient")

    def _rename(self, generator: _Generator, p: int) -> None:
        """Give part p of a generator written by a gradient op a fresh autosplit name."""
        found = generator.writers[p]
        if found is None:  # passed through: no gradient op wrote it under a name of its own
            return
        writer, slot = found
        old = writer.outputs[slot]
        if old not in self.fresh:
            _rename_in(generator.grad_ops, old, self._fresh_name(old))

    def _sum(self, index: int, blob: str, generators: list[_Generator]) -> tuple[list[OperatorDef], str]:
        """Caffe2's dense accumulation: rename later gradient op outputs, one Sum into the first."""
        out = next((g.part_name(0) for g in generators if g.writers[0]), grad_name(blob))
        passed = {g.gradient for g in generators if not g.writers[0]}
        clash = self._in_use(out, index, blob)
        keep_first = not clash and out not in passed
        for generator in generators:
            if generator.writers[0] and keep_first:
                keep_first = False
            elif generator.writers[0]:
                self._rename(generator, 0)
        inputs = [g.part_name(0) for g in generators]
        out = self._fresh_name(grad_name(blob)) if clash else out
        if out in inputs:  # Sum runs in place only into input 0
            first = inputs.index(out)
            inputs[0], inputs[first] = inputs[first], inputs[0]
        return [OperatorDef("Sum", inputs, [out])], out

    def _concat(self, index: int, blob: str, generators: list[_Generator]) -> tuple[list[OperatorDef], GradientSlice]:
        """Caffe2's sparse accumulation: every gradient op output renamed, indices and values concatenated."""
        base = grad_name(blob)
        for g in generators:
            p = next((p for p in (0, 1) if g.writers[p]), None)
            if p is not None:
                base = _strip(g.part_name(p), ("_indices", "_values")[p])
                break
        if any(self._in_use(f"{base}_{w}_concat", index, blob) for w in ("indices", "values")):
            base = self._fresh_name(grad_name(blob))
        ops, outputs = [], []
        for p, what in enumerate(("indices", "values")):
            for generator in generators:
                if generator.writers[p]:
                    self._rename(generator, p)
            outputs.append(f"{base}_{what}_concat")
            ops.append(OperatorDef("Concat", [g.part_name(p) for g in generators],
                                   [outputs[-1], f"{base}_{what}_concat_split"], {"axis": 0}))
        return ops, GradientSlice(*outputs)

    # -- result --------------------------------------------------------------------------------

    def grad_map(self) -> dict:
        """Every blob that received a gradient -> its gradient, as BlobReferences."""
        result: dict = {}
        for blob, gradient in self.grads.items():
            if isinstance(gradient, GradientSlice):
                result[BlobReference(blob)] = GradientSlice(*map(BlobReference, gradient))
            elif gradient is not None:
                result[BlobReference(blob)] = BlobReference(gradient)
        return result


def _stamp(grad_op: OperatorDef, op: OperatorDef, copy_args: bool) -> None:
    """Give a gradient op its forward op's device, engine and args (a maker's explicit ones win)."""
    if grad_op.device_option is None:
        grad_op.device_option = op.device_option
    grad_op.engine = grad_op.engine or op.engine
    if copy_args:
        grad_op.args = {**op.args, **grad_op.args}
    grad_op.is_gradient_op = True
    grad_op.source = f"{op.source} (gradient)".lstrip()


def _probe_gradient(gradient: str | GradientSlice, o: int) -> str | GradientSlice:
    if isinstance(gradient, GradientSlice):
        return GradientSlice(f"{_PROBE}gradient:{o}:indices", f"{_PROBE}gradient:{o}:values")
    return f"{_PROBE}gradient:{o}"


def _probe_kind(blob: str) -> str:
    """'input' or 'output' for a stand-in forward name, else 'local' (an in-place name is never a gradient)."""
    kind = blob[len(_PROBE):].split(":")[0] if blob.startswith(_PROBE) else "local"
    return kind if kind in ("input", "output") else "local"


def _strip(name: str, suffix: str) -> str:
    return name[: -len(suffix)] if name.endswith(suffix) else name
