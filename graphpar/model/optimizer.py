"""Optimizers that record their parameter updates into a model's nets (Caffe2's `optimizer.py`).

`build_sgd` / `build_adam` / `build_adagrad` add, for every trainable param that has a gradient:

- one unscoped CPU iteration counter `optimizer_iteration` per model (a `ConstantFill` of int64 [1] = 0 in
  `param_init_net`, one `Iter` in `net`), advanced before the first `LearningRate`, so step 1 sees iter 1;
- one `LearningRate` blob per device (`<Cls>_<n>_lr_gpu<id>`, or `<Cls>_<n>_lr_cpu` shared by the CPU
  devices, as in Caffe2);
- the update, recorded under `DeviceScope(<the param's device>)` and no name scope, with state blobs named
  from the param (`gpu_1/fc_w_momentum`) and created in `param_init_net`, so `Parallelize` syncs and
  checkpoints them.

Sign of the learning rate (Caffe2's scheme): the LR blob feeding `WeightedSum` and `Adam` holds
-base_learning_rate·factor(iter), because those ops add lr·step to the param; `MomentumSGDUpdate`
subtracts its step, so its LR blob holds +base_learning_rate·factor(iter).

A sparse gradient (a GradientSlice from an embedding lookup) updates only the rows it names, with the
sparse ops of `graphpar.ops.sparse_optim` (`ScatterWeightedSum`, `SparseMomentumSGDUpdate`, `SparseAdam`,
`SparseAdagrad`, `RowWiseSparseAdagrad`), which sum duplicate rows first.

Momentum follows Caffe2: `MomentumSGDUpdate` keeps m = μ·m + lr·g and applies param -= m. With a
constant learning rate this is exactly `torch.optim.SGD(momentum=μ)` (m = lr·buf); when the rate changes
between steps the two differ, because Caffe2's buffer holds lr-scaled gradients.

Dtypes: the learning-rate, `ONE_*` and weight-decay blobs are float32 [1] tensors, as in Caffe2; the
update ops cast them to each param's dtype. Params, gradients and optimizer state keep their own dtype,
but a float64 model is updated with the float32 rounding of lr·factor(iter) and weight_decay (a relative
difference of at most 6e-8 from torch.optim, which keeps them as Python floats).
"""

from __future__ import annotations

import math
from collections import defaultdict, namedtuple
from itertools import groupby
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from graphpar.core.graph import blob_devices
from graphpar.core.ir import CPU, CUDA, BlobReference, DeviceOption, GradientSlice
from graphpar.core.naming import (
    LR_INJECTION,
    OPTIMIZER_ITERATION,
    adam_moment_names,
    device_scope_name,
    momentum_name,
    parse_device_scope,
)
from graphpar.core.schema import get_schema, parse_args
from graphpar.core.scope import CurrentDeviceScope, DeviceScope, NameScope
from graphpar.core.shapes import infer_specs
from graphpar.model.model_helper import fp32_master_name
from graphpar.ops.optim import learning_rate_schedule

if TYPE_CHECKING:
    from graphpar.core.net import Net
    from graphpar.model.model_helper import ModelHelper

_instance_count: defaultdict[str, int] = defaultdict(int)
_optimizer_instance_count = _instance_count  # Caffe2's name, read by its tests
NORM_SCOPE = "norm_clipped_grad_update"  # Caffe2's name scope of the gradient-clipping blobs


def reset_optimizer_instance_count() -> None:
    """Restart every optimizer class's instance numbering at 0 (Caffe2 helper; useful in tests)."""
    _instance_count.clear()


def _constant(init_net: Net, name: str, value: float, device: DeviceOption) -> BlobReference:
    """A [1]-shaped float constant created once in `init_net` on `device`."""
    if not init_net.BlobIsDefined(name):
        with DeviceScope(device):
            init_net.ConstantFill([], BlobReference(name), shape=[1], value=float(value))
    return BlobReference(name)


def _one(init_net: Net, device: DeviceOption) -> BlobReference:
    """Caffe2's `ONE_<devtype>_<id>` constant, one per device."""
    return _constant(init_net, f"ONE_{int(device.device_type)}_{device.device_id}", 1.0, device)


OPTIMIZER_ITERATION_LR = "optimizer_iteration_lr"  # the learning rate's own counter (Caffe2's name)


def _iteration_counter(net: Net, init_net: Net, name: str = OPTIMIZER_ITERATION) -> BlobReference:
    """The model's CPU iteration counter `name`, created on first use (Caffe2's BuildUniqueMutexIter)."""
    iteration = BlobReference(name)
    with DeviceScope(DeviceOption(CPU)):
        if not init_net.BlobIsDefined(iteration):
            init_net.ConstantFill([], iteration, shape=[1], value=0, dtype="int64")
        if not net.BlobIsProduced(iteration):
            net.Iter([iteration], [iteration])
    return iteration


AuxOptimizerParams = namedtuple("AuxOptimizerParams", ["local", "shared"])


class Optimizer:
    """Base class: instance numbering, per-device blob names, the learning rate, and `__call__`.

    Subclasses implement `_update(net, init_net, param, grad, device)`, which records one param's update.
    """

    _caffe2_only: tuple[str, ...] = ()  # Caffe2 options of this optimizer that graphpar does not implement

    def __init__(self, base_learning_rate: float, policy: str, lr_sign: float, **policy_args: Any) -> None:
        _check_number("base_learning_rate", base_learning_rate, low=0.0)
        cls = type(self).__name__
        _check_options(cls, policy, policy_args, self._caffe2_only)
        where = f"{cls}: learning-rate policy {policy!r}"
        lr_args = parse_args(get_schema("LearningRate"), {"base_lr": float(base_learning_rate),
                                                          "policy": policy, **policy_args}, where)
        learning_rate_schedule(lr_args, where)  # a bad policy fails here, not at CreateNet
        self._instance_num = _instance_count[cls]
        _instance_count[cls] += 1
        self.base_learning_rate = float(base_learning_rate)
        self.policy = policy
        self.policy_args = policy_args
        self._lr_sign = lr_sign
        self._lr_multiplier: BlobReference | dict[DeviceOption, BlobReference] | None = None
        self._internal: set[str] = set()  # init blobs that are not auxiliary parameters (as in Caffe2)
        self._created: list[tuple[str, list]] = []  # (param, the init ops its update created)
        self.use_dedicated_lr_iteration_counter = False  # LearningRate reads `optimizer_iteration_lr`

    def get_cpu_blob_name(self, name: str) -> str:
        """The name of this optimizer's CPU blob `name`, e.g. 'SgdOptimizer_0_lr_cpu'."""
        return f"{type(self).__name__}_{self._instance_num}_{name}_cpu"

    def get_gpu_blob_name(self, name: str, gpu_id: int) -> str:
        """The name of this optimizer's blob `name` on CUDA device `gpu_id`, e.g. 'SgdOptimizer_0_lr_gpu1'."""
        return f"{type(self).__name__}_{self._instance_num}_{name}_gpu{gpu_id}"

    def blob_name(self, name: str, device: DeviceOption) -> str:
        """This optimizer's blob `name` for `device` (one blob shared by all CPU devices, as in Caffe2)."""
        if device.device_type == CUDA:
            return self.get_gpu_blob_name(name, device.device_id)
        return self.get_cpu_blob_name(name)

    def device_blob_name(self, name: str, device: DeviceOption) -> str:
        """This optimizer's blob `name` for exactly one device, e.g. 'SgdOptimizer_0_grad_norm_cpu1'."""
        kind = "gpu" if device.device_type == CUDA else "cpu"
        return f"{type(self).__name__}_{self._instance_num}_{name}_{kind}{device.device_id}"

    def add_lr_multiplier(self, lr_multiplier: BlobReference | dict[DeviceOption, BlobReference] | None) -> None:
        """Multiply every learning rate of this optimizer by `lr_multiplier` (Caffe2's method): a [1]
        CPU blob (copied to each CUDA device that needs it), or {device: its blob on that device}."""
        self._lr_multiplier = lr_multiplier

    def build_lr(self, net: Net, init_net: Net, device: DeviceOption) -> BlobReference:
        """The learning-rate blob for `device`, recorded on first use; times the LR multiplier if any
        (`<Cls>_<n>_scaled_lr_<device>`, as Caffe2's `scaled_lr`)."""
        lr = BlobReference(self.blob_name("lr", device))
        scaled = BlobReference(self.blob_name("scaled_lr", device))
        if net.BlobIsDefined(lr):
            return scaled if net.BlobIsDefined(scaled) else lr
        counter = OPTIMIZER_ITERATION_LR if self.use_dedicated_lr_iteration_counter else OPTIMIZER_ITERATION
        iteration = _iteration_counter(net, init_net, counter)
        with DeviceScope(device):
            net.LearningRate([iteration], lr, base_lr=self._lr_sign * self.base_learning_rate,
                             policy=self.policy, **self.policy_args)
            multiplier = self._lr_multiplier
            if isinstance(multiplier, dict):
                multiplier = multiplier.get(device)
            elif multiplier is not None and device.device_type == CUDA:  # a CPU blob
                multiplier = net.CopyCPUToGPU([multiplier], BlobReference(self.blob_name("lr_multiplier", device)))
            return lr if multiplier is None else net.Mul([lr, multiplier], scaled)

    def __call__(self, net: Net, init_net: Net, param: str, grad: str | GradientSlice) -> None:
        """Record the update of `param` from its gradient `grad` (dense, or a GradientSlice: the sparse
        update of the rows it names) on the current DeviceScope's device."""
        device = CurrentDeviceScope() or DeviceOption()
        init_ops = init_net._net.ops  # the live list, read without marking the net's tables stale
        start = len(init_ops)
        if isinstance(grad, GradientSlice):
            sparse = GradientSlice(BlobReference(grad.indices), BlobReference(grad.values))
            self._sparse_update(net, init_net, BlobReference(param), sparse, device)
        else:
            self._update(net, init_net, BlobReference(param), BlobReference(grad), device)
        self._created.append((str(param), init_ops[start:]))

    def _run(self, net: Net, param_init_net: Net, param_info: Any) -> None:
        """Caffe2's entry point: record the update of `param_info.blob` from `param_info.grad`."""
        self(net, param_init_net, param_info.blob, param_info.grad)

    def check(self, init_net: Net, param: str, grad: str | GradientSlice) -> None:
        """Raise, before anything is recorded, if this optimizer cannot update `param` from `grad`."""
        if isinstance(grad, GradientSlice) and not self.supports_sparse:
            raise NotImplementedError(f"{type(self).__name__} has no sparse update; param {str(param)!r} has a "
                                      f"sparse gradient (GradientSlice)")

    supports_sparse = False  # whether `_sparse_update` exists

    def get_auxiliary_parameters(self) -> AuxOptimizerParams:
        """The blobs this optimizer created in the init net: `local` (per-param state such as
        `<param>_momentum`) and `shared` (ONE, weight decay; Adam's iteration counter), as in Caffe2."""
        aux = AuxOptimizerParams(local=[], shared=[])
        for param, ops in self._created:  # Caffe2's split: state named after its param is local
            counters = (OPTIMIZER_ITERATION, OPTIMIZER_ITERATION_LR)
            for blob in (b for op in ops for b in op.outputs if b not in counters and b not in self._internal):
                (aux.local if blob.startswith(param + "_") else aux.shared).append(BlobReference(blob))
        if self._iteration_is_aux and self._created:
            aux.shared.append(BlobReference(OPTIMIZER_ITERATION))
        return aux

    _iteration_is_aux = False  # whether the step counter is state of the update (Adam's, in Caffe2)

    def _internal_constant(self, init_net: Net, name: str, value: float, device: DeviceOption) -> BlobReference:
        """This optimizer's constant `name` on `device`, not counted as an auxiliary parameter."""
        blob = _constant(init_net, self.blob_name(name, device), value, device)
        self._internal.add(str(blob))
        return blob

    def _lars_lr(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference, lr: BlobReference,
                 device: DeviceOption) -> BlobReference:
        """`lr` times Caffe2's LARS factor `<param>_lars` (Lars with offset=lars, trust 1, weight decay 0,
        no upper bound), when the optimizer has `lars`; dense gradients only, as in Caffe2."""
        lars = getattr(self, "lars", None)
        if lars is None:
            return lr
        wd, trust, lr_max = (self._internal_constant(init_net, name, value, device) for name, value in (
            ("lars_wd", 0.0), ("lars_trust", 1.0), ("lars_lr_max", float(np.finfo(np.float32).max))))
        factor = net.Lars([param, grad, wd, trust, lr_max], BlobReference(f"{param}_lars"), offset=lars,
                          lr_min=0.0)
        return net.Mul([lr, factor], BlobReference(f"{param}_lars_scaled_lr"))

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        raise NotImplementedError

    def _sparse_update(self, net: Net, init_net: Net, param: BlobReference, grad: GradientSlice,
                       device: DeviceOption) -> None:
        raise NotImplementedError


class SgdOptimizer(Optimizer):
    """SGD with optional (Nesterov) momentum and L2 weight decay on every param (as torch.optim.SGD)."""

    def __init__(self, base_learning_rate: float, policy: str = "fixed", momentum: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0, lars: float | None = None,
                 **policy_args: Any) -> None:
        _check_number("momentum", momentum, low=0.0)
        _check_number("weight_decay", weight_decay, low=0.0)
        if lars is not None:
            _check_number("lars", lars, low=0.0)
        if nesterov and momentum == 0.0:
            raise ValueError("build_sgd: nesterov=True needs momentum > 0")
        super().__init__(base_learning_rate, policy, 1.0 if momentum > 0 else -1.0, **policy_args)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.weight_decay = float(weight_decay)
        self.lars = lars

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        one = _one(init_net, device)
        if self.weight_decay > 0:
            wd = _constant(init_net, self.blob_name("weight_decay", device), self.weight_decay, device)
            net.WeightedSum([grad, one, param, wd], grad)
        lr = self._lars_lr(net, init_net, param, grad, self.build_lr(net, init_net, device), device)
        if self.momentum == 0:
            net.WeightedSum([param, one, grad, lr], param)
            return
        mom = BlobReference(momentum_name(param))
        init_net.ConstantFill([param], mom, value=0.0)
        net.MomentumSGDUpdate([grad, mom, lr, param], [grad, mom, param], momentum=self.momentum,
                              nesterov=self.nesterov)

    supports_sparse = True

    def check(self, init_net: Net, param: str, grad: str | GradientSlice) -> None:
        if isinstance(grad, GradientSlice) and self.weight_decay > 0:
            raise NotImplementedError(f"build_sgd: weight_decay with the sparse gradient of {str(param)!r} is "
                                      f"not supported (it would touch every row); use weight_decay=0")

    def _sparse_update(self, net: Net, init_net: Net, param: BlobReference, grad: GradientSlice,
                       device: DeviceOption) -> None:
        """Only the rows in the slice: ScatterWeightedSum (plain) or SparseMomentumSGDUpdate."""
        lr = self.build_lr(net, init_net, device)
        one = _one(init_net, device)  # created either way, as Caffe2 (a shared auxiliary parameter)
        if self.momentum == 0:
            net.ScatterWeightedSum([param, one, grad.indices, grad.values, lr], param)
            return
        mom = BlobReference(momentum_name(param))
        init_net.ConstantFill([param], mom, value=0.0)
        net.SparseMomentumSGDUpdate([grad.values, mom, lr, param, grad.indices], [grad.values, mom, param],
                                    momentum=self.momentum, nesterov=self.nesterov)


class MultiPrecisionSgdOptimizer(SgdOptimizer):
    """Caffe2's SGD with float32 master copies: a param made by PseudoFP16Initializer (a float16 param
    with `<param>_fp32` in the init net) gets its float16 gradient cast to float32 (and divided by
    `loss_scale`, the factor the loss was multiplied by), the update applied to the master, and the
    master cast back into the param. Other params get plain SGD, as in Caffe2. With a loss scale, a
    float16 gradient holding an inf or a NaN (an overflow) fails the step before any update
    (`CheckGradients`): `data_parallel_model.RunNet` skips it with a warning."""

    def __init__(self, base_learning_rate: float, policy: str = "fixed", momentum: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0, loss_scale: float = 1.0,
                 **policy_args: Any) -> None:
        _check_number("loss_scale", loss_scale, low=0.0)
        if loss_scale == 0:
            raise ValueError("build_multi_precision_sgd: loss_scale must be > 0")
        super().__init__(base_learning_rate, policy, momentum, nesterov, weight_decay, **policy_args)
        self.loss_scale = float(loss_scale)

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        master = BlobReference(fp32_master_name(param))
        if not init_net.BlobIsDefined(master):
            super()._update(net, init_net, param, grad, device)
            return
        grad32 = net.HalfToFloat([grad], BlobReference(f"{grad}_fp32"))
        if self.loss_scale != 1.0:  # a scaled float16 gradient may overflow: skip the step, not poison the master
            net.Scale([grad32], grad32, scale=1.0 / self.loss_scale)
            net.CheckGradients([grad32], [], loss_scale=self.loss_scale)
        super()._update(net, init_net, master, grad32, device)
        net.FloatToHalf([master], param)


class FP16SgdOptimizer(MultiPrecisionSgdOptimizer):
    """Caffe2's SGD for float16 params: here the update runs on the float32 master copy."""


class AdamOptimizer(Optimizer):
    """Adam (torch.optim.Adam's update) with `<param>_first_moment` / `_second_moment` state.

    `use_smart_decay` (Caffe2's): a sparse gradient runs `SmartDecaySparseAdam`, which decays each row's
    moments by the steps since that row was last updated (`<param>_last_seen`, int64, one per row) and
    catches the first moment up; a dense gradient runs plain Adam (Caffe2 passed `last_seen` to Adam as
    its optional effective-gradient output, overwriting it with a float tensor: a bug, not followed)."""

    _iteration_is_aux = True

    def __init__(self, base_learning_rate: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, policy: str = "fixed", enableRAdam: bool = False,  # noqa: N803
                 use_smart_decay: bool = False, **policy_args: Any) -> None:
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            _check_number(name, beta, low=0.0, below=1.0)
        _check_number("epsilon", epsilon, low=0.0)
        if use_smart_decay and enableRAdam:
            raise NotImplementedError("Smart decay is not implemented for RAdam.  Set enableRAdam or "
                                      "use_smart_decay to False.")
        super().__init__(base_learning_rate, policy, -1.0, **policy_args)
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)
        self.radam = bool(enableRAdam)  # rectified Adam: the RAdam / SparseRAdam ops
        self.use_smart_decay = bool(use_smart_decay)

    def check(self, init_net: Net, param: str, grad: str | GradientSlice) -> None:
        if self.use_smart_decay:
            _rows(init_net, BlobReference(param))

    def _moments(self, init_net: Net, param: BlobReference) -> tuple[BlobReference, ...]:
        """The state: first and second moments, and `<param>_last_seen` with use_smart_decay."""
        m1, m2 = (BlobReference(n) for n in adam_moment_names(param))
        init_net.ConstantFill([param], m1, value=0.0)
        init_net.ConstantFill([param], m2, value=0.0)
        if not self.use_smart_decay:
            return m1, m2
        last_seen = BlobReference(f"{param}_last_seen")
        init_net.ConstantFill([], last_seen, shape=[_rows(init_net, param)], value=0, dtype="int64")
        return m1, m2, last_seen

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        lr = self.build_lr(net, init_net, device)
        m1, m2 = self._moments(init_net, param)[:2]
        op = net.RAdam if self.radam else net.Adam
        op([param, m1, m2, grad, lr, BlobReference(OPTIMIZER_ITERATION)], [param, m1, m2],
           beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon)

    supports_sparse = True

    def _sparse_update(self, net: Net, init_net: Net, param: BlobReference, grad: GradientSlice,
                       device: DeviceOption) -> None:
        """SparseAdam: the rows in the slice only (torch.optim.SparseAdam)."""
        lr = self.build_lr(net, init_net, device)
        state = self._moments(init_net, param)
        if self.use_smart_decay:
            net.SmartDecaySparseAdam([param, *state, grad.indices, grad.values, lr, BlobReference(OPTIMIZER_ITERATION)],
                                     [param, *state], beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon)
            return
        m1, m2 = state
        op = net.SparseRAdam if self.radam else net.SparseAdam
        op([param, m1, m2, grad.indices, grad.values, lr, BlobReference(OPTIMIZER_ITERATION)],
           [param, m1, m2], beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon)


class AdagradOptimizer(Optimizer):
    """Adagrad (Caffe2's AdagradOptimizer): `<param>_squared_sum` state; `rowWise` keeps one value per row
    (`<param>_avg_squared_sum`) for sparse gradients.

    `counter_halflife` > 0 keeps Caffe2's row frequencies: `<param>_update_counter` (float64) and
    `<param>_prev_update_iter` (int64), one per row, which `RowWiseCounter` advances for the rows of each
    sparse gradient (Caffe2 reads them only for its row-wise weight decay, which graphpar's Adagrad
    does not have, so the update itself is unchanged). `use_dedicated_lr_iteration_counter`: the
    learning rate reads its own counter `optimizer_iteration_lr` (as Caffe2). `engine` is accepted and
    ignored (PyTorch picks the kernels)."""

    _caffe2_only = ("weight_decay", "output_effective_lr", "output_effective_lr_and_update", "pruning_options",
                    "swa_options", "ema_options", "weight_scale", "sparse_dedup_aggregator")

    def __init__(self, base_learning_rate: float = 0.01, epsilon: float = 1e-4, decay: float = 1.0,
                 policy: str = "fixed", rowWise: bool = False, lars: float | None = None,  # noqa: N803
                 counter_halflife: int = -1, use_dedicated_lr_iteration_counter: bool = False, engine: str = "",
                 **policy_args: Any) -> None:
        if isinstance(counter_halflife, bool) or not isinstance(counter_halflife, int):
            raise TypeError(f"build_adagrad: counter_halflife must be an int (-1: off), got {counter_halflife!r}")
        _check_number("epsilon", epsilon, low=0.0)
        if lars is not None:
            _check_number("lars", lars, low=0.0)
        self.lars = lars
        _check_number("decay", decay, low=0.0)
        if epsilon == 0 or decay == 0 or decay > 1:
            raise ValueError(f"build_adagrad: needs epsilon > 0 and 0 < decay <= 1, got epsilon={epsilon}, "
                             f"decay={decay}")
        super().__init__(base_learning_rate, policy, -1.0, **policy_args)
        self.epsilon, self.decay, self.row_wise = float(epsilon), float(decay), bool(rowWise)
        self.engine = engine  # Caffe2's kernel choice: PyTorch picks the kernels
        self.counter_halflife = counter_halflife
        self._iteration_is_aux = counter_halflife > 0  # the counters read it (Caffe2 lists it as shared)
        self.use_dedicated_lr_iteration_counter = bool(use_dedicated_lr_iteration_counter)

    supports_sparse = True

    def check(self, init_net: Net, param: str, grad: str | GradientSlice) -> None:
        if self.counter_halflife > 0:
            _rows(init_net, BlobReference(param))
        if not self.row_wise:
            return
        if not isinstance(grad, GradientSlice):
            raise NotImplementedError(f"build_adagrad: rowWise Adagrad is for sparse gradients, but param "
                                      f"{str(param)!r} has a dense one (as in Caffe2)")
        _rows(init_net, BlobReference(param))

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        lr = self._lars_lr(net, init_net, param, grad, self.build_lr(net, init_net, device), device)
        moment = BlobReference(f"{param}_squared_sum")
        init_net.ConstantFill([param], moment, value=0.0)
        self._row_counters(net, init_net, param)
        net.Adagrad([param, moment, grad, lr], [param, moment], epsilon=self.epsilon, decay=self.decay)

    def _row_counters(self, net: Net, init_net: Net, param: BlobReference) -> tuple[BlobReference, ...] | None:
        """(prev_update_iter, update_counter, the iteration counter) with counter_halflife, else None."""
        if self.counter_halflife <= 0:
            return None
        iteration = _iteration_counter(net, init_net)
        rows = _rows(init_net, param)
        counter, prev = BlobReference(f"{param}_update_counter"), BlobReference(f"{param}_prev_update_iter")
        init_net.ConstantFill([], counter, shape=[rows], value=0.0, dtype="float64")
        init_net.ConstantFill([], prev, shape=[rows], value=0, dtype="int64")
        return prev, counter, iteration

    def _sparse_update(self, net: Net, init_net: Net, param: BlobReference, grad: GradientSlice,
                       device: DeviceOption) -> None:
        lr = self.build_lr(net, init_net, device)
        if self.row_wise:
            moment = BlobReference(f"{param}_avg_squared_sum")
            init_net.ConstantFill([], moment, shape=[_rows(init_net, param)], value=0.0)
        else:
            moment = BlobReference(f"{param}_squared_sum")
            init_net.ConstantFill([param], moment, value=0.0)
        counters = self._row_counters(net, init_net, param)
        op = net.RowWiseSparseAdagrad if self.row_wise else net.SparseAdagrad
        op([param, moment, grad.indices, grad.values, lr], [param, moment], epsilon=self.epsilon, decay=self.decay)
        if counters is not None:
            prev, counter, iteration = counters
            net.RowWiseCounter([prev, counter, grad.indices, iteration], [prev, counter],
                               counter_halflife=self.counter_halflife)


class RmsPropOptimizer(Optimizer):
    """Caffe2's RmsProp: `RmsProp` turns the gradient into a step (state `<param>_mean_squares` and
    `<param>_momentum`), which `WeightedSum` adds times -lr. Dense gradients only, as in Caffe2."""

    def __init__(self, base_learning_rate: float = 0.01, decay: float = 0.9, momentum: float = 0.0,
                 epsilon: float = 1e-5, policy: str = "fixed", **policy_args: Any) -> None:
        for name, value in (("decay", decay), ("momentum", momentum), ("epsilon", epsilon)):
            _check_number(name, value, low=0.0)
        super().__init__(base_learning_rate, policy, -1.0, **policy_args)
        self.decay, self.momentum, self.epsilon = float(decay), float(momentum), float(epsilon)

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        lr = self.build_lr(net, init_net, device)
        ms, mom = BlobReference(f"{param}_mean_squares"), BlobReference(momentum_name(param))
        init_net.ConstantFill([param], ms, value=0.0)
        init_net.ConstantFill([param], mom, value=0.0)
        one = _one(init_net, device)
        self._internal.add(str(one))  # RmsProp's rate input, not state (Caffe2 does not list it)
        step = BlobReference(f"{param}_grad_o")
        net.RmsProp([grad, ms, mom, one], [step, ms, mom], decay=self.decay, momentum=self.momentum,
                    epsilon=self.epsilon)
        net.WeightedSum([param, one, step, lr], param)


class AdadeltaOptimizer(Optimizer):
    """Caffe2's Adadelta: state `<param>_squared_moment` and `<param>_squared_moment_update`; sparse
    gradients update their rows (`SparseAdadelta`)."""

    supports_sparse = True

    def __init__(self, base_learning_rate: float = 0.01, epsilon: float = 1e-4, decay: float = 0.95,
                 policy: str = "fixed", **policy_args: Any) -> None:
        _check_number("epsilon", epsilon, low=0.0)
        _check_number("decay", decay, low=0.0, below=1.0)
        super().__init__(base_learning_rate, policy, -1.0, **policy_args)
        self.epsilon, self.decay = float(epsilon), float(decay)

    def _state(self, init_net: Net, param: BlobReference) -> tuple[BlobReference, BlobReference]:
        moment, delta = BlobReference(f"{param}_squared_moment"), BlobReference(f"{param}_squared_moment_update")
        init_net.ConstantFill([param], moment, value=0.0)
        init_net.ConstantFill([param], delta, value=0.0)
        return moment, delta

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        lr = self.build_lr(net, init_net, device)
        moment, delta = self._state(init_net, param)
        net.Adadelta([param, moment, delta, grad, lr], [param, moment, delta], epsilon=self.epsilon, decay=self.decay)

    def _sparse_update(self, net: Net, init_net: Net, param: BlobReference, grad: GradientSlice,
                       device: DeviceOption) -> None:
        lr = self.build_lr(net, init_net, device)
        moment, delta = self._state(init_net, param)
        net.SparseAdadelta([param, moment, delta, grad.indices, grad.values, lr], [param, moment, delta],
                           epsilon=self.epsilon, decay=self.decay)


class WngradOptimizer(Optimizer):
    """Caffe2's WNGrad: one scalar state `<param>_moment` (starting at `moment_init`) per param."""

    supports_sparse = True

    def __init__(self, base_learning_rate: float = 1.0, epsilon: float = 1e-9, moment_init: float = 100.0,
                 policy: str = "fixed", **policy_args: Any) -> None:
        _check_number("epsilon", epsilon, low=0.0)
        _check_number("moment_init", moment_init, low=0.0)
        super().__init__(base_learning_rate, policy, -1.0, **policy_args)
        self.epsilon, self.moment_init = float(epsilon), float(moment_init)

    def _moment(self, init_net: Net, param: BlobReference) -> BlobReference:
        moment = BlobReference(f"{param}_moment")
        init_net.ConstantFill([], moment, shape=[1], value=self.moment_init)
        return moment

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        lr, moment = self.build_lr(net, init_net, device), self._moment(init_net, param)
        net.Wngrad([param, moment, grad, lr], [param, moment], epsilon=self.epsilon)

    def _sparse_update(self, net: Net, init_net: Net, param: BlobReference, grad: GradientSlice,
                       device: DeviceOption) -> None:
        lr, moment = self.build_lr(net, init_net, device), self._moment(init_net, param)
        net.SparseWngrad([param, moment, grad.indices, grad.values, lr], [param, moment], epsilon=self.epsilon)


class FtrlOptimizer(Optimizer):
    """Caffe2's FTRL-Proximal: state `<param>_ftrl_nz` (the param's shape + [2]: n and z); it has its own
    per-coordinate rate, so it reads no learning rate (and ignores LR multipliers)."""

    supports_sparse = True

    def __init__(self, alpha: float = 0.01, beta: float = 1e-4, lambda1: float = 0.0, lambda2: float = 0.0,
                 engine: str | None = "") -> None:
        for name, value in (("alpha", alpha), ("beta", beta), ("lambda1", lambda1), ("lambda2", lambda2)):
            _check_number(name, value, low=0.0)
        super().__init__(0.0, "fixed", -1.0)
        self.alpha, self.beta, self.lambda1, self.lambda2 = float(alpha), float(beta), float(lambda1), float(lambda2)
        self.engine = engine or ""  # Caffe2's SIMD engine: PyTorch picks the kernels

    def _nz(self, init_net: Net, param: BlobReference) -> BlobReference:
        nz = BlobReference(f"{param}_ftrl_nz")
        init_net.ConstantFill([param], nz, extra_shape=[2], value=0.0)
        return nz

    def _args(self) -> dict[str, float]:
        return {"alpha": self.alpha, "beta": self.beta, "lambda1": self.lambda1, "lambda2": self.lambda2}

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        nz = self._nz(init_net, param)
        net.Ftrl([param, nz, grad], [param, nz], **self._args())

    def _sparse_update(self, net: Net, init_net: Net, param: BlobReference, grad: GradientSlice,
                       device: DeviceOption) -> None:
        nz = self._nz(init_net, param)
        net.SparseFtrl([param, nz, grad.indices, grad.values], [param, nz], **self._args())


class StormOptimizer(Optimizer):
    """Caffe2's STORM (Cutkosky & Orabona 2019): state `<param>_moment` (zeros) and `<param>_grad_sq_sum`
    ([1], starting at `grad_sq_init`); `Storm` for dense gradients, `SparseStorm` on the rows of sparse
    ones. `lr` is the rate scale k of the paper, `momentum` its c, `beta` its w; `lars` as in build_sgd."""

    supports_sparse = True

    def __init__(self, lr: float = 0.1, momentum: float = 10.0, beta: float = 0.1, grad_sq_init: float = 0.01,
                 policy: str = "fixed", lars: float | None = None, **policy_args: Any) -> None:
        for name, value in (("momentum", momentum), ("beta", beta), ("grad_sq_init", grad_sq_init)):
            _check_number(name, value, low=0.0)
        if lars is not None:
            _check_number("lars", lars, low=0.0)
        super().__init__(lr, policy, -1.0, **policy_args)
        self.momentum, self.beta, self.grad_sq_init, self.lars = float(momentum), float(beta), float(grad_sq_init), lars

    def _state(self, init_net: Net, param: BlobReference) -> tuple[BlobReference, BlobReference]:
        moment, gss = BlobReference(f"{param}_moment"), BlobReference(f"{param}_grad_sq_sum")
        init_net.ConstantFill([param], moment, value=0.0)
        init_net.ConstantFill([], gss, shape=[1], value=self.grad_sq_init)
        return moment, gss

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        lr = self._lars_lr(net, init_net, param, grad, self.build_lr(net, init_net, device), device)
        moment, gss = self._state(init_net, param)
        net.Storm([param, moment, gss, grad, lr], [param, moment, gss], momentum=self.momentum, beta=self.beta)

    def _sparse_update(self, net: Net, init_net: Net, param: BlobReference, grad: GradientSlice,
                       device: DeviceOption) -> None:
        lr = self.build_lr(net, init_net, device)
        moment, gss = self._state(init_net, param)
        net.SparseStorm([param, moment, gss, grad.values, grad.indices, lr], [param, moment, gss],
                        momentum=self.momentum, beta=self.beta)


class DecayAdagradOptimizer(Optimizer):
    """Caffe2's DecayAdagrad: dense gradients run `DecayAdagrad` (state `<param>_first_mo1ment`, Caffe2's
    spelling, and `<param>_second_moment`; the iteration counter is shared state); sparse ones run
    `SparseAdagrad` with `<param>_squared_sum`, as Caffe2 does."""

    supports_sparse = True

    def __init__(self, alpha: float = 0.01, beta1: float = 0.0, beta2: float = 0.999, epsilon: float = 0.1,
                 weight_decay: float = 0.0, bias_correction_first: bool = True, policy: str = "fixed",
                 engine: str = "", **policy_args: Any) -> None:
        _check_number("beta1", beta1, low=0.0, below=1.0)
        _check_number("beta2", beta2, low=0.0, below=1.0)
        _check_number("epsilon", epsilon, low=0.0)
        _check_number("weight_decay", weight_decay, low=0.0)
        if epsilon == 0:
            raise ValueError("build_decay_adagrad: epsilon must be > 0")
        super().__init__(alpha, policy, -1.0, **policy_args)
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)
        self.weight_decay, self.bias_correction_first = float(weight_decay), bool(bias_correction_first)
        self.engine = engine  # Caffe2's kernel choice: PyTorch picks the kernels

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        lr = self.build_lr(net, init_net, device)
        m1, m2 = BlobReference(f"{param}_first_mo1ment"), BlobReference(f"{param}_second_moment")
        init_net.ConstantFill([param], m1, value=0.0)
        init_net.ConstantFill([param], m2, value=0.0)
        self._iteration_is_aux = True  # as in Caffe2: the dense update's counter is shared state
        net.DecayAdagrad([param, m1, m2, grad, lr, BlobReference(OPTIMIZER_ITERATION)], [param, m1, m2],
                         beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon, weight_decay=self.weight_decay,
                         bias_correction_first=self.bias_correction_first)

    def _sparse_update(self, net: Net, init_net: Net, param: BlobReference, grad: GradientSlice,
                       device: DeviceOption) -> None:
        lr = self.build_lr(net, init_net, device)
        moment = BlobReference(f"{param}_squared_sum")
        init_net.ConstantFill([param], moment, value=0.0)
        net.SparseAdagrad([param, moment, grad.indices, grad.values, lr], [param, moment], epsilon=self.epsilon)


class GFtrlOptimizer(FtrlOptimizer):
    """Caffe2's group-lasso FTRL: `GFtrl` with state `<param>_gftrl_nz` (the param's shape + [2]); each
    column of the param (seen as [dim 0, the rest]) is a group. Dense gradients only, as in Caffe2."""

    supports_sparse = False

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        nz = BlobReference(f"{param}_gftrl_nz")
        init_net.ConstantFill([param], nz, extra_shape=[2], value=0.0)
        net.GFtrl([param, nz, grad], [param, nz], **self._args())


class YellowFinOptimizer(Optimizer):
    """Caffe2's YellowFin (an automatic tuner of momentum SGD): `YellowFin` with its own rate and momentum
    per param (`<param>_lr_avg` starting at `alpha`, `<param>_mu_avg` at `mu`) and the state
    `<param>_moment`, `_curv_win`, `_g_avg`, `_g2_avg`, `_scalars_memory`. It tunes its own rate, so it
    reads no LearningRate (and ignores LR multipliers). Dense gradients only, as in Caffe2."""

    _iteration_is_aux = True

    def __init__(self, alpha: float = 0.1, mu: float = 0.0, beta: float = 0.999, curv_win_width: int = 20,
                 zero_debias: bool = True, epsilon: float = 0.1 ** 6, policy: str = "fixed") -> None:
        _check_number("alpha", alpha, low=0.0)
        _check_number("mu", mu, low=0.0, below=1.0)
        _check_number("beta", beta, low=0.0, below=1.0)
        _check_number("epsilon", epsilon, low=0.0)
        if alpha == 0 or isinstance(curv_win_width, bool) or not isinstance(curv_win_width, int) or curv_win_width < 1:
            raise ValueError(f"build_yellowfin: needs alpha > 0 and an int curv_win_width >= 1, got alpha={alpha}, "
                             f"curv_win_width={curv_win_width!r}")
        if policy != "fixed":
            raise ValueError(f"build_yellowfin: YellowFin tunes its own learning rate; policy={policy!r} would "
                             f"not be used (Caffe2 ignored it too): leave it 'fixed'")
        super().__init__(0.0, "fixed", -1.0)
        self.alpha, self.mu, self.beta, self.epsilon = float(alpha), float(mu), float(beta), float(epsilon)
        self.curv_win_width, self.zero_debias = curv_win_width, bool(zero_debias)

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        state = [BlobReference(f"{param}_{name}") for name in
                 ("moment", "lr_avg", "mu_avg", "curv_win", "g_avg", "g2_avg", "scalars_memory")]
        moment, lr_avg, mu_avg, curv_win, g_avg, g2_avg, memory = state
        for blob in (moment, g_avg, g2_avg):
            init_net.ConstantFill([param], blob, value=0.0)
        for blob, size, value in ((lr_avg, 1, self.alpha), (mu_avg, 1, self.mu), (curv_win, self.curv_win_width, 0.0),
                                  (memory, 5, 0.0)):
            init_net.ConstantFill([], blob, shape=[size], value=value)
        iteration = _iteration_counter(net, init_net)
        net.YellowFin([param, *state, grad, iteration], [param, *state], beta=self.beta, epsilon=self.epsilon,
                      curv_win_width=self.curv_win_width, zero_debias=self.zero_debias)


def _rows(init_net: Net, param: BlobReference) -> int:
    """The first dimension of `param`, from shape inference on the init net's ops creating it."""
    spec = infer_specs(init_net.Proto(), wanted=[str(param)]).get(str(param))
    if spec is None:
        raise ValueError(f"the optimizer keeps one value per row of {str(param)!r} (Adagrad's rowWise or "
                         f"counter_halflife, Adam's use_smart_decay), but param_init_net does not create it with a "
                         f"known shape")
    return spec.shape[0]


class WeightDecayBuilder(Optimizer):
    """Adds wd·param to the gradient of each param it is applied to (Caffe2's `add_weight_decay`)."""

    def __init__(self, weight_decay: float) -> None:
        _check_number("weight_decay", weight_decay, low=0.0)
        super().__init__(0.0, "fixed", -1.0)
        self.weight_decay = float(weight_decay)

    def _update(self, net: Net, init_net: Net, param: BlobReference, grad: BlobReference,
                device: DeviceOption) -> None:
        wd = _constant(init_net, f"wd_{int(device.device_type)}_{device.device_id}", self.weight_decay, device)
        net.WeightedSum([grad, _one(init_net, device), param, wd], grad)


def _check_options(cls: str, policy: str, policy_args: dict[str, Any], caffe2_only: tuple[str, ...]) -> None:
    """Raise for keyword arguments that are neither the optimizer's nor the learning-rate policy's,
    naming them: NotImplementedError for Caffe2's options graphpar does not implement (unless given
    their off value, which is dropped), TypeError for unknown ones."""
    for name in [n for n in caffe2_only if n in policy_args and not policy_args[n]]:
        del policy_args[name]  # None, False, 0 or {}: Caffe2's default, the option is off
    missing = sorted(set(policy_args) & set(caffe2_only))
    if missing:
        raise NotImplementedError(f"{cls}: Caffe2's {', '.join(missing)} is not implemented in graphpar; see "
                                  f"docs/caffe2_migration.md")
    unknown = sorted(set(policy_args) - set(get_schema("LearningRate").all_args()))
    if unknown:
        raise TypeError(f"{cls}: unknown option(s) {unknown}: neither an option of this optimizer nor an "
                        f"argument of the learning-rate policy {policy!r} (e.g. stepsize, gamma for 'step')")


def _check_number(name: str, value: Any, low: float, below: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"optimizer: {name} must be a finite number, got {value!r}")
    if value < low or (below is not None and value >= below):
        bound = f"in [{low}, {below})" if below is not None else f">= {low}"
        raise ValueError(f"optimizer: {name} must be {bound}, got {value!r}")


def _optimization_params(model: ModelHelper, weights_only: bool) -> list[tuple[BlobReference, str | GradientSlice]]:
    """(param, grad) for every trainable param with a gradient, in creation order."""
    model.Validate()
    if model.params and not model.param_to_grad:
        raise ValueError(f"model {model.name!r} has no parameter gradients; call "
                         f"model.AddGradientOperators(losses) before building the optimizer")
    weights = set(model.weights)
    params = [(p, model.param_to_grad[p]) for p in model.params
              if p in model.param_to_grad and (not weights_only or p in weights)]
    return params


def _param_devices(model: ModelHelper, params: list[tuple[BlobReference, str | GradientSlice]]) -> dict[str, DeviceOption]:
    """Each param's device: that of the first op using it, init net first (Caffe2's InferBlobDevices).

    Params are normally created in the init net, so the train net is scanned only if one is not.
    """
    devices = blob_devices(model.param_init_net.Proto())
    if all(param in devices for param, _ in params):
        return devices
    return blob_devices([model.param_init_net.Proto(), model.net.Proto()])


def _replica_scope(param: str) -> str:
    """'gpu_1/' for a replica's param, '' otherwise: the scope of that device's LR-multiplier blobs."""
    replica = parse_device_scope(param)
    return f"{device_scope_name(*replica)}/" if replica else ""


def _norm_ratio(model: ModelHelper, grads: list[str | GradientSlice], device: DeviceOption, scope: str,
                max_norm: float) -> BlobReference:
    """Caffe2's `norm_clipped_grad_update/norm_ratio` on `device`: clip_norm / max(‖grads‖₂, clip_norm),
    the norm taken over the gradients living on the device (a GradientSlice counts by its values).
    After Parallelize's all-reduce every device holds the same gradients, so it is the global norm."""
    net, name = model.net, lambda blob: BlobReference(f"{scope}{NORM_SCOPE}/{blob}")
    with DeviceScope(device):
        squares = [net.SumSqrElements([g.values if isinstance(g, GradientSlice) else g], name(f"grad_{i}_squared_sum"))
                   for i, g in enumerate(grads)]
        total = net.Sum(squares, name("grad_squared_full_sum"))
        norm = net.Sqrt([total], name("global_norm"))
        clip_norm = model.param_init_net.ConstantFill([], name("clip_norm"), shape=[], value=float(max_norm))
        max_norm_blob = net.Max([norm, clip_norm], name("max_norm"))
        return net.Div([clip_norm, max_norm_blob], name("norm_ratio"))


def _lr_multipliers(model: ModelHelper, params: list[tuple[BlobReference, str | GradientSlice]], devices: dict[str, DeviceOption],
                    max_norm: float | None, allow_lr_injection: bool) -> dict[DeviceOption, BlobReference] | None:
    """{device: the blob every learning rate on it is multiplied by} (Caffe2's `lr_multiplier`):
    `norm_ratio` with `max_gradient_norm`, the CPU blob `lr_injection` with `allow_lr_injection`, and
    their product `lr_multiplier` with both. None when neither is asked for."""
    if max_norm is None and not allow_lr_injection:
        return None
    by_device: dict[DeviceOption, list] = defaultdict(list)
    for param, grad in params:
        by_device[devices[param]].append((param, grad))
    injection = _lr_injection(model) if allow_lr_injection else None
    multipliers: dict[DeviceOption, BlobReference] = {}
    with NameScope(None, reset=True):
        for device, pairs in by_device.items():
            scope = _replica_scope(str(pairs[0][0]))
            ratio = None if max_norm is None else _norm_ratio(model, [g for _, g in pairs], device, scope, max_norm)
            on_device = injection
            if injection is not None and device.device_type == CUDA:
                with DeviceScope(device):
                    on_device = model.net.CopyCPUToGPU([injection], BlobReference(
                        f"{scope}{LR_INJECTION}_gpu{device.device_id}"))
            if ratio is None or on_device is None:
                only = ratio if on_device is None else on_device
                if only is not None:  # one of them is asked for (else there are no multipliers)
                    multipliers[device] = only
                continue
            with DeviceScope(device):
                multipliers[device] = model.net.Mul([on_device, ratio], BlobReference(f"{scope}lr_multiplier"))
    return multipliers


def _get_param_to_device(model: ModelHelper) -> dict[str, DeviceOption]:
    """{blob: its device} over the model's net and init net, the init net's placement winning (Caffe2)."""
    return {**blob_devices(model.net.Proto()), **blob_devices(model.param_init_net.Proto())}


def get_param_device(param_name: str, grad: str | GradientSlice | None, param_to_device: dict | None = None,
                     default_device: DeviceOption | None = None) -> DeviceOption:
    """The device of `param_name` in `param_to_device`, else that of its gradient (a GradientSlice's
    values or indices), else `default_device` (Caffe2's helper).

    Raises: ValueError when none of them is known.
    """
    known = param_to_device or {}
    names = [param_name, *([grad.values, grad.indices] if isinstance(grad, GradientSlice) else [grad])]
    device = next((known[str(n)] for n in names if n is not None and str(n) in known), default_device)
    if device is None:
        raise ValueError(f"cannot infer the device of {param_name!r}: no op creates or reads it")
    return device


def _lr_injection(model: ModelHelper) -> BlobReference:
    """The unscoped CPU blob `lr_injection` (1.0 at init) that users may feed to scale every LR."""
    return _constant(model.param_init_net, LR_INJECTION, 1.0, DeviceOption(CPU))


OptimizerT = TypeVar("OptimizerT", bound=Optimizer)


def _build(model: ModelHelper, optimizer: OptimizerT, weights_only: bool = False,
           max_gradient_norm: float | None = None, allow_lr_injection: bool = False) -> OptimizerT:
    """Record `optimizer`'s update for each param with a gradient, on the param's device (Caffe2's _build)."""
    params = _optimization_params(model, weights_only)
    for param, grad in params:
        optimizer.check(model.param_init_net, param, grad)
    devices = _param_devices(model, params)
    multipliers = _lr_multipliers(model, params, devices, max_gradient_norm, allow_lr_injection)
    if multipliers is not None:
        optimizer.add_lr_multiplier(multipliers)
    with NameScope(None, reset=True):
        for device, run in groupby(params, key=lambda pair: devices[pair[0]]):
            with DeviceScope(device):  # one scope per run of consecutive params on the same device
                for param, grad in run:
                    optimizer(model.net, model.param_init_net, param, grad)
    return optimizer


def build_sgd(model: ModelHelper, base_learning_rate: float, policy: str = "fixed", momentum: float = 0.0,
              nesterov: bool = False, weight_decay: float = 0.0, max_gradient_norm: float | None = None,
              allow_lr_injection: bool = False, lars: float | None = None, **policy_args: Any) -> SgdOptimizer:
    """Add SGD updates for every param of `model` that has a gradient; return the optimizer.

    Args:
        model: a ModelHelper whose gradients were added (`AddGradientOperators`).
        base_learning_rate: the rate before the policy's factor (>= 0).
        policy: a `LearningRate` policy ('fixed', 'step', 'multistep', 'exp', 'inv', 'poly', ...), with its
            Caffe2-named arguments in `policy_args` (stepsize, gamma, stepsizes, power, max_iter, ...).
        momentum, nesterov: `MomentumSGDUpdate` with a zero-initialised `<param>_momentum` when momentum > 0.
        weight_decay: adds weight_decay·param to the gradient of *every* param (weights and biases), as
            torch.optim.SGD does; use `add_weight_decay` for Caffe2's weights-only decay.
        max_gradient_norm: Caffe2's clipping by the global L2 norm: every LR is multiplied by
            `norm_clipped_grad_update/norm_ratio` = max_norm / max(‖grads‖₂, max_norm) (for SGD, the same
            step as torch's clip_grad_norm_).
        allow_lr_injection: multiply every LR by the CPU blob `lr_injection` (1.0 until the user feeds it).
        lars: Caffe2's layer-wise adaptive rate scaling: each dense param's LR times `Lars` (offset=lars,
            trust 1, no weight decay, no upper bound), as Caffe2's SgdOptimizer(lars=...).

    Raises:
        ValueError / TypeError: a bad hyper-parameter, nesterov without momentum, a model without gradients.
        NotImplementedError: a sparse (GradientSlice) gradient with weight_decay.
    """
    _check_clip_norm(max_gradient_norm)
    optimizer = SgdOptimizer(base_learning_rate, policy, momentum, nesterov, weight_decay, lars, **policy_args)
    return _build(model, optimizer, max_gradient_norm=max_gradient_norm, allow_lr_injection=allow_lr_injection)


def build_adam(model: ModelHelper, base_learning_rate: float, beta1: float = 0.9, beta2: float = 0.999,
               epsilon: float = 1e-8, policy: str = "fixed", max_gradient_norm: float | None = None,
               allow_lr_injection: bool = False, use_smart_decay: bool = False, enableRAdam: bool = False,  # noqa: N803
               **policy_args: Any) -> AdamOptimizer:
    """Add Adam updates (torch.optim.Adam's rule) for every param of `model` with a gradient.

    Args are those of `build_sgd` plus Adam's betas and epsilon; the state blobs are
    `<param>_first_moment` and `<param>_second_moment` (zeros), and the step count is `optimizer_iteration`.
    `max_gradient_norm` and `allow_lr_injection` multiply the learning rate as in `build_sgd`
    (Caffe2's mechanism; for Adam this differs from clipping the gradients). `enableRAdam`: rectified Adam
    (torch.optim.RAdam's update, ops `RAdam` / `SparseRAdam`). `use_smart_decay`: Caffe2's smart decay
    for sparse gradients (`AdamOptimizer`).

    Raises:
        ValueError / TypeError: a bad hyper-parameter or a model without gradients.
        NotImplementedError: use_smart_decay with enableRAdam (as in Caffe2).
    """
    _check_clip_norm(max_gradient_norm)
    optimizer = AdamOptimizer(base_learning_rate, beta1, beta2, epsilon, policy, enableRAdam, use_smart_decay,
                              **policy_args)
    return _build(model, optimizer, max_gradient_norm=max_gradient_norm, allow_lr_injection=allow_lr_injection)


def _check_clip_norm(max_gradient_norm: float | None) -> None:
    if max_gradient_norm is not None:
        _check_number("max_gradient_norm", max_gradient_norm, low=0.0)
        if max_gradient_norm == 0:
            raise ValueError("max_gradient_norm must be > 0 (None disables clipping)")


def build_multi_precision_sgd(model: ModelHelper, base_learning_rate: float, momentum: float = 0.0,
                              policy: str = "fixed", nesterov: bool = False, weight_decay: float = 0.0,
                              loss_scale: float = 1.0, max_gradient_norm: float | None = None,
                              allow_lr_injection: bool = False, **policy_args: Any) -> MultiPrecisionSgdOptimizer:
    """SGD that keeps float32 master copies of float16 params (`MultiPrecisionSgdOptimizer`); float32
    params get plain SGD. `loss_scale`: the factor the loss was multiplied by (static loss scaling);
    gradients are divided by it in float32 and checked before any update (an overflow skips the step,
    see `MultiPrecisionSgdOptimizer`). `max_gradient_norm` and
    `allow_lr_injection` as in `build_sgd`."""
    _check_clip_norm(max_gradient_norm)
    optimizer = MultiPrecisionSgdOptimizer(base_learning_rate, policy, momentum, nesterov, weight_decay,
                                           loss_scale, **policy_args)
    return _build(model, optimizer, max_gradient_norm=max_gradient_norm, allow_lr_injection=allow_lr_injection)


def build_adagrad(model: ModelHelper, base_learning_rate: float, epsilon: float = 1e-4, decay: float = 1.0,
                  policy: str = "fixed", rowWise: bool = False, max_gradient_norm: float | None = None,  # noqa: N803
                  allow_lr_injection: bool = False, lars: float | None = None, counter_halflife: int = -1,
                  use_dedicated_lr_iteration_counter: bool = False, **policy_args: Any) -> AdagradOptimizer:
    """Add Adagrad updates for every param of `model` with a gradient (Caffe2's `build_adagrad`).

    Dense gradients: `Adagrad` (moment = decay moment + g^2; param -= lr g / (sqrt(moment) + epsilon));
    sparse ones (GradientSlice): `SparseAdagrad` on their rows, or `RowWiseSparseAdagrad` (one moment
    value per row) with `rowWise`, which Caffe2 allows for sparse gradients only. State:
    `<param>_squared_sum` (`<param>_avg_squared_sum` row-wise), zeros. Equals torch.optim.Adagrad
    (lr_decay 0, initial_accumulator_value 0, eps=epsilon) with decay 1. `lars`, `max_gradient_norm`,
    `allow_lr_injection`: as in `build_sgd` (LARS scales dense updates only, as in Caffe2).
    `counter_halflife`, `use_dedicated_lr_iteration_counter`: see `AdagradOptimizer`.

    Raises:
        ValueError / TypeError: a bad hyper-parameter or a model without gradients.
        NotImplementedError: rowWise with a dense gradient.
    """
    _check_clip_norm(max_gradient_norm)
    optimizer = AdagradOptimizer(base_learning_rate, epsilon, decay, policy, rowWise, lars, counter_halflife,
                                 use_dedicated_lr_iteration_counter, **policy_args)
    return _build(model, optimizer, max_gradient_norm=max_gradient_norm, allow_lr_injection=allow_lr_injection)


def build_rms_prop(model: ModelHelper, base_learning_rate: float, max_gradient_norm: float | None = None,
                   allow_lr_injection: bool = False, **kwargs: Any) -> RmsPropOptimizer:
    """Add Caffe2's RmsProp updates (`RmsPropOptimizer`: decay, momentum, epsilon, policy and its args)."""
    _check_clip_norm(max_gradient_norm)
    return _build(model, RmsPropOptimizer(base_learning_rate, **kwargs), max_gradient_norm=max_gradient_norm,
                  allow_lr_injection=allow_lr_injection)


def build_adadelta(model: ModelHelper, base_learning_rate: float, max_gradient_norm: float | None = None,
                   allow_lr_injection: bool = False, **kwargs: Any) -> AdadeltaOptimizer:
    """Add Caffe2's Adadelta updates (`AdadeltaOptimizer`: epsilon, decay, policy and its args)."""
    _check_clip_norm(max_gradient_norm)
    return _build(model, AdadeltaOptimizer(base_learning_rate, **kwargs), max_gradient_norm=max_gradient_norm,
                  allow_lr_injection=allow_lr_injection)


def build_wngrad(model: ModelHelper, base_learning_rate: float, max_gradient_norm: float | None = None,
                 allow_lr_injection: bool = False, **kwargs: Any) -> WngradOptimizer:
    """Add Caffe2's WNGrad updates (`WngradOptimizer`: epsilon, moment_init, policy and its args)."""
    _check_clip_norm(max_gradient_norm)
    return _build(model, WngradOptimizer(base_learning_rate, **kwargs), max_gradient_norm=max_gradient_norm,
                  allow_lr_injection=allow_lr_injection)


def build_ftrl(model: ModelHelper, engine: str | None = "SIMD", **kwargs: Any) -> FtrlOptimizer:
    """Add Caffe2's FTRL updates (`FtrlOptimizer`: alpha, beta, lambda1, lambda2); `engine` is accepted
    and ignored."""
    return _build(model, FtrlOptimizer(engine=engine, **kwargs))


def build_storm(model: ModelHelper, base_learning_rate: float, parameters: Any = None,
                max_gradient_norm: float | None = None, allow_lr_injection: bool = False,
                **kwargs: Any) -> StormOptimizer:
    """Add Caffe2's STORM updates (`StormOptimizer`: momentum, beta, grad_sq_init, lars, policy and its
    args); `parameters` is accepted and unused, as in Caffe2."""
    _check_clip_norm(max_gradient_norm)
    return _build(model, StormOptimizer(lr=base_learning_rate, **kwargs), max_gradient_norm=max_gradient_norm,
                  allow_lr_injection=allow_lr_injection)


def build_decay_adagrad(model: ModelHelper, base_learning_rate: float, max_gradient_norm: float | None = None,
                        allow_lr_injection: bool = False, **kwargs: Any) -> DecayAdagradOptimizer:
    """Add Caffe2's DecayAdagrad updates (`DecayAdagradOptimizer`: beta1, beta2, epsilon, weight_decay,
    bias_correction_first, policy and its args)."""
    _check_clip_norm(max_gradient_norm)
    return _build(model, DecayAdagradOptimizer(alpha=base_learning_rate, **kwargs),
                  max_gradient_norm=max_gradient_norm, allow_lr_injection=allow_lr_injection)


def build_gftrl(model: ModelHelper, engine: str | None = "", **kwargs: Any) -> GFtrlOptimizer:
    """Add Caffe2's group-lasso FTRL updates (`GFtrlOptimizer`: alpha, beta, lambda1, lambda2); `engine`
    is accepted and ignored."""
    return _build(model, GFtrlOptimizer(engine=engine, **kwargs))


def build_yellowfin(model: ModelHelper, base_learning_rate: float = 0.1, **kwargs: Any) -> YellowFinOptimizer:
    """Add Caffe2's YellowFin updates (`YellowFinOptimizer`: mu, beta, curv_win_width, zero_debias,
    epsilon); `base_learning_rate` is the initial tuned rate."""
    return _build(model, YellowFinOptimizer(alpha=base_learning_rate, **kwargs))


def build_fp16_sgd(model: ModelHelper, base_learning_rate: float, momentum: float = 0.0,
                   policy: str = "fixed", nesterov: bool = False, **kwargs: Any) -> MultiPrecisionSgdOptimizer:
    """Caffe2's SGD for float16 params: here `build_multi_precision_sgd` (the update runs on the
    float32 master copy, which is at least as accurate)."""
    return build_multi_precision_sgd(model, base_learning_rate, momentum, policy, nesterov, **kwargs)


def get_lr_injection() -> np.ndarray:
    """The current `lr_injection` multiplier (a [1] float32 array) of the current workspace."""
    from graphpar.runtime import workspace

    return workspace.FetchBlob(LR_INJECTION)


def set_lr_injection(lr_injection_value: float) -> None:
    """Feed the `lr_injection` multiplier (models built with `allow_lr_injection=True`)."""
    from graphpar.runtime import workspace

    workspace.FeedBlob(LR_INJECTION, np.array([float(lr_injection_value)], dtype=np.float32))


def add_weight_decay(model: ModelHelper, weight_decay: float) -> WeightDecayBuilder | None:
    """Add weight_decay·w to the gradient of every weight (not bias) of `model` (Caffe2's helper).

    Call it after `AddGradientOperators` and before the optimizer builder. A weight decay of 0 adds nothing.

    Raises:
        ValueError / TypeError: a negative or non-numeric weight decay, or a model without gradients.
    """
    _check_number("weight_decay", weight_decay, low=0.0)
    if weight_decay == 0:
        return None
    return _build(model, WeightDecayBuilder(weight_decay), weights_only=True)
