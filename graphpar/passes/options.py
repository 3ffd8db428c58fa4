"""Parallelize's options: each declared once, as a field of `ParallelizeOptions` with its default,
its check and its doc; and the values some of them take (`LossScale`).

`Parallelize` writes the same parameters out after `model_helper_obj` (so static tools and IDEs see
them), with these names, defaults and order (Caffe2's arguments first, in Caffe2's order;
`tests/passes/test_options.py` checks that they match); the options part of its docstring is made
from these fields, every argument goes through its field's check, and the passes read the checked
options as `state.options`. Adding an option is one field here, its parameter in `Parallelize`, and
the pass that reads it. A check is `check(value, caller) -> canonical value` and raises
(`ParallelizeError` / `TypeError`, naming the caller and the option) for a bad value; rules that
relate an option to others or to the machine (which devices exist, the rendezvous's shards and
engine, default buckets on CUDA, the executor types) are `Parallelize`'s. The module imports nothing
from the passes, so every pass can import it.
"""
from __future__ import annotations

import operator
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from graphpar.core.naming import COMPILE_MODES
from graphpar.errors import ParallelizeError
from graphpar.platform.distributed import Rendezvous

Builder = Callable[..., Any]
Check = Callable[[Any, str], Any]  # (value, the caller's name) -> the canonical value


@dataclass(frozen=True)
class LossScale:
    """A loss scale: static (`dynamic=False`: S stays `init_scale`) or dynamic, with GradScaler's defaults."""

    init_scale: float = 2.0 ** 16
    dynamic: bool = True
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


def check_loss_scale(value: Any) -> LossScale | None:
    """`Parallelize`'s loss_scale argument as a LossScale: None, a number > 0 (static), "dynamic", a
    dict of LossScale's fields (dynamic unless it says otherwise) or a LossScale.

    Raises:
        ValueError / TypeError: any other value, a scale <= 0 or not finite, a growth_factor <= 1 or not
            finite, backoff_factor outside (0, 1), growth_interval < 1.
    """
    if value is None or isinstance(value, LossScale):
        scale = value
    elif value == "dynamic":
        scale = LossScale()
    elif isinstance(value, dict):
        unknown = sorted(set(value) - set(LossScale.__dataclass_fields__))
        if unknown:
            raise TypeError(f"loss_scale: unknown keys {unknown}; use {sorted(LossScale.__dataclass_fields__)}")
        scale = LossScale(**value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        scale = LossScale(float(value), dynamic=False)
    else:
        raise TypeError(f"loss_scale={value!r}: use a number > 0 (static), 'dynamic', a dict of "
                        f"graphpar.passes.loss_scale.LossScale fields, or None")
    if scale is not None:
        ok = (0 < scale.init_scale < float("inf") and 1 < scale.growth_factor < float("inf")
              and 0 < scale.backoff_factor < 1 and isinstance(scale.growth_interval, int)
              and scale.growth_interval >= 1)
        if not ok:
            raise ValueError(f"loss_scale: {scale} needs 0 < init_scale < inf, 1 < growth_factor < inf, "
                             f"0 < backoff_factor < 1 and an int growth_interval >= 1")
    return scale


@dataclass(frozen=True)
class CompileOptions:
    """How `Parallelize(compile=...)` compiles the train step (`torch.compile`'s backend and inductor's mode)."""

    backend: str = "inductor"
    mode: str | None = None


def check_compile(value: Any) -> CompileOptions | None:
    """`Parallelize`'s compile argument as CompileOptions: False/None (off), True (inductor's default),
    a mode of inductor (`COMPILE_MODES`), a dict of CompileOptions' fields, or CompileOptions.

    Raises:
        ValueError / TypeError: any other value, an unknown mode, a backend that is not a str.
    """
    if value is None or value is False:
        return None
    if value is True:
        return CompileOptions()
    if isinstance(value, CompileOptions):
        options = value
    elif isinstance(value, str):
        options = CompileOptions(mode=value)
    elif isinstance(value, dict):
        unknown = sorted(set(value) - set(CompileOptions.__dataclass_fields__))
        if unknown:
            raise TypeError(f"compile: unknown keys {unknown}; use {sorted(CompileOptions.__dataclass_fields__)}")
        options = CompileOptions(**value)
    else:
        raise TypeError(f"compile={value!r}: use True, a mode of inductor ({', '.join(COMPILE_MODES)}), a dict "
                        f"with 'backend' and/or 'mode', or False")
    if not isinstance(options.backend, str) or not options.backend:
        raise TypeError(f"compile: backend must be the name of a torch.compile backend, got {options.backend!r}")
    if options.mode is not None and options.mode not in COMPILE_MODES:
        raise ValueError(f"compile: mode must be one of {', '.join(COMPILE_MODES)}, got {options.mode!r}")
    if options.mode is not None and options.backend != "inductor":
        raise ValueError(f"compile: mode {options.mode!r} is inductor's; backend {options.backend!r} takes none")
    return options


_LOW_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "half": "float16", "float32": None, "fp32": None, "float": None}


def check_compute_dtype(value: Any, where: str = "compute_dtype") -> str | None:
    """The canonical name ("bfloat16", "float16") of a compute dtype, or None for fp32 (no rewrite).

    Accepts a name (any case; bf16, fp16, half, float32, ...), a torch dtype or None.

    Raises:
        ValueError: any other value.
    """
    if value is None:
        return None
    name = str(value).removeprefix("torch.").lower() if not isinstance(value, str) else value.lower()
    if name not in _LOW_DTYPES:
        raise ValueError(f"{where}={value!r}: use 'bfloat16' or 'float16' (or None / 'float32' for no mixed "
                         f"precision)")
    return _LOW_DTYPES[name]


def blob_names(names: Iterable[str] | None, what: str) -> tuple[str, ...]:
    """`names` as a tuple of strs; TypeError for anything but an iterable of non-empty strs."""
    if names is None:
        return ()
    listed = () if isinstance(names, str) else tuple(names)
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in listed):
        raise TypeError(f"{what} must be a list of blob names, got {names!r}")
    return tuple(str(n) for n in listed)


# ---- checks: (value, caller) -> canonical value --------------------------------------------------


def _function(name: str, optional: bool = False) -> Check:
    """A callable (or, when `optional`, None); TypeError '<caller>: <name> must be a function, got ...'."""
    def check(value: Any, caller: str) -> Any:
        if not (callable(value) or (optional and value is None)):
            raise TypeError(f"{caller}: {name} must be a function{' or None' if optional else ''}, got "
                            f"{type(value).__name__}")
        return value
    return check


def _int(name: str, low: int, note: str = "") -> Check:
    """An int (not a bool) >= low; ParallelizeError '<caller>: <name> must be an int >= <low><note>, got ...'."""
    def check(value: Any, caller: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ParallelizeError(f"{caller}: {name} must be an int >= {low}{note}, got {value!r}")
        return value
    return check


def _bytes(name: str, low: int) -> Check:
    """None, or an int number of bytes >= low (TypeError for a non-int)."""
    def check(value: Any, caller: str) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{caller}: {name} must be an int number of bytes, got {value!r}")
        if value < low:
            raise ParallelizeError(f"{caller}: {name} must be >= {low} byte, got {value}")
        return value
    return check


def _positive(name: str, unit: str) -> Check:
    """A number (not a bool) > 0; None stays None."""
    def check(value: Any, caller: str) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ParallelizeError(f"{caller}: {name} must be a number of {unit} > 0, got {value!r}")
        return value
    return check


def _flag(name: str) -> Check:
    """True or False (an int 0 or 1 is taken as one); TypeError for anything else (None, a str, ...)."""
    def check(value: Any, caller: str) -> bool:
        if not isinstance(value, int) or value not in (0, 1):
            raise TypeError(f"{caller}: {name} must be True or False, got {value!r}")
        return bool(value)
    return check


def _flag_or_none(name: str) -> Check:
    """None (the option decides), or True or False."""
    flag = _flag(name)
    return lambda value, caller: None if value is None else flag(value, caller)


def _device_ids(value: Any, caller: str) -> tuple[int, ...] | None:
    """None (the default devices), or unique int (not bool) device ids >= 0; which exist is Parallelize's."""
    if value is None:
        return None
    try:
        listed = list(value)
        if any(isinstance(d, bool) for d in listed):  # True is index 1: [True, False] would be devices 1, 0
            raise TypeError
        ids = tuple(operator.index(d) for d in listed)
    except TypeError:
        raise TypeError(f"{caller}: devices must be a list of int device ids, got {value!r}") from None
    if len(set(ids)) != len(ids) or min(ids, default=0) < 0:
        raise ParallelizeError(f"{caller}: device ids must be unique and >= 0, got {list(ids)}")
    return ids


def _rendezvous(value: Any, caller: str) -> Any:
    """None, a parsed Rendezvous or Caffe2's dict (its keys and values are checked by `parse_rendezvous`,
    which may ask torch.distributed, so Parallelize calls it)."""
    if value is not None and not isinstance(value, (Mapping, Rendezvous)):
        raise ParallelizeError(f"{caller}: rendezvous must be a dict, got {type(value).__name__}")
    return value


def _net_type(value: Any, caller: str) -> str:
    """A non-empty str (which executors exist is the executor registry's; Parallelize asks it)."""
    if not isinstance(value, str) or not value:
        raise ParallelizeError(f"{caller}: net_type must be the name of an executor type, got {value!r}")
    return value


BnGroups = tuple[tuple[int, ...], ...]


def _spatial_bn(value: Any, caller: str) -> bool | str | BnGroups:
    """True, False, "shard", or groups of shards: a list of lists of shard ids (torch.distributed's
    `new_group` ranks), or a torch.distributed ProcessGroup (its ranks are this shard's group)."""
    if isinstance(value, (bool, str)) or (isinstance(value, int) and value in (0, 1)):
        if value not in (True, False, "shard"):
            raise ParallelizeError(f"{caller}: combine_spatial_bn must be True, False, 'shard' or groups of shard "
                                   f"ids, got {value!r}")
        return value if isinstance(value, str) else bool(value)
    if _is_process_group(value):
        import torch.distributed as dist

        value = [dist.get_process_group_ranks(value)]
    try:
        groups = tuple(tuple(int(_shard_id(r)) for r in group) for group in value)
    except (TypeError, ValueError):
        raise ParallelizeError(f"{caller}: combine_spatial_bn must be True, False, 'shard' (statistics over this "
                               f"shard's devices only), a list of groups of shard ids (as torch.distributed."
                               f"new_group's ranks, e.g. [[0, 1], [2, 3]]) or a torch ProcessGroup, got "
                               f"{value!r}") from None
    ids = [r for group in groups for r in group]
    if not groups or not all(groups) or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ParallelizeError(f"{caller}: combine_spatial_bn's groups must be non-empty groups of distinct shard "
                               f"ids >= 0, each shard in one group at most, got {value!r}")
    return groups


def _is_process_group(value: Any) -> bool:
    return type(value).__name__ == "ProcessGroup" and type(value).__module__.startswith("torch")


def _shard_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(value)
    return value


def _names(name: str) -> Check:
    return lambda value, caller: blob_names(value, name)


def _low_dtype(name: str) -> Check:
    def check(value: Any, caller: str) -> str | None:
        try:
            return check_compute_dtype(value, f"{caller}: {name}")
        except ValueError as exc:
            raise ParallelizeError(str(exc)) from None
    return check


def _loss_scale(value: Any, caller: str) -> LossScale | None:
    try:
        return check_loss_scale(value)
    except ValueError as exc:
        raise ParallelizeError(str(exc)) from None


def _compile(value: Any, caller: str) -> CompileOptions | None:
    try:
        return check_compile(value)
    except ValueError as exc:
        raise ParallelizeError(f"{caller}: {exc}") from None
    except TypeError as exc:
        raise TypeError(f"{caller}: {exc}") from None


def _seconds(value: Any, caller: str) -> float:
    return float(_positive("barrier_net_timeout_sec", "seconds")(value, caller))


# ---- the declarations ------------------------------------------------------------------------------

_REQUIRED = MISSING


def option(default: Any, doc: str, check: Check | None = None) -> Any:
    """A field of ParallelizeOptions: one Parallelize argument, its default (`_REQUIRED`: none), the check
    its given value goes through (None: kept as given) and its doc (the docstring's Args entry)."""
    metadata = {"doc": textwrap.dedent(doc).strip(), "check": check}
    return field(metadata=metadata) if default is _REQUIRED else field(default=default, metadata=metadata)


def derived(default: Any, doc: str) -> Any:
    """A field of ParallelizeOptions that Parallelize derives from other options (not an argument)."""
    return field(default=default, metadata={"doc": doc, "check": None, "derived": True})


@dataclass(frozen=True, kw_only=True)
class ParallelizeOptions:
    """Parallelize's options after checking (see the module docstring); built by name."""

    input_builder_fun: Builder = option(_REQUIRED, """
        `f(model)`, per device, inside the device's scopes (may add nothing).""",
        _function("input_builder_fun"))
    forward_pass_builder_fun: Builder = option(_REQUIRED, """
        `f(model, loss_scale) -> [loss, ...]`, per device, scoped; the user multiplies each loss by
        `loss_scale` = 1/len(devices). Training needs a list of BlobReferences.""",
        _function("forward_pass_builder_fun"))
    param_update_builder_fun: Builder | None = option(None, """
        `f(model)` per device, scoped: records that replica's updates.""",
        _function("param_update_builder_fun", optional=True))
    optimizer_builder_fun: Builder | None = option(None, """
        `f(model)` once, unscoped (e.g. `optimizer.build_sgd`); its result is kept as `model._optimizer`.
        At most one of the two update builders; none = forward only.""",
        _function("optimizer_builder_fun", optional=True))
    post_sync_builder_fun: Builder | None = option(None, """
        `f(model)` per device, scoped, after the initial sync was added.""",
        _function("post_sync_builder_fun", optional=True))
    pre_grad_net_transformer_fun: Builder | None = option(None, """
        `f(model)` once, before the gradient ops are added.""",
        _function("pre_grad_net_transformer_fun", optional=True))
    net_transformer_fun: Builder | None = option(None, """
        `f(model, num_devices, prefix, device_type)` exactly once, after the gradient ops (train and test
        models alike).""", _function("net_transformer_fun", optional=True))
    devices: tuple[int, ...] | None = option(None, """
        device ids (need not start at 0); default all CUDA devices, or `os.cpu_count()` CPU devices with
        `cpu_device`.""", _device_ids)
    rendezvous: Rendezvous | None = option(None, """
        train over several processes (shards, on one machine or many), each owning `devices`: Caffe2's
        dict `{"shard_id", "num_shards", "engine": "GLOO"|"NCCL", "kv_handler", ...}` (engine default:
        NCCL on real CUDA devices when torch has it, else GLOO; see `graphpar.distributed.parse_rendezvous`;
        `kv_handler` a torch.distributed Store, the name of a blob written by FileStoreHandlerCreate /
        TCPStoreHandlerCreate, or None for torch.distributed's default group or env://). loss_scale
        becomes 1/(devices * num_shards); every gradient (or bucket) is summed onto the first device,
        all-reduced across shards and copied back; computed params, the initial sync, AddBlobSync and
        FinalizeAfterCheckpoint broadcast from shard 0's first device (average_computed_params averages
        over every replica of every shard). `RunInitNet` checks that every shard built the same model and
        ends at a barrier; combine_spatial_bn uses the statistics of every shard's batch; sparse gradients
        are gathered across shards (`Allgather`). Not with shared_model.""", _rendezvous)
    net_type: str = option("dag", """
        the train net's executor type.""", _net_type)
    broadcast_computed_params: bool = option(True, """
        copy computed params (BN running stats) from the first device to the others every iteration.""",
        _flag("broadcast_computed_params"))
    optimize_gradient_memory: bool = option(False, """
        each replica's gradient blobs whose lifetimes do not overlap share one name (Caffe2's memonger,
        `passes.memonger`), so a step holds fewer of them; param gradients are never shared. Same results;
        may be combined with dynamic_memory_management (Caffe2 refused the combination).""",
        _flag("optimize_gradient_memory"))
    dynamic_memory_management: bool = option(False, """
        the train net frees every intermediate right after its last use within a step and keeps only
        persistent blobs (params, optimizer state, fed inputs, counters), each replica's losses and
        `blobs_to_keep` (see `graphpar.executor.frame`); fetching a freed blob afterwards raises an error
        naming the option. Same results.""", _flag("dynamic_memory_management"))
    blobs_to_keep: tuple[str, ...] = option(None, """
        unscoped names kept on every replica under dynamic_memory_management.""", _names("blobs_to_keep"))
    use_nccl: bool = option(False, """
        all-reduce CUDA gradients with `NCCLAllreduce` instead of a Sum tree.""", _flag("use_nccl"))
    max_concurrent_distributed_ops: int = option(16, """
        with a rendezvous, the communicators cross-shard collectives take turns on: up to that many are in
        flight at once (an int >= 1).""", _int("max_concurrent_distributed_ops", 1))
    cpu_device: bool = option(False, """
        replicas `cpu_<id>` on the CPU instead of `gpu_<id>` on CUDA.""", _flag("cpu_device"))
    ideep: bool = option(False, """
        Caffe2's MKL-DNN CPU devices; here the same as `cpu_device=True` (torch's CPU kernels use oneDNN
        themselves), replicas named `cpu_<id>`.""", _flag("ideep"))
    num_threads_per_device: int = option(4, """
        `num_workers = len(devices) * num_threads_per_device` for the train net's executor.""",
        _int("num_threads_per_device", 1))
    shared_model: bool = option(False, """
        CPU only: every replica reads the first device's params (one copy updated).""", _flag("shared_model"))
    combine_spatial_bn: bool | str | BnGroups = option(False, """
        training batch norm uses the statistics of the whole global batch (interleaved replicas,
        per-device sums and value counts all-reduced, so devices fed batches of different sizes still get
        the whole batch's statistics); forward-only models ignore it. "shard": the statistics of this
        shard's devices only (SyncBatchNorm with a process group of one process); groups of shards
        (`[[0, 2], [1, 3]]`, as torch.distributed.new_group's ranks, or a torch ProcessGroup as
        SyncBatchNorm's process_group): the statistics of the devices of this shard's group; the
        gradients are all-reduced over every shard either way.""", _spatial_bn)
    barrier_net_timeout_sec: float = option(300, """
        with a rendezvous, how long RunInitNet's barrier waits for the others.""", _seconds)
    static_shapes: bool = option(False, """
        (later Caffe2 versions' argument) promise that every step feeds inputs of one shape and dtype: the
        nets RunNet runs carry the net argument `static_shapes` (`core.naming.STATIC_SHAPES_ARG`), so the
        engine may compile the step for those shapes, and running them refuses a fed input whose shape or
        dtype differs from the one it had at CreateNet (or, fed later, at the first run): a ValueError
        naming the blob, before anything changes. Feed full batches (a loader's `drop_last=True`).""",
        _flag("static_shapes"))
    gradient_bucket_bytes: int | None = option(None, """
        None (default): on real CUDA devices buckets of DDP's default 25 MiB (`bucket_cap_mb=25`, the
        first bucket 1 MiB; each gradient on its own when a param's size cannot be told), elsewhere (CPU
        devices, CUDA simulated on the CPU) each gradient on its own; 0: each gradient on its own on CUDA
        too. An int >= 1 all-reduces them in buckets, as PyTorch DDP does: in the same reverse creation
        order, the gradients are packed into buckets that close once they hold at least this many
        bytes (the first bucket `first_bucket_bytes`; each dtype fills buckets of its own: DDP's
        assignment, `passes.bucketing.plan_buckets`); per device each bucket is flattened into one buffer (FlattenToVec + Concat), the buffers
        are all-reduced by one collective (Sum tree or NCCLAllreduce), then split and reshaped back into
        the gradient blobs. Sizes come from shape inference on the ops of param_init_net that create each
        param; a param whose size it cannot tell raises ParallelizeError naming it. See
        `graphpar.passes.bucketing`.""", _bytes("gradient_bucket_bytes", 0))
    first_bucket_bytes: int = option(1024 * 1024, """
        the first bucket's limit (default 1 MiB, DDP's), an int >= 1, so the first collective can start
        early; used only with buckets.""", _bytes("first_bucket_bytes", 1))
    bucket_cap_mb: float | None = option(None, """
        DDP's name for the bucket size, in MiB (a number > 0); instead of gradient_bucket_bytes, not with
        it.""", _positive("bucket_cap_mb", "MiB"))
    average_computed_params: bool = option(False, """
        instead (whatever broadcast_computed_params says), replace every replica's computed params by their
        mean over the replicas every iteration (all-reduce, then Scale by 1/N), at the same place in the
        net. Off by default, as in Caffe2.""", _flag("average_computed_params"))
    uneven_batches: bool = option(False, """
        allow `graphpar.data.feed` to give devices chunks of different sizes (a batch that is not a
        multiple of the device count): each replica's loss gradient is multiplied by its fed
        `_batch_weight` blob, N·n_d/n, so the gradients are those of the whole batch. `feed` must then
        feed every step (the train net reads the blob).""", _flag("uneven_batches"))
    check_finite_loss: bool | None = option(None, """
        stop every step whose loss is NaN or infinite before it updates anything: a `CheckFinite` op per
        replica on its losses (placed before the gradients) makes RunNet raise an OperatorError naming
        the loss, with params, optimizer state and counters unchanged. It reads each loss on the host (one
        device sync per replica and step), so the default (None) is on for training CPU replicas, where
        that costs a few µs per step (docs/errors.md), and off on CUDA, where the sync would stall the
        step's queue, and for models without an optimizer (an evaluation reports a NaN loss); pass True
        or False to choose. See docs/errors.md.""", _flag_or_none("check_finite_loss"))
    accumulate_gradients: int = option(1, """
        k >= 1 micro-batches per update (DDP's `no_sync`): `model._accumulate_net` runs forward and
        backward and adds the gradients to running sums (no all-reduce); the train net adds its own
        micro-batch, all-reduces the mean once and updates. Run the accumulate net k - 1 times, then
        `RunNet` (engine.Trainer does); the same update as one step on the k-times batch. See
        `graphpar.passes.accumulate`.""", _int("accumulate_gradients", 1, " (micro-batches per update)"))
    cpu_update_once: bool = option(True, """
        (default on) CPU replicas of one process (not shared_model) run each update once, on the first
        device: the other replicas' params, optimizer state and summed gradients become aliases of the
        first device's tensors (no copies, no repeated updates; see `graphpar.passes.cpu_update_once`).
        Same results, bit for bit; a value fed to one replica's param or state alone is replaced by the
        first device's at the next step. Ignored on CUDA, across shards and with sharded state.""",
        _flag("cpu_update_once"))
    cuda_graph: bool = option(False, """
        capture the whole train step in a CUDA graph after warm-up and replay it on every RunNet (net type
        "cuda_graph", whatever net_type says; one CUDA device; see docs/engine.md).""", _flag("cuda_graph"))
    compile: CompileOptions | None = option(None, """
        compile the train step with torch.compile (net type "compiled", whatever net_type says; see
        docs/engine.md): True (inductor, its default mode), a mode of inductor ("reduce-overhead": its
        CUDA graphs; "max-autotune"), or a dict of `CompileOptions` fields ({"backend": "aot_eager"}
        compiles fast and fuses nothing). The train net then frees its intermediates
        (dynamic_memory_management=True), so that they stay inside the compiled program: keep what you
        fetch with blobs_to_keep. The first run compiles (seconds to minutes). Not with cuda_graph.""",
        _compile)
    compute_dtype: str | None = option(None, """
        "bfloat16" or "float16" trains in mixed precision (`graphpar.passes.precision`,
        docs/precision.md): Conv, FC, their gradients and the element-wise ops between them compute in
        that dtype; params stay fp32 masters; losses, softmax, batch-norm statistics, reductions, the
        gradient all-reduce and the updates stay fp32. None (default) or "float32": no rewrite.""",
        _low_dtype("compute_dtype"))
    loss_scale: LossScale | None = option(None, """
        scale the loss gradients for float16 (`graphpar.passes.loss_scale`): a number S > 0 (static, as
        Caffe2's trainer), "dynamic" (torch.amp.GradScaler's policy: start at 2**16, double after 2000
        good steps, halve on overflow) or a dict of `LossScale` fields. Gradients are divided by S after
        the all-reduce; a step whose gradients hold an inf or a NaN on any replica or shard is skipped
        everywhere (RunNet logs a warning; params, optimizer state and the iteration counter unchanged)
        and, when dynamic, S shrinks. S is replica state (checkpointed).""", _loss_scale)
    channels_last: bool = option(False, """
        keep an NCHW model's activations in torch.channels_last memory format (cuDNN's fast path): the
        input of the first Conv is converted once, and no conversion is left between consecutive convs
        (`graphpar.passes.channels_last`). Same values and shapes.""", _flag("channels_last"))
    allreduce_dtype: str | None = option(None, """
        "bfloat16" or "float16" all-reduces the fp32 dense gradients in that dtype (half the bytes, as
        DDP's bf16/fp16 compression hooks): each copy is cast down, summed, and the sum cast back to fp32
        before the update. float16 holds at most 65504: with a loss_scale an overflowing step is skipped
        as any overflow; without one the sums are checked (one host read per step) and a step that
        overflowed raises before any update. None (default): gradients are all-reduced in their own dtype
        (fp32 masters: fp32). One process only (not with a rendezvous).""", _low_dtype("allreduce_dtype"))
    shard_optimizer_state: bool = option(False, """
        ZeRO stage 1 (`graphpar.passes.shard_updates`, docs/sharding.md): every replica of every shard keeps
        1/N of the optimizer state (N replicas in all) and updates only its part of each flattened param,
        then the params are all-gathered; the gradients are still all-reduced. Updates must work element
        by element (SGD, momentum, Nesterov, weight decay, Adam, Adagrad, RmsProp, Adadelta, RAdam; LARS
        and gradient clipping read the whole gradients); anything else is refused, before the model
        changes. Same params as unsharded, bit for bit with Sum trees; `GetCheckpointParams` and
        `FinalizeAfterCheckpoint` gather and cut the state, so checkpoints keep one format. Not with
        shared_model, sparse (GradientSlice) gradients or BMUF.""", _flag("shard_optimizer_state"))
    shard_gradients: bool = option(False, """
        ZeRO stage 2 (implies shard_optimizer_state): the gradients are reduce-scattered instead of
        all-reduced, so each replica holds only its part of each summed gradient. Not with gradient
        buckets, allreduce_dtype, LARS or gradient clipping (they read whole gradients), nor with
        loss_scale across shards.""", _flag("shard_gradients"))
    auto_buckets: bool = derived(False, "gradient_bucket_bytes is the CUDA default: per gradient if sizes are "
                                        "unknown")

    @property
    def num_shards(self) -> int:
        """How many processes train the model together (1 without a rendezvous)."""
        return 1 if self.rendezvous is None else self.rendezvous.num_shards

    @property
    def training(self) -> bool:
        """Whether the model gets gradients and updates (an update builder was given)."""
        return self.param_update_builder_fun is not None or self.optimizer_builder_fun is not None


def declared() -> list[Field]:
    """The options Parallelize takes as arguments, in its signature's order."""
    return [f for f in fields(ParallelizeOptions) if not f.metadata.get("derived")]


def checked(values: Mapping[str, Any], caller: str) -> dict[str, Any]:
    """Every option's value: as given in `values` (option name -> value) or its default, after its check;
    `caller` names the function in the errors."""
    options = {}
    for f in declared():
        value = values[f.name] if f.name in values or f.default is MISSING else f.default
        options[f.name] = value if f.metadata["check"] is None else f.metadata["check"](value, caller)
    return options


def args_doc(indent: str = "        ", width: int = 108) -> str:
    """The docstring's Args entries of the options, from the declarations."""
    return "\n".join(textwrap.fill(f"{f.name}: {' '.join(f.metadata['doc'].split())}", width, initial_indent=indent,
                                   subsequent_indent=indent + "    ") for f in declared())
