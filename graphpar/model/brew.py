"""brew: layer helpers that create a layer's parameters and record its op, with Caffe2's names.

Every helper takes the model first: `brew.fc(model, "data", "fc1", dim_in=64, dim_out=32)` creates
`fc1_w` [32, 64] (XavierFill) and `fc1_b` [32] (ConstantFill 0) in `model.param_init_net` and records
`FC([data, fc1_w, fc1_b], fc1)` in `model.net`. Keyword arguments merge in increasing priority:
`model.arg_scope` (only the keys a helper names, unless it takes **kwargs, whose extra keys go to the
op as arguments), then active `brew.arg_scope` contexts, then the call's own arguments (positional
ones included). `brew.Register` adds custom helpers that get the same merging.

Arguments every helper shares: `model` (the ModelHelper), `blob_in` (or a list `blobs_in`) and
`blob_out` (plain names get the current name scope, BlobReferences are taken as they are), and
`**kwargs`, passed to the op as its arguments. Sizes (`dim_in`, `dim_out`, `kernel`) are ints (numpy
integers too). Each helper returns the BlobReference of its (first) output and raises TypeError when
the first argument is not a ModelHelper; an op argument the op does not know, or of the wrong kind,
raises TypeError, and a parameter re-created with another shape ValueError (`create_param`).
"""

from __future__ import annotations

import functools
import inspect
import numbers
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from graphpar.core.dataflow import dataflow
from graphpar.core.ir import CPU, BlobReference, DeviceOption
from graphpar.core.scope import DeviceScope, ScopedName
from graphpar.errors import DuplicateHelperError
from graphpar.model.model_helper import Initializer, ModelHelper, ParameterTags

_HELPERS: dict[str, Callable[..., Any]] = {}
_scope = threading.local()


def _current_arg_scope() -> dict[str, dict[str, Any]]:
    """Helper name -> the keyword arguments active `arg_scope` contexts give it."""
    return getattr(_scope, "helpers", {})


def Register(helper: Callable[..., Any]) -> Callable[..., Any]:  # noqa: N802 - Caffe2 name
    """Make `helper(model, ...)` available as `brew.<helper name>` with arg-scope merging; return it.

    Raises:
        DuplicateHelperError: a helper of that name already exists (a ValueError and, as in Caffe2,
            an AttributeError).
    """
    name = helper.__name__
    if name in _HELPERS:
        raise DuplicateHelperError(f"brew helper {name!r} already exists; give your helper another name")
    signature = inspect.signature(helper)
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    named = frozenset(signature.parameters)

    @functools.wraps(helper)
    def call(*args: Any, **kwargs: Any) -> Any:
        model = args[0] if args else kwargs.get("model")
        if not isinstance(model, ModelHelper):
            raise TypeError(f"brew.{name}: the first argument must be a ModelHelper, got "
                            f"{type(model).__name__}")
        merged = {k: v for k, v in model.arg_scope.items() if takes_kwargs or k in named}
        merged.update(_current_arg_scope().get(name, {}))
        for bound in signature.bind_partial(*args).arguments:  # positional arguments win over scopes
            merged.pop(bound, None)
        merged.update(kwargs)
        return helper(*args, **merged)

    _HELPERS[name] = call
    return call


def __getattr__(name: str) -> Callable[..., Any]:
    """Helpers added with `Register` after import."""
    helper = _HELPERS.get(name)
    if helper is None:
        raise AttributeError(f"module 'graphpar.brew' has no helper {name!r} (helpers: "
                             f"{', '.join(sorted(_HELPERS))}; add one with brew.Register)")
    return helper


def has_helper(helper: str | Callable[..., Any]) -> bool:
    """Whether a helper of that name (a str, or a function's `__name__`) is registered (Caffe2's rule)."""
    return (helper if isinstance(helper, str) else getattr(helper, "__name__", None)) in _HELPERS


@contextmanager
def arg_scope(helpers: Callable[..., Any] | Sequence[Callable[..., Any]], **kwargs: Any) -> Iterator[None]:
    """Within the block, `helpers` (one or a list of brew helpers) get `kwargs` as defaults.

    Nested scopes add to (and override) the outer ones; explicit arguments still win.

    Raises:
        TypeError: something that is not a registered brew helper.
    """
    helpers = [helpers] if callable(helpers) else list(helpers)
    for helper in helpers:
        if not callable(helper) or not has_helper(helper):
            raise TypeError(f"brew.arg_scope takes brew helpers (e.g. brew.fc, or a function given to "
                            f"brew.Register), got {helper!r}")
    old = _current_arg_scope()
    _scope.helpers = {**old, **{h.__name__: {**old.get(h.__name__, {}), **kwargs} for h in helpers}}
    try:
        yield
    finally:
        _scope.helpers = old


def _suffixed(blob: str, suffix: str, prefix: str = "") -> str:
    """`prefix + name + suffix` inside the blob's own name scope ('gpu_0/d' -> 'gpu_0/_d_mask').

    A str stays a str (the net name-scopes it); a BlobReference stays one (taken as is). Caffe2
    prepended the prefix to the whole name, putting '_' before the scope; graphpar keeps the scope.
    """
    if not isinstance(blob, str):
        raise TypeError(f"brew: output blob names must be strings, got {type(blob).__name__} {blob!r}")
    cut = blob.rfind("/") + 1
    name = blob[:cut] + prefix + blob[cut:] + suffix
    return BlobReference(name) if isinstance(blob, BlobReference) else name


def _initializer(cls: type | None, op_and_kwargs: Sequence[Any] | None,
                 default: tuple[str, dict[str, Any]]) -> Initializer:
    """Caffe2's `update_initializer`: `cls` (default Initializer) built from `(op_name, kwargs)`."""
    op_and_kwargs = default if op_and_kwargs is None else op_and_kwargs
    if (not isinstance(op_and_kwargs, (tuple, list)) or len(op_and_kwargs) != 2
            or not isinstance(op_and_kwargs[0], str) or not isinstance(op_and_kwargs[1], dict)):
        raise TypeError(f"brew: an initializer is an (op_name, kwargs) pair such as ('GaussianFill', "
                        f"{{'std': 0.01}}), got {op_and_kwargs!r}")
    return (cls or Initializer)(op_and_kwargs[0], **op_and_kwargs[1])


def _kernel_args(kernel: int | Sequence[int]) -> tuple[tuple[int, int], dict[str, int]]:
    """((kh, kw), the Conv arguments naming them) for an int or a [kh, kw] kernel."""
    def integer(k: Any) -> bool:
        return isinstance(k, numbers.Integral) and not isinstance(k, bool)

    if isinstance(kernel, numbers.Integral) and not isinstance(kernel, bool):
        return (int(kernel), int(kernel)), {"kernel": int(kernel)}
    if isinstance(kernel, (list, tuple)) and len(kernel) == 2 and all(integer(k) for k in kernel):
        kh, kw = int(kernel[0]), int(kernel[1])
        return (kh, kw), {"kernel_h": kh, "kernel_w": kw}
    raise ValueError(f"brew.conv: kernel must be an int or [kernel_h, kernel_w] (2-D only), got {kernel!r}")


@Register
def fc(model: ModelHelper, blob_in: str, blob_out: str, dim_in: int, dim_out: int,
       weight_init: tuple[str, dict] | None = None, bias_init: tuple[str, dict] | None = None,
       WeightInitializer: type | None = None, BiasInitializer: type | None = None,  # noqa: N803
       **kwargs: Any) -> BlobReference:
    """FC: `<out>_w` [dim_out, dim_in] XavierFill (WEIGHT), `<out>_b` [dim_out] ConstantFill 0 (BIAS).

    `weight_init`/`bias_init` are `(op_name, kwargs)` pairs; `WeightInitializer`/`BiasInitializer`
    are Initializer classes; other kwargs (e.g. `axis`) go to the FC op. Caffe2's
    `enable_tensor_core` (a cuDNN/cuBLAS math mode) is consumed here, as Caffe2's helper does, and
    ignored: PyTorch picks the math mode.
    """
    kwargs.pop("enable_tensor_core", None)
    weight = model.create_param(_suffixed(blob_out, "_w"), [dim_out, dim_in],
                                _initializer(WeightInitializer, weight_init, ("XavierFill", {})),
                                ParameterTags.WEIGHT)
    bias = model.create_param(_suffixed(blob_out, "_b"), [dim_out],
                              _initializer(BiasInitializer, bias_init, ("ConstantFill", {})),
                              ParameterTags.BIAS)
    return model.net.FC([blob_in, weight, bias], blob_out, **kwargs)


@Register
def conv(model: ModelHelper, blob_in: str, blob_out: str, dim_in: int, dim_out: int,
         kernel: int | Sequence[int], weight_init: tuple[str, dict] | None = None,
         bias_init: tuple[str, dict] | None = None, WeightInitializer: type | None = None,  # noqa: N803
         BiasInitializer: type | None = None, group: int = 1, order: str = "NCHW",  # noqa: N803
         **kwargs: Any) -> BlobReference:
    """2-D Conv: `<out>_w` [dim_out, dim_in/group, kh, kw] XavierFill, `<out>_b` [dim_out] unless no_bias.

    With `order="NHWC"` the filter is [dim_out, kh, kw, dim_in/group], as in Caffe2. `stride`, `pad`,
    `dilation` and other kwargs go to the Conv op; `group` is passed when not 1. Caffe2's
    `enable_tensor_core` (cuDNN math mode) is accepted and ignored: PyTorch picks the math mode.

    Raises:
        ValueError: a layout other than NCHW/NHWC, a bad kernel, or dim_in not divisible by group.
    """
    kwargs.pop("enable_tensor_core", None)
    if order not in ("NCHW", "NHWC"):
        raise ValueError(f"brew.conv({blob_out!r}): order must be 'NCHW' or 'NHWC', got {order!r}")
    if group < 1 or dim_in % group:
        raise ValueError(f"brew.conv({blob_out!r}): dim_in={dim_in} must be divisible by group={group}")
    (kh, kw), kernel_args = _kernel_args(kernel)
    no_bias = bool(kwargs.pop("no_bias", False))
    inputs = [blob_in, model.create_param(
        _suffixed(blob_out, "_w"),
        [dim_out, dim_in // group, kh, kw] if order == "NCHW" else [dim_out, kh, kw, dim_in // group],
        _initializer(WeightInitializer, weight_init, ("XavierFill", {})), ParameterTags.WEIGHT)]
    if not no_bias:
        inputs.append(model.create_param(_suffixed(blob_out, "_b"), [dim_out],
                                         _initializer(BiasInitializer, bias_init, ("ConstantFill", {})),
                                         ParameterTags.BIAS))
    if group != 1:
        kwargs["group"] = group
    return model.net.Conv(inputs, blob_out, **kernel_args, order=order, **kwargs)


_OP_DEFAULT = object()  # spatial_bn's momentum when not given: the op's own default


@Register
def spatial_bn(model: ModelHelper, blob_in: str, blob_out: str, dim_in: int, init_scale: float = 1.0,
               init_bias: float = 0.0, ScaleInitializer: type | None = None,  # noqa: N803
               BiasInitializer: type | None = None, RunningMeanInitializer: type | None = None,  # noqa: N803
               RunningVarianceInitializer: type | None = None, order: str = "NCHW",  # noqa: N803
               affine: bool = True, track_running_stats: bool = True, momentum: Any = _OP_DEFAULT,
               **kwargs: Any) -> BlobReference:
    """SpatialBN with `<out>_s` (init_scale), `<out>_b` (init_bias) and computed `<out>_rm` 0, `<out>_riv` 1.

    Training (the default) records outputs [out, rm, riv, `<out>_sm`, `<out>_siv`] with the running
    stats updated in place; `is_test=True` records the single output. `epsilon` and other kwargs go
    to the op. `momentum` is Caffe2's (the weight of the OLD running value; the op's 0.9 unless given).
    torch's BatchNorm /
    SyncBatchNorm options (each also under `combine_spatial_bn`):

    - `affine=False`: no learnable scale and bias: constant 1 and 0 blobs, not params.
    - `track_running_stats=False`: no running statistics: `<out>_rm` / `<out>_riv` are scratch blobs,
      not computed params, and `is_test=True` still normalises with the batch's statistics.
    - `momentum=None`: the running statistics are the cumulative moving average of every batch's,
      as torch's: a computed param `<out>_nbt` (num_batches_tracked, float [1]) counts the batches,
      and each running stat moves by 1/nbt towards the batch's (SpatialBN runs with momentum 0 into
      `<out>_bm` / `<out>_bv`, then Sub, Div, Add per stat).
    """
    def param(suffix: str, cls: type | None, value: float, tag: str) -> BlobReference:
        init = (cls or Initializer)("ConstantFill", value=float(value))
        return model.create_param(_suffixed(blob_out, suffix), [dim_in], init, tag)

    def constant(suffix: str, value: float, shape: Sequence[int] = (dim_in,)) -> BlobReference:
        return model.param_init_net.ConstantFill([], _suffixed(blob_out, suffix), shape=list(shape), value=value)

    if affine:
        scale = param("_s", ScaleInitializer, init_scale, ParameterTags.WEIGHT)
        bias = param("_b", BiasInitializer, init_bias, ParameterTags.BIAS)
    else:
        scale, bias = constant("_s", 1.0), constant("_b", 0.0)
    if track_running_stats:
        running_mean = param("_rm", RunningMeanInitializer, 0.0, ParameterTags.COMPUTED_PARAM)
        running_var = param("_riv", RunningVarianceInitializer, 1.0, ParameterTags.COMPUTED_PARAM)
    else:
        running_mean, running_var = constant("_rm", 0.0), constant("_riv", 1.0)
        kwargs.pop("is_test", None)  # batch statistics in evaluation too
    inputs = [blob_in, scale, bias, running_mean, running_var]
    if momentum is not _OP_DEFAULT and (momentum is not None or not track_running_stats):
        kwargs["momentum"] = momentum or 0.0
    if kwargs.get("is_test"):
        return model.net.SpatialBN(inputs, blob_out, order=order, **kwargs)
    saved = [_suffixed(blob_out, "_sm"), _suffixed(blob_out, "_siv")]
    if momentum is not None or not track_running_stats:
        outputs = [blob_out, running_mean, running_var, *saved]
        return model.net.SpatialBN(inputs, outputs, order=order, **kwargs)[0]
    return _cumulative_bn(model, inputs, blob_out, saved, constant, order, kwargs)


def _cumulative_bn(model: ModelHelper, inputs: list, blob_out: str, saved: list[str], constant: Callable,
                   order: str, kwargs: dict) -> BlobReference:
    """SpatialBN with momentum=None: batch statistics into scratch blobs, then running += (batch -
    running) / num_batches_tracked, after counting this batch."""
    count = model.create_param(_suffixed(blob_out, "_nbt"), [1], Initializer("ConstantFill", value=0.0),
                               ParameterTags.COMPUTED_PARAM)
    one = constant("_one", 1.0, (1,))
    batch = [constant("_bm", 0.0), constant("_bv", 1.0)]
    out = model.net.SpatialBN([*inputs[:3], *batch], [blob_out, *batch, *saved], order=order, momentum=0.0,
                              **kwargs)[0]
    model.net.Add([count, one], count)
    for running, new in zip(inputs[3:5], batch):
        step = model.net.Sub([new, running], _suffixed(new, "_step"))
        model.net.Div([step, count], step)
        model.net.Add([running, step], running)
    return out


@Register
def relu(model: ModelHelper, blob_in: str, blob_out: str, **kwargs: Any) -> BlobReference:
    """Relu (may run in place: `brew.relu(model, h, h)`)."""
    return model.net.Relu(blob_in, blob_out, **kwargs)


@Register
def leaky_relu(model: ModelHelper, blob_in: str, blob_out: str, alpha: float | None = None) -> BlobReference:
    """LeakyRelu; `alpha` is passed only when given (the op's default is Caffe2's 0.01)."""
    extra = {} if alpha is None else {"alpha": alpha}
    return model.net.LeakyRelu(blob_in, blob_out, **extra)


@Register
def sigmoid(model: ModelHelper, blob_in: str, blob_out: str, **kwargs: Any) -> BlobReference:
    """Sigmoid."""
    return model.net.Sigmoid(blob_in, blob_out, **kwargs)


@Register
def tanh(model: ModelHelper, blob_in: str, blob_out: str, **kwargs: Any) -> BlobReference:
    """Tanh."""
    return model.net.Tanh(blob_in, blob_out, **kwargs)


@Register
def softmax(model: ModelHelper, blob_in: str, blob_out: str | None = None, **kwargs: Any) -> BlobReference:
    """Softmax (auto-named output when `blob_out` is None)."""
    return model.net.Softmax(blob_in, blob_out, **kwargs)


@Register
def max_pool(model: ModelHelper, blob_in: str, blob_out: str, is_test: bool = False,
             **kwargs: Any) -> BlobReference:
    """MaxPool; `kernel`, `stride`, `pad`, `global_pooling` go to the op.

    Training (the default) also records the arg-max indices into `<out>_index`, which the gradient
    (MaxPoolWithIndexGradient) reads instead of pooling again; `is_test=True` records Y only.
    """
    if is_test:
        return model.net.MaxPool(blob_in, blob_out, **kwargs)
    return model.net.MaxPool(blob_in, [blob_out, _suffixed(blob_out, "_index")], **kwargs)[0]


@Register
def average_pool(model: ModelHelper, blob_in: str, blob_out: str, **kwargs: Any) -> BlobReference:
    """AveragePool; `kernel`, `stride`, `pad`, `global_pooling` go to the op."""
    return model.net.AveragePool(blob_in, blob_out, **kwargs)


@Register
def dropout(model: ModelHelper, blob_in: str, blob_out: str, **kwargs: Any) -> BlobReference:
    """Dropout into [out, `_<out>_mask`]; `is_test` is required (as in Caffe2), `ratio` optional.

    Raises:
        TypeError: `is_test` was not given.
    """
    if "is_test" not in kwargs:
        raise TypeError(f"brew.dropout({blob_out!r}): argument 'is_test' is required (False for "
                        f"training, True for inference)")
    return model.net.Dropout(blob_in, [blob_out, _suffixed(blob_out, "_mask", prefix="_")], **kwargs)[0]


@Register
def concat(model: ModelHelper, blobs_in: Sequence[str], blob_out: str, axis: int | None = None,
           order: str = "NCHW", **kwargs: Any) -> BlobReference:
    """Concat into [out, `_<out>_concat_dims`]; along `axis`, else the channel axis of `order`.

    Caffe2 passed `order` to the op and dropped it only when `axis` was truthy (so axis=0 failed);
    graphpar always resolves one `axis`.

    Raises:
        ValueError: an unknown `order`.
    """
    if axis is None:
        if order not in ("NCHW", "NHWC"):
            raise ValueError(f"brew.concat({blob_out!r}): order must be 'NCHW' or 'NHWC', got {order!r}")
        axis = 1 if order == "NCHW" else 3
    outputs = [blob_out, _suffixed(blob_out, "_concat_dims", prefix="_")]
    return model.net.Concat(blobs_in, outputs, axis=axis, **kwargs)[0]


@Register
def sum(model: ModelHelper, blob_in: Sequence[str], blob_out: str, **kwargs: Any) -> BlobReference:
    """Sum of the input blobs (elementwise; may write input 0 in place)."""
    return model.net.Sum(blob_in, blob_out, **kwargs)


@Register
def flatten(model: ModelHelper, blob_in: str, blob_out: str, **kwargs: Any) -> BlobReference:
    """Flatten to 2-D at `axis` (default 1)."""
    return model.net.Flatten(blob_in, blob_out, **kwargs)


@Register
def accuracy(model: ModelHelper, blob_in: Sequence[str], blob_out: str, top_k: int = 1,
             **kwargs: Any) -> BlobReference:
    """Accuracy of [prediction, label] (top-k); no gradient.

    Caffe2 dropped `top_k` on CPU and copied GPU inputs to the host for top_k > 1; graphpar's
    kernel runs on any device and always honours `top_k`.
    """
    return model.net.Accuracy(blob_in, blob_out, top_k=top_k, **kwargs)


@Register
def iter(model: ModelHelper, blob_out: str) -> BlobReference:
    """An int64 CPU counter: ConstantFill 0 (shape [1]) in param_init_net and `Iter` in net, both on CPU.

    Unlike Caffe2 it takes no op kwargs: neither op has arguments worth passing.
    """
    with DeviceScope(DeviceOption(CPU, 0)):
        model.param_init_net.ConstantFill([], blob_out, shape=[1], value=0, dtype="int64")
        return model.net.Iter(blob_out, blob_out)


@Register
def transpose(model: ModelHelper, blob_in: str, blob_out: str, use_cudnn: bool = False,
              **kwargs: Any) -> BlobReference:
    """Transpose (`axes` as the op takes them); Caffe2's `use_cudnn` is accepted and ignored."""
    return model.net.Transpose(blob_in, blob_out, **kwargs)


@Register
def depth_concat(model: ModelHelper, blobs_in: Sequence[str], blob_out: str, **kwargs: Any) -> BlobReference:
    """Caffe2's older name of `concat` along the channel axis."""
    return concat(model, blobs_in, blob_out, **kwargs)


@Register
def add_weight_decay(model: ModelHelper, weight_decay: float) -> Any:
    """optimizer.add_weight_decay(model, weight_decay): weight_decay·w added to each weight's gradient."""
    from graphpar.model.optimizer import add_weight_decay as add

    return add(model, weight_decay)


def _net_blobs(models: Sequence[ModelHelper], scope: Sequence[str], where: str) -> tuple[list[str], list[str]]:
    """(blobs the models' nets read before writing them, blobs they write that are in `scope`), in first-use
    order, as Caffe2's control_ops_util.get_external_blob_names. A str of `scope` names a blob as given
    or inside the current NameScope (the nets' ops were recorded in it), a BlobReference as it is.

    Raises:
        ValueError: a net reads a blob that is neither written before by it nor in `scope`.
    """
    lexical, reads, writes = {str(b) for b in scope} | {_absolute(b) for b in scope}, [], []
    for model in models:
        flow = dataflow(model.net.Proto())
        reads += [b for b in flow.loads if b not in reads]
        writes += [b for b in flow.first_write if b in lexical and b not in writes]
    undefined = [b for b in reads if b not in lexical]
    if undefined:
        raise ValueError(f"{where}: the nets read {undefined}, which are not in external_blobs {sorted(lexical)} "
                         f"(nor written before by the net that reads them)")
    return reads, writes


def _absolute(blob: str) -> str:
    """A blob's name as an op records it: a BlobReference as it is, a str inside the current NameScope."""
    return str(blob) if isinstance(blob, BlobReference) else ScopedName(blob)


def _control_op(model: ModelHelper, op_type: str, cond_blob: str, reads: list[str], writes: list[str],
                nets: dict[str, Any]) -> list[BlobReference]:
    """Record `op_type` with [cond_blob, *reads] -> writes, names taken as they are (already scoped: a
    replica's nets read `gpu_0/data`, which must not become `gpu_0/gpu_0/data`)."""
    inputs = [BlobReference(name) for name in dict.fromkeys([cond_blob, *reads])]
    outputs = getattr(model.net, op_type)(inputs, [BlobReference(name) for name in writes], **nets)
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


@Register
def cond(model: ModelHelper, cond_blob: str, external_blobs: Sequence[str], then_model: ModelHelper,
         else_model: ModelHelper | None = None) -> list[BlobReference]:
    """Caffe2's brew.cond: an `If` op in model.net running then_model's net if `cond_blob` is true, else
    else_model's (if given). `external_blobs`: the blobs of the enclosing net the branches may read or
    write; what they read becomes the op's inputs, what they write of them its outputs (without an
    else branch the outputs are read too, so they keep their values when the condition is false).
    Names are taken as ops take them: a str inside the current NameScope (so it works in a Parallelize
    builder, where the branches' blobs are `gpu_<id>/...`), a BlobReference as it is. Returns the
    outputs."""
    models = [then_model] if else_model is None else [then_model, else_model]
    reads, writes = _net_blobs(models, external_blobs, f"brew.cond({cond_blob!r})")
    if else_model is None:
        reads += [b for b in writes if b not in reads]
    nets = {"then_net": then_model.net.Proto(), **({} if else_model is None else {"else_net": else_model.net.Proto()})}
    return _control_op(model, "If", _absolute(cond_blob), reads, writes, nets)


@Register
def loop(model: ModelHelper, cond_blob: str, external_blobs: Sequence[str], loop_model: ModelHelper,
         cond_model: ModelHelper | None = None) -> list[BlobReference]:
    """Caffe2's brew.loop: a `While` op in model.net repeating { cond_model's net (if given); stop unless
    `cond_blob` is true; loop_model's net }. `external_blobs` as in `cond`; the outputs are read too
    (the loop may not run at all). Returns the outputs."""
    models = [loop_model] if cond_model is None else [loop_model, cond_model]
    reads, writes = _net_blobs(models, external_blobs, f"brew.loop({cond_blob!r})")
    reads += [b for b in writes if b not in reads]
    nets = {"loop_net": loop_model.net.Proto(), **({} if cond_model is None else {"cond_net": cond_model.net.Proto()})}
    return _control_op(model, "While", _absolute(cond_blob), reads, writes, nets)
