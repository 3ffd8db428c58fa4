"""The "compiled" executor: each phase of a plan lowered to functional programs, compiled once by
`torch.compile`, so that a step runs as a few compiled programs instead of op by op.

A net of type `"compiled"` (`Parallelize(..., compile=True)`, or `net.Proto().type = "compiled"`)
is lowered when it first runs (`lower`). Each phase of the plan (`executor.plan.CompiledNet`: the
updates run in the second) is cut into *regions*, in an order that respects the plan's dependencies:

- *compiled* regions: steps whose kernels trace (`OpSchema.traceable`), generated as one function
  of the slots they read, returning the slots that outlive the region (`program.functional`): read by
  a later step, or kept by the run (`FrameLayout.store_slots`; with `dynamic_memory_management` only
  the persistent blobs, so intermediates stay inside the program and fuse). Parameters and optimizer
  state updated in place are graph-input mutations. The function is compiled with `fullgraph=True`
  and `dynamic=False` on its first call: no graph break, fixed shapes;
- *eager* regions: steps that cannot be traced (a host read of tensor values, per-run random streams,
  another process, the host's iteration counter), run as the "simple" executor runs them
  (`program.straight_line`). The host prologue of a step (`Iter`, `LearningRate`) is the eager
  region before the first compiled one. Eager steps go as early or as late as their dependencies let
  them, so that a phase has as few compiled regions as the dependencies allow; the reason each eager
  step cannot be compiled is logged once.

The run keeps every executor's contract (`executor.run.run_plan`): the state check before the
second phase, a failed run commits nothing. A kernel error inside a compiled region (or a kernel
that does not trace after all) is found by rerunning the region's steps one by one on copies of its
inputs: the error names the op and where it was recorded, as "simple"'s would.

The compile options are net arguments: `compile_backend` (default "inductor"; "aot_eager" compiles
fast, for tests) and `compile_mode` (inductor's "default", "reduce-overhead" for its CUDA graphs,
"max-autotune"). Compiling takes seconds to minutes on the first run (logged once per phase);
inductor caches what it built on disk, so the next process compiles faster.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphpar.core.ir import CPU
from graphpar.core.naming import COMPILE_BACKEND_ARG, COMPILE_MODE_ARG
from graphpar.core.schema import UNTRACEABLE_TRAITS, get_schema
from graphpar.executor.failure import op_location
from graphpar.executor.program import StepFailed, functional, step_runs, straight_line
from graphpar.executor.run import run_plan
from graphpar.executor.runtime import Runtime, runtime_of

if TYPE_CHECKING:
    from graphpar.core.ir import NetDef
    from graphpar.executor.plan import CompiledNet, Phase

log = logging.getLogger(__name__)

DEFAULT_BACKEND = "inductor"


class CompileError(RuntimeError):
    """A step whose kernel torch.compile cannot trace, though its registration says it can."""


@dataclass(frozen=True)
class Region:
    """Steps of one phase that run together: compiled into one program, or eagerly one by one.

    `inputs`: the slots a compiled region reads before writing them; `outputs`: the slots it writes
    that outlive it; `clears`: the slots freed after it (read or written by it, needed by nothing later).
    """

    steps: tuple[int, ...]
    compiled: bool
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    clears: tuple[int, ...] = ()


def eager_reason(plan: CompiledNet, index: int) -> str | None:
    """Why step `index` cannot run in a compiled program (None: it can), from its op's registration."""
    op = plan.netdef.ops[index]
    schema = get_schema(op.type)
    if schema.traceable(op):
        return None
    traits = ", ".join(sorted(t.value for t in schema.traits & UNTRACEABLE_TRAITS))
    return f"traceable=False at its registration{f' ({traits})' if traits else ''}"


def lower(plan: CompiledNet) -> tuple[tuple[Region, ...], ...]:
    """Per phase of `plan`: its regions, in the order they run (see the module docstring)."""
    eager = {j for j in range(len(plan.steps)) if eager_reason(plan, j) is not None}
    cuts = [_cut(phase.steps, plan.dependencies, eager) for phase in plan.phases]
    order = [j for phase in cuts for _, steps in phase for j in steps]
    position = {j: k for k, j in enumerate(order)}
    later_reads: list[set[int]] = [set() for _ in range(len(order) + 1)]  # slots read at position >= k
    for k in range(len(order) - 1, -1, -1):
        later_reads[k] = later_reads[k + 1] | set(plan.steps[order[k]].inputs)
    kept = set(plan.frame.store_slots)
    lowered = []
    for phase in cuts:
        regions = []
        for compiled, steps in phase:
            needed = later_reads[position[steps[-1]] + 1] | kept
            inputs: dict[int, None] = {}
            written: dict[int, None] = {}
            for j in steps:
                inputs.update((slot, None) for slot in plan.steps[j].inputs if slot not in written)
                written.update((slot, None) for slot in plan.steps[j].outputs)
            outputs = tuple(slot for slot in written if slot in needed) if compiled else ()
            clears = tuple(slot for slot in {**inputs, **written} if slot not in needed) if compiled else ()
            regions.append(Region(tuple(steps), compiled, tuple(inputs) if compiled else (), outputs, clears))
        lowered.append(tuple(regions))
    return tuple(lowered)


def _cut(steps: Sequence[int], dependencies: Sequence[Sequence[int]], eager: set[int]) -> list[tuple[bool, list[int]]]:
    """`steps` (one phase, in program order) as alternating runs of compiled and eager steps: each run
    takes every step of its kind whose dependencies in the phase have run. Of the two cuts (eager or
    compiled first), the one with fewer compiled regions, then fewer regions."""
    members = set(steps)

    def greedy(eager_first: bool) -> list[tuple[bool, list[int]]]:
        left, done, cut, take_eager = list(steps), set(), [], eager_first
        while left:
            taken = []
            for j in left:
                if (j in eager) == take_eager and all(i in done or i not in members for i in dependencies[j]):
                    taken.append(j)
                    done.add(j)
            if taken:
                cut.append((not take_eager, taken))
                left = [j for j in left if j not in done]
            take_eager = not take_eager
        return cut

    return min((greedy(True), greedy(False)), key=lambda cut: (sum(c for c, _ in cut), len(cut)))


class _Region:
    """One region ready to run on a frame: a compiled program (compiled on its first call) or a
    straight-line program of eager steps."""

    def __init__(self, plan: CompiledNet, region: Region, label: str, frees: Sequence[Sequence[int]] | None,
                 options: dict[str, Any]) -> None:
        self.region, self.label, self.options = region, label, options
        # per output: its position among the inputs (-1: none). An input updated in place keeps its tensor
        # (its identity: the workspace, references to it and state checks see it, as after an eager update)
        position = {slot: k for k, slot in enumerate(region.inputs)}
        self.was = tuple(position.get(slot, -1) for slot in region.outputs)
        self.net_name, self.names = plan.name, plan.frame.names
        self.compiles = 0  # graphs the backend compiled for this region (a new input shape compiles another)
        self.shapes: dict[str, tuple] = {}  # the input shapes of the last compile
        if region.compiled:
            self.program = functional(plan, region.steps, region.inputs, region.outputs, label)
            self.compiled = torch.compile(self.program, backend=self._backend(options), fullgraph=True,
                                          dynamic=False)
        else:
            self.eager = straight_line(plan, region.steps, frees, label)
        self.seconds: float | None = None  # how long the first call (the compile) took

    def _backend(self, options: dict[str, Any]) -> Callable[..., Any]:
        """torch.compile's backend for this region, counting the graphs it compiles (no cost per run)."""
        name, mode = options["backend"], options.get("mode")
        if name == "inductor":
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            patches = dict(list_mode_options(mode)) if mode else {}
            if options["cpu_only"]:
                # inductor's default turns a graph with convolutions channels-last, which on the CPU costs a
                # layout copy per convolution: ResNet-18's training step took 1.7x as long
                patches["layout_optimization"] = False
            compile_graph: Callable[..., Any] = functools.partial(compile_fx, config_patches=patches or None)
        else:
            compile_graph = torch._dynamo.lookup_backend(name)

        def counted(graph: Any, example_inputs: Sequence[Any]) -> Any:
            self.compiles += 1
            return compile_graph(graph, example_inputs)

        return counted

    def run(self, plan: CompiledNet, frame: list) -> None:
        region = self.region
        if not region.compiled:
            self.eager(frame)
            return
        args = _distinct([frame[slot] for slot in region.inputs])
        began, compiles = time.perf_counter() if self.seconds is None else 0.0, self.compiles
        try:
            values = self.compiled(*args)
        except Exception as exc:  # noqa: BLE001 - a failure to compile (or retrace) or to run: found below
            error = _diagnose(plan, region, frame, exc)
            del args
            raise error from error.__cause__
        if self.seconds is None:
            self.seconds = time.perf_counter() - began
        if self.compiles != compiles:
            self._compiled_for(args)
        for slot, value, was in zip(region.outputs, values, self.was):
            # an input updated in place comes back as a new view of itself: keep the input's tensor
            frame[slot] = args[was] if was >= 0 and _same_tensor(value, args[was]) else value
        del args
        for slot in region.clears:
            frame[slot] = None


    def _compiled_for(self, args: Sequence[Any]) -> None:
        """Note the input shapes a compile was for; from the second compile on, say which changed."""
        shapes = {self.names[slot]: tuple(value.shape) for slot, value in zip(self.region.inputs, args)
                  if isinstance(value, torch.Tensor)}
        if self.shapes:
            changed = {name: (self.shapes.get(name), shape) for name, shape in shapes.items()
                       if self.shapes.get(name) != shape}
            say = log.warning if self.compiles == 2 else log.info
            if changed:
                say("net %r %s: compiled again (compile %d) for new input shapes: %s. Each new shape compiles "
                    "once more; a shape that changes every run compiles every run: feed fixed shapes (a "
                    "loader's drop_last), or run the net as 'dag'", self.net_name, self.label, self.compiles,
                    ", ".join(f"{name} {list(old or ())} -> {list(new)}" for name, (old, new) in changed.items()))
            else:
                say("net %r %s: compiled again (compile %d) for inputs that changed other than in shape (a "
                    "dtype, device, layout or requires_grad; TORCH_LOGS=recompiles names the check that failed)",
                    self.net_name, self.label, self.compiles)
        self.shapes = shapes


def _distinct(args: list) -> list:
    """`args` with each tensor passed once: a second name for one tensor gets a copy. CPU replicas share
    their updated params from the second step on (`passes/cpu_update_once.py`), and torch.compile, which
    traced the first run's distinct inputs, would otherwise compile the region again for the aliasing.
    The copy holds the same values the shared tensor has when the region starts, which is all a
    functional region reads (an in-place update is copied back into the first name's tensor)."""
    seen: set[int] = set()
    for k, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                args[k] = value.clone()
            else:
                seen.add(id(value))
    return args


def _same_tensor(value: Any, old: Any) -> bool:
    """Whether `value` is `old` again: the same memory, shape, strides and dtype (a view of all of it)."""
    return (value is old or isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor)
            and value.data_ptr() == old.data_ptr() and value.dtype == old.dtype and value.shape == old.shape
            and value.stride() == old.stride() and value.device == old.device)


def _diagnose(plan: CompiledNet, region: Region, frame: list, exc: Exception) -> Exception:
    """The error for a compiled region that failed: rerun its steps one by one on copies of its inputs,
    tracing each alone first. A kernel that fails gives StepFailed (its op's error, as "simple" gives);
    a kernel that does not trace gives StepFailed from a CompileError naming it; else the compiler's
    own failure, naming the region."""
    if isinstance(exc, torch._dynamo.exc.FailOnRecompileLimitHit):
        error = RuntimeError(
            f"net {plan.name!r}: the inputs of {len(region.steps)} compiled steps (from "
            f"{op_location(plan.netdef, region.steps[0])}) took a new shape at {torch._dynamo.config.recompile_limit} "
            f"runs, each compiled anew, and torch.compile compiles no more: feed fixed shapes (a loader's drop_last), "
            f"or run the net as 'dag'; nothing was changed")
        error.__cause__ = exc.with_traceback(None)
        return error
    scratch = list(frame)  # the failing step's inputs go back to `frame`, for its error message
    for slot in region.inputs:
        value = scratch[slot]
        scratch[slot] = value.clone() if isinstance(value, torch.Tensor) else value
    runs = step_runs(plan)
    for j in region.steps:
        step = plan.steps[j]
        probe = functional(plan, (j,), tuple(dict.fromkeys(step.inputs)), step.outputs, f"probe {j}")
        args = [_copy(scratch[slot]) for slot in dict.fromkeys(step.inputs)]
        try:
            runs[j](scratch)
        except Exception as failed:  # noqa: BLE001 - the op's own error, reported as "simple" reports it
            return _failed_step(frame, step.inputs, args, j, failed)
        try:
            torch.compile(probe, backend="eager", fullgraph=True, dynamic=False)(*args)
        except Exception as untraced:  # noqa: BLE001
            return _failed_step(frame, step.inputs, args, j, CompileError(
                f"its kernel cannot be compiled ({type(untraced).__name__}: {_first_line(untraced)}); register "
                f"the op with traceable=False, or run the net as 'simple' or 'dag'"))
    error = RuntimeError(f"net {plan.name!r}: compiling {len(region.steps)} steps (from {op_location(plan.netdef, region.steps[0])}) "
                        f"failed: {type(exc).__name__}: {_first_line(exc)}. Run the net as 'simple' or 'dag', or "
                        f"try another compile_backend (e.g. 'aot_eager')")
    error.__cause__ = exc.with_traceback(None)
    return error


def _failed_step(frame: list, slots: Sequence[int], values: Sequence[Any], index: int, cause: Exception) -> StepFailed:
    """StepFailed for step `index` caused by `cause`, with the step's inputs put back in `frame`."""
    for slot, value in zip(dict.fromkeys(slots), values):
        frame[slot] = value
    error = StepFailed(index)
    error.__cause__ = cause
    return error


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


class Lowered:
    """A plan lowered for compilation: its regions per phase, ready to run."""

    def __init__(self, plan: CompiledNet) -> None:
        regions = lower(plan)
        order = [j for phase in regions for region in phase for j in region.steps]
        frees = plan.frame.frees_in(order) if plan.frame.frees_memory else None
        args = plan.netdef.args
        backend = args.get(COMPILE_BACKEND_ARG) or DEFAULT_BACKEND
        mode = args.get(COMPILE_MODE_ARG) or None
        options: dict[str, Any] = {"backend": backend, **({"mode": mode} if mode else {}),
                                   "cpu_only": all(plan.netdef.op_device(op).device_type == CPU
                                                   for op in plan.netdef.ops)}
        self.cuda_graphs = mode == "reduce-overhead"
        self.phases = tuple(tuple(_Region(plan, region, f"phase {k} region {r}", frees, options)
                                  for r, region in enumerate(phase))
                            for k, phase in enumerate(regions))
        self.told = False
        reasons: dict[str, str] = {}
        for phase in regions:
            for region in phase:
                if not region.compiled:
                    for j in region.steps:
                        reasons.setdefault(plan.netdef.ops[j].type, eager_reason(plan, j) or "")
        if reasons:
            log.info("net %r (type 'compiled'): runs %s eagerly between its compiled regions: %s", plan.name,
                     ", ".join(sorted(reasons)), "; ".join(f"{t}: {why}" for t, why in sorted(reasons.items())))

    def compile_seconds(self) -> list[float]:
        """Per phase: the seconds its first run spent compiling (0 for a phase not yet run)."""
        return [sum(r.seconds or 0.0 for r in phase if r.region.compiled) for phase in self.phases]


class _Launch:
    """The Launch of a compiled run (`executor.run.Launch`): each phase's regions in order."""

    def __init__(self, plan: CompiledNet, lowered: Lowered, frame: list) -> None:
        self.plan, self.lowered, self.frame = plan, lowered, frame

    def __call__(self, phase: Phase) -> None:
        plan, frame = self.plan, self.frame
        regions = self.lowered.phases[phase.index]
        first = any(r.seconds is None for r in regions if r.region.compiled)
        for region in regions:
            # a compiled region runs every replica's ops in one program, one kernel at a time: with the whole
            # thread budget (inductor builds its kernels for the count it compiles under)
            threads = plan.thread_budget if region.region.compiled else phase.threads
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            region.run(plan, frame)
        if first:
            seconds = sum(r.seconds or 0.0 for r in regions if r.region.compiled)
            compiled = sum(r.region.compiled for r in regions)
            log.info("compiled %r phase %d (%d region%s) in %.1f s", plan.name, phase.index, compiled,
                     "" if compiled == 1 else "s", seconds)

    def close(self) -> None:
        return None


def lowered_of(plan: CompiledNet) -> Lowered:
    """The lowered form of `plan`, made on its first run and kept in its runtime."""
    runtime: Runtime = runtime_of(plan)
    if runtime.lowered is None:
        with runtime.lock:
            if runtime.lowered is None:
                runtime.lowered = Lowered(plan)
    return runtime.lowered


class CompiledExecutor:
    """Runs a plan as compiled regions and eager steps (see the module docstring)."""

    op_by_op = "simple"  # a compiled program has no per-op times

    def keeps_outputs(self, netdef: NetDef) -> bool:
        """False under inductor's CUDA graphs ("reduce-overhead"), whose next replay reuses their memory."""
        return netdef.args.get(COMPILE_MODE_ARG) != "reduce-overhead"

    def run(self, plan: CompiledNet, blobs: dict[str, torch.Tensor]) -> None:
        lowered = lowered_of(plan)
        if lowered.cuda_graphs:  # a new step: inductor's CUDA graphs may reuse the last step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        run_plan(plan, blobs, lambda plan, _runtime, frame: _Launch(plan, lowered, frame))


def compile_options(backend: str | None, mode: str | None) -> dict[str, Any]:
    """The net arguments that choose `torch.compile`'s backend and mode (None: the default)."""
    return {**({COMPILE_BACKEND_ARG: backend} if backend else {}), **({COMPILE_MODE_ARG: mode} if mode else {})}

