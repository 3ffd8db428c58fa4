"""Dataflow facts of a net, computed once per net version: loads, writes, versions, lifetimes, dependencies.

"Read before written", first and last writers, readers and writers per blob, blob versions, the
loads a run makes and last uses are derived here and nowhere else; passes, the plan and the frame layout ask `dataflow(net)`. The
result is cached on the NetDef (as torch.fx keeps facts in `Node.meta`) together with the net's
*blob signature*: every op's inputs, outputs and control inputs. A later call compares the signature
(one tuple per op, compared at C speed) and recomputes when a pass changed any op's blobs, added,
removed or reordered ops; changes that move no blob (types, arguments, devices) keep the facts,
which do not depend on them. Each fact is computed on first use from the signature, a snapshot,
so facts of one version never mix with a later edit. Control inputs count as reads where noted
(Caffe2's DAG nets order on them) and never as data: loads and versions are data inputs only.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from functools import cached_property
from operator import attrgetter
from typing import NamedTuple

from graphpar.core.ir import NetDef, OperatorDef

Signature = tuple[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...]
_CACHE = "_dataflow"  # the NetDef attribute holding (signature, Dataflow)
_BLOBS = attrgetter("inputs", "outputs", "control_inputs")


class Load(NamedTuple):
    """A blob a run reads before any op writes it: the first op reading it and that op's input index."""

    reader: int
    position: int


class Version(NamedTuple):
    """One write of a blob and the ops that use that value: its writer, then its readers (data inputs)
    up to the next write. `rewritten_in_place`: the next version's writer reads this one (x = f(x))."""

    blob: str
    users: frozenset[int]
    rewritten_in_place: bool


def signature(net: NetDef) -> Signature:
    """Every op's (inputs, outputs, control inputs): all the facts below depend on."""
    return tuple([(tuple(i), tuple(o), tuple(c) if c else ()) for i, o, c in map(_BLOBS, net.ops)])


def facts(ops: Sequence[OperatorDef]) -> Dataflow:
    """The dataflow facts of a list of ops (a pass's draft of a net), not cached."""
    return Dataflow(tuple([(tuple(i), tuple(o), tuple(c) if c else ()) for i, o, c in map(_BLOBS, ops)]))


def dataflow(net: NetDef) -> Dataflow:
    """The dataflow facts of `net` as it is now (cached on the net until its blob signature changes)."""
    current = signature(net)
    cached = net.__dict__.get(_CACHE)
    if cached is not None and cached[0] == current:
        return cached[1]
    facts = Dataflow(current)
    net.__dict__[_CACHE] = (current, facts)
    return facts


class Dataflow:
    """The facts of one net version (see the module docstring); each computed on first use."""

    def __init__(self, ops: Signature) -> None:
        self.ops = ops

    @cached_property
    def loads(self) -> Mapping[str, Load]:
        """{blob: Load} for the data inputs read before any op writes them, in first-read order (an op
        writing in place the blob it reads counts as reading it first): what a run loads."""
        loads: dict[str, Load] = {}
        seen: set[str] = set()  # read or written so far
        for index, (inputs, outputs, _) in enumerate(self.ops):
            if not seen.issuperset(inputs):  # most ops read only blobs seen before
                for k, blob in enumerate(inputs):
                    if blob not in seen:
                        seen.add(blob)
                        loads[blob] = Load(index, k)
            seen.update(outputs)
        return loads

    @cached_property
    def read_first(self) -> frozenset[str]:
        """The blobs read (as inputs or control inputs) before any op writes them."""
        found: set[str] = set()
        written: set[str] = set()
        for inputs, outputs, controls in self.ops:
            found.update(b for b in (*inputs, *controls) if b not in written)
            written.update(outputs)
        return frozenset(found)

    @cached_property
    def first_write(self) -> Mapping[str, int]:
        """{blob: index of the first op writing it}, in that order."""
        first: dict[str, int] = {}
        for index, (_, outputs, _) in enumerate(self.ops):
            for blob in outputs:
                first.setdefault(blob, index)
        return first

    def written_before(self, blob: str, index: int) -> bool:
        """Whether an op before op `index` writes `blob` (else op `index` reads it as loaded)."""
        return self.first_write.get(blob, index) < index

    @property
    def readers(self) -> Mapping[str, Sequence[int]]:
        """{blob: the ops reading it as a data input}, ascending, each op once."""
        return self._uses[0]

    @property
    def writers(self) -> Mapping[str, Sequence[int]]:
        """{blob: the ops writing it}, ascending."""
        return self._uses[1]

    @property
    def waiters(self) -> Mapping[str, Sequence[int]]:
        """{blob: the ops naming it as a control input}, ascending, each op once."""
        return self._uses[2]

    @cached_property
    def _uses(self) -> tuple[dict[str, list[int]], dict[str, list[int]], dict[str, list[int]]]:
        """(readers, writers, waiters), in one scan of the ops."""
        readers: dict[str, list[int]] = {}
        writers: dict[str, list[int]] = {}
        waiters: dict[str, list[int]] = {}
        for index, (inputs, outputs, controls) in enumerate(self.ops):
            for blob in inputs:
                at = readers.get(blob)
                if at is None:
                    readers[blob] = [index]
                elif at[-1] != index:
                    at.append(index)
            for blob in outputs:  # an op names a blob once among its outputs
                at = writers.get(blob)
                if at is None:
                    writers[blob] = [index]
                else:
                    at.append(index)
            for blob in controls:
                at = waiters.get(blob)
                if at is None:
                    waiters[blob] = [index]
                elif at[-1] != index:
                    at.append(index)
        return readers, writers, waiters

    def loaded_readers(self, blob: str) -> Sequence[int]:
        """The ops reading the value `blob` has when a run starts: its readers up to its first writer
        (included, when that op reads it too)."""
        readers, writers = self.readers.get(blob, ()), self.writers.get(blob)
        return readers if not writers else readers[:bisect_right(readers, writers[0])]

    def last_write_before(self, blob: str, index: int) -> int | None:
        """The last op before op `index` writing `blob` (None: none does)."""
        writers = self.writers.get(blob, ())
        k = bisect_left(writers, index)
        return writers[k - 1] if k else None

    @cached_property
    def data_blobs(self) -> tuple[str, ...]:
        """Every blob of the data inputs and outputs, in first-use order (an op's inputs, then outputs)."""
        seen: dict[str, None] = {}
        for inputs, outputs, _ in self.ops:
            seen.update(dict.fromkeys(inputs))
            seen.update(dict.fromkeys(outputs))
        return tuple(seen)

    @cached_property
    def lifetimes(self) -> Mapping[str, tuple[int, int]]:
        """{blob: (first op using it, last op using it)}; uses are reads, control inputs and writes.
        External outputs are not extended to the end of the net."""
        spans: dict[str, tuple[int, int]] = {}
        for index, (inputs, outputs, controls) in enumerate(self.ops):
            for blob in (*inputs, *controls, *outputs):
                span = spans.get(blob)
                spans[blob] = (index, index) if span is None else (span[0], index)
        return spans

    @cached_property
    def versions(self) -> tuple[Version, ...]:
        """Every write's Version, in write order (an op's outputs in order)."""
        users: list[set[int]] = []
        blobs: list[str] = []
        in_place: set[int] = set()
        current: dict[str, int] = {}
        for index, (inputs, outputs, _) in enumerate(self.ops):
            for blob in inputs:
                if blob in current:
                    users[current[blob]].add(index)
            for blob in outputs:
                previous = current.get(blob)
                if previous is not None and index in users[previous]:
                    in_place.add(previous)
                current[blob] = len(users)
                users.append({index})
                blobs.append(blob)
        return tuple(Version(blob, frozenset(u), v in in_place) for v, (blob, u) in enumerate(zip(blobs, users)))

    @cached_property
    def edges(self) -> Mapping[tuple[int, int], tuple[str, str]]:
        """{(i, j): (kind, blob)}: op j must run after op i, for the first reason found: read after
        write ("raw", control inputs count), write after write ("waw"), write after read ("war"); no
        self-edges."""
        edges: dict[tuple[int, int], tuple[str, str]] = {}  # first reason per pair, in insertion order
        last_writer: dict[str, int] = {}
        readers: dict[str, list[int]] = {}
        for j, (inputs, outputs, controls) in enumerate(self.ops):
            for blob in (*inputs, *controls):
                if blob in last_writer:
                    edges.setdefault((last_writer[blob], j), ("raw", blob))
                readers.setdefault(blob, []).append(j)
            for blob in outputs:
                if blob in last_writer:
                    edges.setdefault((last_writer[blob], j), ("waw", blob))
                for i in readers.pop(blob, ()):
                    edges.setdefault((i, j), ("war", blob))
                last_writer[blob] = j
        return {pair: reason for pair, reason in edges.items() if pair[0] != pair[1]}

    @cached_property
    def predecessors(self) -> tuple[tuple[int, ...], ...]:
        """For each op, the sorted indices of the ops it must run after (the edges)."""
        found: list[list[int]] = [[] for _ in self.ops]
        for i, j in self.edges:
            found[j].append(i)
        return tuple(tuple(sorted(p)) for p in found)
