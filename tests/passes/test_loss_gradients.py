from __future__ import annotations

from graphpar.core.ir import NetDef
from graphpar.core.schema import validate_net
from graphpar.passes.loss_gradients import add_loss_gradient_seeds
from tests.passes.helpers import fill, gpu, layout, summary


def test_one_fill_of_ones_per_loss_on_its_device():
    lay = layout([2, 5], gpu=True)
    net = NetDef("n", [fill(f"gpu_{d}/{name}", gpu(d)) for d in (2, 5) for name in ("l1", "l2")])
    seeds = add_loss_gradient_seeds(net, {5: ["gpu_5/l1", "gpu_5/l2"], 2: ["gpu_2/l1"]}, lay)
    assert seeds == {"gpu_2/l1": "gpu_2/l1_grad", "gpu_5/l1": "gpu_5/l1_grad", "gpu_5/l2": "gpu_5/l2_grad"}
    added = net.ops[4:]
    assert summary(added) == [
        ("ConstantFill", ["gpu_2/l1"], ["gpu_2/l1_grad"], gpu(2), "", []),
        ("ConstantFill", ["gpu_5/l1"], ["gpu_5/l1_grad"], gpu(5), "", []),
        ("ConstantFill", ["gpu_5/l2"], ["gpu_5/l2_grad"], gpu(5), "", []),
    ]
    assert all(op.args == {"value": 1.0} for op in added)
    validate_net(net)
