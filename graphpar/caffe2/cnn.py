"""Caffe2's deprecated `CNNModelHelper`: a ModelHelper whose CamelCase methods call brew helpers.

New code uses `ModelHelper` with `brew`; this class exists so that older Caffe2 scripts run with
their imports changed. Each method passes its arguments to the brew helper of the same meaning.
"""

from __future__ import annotations

import logging
from typing import Any

from graphpar.core.ir import BlobReference
from graphpar.model import brew
from graphpar.model.model_helper import ModelHelper
from graphpar.model.optimizer import add_weight_decay

_log = logging.getLogger(__name__)


def _delegate(helper_name: str) -> Any:
    def method(self: CNNModelHelper, *args: Any, **kwargs: Any) -> BlobReference:
        return getattr(brew, helper_name)(self, *args, **kwargs)

    method.__doc__ = f"brew.{helper_name}(self, ...)."
    return method


class CNNModelHelper(ModelHelper):
    """A ModelHelper for CNNs with `order`, `use_cudnn` and `cudnn_exhaustive_search` in its arg scope.

    Raises ValueError for an order other than "NCHW" or "NHWC".
    """

    def __init__(self, order: str = "NCHW", name: str | None = None, use_cudnn: bool = True,
                 cudnn_exhaustive_search: bool = False, ws_nbytes_limit: int | None = None,
                 init_params: bool = True, skip_sparse_optim: bool = False,
                 param_model: ModelHelper | None = None) -> None:
        _log.warning("CNNModelHelper is deprecated (as in Caffe2): use ModelHelper with brew helpers")
        if order not in ("NCHW", "NHWC"):
            raise ValueError(f"CNNModelHelper: order must be 'NCHW' or 'NHWC', got {order!r}")
        scope: dict[str, Any] = {"order": order, "use_cudnn": use_cudnn,
                                 "cudnn_exhaustive_search": cudnn_exhaustive_search}
        if ws_nbytes_limit:
            scope["ws_nbytes_limit"] = ws_nbytes_limit
        super().__init__(name="CNN" if name is None else name, init_params=init_params,
                         skip_sparse_optim=skip_sparse_optim, param_model=param_model, arg_scope=scope)
        self.order, self.use_cudnn = order, use_cudnn
        self.cudnn_exhaustive_search, self.ws_nbytes_limit = cudnn_exhaustive_search, ws_nbytes_limit

    FC = _delegate("fc")
    Conv = _delegate("conv")
    SpatialBN = _delegate("spatial_bn")
    Relu = _delegate("relu")
    LeakyRelu = _delegate("leaky_relu")
    Sigmoid = _delegate("sigmoid")
    Tanh = _delegate("tanh")
    Softmax = _delegate("softmax")
    MaxPool = _delegate("max_pool")
    AveragePool = _delegate("average_pool")
    Dropout = _delegate("dropout")
    Concat = _delegate("concat")
    DepthConcat = _delegate("concat")
    Sum = _delegate("sum")
    Accuracy = _delegate("accuracy")
    Iter = _delegate("iter")

    XavierInit = property(lambda self: ("XavierFill", {}), doc="Caffe2's ('XavierFill', {}) initializer.")
    ConstantInit = property(lambda self: ("ConstantFill", {}), doc="Caffe2's ('ConstantFill', {}).")
    MSRAInit = property(lambda self: ("MSRAFill", {}), doc="Caffe2's ('MSRAFill', {}) initializer.")

    def AddWeightDecay(self, weight_decay: float) -> Any:  # noqa: N802 - Caffe2 name
        """optimizer.add_weight_decay(self, weight_decay)."""
        return add_weight_decay(self, weight_decay)
