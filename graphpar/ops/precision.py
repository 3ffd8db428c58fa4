"""Caffe2's precision casts for mixed-precision training: FloatToHalf and HalfToFloat.

Each is the other's gradient, so a float16 forward between them back-propagates float16 gradients
and the float32 side gets float32 ones. (`Cast` converts to any dtype, bfloat16 included.)
"""

from __future__ import annotations

import torch

from graphpar.core.schema import register_op
from graphpar.ops.common import one_input_gradient

register_op("FloatToHalf", kernel=lambda _a, _ctx: lambda x: x.to(torch.float16),
            gradient=one_input_gradient("HalfToFloat"),
            doc="Y = X as float16 (Caffe2's name). Gradient: HalfToFloat(dY).")
register_op("HalfToFloat", kernel=lambda _a, _ctx: lambda x: x.to(torch.float32),
            gradient=one_input_gradient("FloatToHalf"),
            doc="Y = X as float32 (Caffe2's name). Gradient: FloatToHalf(dY).")
