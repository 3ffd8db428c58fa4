"""Op effects declared at registration (`core.schema.Effects`): a new op is handled by the passes with
no other edit, and an op registered without the effect is not (so the registration is what counts)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

import pytest

from graphpar import data_parallel_model as dpm
from graphpar import model_helper, optimizer, workspace
from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.schema import (
    NOT_DIFFERENTIABLE,
    Effects,
    MultiTensor,
    Trait,
    crosses_devices,
    effects_of,
    register_op,
    same_shape,
    scoped_registry,
)
from graphpar.models import mlp
from graphpar.ops.optim import _momentum_sgd
from graphpar.passes.cpu_update_once import _inplace_written
from graphpar.passes.fuse_updates import fuse_update_ops
from graphpar.passes.memonger import share_blobs

MOMENTUM_EFFECTS = Effects(rebinds={0}, momentum=1,
                           multi_tensor=MultiTensor("MultiTensorMomentumSGDUpdate", (0, 1, 3), (2,), (0, 1, 3)))


def _register_update(name: str, effects: Effects) -> None:
    """An in-place momentum update under a new name: MomentumSGDUpdate's kernel, its effects or others."""
    register_op(name, inputs=4, outputs=3, enforce_inplace={(0, 0), (1, 1), (3, 2)},
                args={"momentum": 0.0, "nesterov": False}, kernel=_momentum_sgd, gradient=NOT_DIFFERENTIABLE,
                reuse=(0, functools.partial(_momentum_sgd, into_grad=True)), traits=(Trait.INPLACE_UPDATE,),
                check=same_shape((0, 1, 3)), effects=effects, doc="A test-only momentum update.")


@pytest.fixture()
def test_ops() -> Iterator[None]:
    with scoped_registry():
        _register_update("TestMomentum", MOMENTUM_EFFECTS)
        _register_update("TestMomentumUndeclared", Effects())
        register_op("TestView", kernel=lambda _a, _ctx: lambda x: x, effects=Effects(aliases={(0, 0)}),
                    doc="Y is X (a test-only alias).")
        register_op("TestPlain", kernel=lambda _a, _ctx: lambda x: x + 0, doc="Y = X + 0 (a new tensor).")
        yield


def _model(update: str, cpu_update_once: bool = True) -> model_helper.ModelHelper:
    """Two CPU replicas of an MLP trained with momentum SGD whose update ops are `update`."""
    def build(m: model_helper.ModelHelper) -> None:
        optimizer.build_sgd(m, 0.1, momentum=0.9, weight_decay=1e-3)
        for op in m.net.Proto().ops:
            if op.type == "MomentumSGDUpdate":
                op.type = update

    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="effects")
    dpm.Parallelize(model, input_builder_fun=lambda m: None,
                    forward_pass_builder_fun=functools.partial(mlp, dim_in=6, hidden=(5,), num_classes=3),
                    optimizer_builder_fun=build, devices=[0, 1], cpu_device=True, cpu_update_once=cpu_update_once)
    return model


def _ops(net: NetDef, update: str) -> list[tuple]:
    """The net's ops with `update` read as MomentumSGDUpdate and optimizer instance numbers dropped."""
    def names(blobs: list[str]) -> list[str]:
        return [re.sub(r"Optimizer_\d+", "Optimizer", b) for b in blobs]

    return [(op.type.replace(update, "MomentumSGDUpdate"), names(op.inputs), names(op.outputs),
             names(op.control_inputs)) for op in net.ops]


def test_a_new_update_op_declaring_its_effects_updates_once_like_momentum_sgd(test_ops: None):
    reference = _ops(_model("MomentumSGDUpdate").net.Proto(), "MomentumSGDUpdate")
    assert _ops(_model("TestMomentum").net.Proto(), "TestMomentum") == reference  # same rewrite, aliases and order
    # `rebinds`: the grad it rewrites is not written in place (what `_safe` and the Copy-to-Alias rule ask)
    blobs = ["g", "m", "lr", "p"]
    assert _inplace_written(OperatorDef("TestMomentum", blobs, ["g", "m", "p"])) == {"m", "p"}
    assert _inplace_written(OperatorDef("TestMomentumUndeclared", blobs, ["g", "m", "p"])) == {"g", "m", "p"}


def test_a_new_update_op_declaring_multi_tensor_fuses(test_ops: None):
    net = _model("TestMomentum", cpu_update_once=False).net.Proto()
    fused = fuse_update_ops(net)
    assert [op.type for op in fused] == ["MultiTensorMomentumSGDUpdate"] * 2
    assert not any(op.type == "TestMomentum" for op in net.ops)
    plain = _model("TestMomentumUndeclared", cpu_update_once=False).net.Proto()
    assert fuse_update_ops(plain) == []


def _net(op_type: str) -> NetDef:
    ops = [OperatorDef("Relu", ["cpu_0/x"], ["cpu_0/a"]), OperatorDef(op_type, ["cpu_0/a"], ["cpu_0/b"]),
           OperatorDef("Relu", ["cpu_0/b"], ["cpu_0/c"]), OperatorDef("Relu", ["cpu_0/c"], ["cpu_0/d"]),
           OperatorDef("Relu", ["cpu_0/d"], ["cpu_0/e"])]
    return NetDef("chain", ops, external_inputs=["cpu_0/x"], external_outputs=["cpu_0/e"])


def test_memonger_keeps_the_names_of_a_new_aliasing_op(test_ops: None):
    renamed = share_blobs(_net("TestPlain"), "cpu_0/", lambda blob: True)
    assert {"cpu_0/a", "cpu_0/b"} & set(renamed)  # an op without the effect: its blobs may share names
    renamed = share_blobs(_net("TestView"), "cpu_0/", lambda blob: True)
    assert not {"cpu_0/a", "cpu_0/b"} & set(renamed) and renamed  # the aliased names keep theirs; others share


def test_aliases_are_same_values_and_a_sum_crosses_replicas_by_its_name():
    assert Effects(aliases={(0, 0)}).same_value == {(0, 0)}
    assert effects_of(OperatorDef("Alias", ["a"], ["b"])).aliases == {(0, 0)}
    assert effects_of(OperatorDef("NoSuchOp", ["a"], ["b"])) == Effects()  # unregistered: no effects
    assert crosses_devices(OperatorDef("Sum", ["cpu_0/g", "cpu_1/g"], ["cpu_0/g"], name="dpm"))
    assert not crosses_devices(OperatorDef("Sum", ["cpu_0/g", "cpu_0/h"], ["cpu_0/g"]))
    assert crosses_devices(OperatorDef("Copy", ["cpu_0/g"], ["cpu_1/g"]))  # Trait.CROSS_DEVICE
