from __future__ import annotations

import pytest

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.schema import validate_net
from graphpar.passes.predictor import extract_predictor_net
from tests.passes.helpers import cpu, gpu


def _train_net() -> NetDef:
    ops = [OperatorDef("UniformFill", [], ["d"], {"shape": [2, 3]}, cpu(0)),
           OperatorDef("FC", ["d", "w", "b"], ["h"], {}, cpu(0)),
           OperatorDef("Relu", ["h"], ["h"], {}, cpu(0)),
           OperatorDef("FC", ["h", "w2", "b2"], ["p"], {}, cpu(0)),
           OperatorDef("Softmax", ["p"], ["s"], {}, cpu(0)),
           OperatorDef("LabelCrossEntropy", ["s", "label"], ["xent"], {}, cpu(0)),
           OperatorDef("FCGradient", ["h", "w2", "p_grad"], ["w2_grad", "b2_grad", "h_grad"], {}, cpu(0),
                       is_gradient_op=True)]
    return NetDef("train", ops, external_inputs=["w", "b", "w2", "b2", "label", "p_grad"])


def test_extracts_the_forward_ops_between_inputs_and_outputs():
    renames = {"d": "data", "s": "prob"}
    net, params = extract_predictor_net(_train_net(), ["d"], ["s"], gpu(1), renames)
    assert net.name == "train_predict"
    assert [(op.type, op.inputs, op.outputs) for op in net.ops] == [
        ("FC", ["data", "w", "b"], ["h"]), ("Relu", ["h"], ["h"]), ("FC", ["h", "w2", "b2"], ["p"]),
        ("Softmax", ["p"], ["prob"])]
    assert all(op.device_option == gpu(1) for op in net.ops)
    assert net.external_inputs == ["data", "w", "b", "w2", "b2"] and net.external_outputs == ["prob"]
    assert params == ["w", "b", "w2", "b2"]
    validate_net(net)


def test_unknown_blobs_and_training_ops_are_refused():
    with pytest.raises(ValueError, match="no op reads"):
        extract_predictor_net(_train_net(), ["nope"], ["s"])
    net = _train_net()
    net.ops.insert(2, OperatorDef("Dropout", ["h"], ["h", "mask"], {"is_test": False}, cpu(0)))
    with pytest.raises(ValueError, match="is_test=0"):
        extract_predictor_net(net, ["d"], ["s"])
