"""Memory format: `ChannelsLast` keeps an NCHW tensor's values and shape and stores it channels-last.

torch's Conv, batch-norm, pooling and element-wise kernels return channels-last outputs for
channels-last inputs (cuDNN's fast path on CUDA), so one conversion of a net's input keeps every
activation of a conv stack channels-last (`Parallelize(channels_last=True)`, `passes.channels_last`).
"""

from __future__ import annotations

import torch

from graphpar.core.schema import Precision, PrecisionRule, register_op
from graphpar.ops.common import one_input_gradient


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x


register_op("ChannelsLast", kernel=lambda _a, _ctx: _channels_last, gradient=one_input_gradient("ChannelsLast"),
            precision=PrecisionRule(Precision.FOLLOW), inplace={(0, 0)},
            doc="Y = X (same values and NCHW shape) stored in torch.channels_last memory format when 4-D. "
                "In place (Y named X) it rebinds the blob to the converted tensor. Gradient: ChannelsLast(dY).")
