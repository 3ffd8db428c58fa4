"""Blob naming conventions, in one place: gradients, optimizer state, device scopes."""

from __future__ import annotations

from collections.abc import Iterable

from graphpar.core.ir import GradientSlice

SCOPE_SEPARATOR = "/"
SHARD_SUFFIX = "_shard"
BATCH_WEIGHT = "_batch_weight"  # per replica, with Parallelize(uneven_batches=True): N·n_d/n, fed by data.feed


def grad_name(blob: str) -> str:
    """The dense gradient blob of `blob` (Caffe2: `x` -> `x_grad`)."""
    return f"{blob}_grad"


def accumulated_grad_name(grad: str) -> str:
    """The running sum of `grad` over micro-batches (`accumulate_gradients`): 'x_grad' -> 'x_grad_accumulated'."""
    return f"{grad}_accumulated"


def autosplit_grad_name(grad: str, k: int) -> str:
    """The k-th renamed partial gradient that a `Sum` later accumulates into `grad`."""
    return f"_{grad}_autosplit_{k}"


def bucket_name(first_grad: str, k: int) -> str:
    """The flat buffer of gradient bucket k, in the name scope of its first gradient:
    ('gpu_0/fc_w_grad', 1) -> 'gpu_0/_bucket_1'."""
    return f"{name_scope_of(first_grad)}_bucket_{k}"


def flat_name(blob: str) -> str:
    """`blob` flattened to 1-D (a bucket's piece): 'gpu_0/fc_w_grad' -> 'gpu_0/fc_w_grad_flat'."""
    return f"{blob}_flat"


def split_info_name(blob: str) -> str:
    """The sizes a `Concat` into `blob` records (its second output): 'gpu_0/_bucket_1_split_info'."""
    return f"{blob}_split_info"


def old_shape_name(blob: str) -> str:
    """The former shape a `Reshape` of `blob` records (its second output): 'gpu_0/fc_w_grad_old_shape'."""
    return f"{blob}_old_shape"


def shard_name(blob: str) -> str:
    """This replica's shard of `blob` (`shard_optimizer_state`): 'gpu_1/fc_w_momentum' -> 'gpu_1/fc_w_momentum_shard'."""
    return f"{blob}{SHARD_SUFFIX}"


def unsharded_name(blob: str) -> str | None:
    """The blob `blob` is a shard of ('gpu_1/fc_w_momentum_shard' -> 'gpu_1/fc_w_momentum'), else None."""
    return blob[: -len(SHARD_SUFFIX)] if blob.endswith(SHARD_SUFFIX) else None


def gathered_name(blob: str) -> str:
    """Every replica's shard of `blob` concatenated (1-D): 'gpu_0/fc_w' -> 'gpu_0/fc_w_gathered'."""
    return f"{blob}_gathered"


def part_name(blob: str, k: int) -> str:
    """Part k of `blob` cut into one piece per shard: ('gpu_0/fc_w_grad', 1) -> 'gpu_0/fc_w_grad_part_1'."""
    return f"{blob}_part_{k}"


def name_scope_of(blob: str) -> str:
    """Everything up to and including the last '/', e.g. 'gpu_1/' for 'gpu_1/fc_w'."""
    cut = blob.rfind(SCOPE_SEPARATOR)
    return blob[: cut + 1] if cut >= 0 else ""


def unscoped_name(blob: str) -> str:
    """The part after the last '/'."""
    return blob[blob.rfind(SCOPE_SEPARATOR) + 1 :]


def device_prefix(cpu_device: bool) -> str:
    """The replica name-scope prefix: 'cpu' or 'gpu'."""
    return "cpu" if cpu_device else "gpu"


def device_scope_name(prefix: str, device_id: int) -> str:
    """The replica name scope without the trailing '/', e.g. 'gpu_3'."""
    return f"{prefix}_{device_id}"


def device_scoped(prefix: str, device_id: int, name: str) -> str:
    """`name` inside replica `device_id`'s scope, e.g. 'gpu_3/fc_w'."""
    return f"{prefix}_{device_id}{SCOPE_SEPARATOR}{name}"


def parse_device_scope(blob: str) -> tuple[str, int] | None:
    """('gpu', 3) for 'gpu_3/...' (also 'cpu_1/...'); None for a blob outside any replica scope."""
    head, sep, _ = blob.partition(SCOPE_SEPARATOR)
    if not sep:
        return None
    prefix, _, index = head.rpartition("_")
    if prefix not in ("gpu", "cpu") or not index.isdigit():
        return None
    return prefix, int(index)


def first_replica_blobs(names: Iterable[str], available: Iterable[str]) -> dict[str, str]:
    """{name: its first replica's blob} for each name of `names` outside any replica scope that `available`
    lacks but a replica holds: 'fc_w' -> 'cpu_0/fc_w' (the lowest device id). That is the blob
    `data_parallel_model.ExtractPredictorNet` names 'fc_w' in its predictor, so a checkpoint can save and
    load a predictor's params by the predictor's names. Names no replica holds are left out.

    Raises:
        ValueError: both CPU and GPU replicas hold a name (which one is meant is unclear).
    """
    present = set(available)
    wanted = {n for n in names if n not in present and parse_device_scope(n) is None}
    if not wanted:
        return {}
    holders: dict[str, list[tuple[str, int, str]]] = {}
    for blob in present:
        scope = parse_device_scope(blob)
        if scope is not None and (base := blob.split(SCOPE_SEPARATOR, 1)[1]) in wanted:
            holders.setdefault(base, []).append((*scope, blob))
    found = {}
    for name, replicas in holders.items():
        prefixes = sorted({prefix for prefix, _, _ in replicas})
        if len(prefixes) > 1:
            raise ValueError(f"blob {name!r} is held by replicas of several device types "
                             f"({', '.join(p + '_*' for p in prefixes)}): name the one meant, e.g. "
                             f"{min(replicas)[2]!r}")
        found[name] = min(replicas)[2]
    return found


def stripBlobName(blob: str | GradientSlice) -> str:  # noqa: N802 - Caffe2 name
    """The name without its replica scope: 'gpu_0/fc_w' -> 'fc_w'; unscoped names come back unchanged.

    Caffe2 used `str.index('/')`, which raised on unscoped names; graphpar accepts them.
    """
    if isinstance(blob, GradientSlice):
        return f"{stripBlobName(blob.indices)}:{stripBlobName(blob.values)}"
    return blob.split(SCOPE_SEPARATOR, 1)[1] if SCOPE_SEPARATOR in blob else str(blob)


def shared_blob_name(namescope: str, k: int) -> str:
    """The k-th name blobs of `namescope` share under the memory optimiser (Caffe2's `__m{k}_shared`)."""
    return f"{namescope}__m{k}_shared"


def momentum_name(param: str) -> str:
    """The momentum state blob of `param` under SGD with momentum (Caffe2: `fc_w` -> `fc_w_momentum`)."""
    return f"{param}_momentum"


def adam_moment_names(param: str) -> tuple[str, str]:
    """Adam's first and second moment blobs of `param` (Caffe2's names)."""
    return f"{param}_first_moment", f"{param}_second_moment"


OPTIMIZER_ITERATION = "optimizer_iteration"  # the model's one unscoped CPU iteration counter (Caffe2's name)
LR_INJECTION = "lr_injection"  # the CPU multiplier blob of `allow_lr_injection` (Caffe2's name)
DYNAMIC_MEMORY_ARG = "dynamic_memory_management"  # net argument: free intermediates at their last use
KEEP_ARG = "blobs_to_keep"  # net argument: blobs a run keeps whatever else holds
FIRST_ITER_ARG = "first_iter_only_one_worker"  # net argument: the dag runs the first run serially
COMPILE_BACKEND_ARG = "compile_backend"  # net argument of a "compiled" net: torch.compile's backend
COMPILE_MODE_ARG = "compile_mode"  # net argument of a "compiled" net: inductor's mode ("reduce-overhead", ...)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # inductor's modes
# net argument: every run feeds inputs of the shapes and dtypes they had at CreateNet (or the first run);
# RunNet refuses others (runtime.static_shapes), so an executor may compile without dynamic shapes
STATIC_SHAPES_ARG = "static_shapes"
# net argument: replica state that a run rebinds to the first device's tensors (passes.cpu_update_once):
# written without being read, yet persistent, and its loaded value is in use (graphpar.resume)
ALIASED_STATE_ARG = "aliased_state"
CROSS_REPLICA_SUM_NAME = "dpm"  # the name of the cross-replica Sum ops Parallelize adds (Caffe2's marker)


LOSS_SCALE = "_loss_scale"  # per replica, with Parallelize(loss_scale=...): the scale S of the loss gradients
LOSS_SCALE_GOOD_STEPS = "_loss_scale_good_steps"  # per replica, dynamic scaling: steps since S last changed
_CAST_SUFFIX = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def cast_name(blob: str, dtype: str) -> str:
    """The blob the mixed-precision pass casts `blob` into for `dtype` ("bfloat16", "float16", "float32")."""
    return f"{blob}_{_CAST_SUFFIX[dtype]}"
