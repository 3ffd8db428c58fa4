"""ModelHelper: a model's two nets (init and train) plus its parameter bookkeeping, as in Caffe2.

`param_init_net` (named `<name>_init`) is run once and holds the parameter fills; `net` (named
`<name>`) is run every iteration and holds the forward, backward and update ops. Parameters are
created with `create_param`, usually through `graphpar.brew` helpers, and are remembered in
`params` (trainable) or `_computed_params` (e.g. batch-norm running statistics), plus `weights` and
`biases` by tag. `model.SomeOp(...)` records `SomeOp` into `model.net`.
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphpar.core.ir import BlobReference, DataType, GradientSlice, NetDef
from graphpar.core.net import Net
from graphpar.core.schema import get_schema
from graphpar.core.scope import CurrentNameScope
from graphpar.model.optimizer_context import OptimizerContext

if TYPE_CHECKING:
    from graphpar.passes.state import ParallelState


_INIT_NET_TAG = "/param_init_net"  # marks init ops in GetCompleteNet's debug_info, as Caffe2 did


class ParameterTags:
    """Tags a parameter may carry; COMPUTED_PARAM ones are not trained (no gradient, no optimizer)."""

    WEIGHT = "WEIGHT"
    BIAS = "BIAS"
    COMPUTED_PARAM = "COMPUTED_PARAM"


class Initializer:
    """Emits `init_net.<op_name>([], name, shape=shape, **kwargs)` for a new parameter.

    Brew helpers build one from a Caffe2-style `(op_name, kwargs)` tuple, e.g. `("XavierFill", {})`.
    """

    def __init__(self, op_name: str, **kwargs: Any) -> None:
        if not isinstance(op_name, str) or not op_name:
            raise TypeError(f"Initializer needs a fill operator name such as 'XavierFill', got {op_name!r}")
        self.op_name = op_name
        self.kwargs = kwargs

    def create_param(self, param_name: BlobReference, init_net: Net, shape: Sequence[int]) -> BlobReference:
        """Record the fill op for `param_name` into `init_net` (under the current DeviceScope)."""
        return getattr(init_net, self.op_name)([], param_name, shape=list(shape), **self.kwargs)

    def __repr__(self) -> str:
        return f"Initializer({self.op_name!r}, **{self.kwargs})"


class ExternalInitializer:
    """Creates no op: the parameter's value is fed or loaded from outside (predict/eval models)."""

    def create_param(self, param_name: BlobReference, init_net: Net, shape: Sequence[int]) -> BlobReference:
        """Return the blob reference without recording anything."""
        return BlobReference(param_name)

    def __repr__(self) -> str:
        return "ExternalInitializer()"


def fp32_master_name(param: str) -> str:
    """The float32 master copy of a float16 parameter (PseudoFP16Initializer; Caffe2's name)."""
    return f"{param}_fp32"


class PseudoFP16Initializer(Initializer):
    """A float16 parameter with a float32 master copy: the fill writes `<param>_fp32` and `FloatToHalf`
    makes the parameter from it. `optimizer.build_multi_precision_sgd` updates the master and casts
    it back each step (Caffe2's mixed-precision recipe)."""

    def create_param(self, param_name: BlobReference, init_net: Net, shape: Sequence[int]) -> BlobReference:
        """Record the float32 fill of the master copy, then its float16 cast into `param_name`."""
        master = getattr(init_net, self.op_name)([], BlobReference(fp32_master_name(param_name)),
                                                 shape=list(shape), **self.kwargs)
        return init_net.FloatToHalf([master], param_name)


@dataclass
class ParameterInfo:
    """What the model knows about one parameter; `grad` is set by AddGradientOperators."""

    name: str
    blob: BlobReference
    shape: tuple[int, ...] | None
    initializer: Initializer | ExternalInitializer | None = None
    tags: tuple[str, ...] = ()
    grad: str | GradientSlice | None = None
    optimizer: Any = None  # from an active optimizer_context.UseOptimizer block, else None

    @property
    def blob_copy(self) -> dict[int, str] | None:
        """Caffe2's copies of the param in other dtypes: {DataType.FLOAT: '<param>_fp32'} for a float16
        param with a float32 master (PseudoFP16Initializer), else None."""
        if not isinstance(self.initializer, PseudoFP16Initializer):
            return None
        return {DataType.FLOAT: fp32_master_name(self.name)}


def _normalize_tags(tags: str | Iterable[str] | None) -> tuple[str, ...]:
    """A tag or a list of tags as a tuple; TypeError for anything else."""
    if tags is None:
        return ()
    if isinstance(tags, str):
        return (tags,)
    if isinstance(tags, Iterable):
        result = tuple(tags)
        if all(isinstance(t, str) for t in result):
            return result
    raise TypeError(f"parameter tags must be a tag or a list of tags (ParameterTags.WEIGHT, ...), got {tags!r}")


def _normalize_shape(param_name: str, shape: Iterable[int]) -> tuple[int, ...]:
    """The shape as a tuple of Python ints (numpy integers accepted, as in op arguments)."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"create_param({param_name!r}): shape must be a list of ints, got {shape!r}") from None
    if not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise TypeError(f"create_param({param_name!r}): shape must be non-negative ints, got {list(dims)}")
    return tuple(int(d) for d in dims)


def _in_scope(blobs: list[BlobReference], namescope: str | None) -> list[BlobReference]:
    """The blobs in `namescope` (default: the current name scope; '' = all)."""
    if namescope is None:
        namescope = CurrentNameScope()
    if not namescope:
        return list(blobs)
    if not namescope.endswith("/"):
        namescope += "/"
    return [b for b in blobs if b.startswith(namescope)]


def _parallel_attribute(read: Callable[[ParallelState], Any], unset: Callable[[], Any], doc: str) -> property:
    """A read-only view of the model's Parallelize state under one of Caffe2's attribute names."""

    def get(model: ModelHelper) -> Any:
        return unset() if model._parallel is None else read(model._parallel)

    return property(get, doc=doc)


class ModelHelper:
    """A model: `param_init_net`, `net`, its parameters, and (after AddGradientOperators) their gradients.

    Args:
        name: the train net's name; the init net is `<name>_init` (Net names are made unique).
        init_params: False for eval/predict models: parameters get no init ops (ExternalInitializer).
        arg_scope: defaults that brew helpers receive (merged over `{"order": "NCHW"}`).
        param_model: another ModelHelper whose init net and parameters this one shares (Caffe2's
            step models): parameters created through either are known to both.
        allow_not_known_ops, skip_sparse_optim: Caffe2's flags, accepted; every registered op is
            known here, and sparse gradients are always optimized.
    """

    def __init__(self, name: str = "model", init_params: bool = True, allow_not_known_ops: bool = True,
                 skip_sparse_optim: bool = False, param_model: ModelHelper | None = None,
                 arg_scope: dict[str, Any] | None = None) -> None:
        self.name = name or "model"
        self.net = Net(self.name)
        self.init_params = init_params
        if param_model is not None and not isinstance(param_model, ModelHelper):
            raise TypeError(f"param_model must be a ModelHelper, got {type(param_model).__name__}")
        shared = param_model or self
        self.param_init_net: Net = Net(self.name + "_init") if param_model is None else param_model.param_init_net
        self.params: list[BlobReference] = [] if param_model is None else shared.params
        self._computed_params: list[BlobReference] = [] if param_model is None else shared._computed_params
        self.weights: list[BlobReference] = [] if param_model is None else shared.weights
        self.biases: list[BlobReference] = [] if param_model is None else shared.biases
        self._parameters_info: dict[str, ParameterInfo] = {} if param_model is None else shared._parameters_info
        self.param_to_grad: dict[BlobReference, str | GradientSlice] = {}
        self.grad_map: dict[BlobReference, str | GradientSlice] = {}
        self.gradient_ops_added = False
        self._input_casts: set[str] = set()  # casts of fed inputs (passes.precision): no gradient either
        self._parallel: ParallelState | None = None  # set by data_parallel_model.Parallelize
        self._parallel_runs: Any = None  # data_parallel_model.RunState: what runs of the parallel model count
        self._checkpoint_net: Net | None = None  # data_parallel_model.FinalizeAfterCheckpoint's, once built
        self._arg_scope: dict[str, Any] = {"order": "NCHW", **(arg_scope or {})}

    # Caffe2's private attributes of a parallelized model, read-only views of `self._parallel`.
    _devices = _parallel_attribute(lambda s: list(s.layout.devices), list, "The device ids of the replicas.")
    _device_prefix = _parallel_attribute(lambda s: s.layout.prefix, lambda: None, "'gpu' or 'cpu'.")
    _device_type = _parallel_attribute(lambda s: s.layout.device_type, lambda: None, "CUDA or CPU.")
    _shared_model = _parallel_attribute(lambda s: s.options.shared_model, lambda: False, "Parallelize's option.")
    _rendezvous = _parallel_attribute(lambda s: s.options.rendezvous, lambda: None, "Parallelize's option.")
    _device_grouped_blobs = _parallel_attribute(lambda s: s.grouped, dict,
                                                "Unscoped name -> {device id: blob}.")
    _param_names = _parallel_attribute(lambda s: s.param_names, list, "Unscoped params and computed params.")
    _computed_param_names = _parallel_attribute(lambda s: s.computed_param_names, list,
                                                "Unscoped computed params.")
    _grad_names = _parallel_attribute(lambda s: s.grad_names, list, "Unscoped gradients, in param order.")
    _sync_names = _parallel_attribute(lambda s: s.sync_names, list, "Unscoped blobs of the initial sync.")
    _blob_to_device = _parallel_attribute(lambda s: s.blob_to_device, dict, "Blob -> DeviceOption.")
    _losses_by_gpu = _parallel_attribute(lambda s: s.losses_by_device, dict, "Device id -> its losses.")
    _optimizer = _parallel_attribute(lambda s: s.optimizer, lambda: None, "optimizer_builder_fun's result.")
    _data_parallel_model_init_nets = _parallel_attribute(lambda s: s.init_nets, list, "What RunInitNet runs.")
    _data_parallel_model_nets = _parallel_attribute(lambda s: s.nets, list, "What RunNet runs.")

    @property
    def arg_scope(self) -> dict[str, Any]:
        """Defaults brew helpers receive, below `brew.arg_scope` contexts and explicit arguments."""
        return self._arg_scope

    def __getattr__(self, op_type: str) -> Any:
        """`model.SomeOp(...)` records a registered operator into `model.net`."""
        if op_type.startswith("_"):
            raise AttributeError(op_type)
        try:
            get_schema(op_type)
        except AttributeError as err:
            raise AttributeError(f"ModelHelper has no attribute {op_type!r} and it is not a registered "
                                 f"operator: {err}") from None
        return getattr(self.net, op_type)

    def create_param(self, param_name: str, shape: Iterable[int],
                     initializer: Initializer | ExternalInitializer,
                     tags: str | Iterable[str] | None = None) -> BlobReference:
        """Create a parameter (its fill op goes into `param_init_net`) and register it; return its blob.

        A str name gets the current name scope; a BlobReference is used as is. Re-using an existing
        name with the same shape returns the existing blob (parameter sharing). With
        `init_params=False` no op is created, whatever the initializer.

        Raises:
            ValueError: the name exists with another shape.
            TypeError: a bad name, shape, initializer or tags (checked before anything is recorded).
        """
        if not isinstance(param_name, str) or not param_name:
            raise TypeError(f"create_param: param_name must be a non-empty str or BlobReference, got "
                            f"{param_name!r}")
        name = str(param_name) if isinstance(param_name, BlobReference) else CurrentNameScope() + param_name
        dims = _normalize_shape(name, shape)
        tag_tuple = _normalize_tags(tags)
        existing = self._parameters_info.get(name)
        if existing is not None:
            if existing.shape != dims:
                known = "unknown" if existing.shape is None else list(existing.shape)
                raise ValueError(f"parameter {name!r} already exists with shape {known}; "
                                 f"cannot re-create it with shape {list(dims)} (to share it, use the same "
                                 f"shape; otherwise choose another name)")
            return existing.blob
        if not self.init_params:
            initializer = ExternalInitializer()
        if not hasattr(initializer, "create_param"):
            raise TypeError(f"create_param({name!r}): initializer must be an Initializer or "
                            f"ExternalInitializer, got {initializer!r}")
        blob = BlobReference(initializer.create_param(BlobReference(name), self.param_init_net, dims))
        self._parameters_info[name] = ParameterInfo(name, blob, dims, initializer, tag_tuple,
                                                    optimizer=OptimizerContext.current().for_tags(tag_tuple))
        self.AddParameter(blob, tag_tuple)
        return blob

    def AddParameter(self, param: BlobReference, tags: str | Iterable[str] | None = None) -> None:  # noqa: N802
        """Register an existing blob as a parameter (COMPUTED_PARAM -> computed params) and by tag.

        Raises:
            TypeError: `param` is not a BlobReference, or `tags` is not a tag or a list of tags.
        """
        if not isinstance(param, BlobReference):
            raise TypeError(f"AddParameter needs a BlobReference, got {type(param).__name__} {param!r}")
        tags = _normalize_tags(tags)
        (self._computed_params if ParameterTags.COMPUTED_PARAM in tags else self.params).append(param)
        if ParameterTags.WEIGHT in tags:
            self.weights.append(param)
        if ParameterTags.BIAS in tags:
            self.biases.append(param)

    def GetParams(self, namescope: str | None = None, top_scope: bool = False) -> list[BlobReference]:  # noqa: N802
        """Trainable params in `namescope` (default: the current name scope; '' = all) or a scope
        below it. `top_scope` is Caffe2's flag for that same rule (accepted, no other effect)."""
        return _in_scope(self.params, namescope)

    def GetComputedParams(self, namescope: str | None = None) -> list[BlobReference]:  # noqa: N802
        """Computed (non-trained) params in `namescope` (default: the current name scope; '' = all)."""
        return _in_scope(self._computed_params, namescope)

    def GetAllParams(self, namescope: str | None = None) -> list[BlobReference]:  # noqa: N802
        """Trainable then computed params in `namescope`."""
        return self.GetParams(namescope) + self.GetComputedParams(namescope)

    def Validate(self) -> None:  # noqa: N802
        """Check that no parameter is registered twice (Caffe2's check), in O(params).

        The ops are not re-checked: `Net` checks each op against its schema when it is recorded, and
        the workspace checks the whole net again (`NetDef.validate`) when it creates it.

        Raises:
            ValueError: duplicate parameters (listed).
        """
        counts = Counter(str(p) for p in self.params + self._computed_params)
        dupes = sorted(p for p, n in counts.items() if n > 1)
        if dupes:
            raise ValueError(f"model {self.name!r}: Duplicate entries in params: {dupes}. Each parameter "
                             f"must be created once (create_param returns the existing blob when a name "
                             f"is reused)")

    def _Validate(self) -> list[str]:  # noqa: N802 - Caffe2 name
        """The trainable params registered more than once, sorted (Caffe2's check; [] when none)."""
        counts = Counter(str(p) for p in self.params)
        return sorted(p for p, n in counts.items() if n > 1)

    def Proto(self) -> NetDef:  # noqa: N802
        """`net`'s live NetDef."""
        return self.net.Proto()

    def InitProto(self) -> NetDef:  # noqa: N802
        """`param_init_net`'s live NetDef."""
        return self.param_init_net.Proto()

    def RunAllOnGPU(self, gpu_id: int = 0) -> None:  # noqa: N802
        """Place both nets on CUDA device `gpu_id` (ops without their own device option)."""
        self.param_init_net.RunAllOnGPU(gpu_id)
        self.net.RunAllOnGPU(gpu_id)

    def get_param_info(self, param: str) -> ParameterInfo | None:
        """The ParameterInfo of `param` (a created parameter), else None."""
        return self._parameters_info.get(str(param))

    def GetOptimizationParamInfo(self, params: Iterable[str] | None = None) -> list[ParameterInfo]:  # noqa: N802
        """The ParameterInfo of each param that has a gradient (of `params` if given), in creation order,
        as Caffe2's: what the optimizer builders update (each info's `grad` is set)."""
        param_to_grad = self.param_to_grad if not params else self.get_param_to_grad(params)
        return [self._parameters_info.setdefault(str(p), ParameterInfo(str(p), p, None, grad=g))
                for p, g in param_to_grad.items()]

    def get_param_to_grad(self, params: Iterable[str]) -> dict[BlobReference, str | GradientSlice]:
        """{param: gradient} for `params` that have one (after AddGradientOperators)."""
        wanted = {str(p) for p in params}
        return {p: g for p, g in self.param_to_grad.items() if str(p) in wanted}

    def GetCompleteNet(self) -> Net:  # noqa: N802
        """One net: `param_init_net`'s ops (tagged `/param_init_net` in their debug_info) then
        `net`'s, with `net`'s type; `ConstructInitTrainNetfromNet` splits it again."""
        complete = self.param_init_net.Clone(self.name + "_complete_net")
        for op in complete.Proto().ops:
            op.debug_info += _INIT_NET_TAG
        complete.AppendNet(self.net)
        complete.Proto().type = self.net.Proto().type
        return complete

    def ConstructInitTrainNetfromNet(self, net: Net) -> None:  # noqa: N802
        """Set `param_init_net` and `net` from a `GetCompleteNet()` net (ops tagged as init ops go
        to the init net); both keep the complete net's type and get recomputed external inputs."""
        init_ids = [i for i, op in enumerate(net.Proto().ops) if op.debug_info.endswith(_INIT_NET_TAG)]
        train_ids = [i for i in range(len(net.Proto().ops)) if i not in set(init_ids)]
        self.param_init_net = net.Clone(net.Name() + "/generated_param_init_net", op_id_mask=init_ids,
                                        update_external_list=True)
        self.net = net.Clone(net.Name() + "/generated_net", op_id_mask=train_ids, update_external_list=True)

    def add_input_casts(self, casts: Iterable[str]) -> None:
        """Mark `casts` as casts of fed inputs (`passes.precision`): like the inputs themselves, they get no
        gradient from `AddGradientOperators`."""
        self._input_casts.update(str(b) for b in casts)

    def AddGradientOperators(self, ys: list | dict,  # noqa: N802
                             input_gradients: bool = False) -> dict[BlobReference, str | GradientSlice]:
        """Append the gradient ops of `net` for losses `ys` (once); fill grad_map and param_to_grad.

        Like PyTorch, and unlike Caffe2, the net's inputs fed from outside (its external inputs that
        are not parameters: data, labels) get no gradient: they have no grad_map entry, and autodiff
        drops the gradient computation that serves only them (e.g. the first FC's dX).
        `input_gradients=True` computes them too, as Caffe2 did (`net.AddGradientOperators`).

        Raises:
            RuntimeError: gradient operators were already added.
            ValueError: Validate() failed (e.g. duplicate parameters).
            GradientError: a correct gradient cannot be built (see `backward_pass`).
        """
        if self.gradient_ops_added:
            raise RuntimeError(f"model {self.name!r}: AddGradientOperators was already called; it may run "
                               f"only once per model (pass every loss in one call)")
        self.Validate()
        params = {str(p) for p in self.GetAllParams("")}
        fed = [] if input_gradients else [b for b in self.net.Proto().external_inputs if b not in params]
        fed += [] if input_gradients else sorted(self._input_casts)
        self.grad_map = self.net.AddGradientOperators(ys, no_gradient_to=fed)
        self.gradient_ops_added = True
        self.param_to_grad = {p: self.grad_map[p] for p in self.params if p in self.grad_map}
        for param, grad in self.param_to_grad.items():
            info = self._parameters_info.setdefault(str(param), ParameterInfo(str(param), param, None))
            info.grad = grad
        return self.grad_map

    def GetDevices(self) -> list[int]:  # noqa: N802
        """The device ids `data_parallel_model.Parallelize` placed this model on.

        Raises:
            RuntimeError: the model was not parallelized.
        """
        if not self._devices:
            raise RuntimeError(f"model {self.name!r} has no devices: use graphpar.data_parallel_model."
                               f"Parallelize to run it on several devices")
        return self._devices



def ExtractPredictorNet(net_proto: NetDef, input_blobs: Sequence[str], output_blobs: Sequence[str],  # noqa: N802
                        device: Any = None, renames: dict[str, str] | None = None,
                        disabled_inputs: Sequence[str] | None = None) -> tuple[Net, list[str]]:
    """Caffe2's model_helper.ExtractPredictorNet: the forward ops of `net_proto` from `input_blobs` to
    `output_blobs` as a Net (blobs renamed through `renames`, placed on `device` if given), and the
    blobs to export with it (those it reads besides the inputs). `disabled_inputs` are left out of
    the export list. For a parallelized model use `data_parallel_model.ExtractPredictorNet`.

    Raises ValueError as `passes.predictor.extract_predictor_net`.
    """
    from graphpar.passes.predictor import extract_predictor_net

    predictor, export = extract_predictor_net(net_proto, input_blobs, output_blobs, device, renames)
    disabled = {str(b) for b in disabled_inputs or ()}
    return Net(predictor), [b for b in export if b not in disabled]
