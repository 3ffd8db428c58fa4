from __future__ import annotations

from types import SimpleNamespace

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.passes.shared_model import prune_parameters_for_sharing, remap_shared_parameters
from tests.passes.helpers import cpu, fill, layout


def test_prune_keeps_first_device_and_unscoped_params():
    lay = layout([2, 3])
    model = SimpleNamespace(params=["shared_emb", "cpu_2/w", "cpu_3/w", "cpu_2/b", "cpu_3/b"],
                            param_to_grad={"cpu_2/w": "cpu_2/w_grad", "cpu_3/w": "cpu_3/w_grad"},
                            weights=["cpu_2/w", "cpu_3/w"], biases=["cpu_2/b", "cpu_3/b"])
    prune_parameters_for_sharing(model, lay)
    assert model.params == ["shared_emb", "cpu_2/w", "cpu_2/b"]
    assert model.param_to_grad == {"cpu_2/w": "cpu_2/w_grad"}
    assert (model.weights, model.biases) == (["cpu_2/w"], ["cpu_2/b"])


def test_remap_drops_other_replicas_param_writers_and_reads_the_first_copy():
    lay = layout([0, 1])
    init = NetDef("init", [fill("cpu_0/w", cpu(0)), fill("cpu_1/w", cpu(1)), fill("cpu_1/rm", cpu(1))])
    net = NetDef("net", [OperatorDef("FC", ["cpu_1/x", "cpu_1/w", "cpu_1/b"], ["cpu_1/y"], {}, cpu(1)),
                         OperatorDef("Relu", ["cpu_1/y"], ["cpu_1/y"], {}, cpu(1))],
                 external_inputs=["cpu_1/x", "cpu_1/w", "cpu_0/w", "cpu_1/b"])
    remap_shared_parameters([init, net], ["cpu_0/w", "cpu_1/w", "cpu_0/b", "cpu_1/b"], lay)
    assert [op.outputs for op in init.ops] == [["cpu_0/w"], ["cpu_1/rm"]]
    assert net.ops[0].inputs == ["cpu_1/x", "cpu_0/w", "cpu_0/b"]
    assert net.external_inputs == ["cpu_1/x", "cpu_0/w", "cpu_0/b"]
