"""A small model zoo of brew builders, each usable as `Parallelize`'s `forward_pass_builder_fun`.

Every builder has the signature `f(model, loss_scale, **options) -> [scaled loss]`, reads the blobs
`data` (NCHW float32) and `label` (int32 class ids) in the current name scope, and records a
`SoftmaxWithLoss` (blobs `softmax`, `loss`) whose loss is multiplied by `loss_scale` (`scaled_loss`).
Configure one with `functools.partial(resnet50, num_classes=10)`. `dlrm` is the exception: a click
model reading dense features, embedding lookups and click labels (see `graphpar.models.dlrm`).
"""

from graphpar.models.cnn import lenet
from graphpar.models.dlrm import dlrm
from graphpar.models.mlp import mlp
from graphpar.models.resnet import resnet18, resnet50

__all__ = ["dlrm", "lenet", "mlp", "resnet18", "resnet50"]
