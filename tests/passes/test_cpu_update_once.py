"""`cpu_update_once`: CPU replicas update once, on the first device, and alias its tensors, bit-identically."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from graphpar import brew, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core.graph import dependency_graph
from graphpar.core.schema import Trait, has_trait
from graphpar.engine import Trainer
from graphpar.models import mlp
from tests.executor.test_engine import CASES, MODELS, assert_identical, train
from tests.parallel.test_accumulate import K, _micro_batches
from tests.parallel.test_accumulate import _model as accumulating

ON = {"cpu_update_once": True}
UPDATE_CASES = {
    "mlp": ("mlp", [0, 1, 2], {}),
    "mlp buckets": CASES["mlp buckets"],
    "resnet18 combined bn": CASES["resnet18 combined bn"],
}


@pytest.mark.parametrize("net_type", ["dag", "simple"])
@pytest.mark.parametrize("case", sorted(UPDATE_CASES))
def test_trains_bit_identically_to_updating_every_replica(case: str, net_type: str):
    model_name, devices, options = UPDATE_CASES[case]
    reference = train(model_name, devices, net_type="simple", **options)
    assert_identical(train(model_name, devices, net_type=net_type, **ON, **options), reference)
    blobs = workspace.get_workspace().blobs
    weights = [name for name in blobs if name.startswith("cpu_1/") and name.endswith(("_w", "_w_momentum"))]
    assert weights and all(blobs[w] is blobs[w.replace("cpu_1/", "cpu_0/")] for w in weights)  # updated once


@pytest.mark.parametrize("case", ["mlp", "resnet18 combined bn"])
def test_memory_options_train_identically(case: str):
    model_name, devices, options = UPDATE_CASES[case]
    reference = train(model_name, devices, **options)
    both = train(model_name, devices, optimize_gradient_memory=True, dynamic_memory_management=True, **ON, **options)
    assert_identical(both, {name: value for name, value in reference.items() if not name.endswith("_grad")})
    assert_identical(train(model_name, devices, optimize_gradient_memory=True, **ON, **options), reference)


def _forward(model: model_helper.ModelHelper, loss_scale: float) -> list:
    """The MLP, plus a reader of a param that feeds no gradient (only the alias hazard orders it)."""
    losses = mlp(model, loss_scale, dim_in=6, hidden=(8,), num_classes=3)
    model.net.SumSqrElements([model.params[-4]], "fc1_w_norm")
    return losses


def _model(devices: list[int], build=None, **options) -> model_helper.ModelHelper:  # noqa: ANN001
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="update_once")
    if "param_update_builder_fun" not in options:
        options["optimizer_builder_fun"] = build or (lambda m: optimizer.build_sgd(m, 0.05, momentum=0.9,
                                                                                   weight_decay=1e-3))
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_forward,
                    devices=devices, cpu_device=True, **options)
    return model


def _train_steps(model: model_helper.ModelHelper, devices: int, steps: int) -> None:
    """Initialise `model`, then train `steps` steps, each on a fresh random batch per device."""
    rng = np.random.default_rng(0)
    for step in range(steps):
        for d in range(devices):
            workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((3, 6), dtype=np.float32))
            workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 3, 3).astype(np.int32))
        if step == 0:
            dpm.RunInitNet(model)
        dpm.RunNet(model, 1)


def _trained(steps: int, **options) -> dict[str, np.ndarray]:
    _train_steps(_model([0, 1, 2], **options), 3, steps)
    return {n: workspace.FetchBlob(n) for n in workspace.Blobs() if n.startswith("cpu_")}


def _per_device_updates(model: model_helper.ModelHelper) -> None:
    """Caffe2's per-replica builder: each replica's own counter, learning rate and momentum updates."""
    it = brew.iter(model, "ITER")
    lr = model.net.LearningRate([it], "LR", base_lr=0.1, policy="step", stepsize=2, gamma=0.5)
    for param in model.GetParams():
        momentum = model.param_init_net.ConstantFill([param], f"{dpm.stripBlobName(param)}_momentum", value=0.0)
        grad = model.param_to_grad[param]
        model.net.MomentumSGDUpdate([grad, momentum, lr, param], [grad, momentum, param], momentum=0.9)


def test_a_per_device_update_builder_with_its_own_counters_updates_once_and_identically():
    per_device = {"param_update_builder_fun": _per_device_updates}
    net = _model([0, 1, 2], **per_device).net.Proto()
    assert {op.device_option.device_id for op in net.ops if op.type == "MomentumSGDUpdate"} == {0}
    assert sorted(op.outputs[0] for op in net.ops if op.type == "Iter") == [f"cpu_{d}/ITER" for d in range(3)]
    assert_identical(_trained(4, **per_device), _trained(4, cpu_update_once=False, **per_device))


PLAIN_SGD = lambda m: optimizer.build_sgd(m, 0.05, weight_decay=1e-3)  # noqa: E731 - WeightedSum updates


@pytest.mark.parametrize("build", [lambda m: optimizer.build_adam(m, 0.01),
                                   lambda m: optimizer.build_sgd(m, 0.05, momentum=0.9, nesterov=True,
                                                                 max_gradient_norm=0.1),
                                   PLAIN_SGD],
                         ids=["adam", "nesterov clipped", "plain sgd"])
def test_other_optimizers_train_bit_identically(build):
    assert_identical(_trained(3, build=build), _trained(3, build=build, cpu_update_once=False))


def test_plain_sgd_updates_each_param_once_on_the_first_device():
    net = _model([0, 1, 2], build=PLAIN_SGD, **ON).net.Proto()
    updates = [op for op in net.ops if op.type == "WeightedSum" and op.outputs[0] == op.inputs[0]
               and not op.outputs[0].endswith("_grad")]
    assert len(updates) == 4 and {op.device_option.device_id for op in updates} == {0}
    aliases = {op.outputs[0]: op.inputs[0] for op in net.ops if op.type == "Alias"}
    assert aliases["cpu_2/fc1_w"] == "cpu_0/fc1_w"


def test_other_replicas_lose_their_updates_copies_and_weight_decay_and_wait_for_nothing():
    net = _model([0, 1, 2], **ON).net.Proto()
    updates = [op for op in net.ops if has_trait(op, Trait.INPLACE_UPDATE) and op.type != "Iter"]
    assert {op.device_option.device_id for op in updates} == {0}
    assert not [op for op in net.ops if op.type in ("Copy", "WeightedSum") and op.device_option.device_id != 0]
    aliases = {op.outputs[0]: op.inputs[0] for op in net.ops if op.type == "Alias"}
    assert aliases["cpu_2/fc1_w"] == "cpu_0/fc1_w" and aliases["cpu_1/pred_w_momentum"] == "cpu_0/pred_w_momentum"
    # the write-after-read through the alias: every op of another replica reading its param comes first
    graph = dependency_graph(net)
    for index, op in enumerate(net.ops):
        if op.type == "MomentumSGDUpdate":
            param = op.outputs[2]
            for d in (1, 2):
                readers = [i for i, r in enumerate(net.ops) if param.replace("cpu_0", f"cpu_{d}") in r.inputs
                           and r.type != "Alias"]
                assert readers and all(nx.has_path(graph, r, index) for r in readers), (param, d)


@pytest.mark.parametrize("build", [lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9, weight_decay=1e-4),
                                   lambda m: optimizer.build_adam(m, 0.01)], ids=["sgd", "adam"])
def test_every_update_of_a_resnet_runs_once_even_where_states_start_with_equal_values(build):
    """Batch-norm scales and running variances both start as ones: equal values, yet not one class."""
    model = model_helper.ModelHelper(name="resnet_once")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=MODELS["resnet18"][0],
                    optimizer_builder_fun=build, devices=[0, 1], cpu_device=True)
    updates = [op for op in model.net.Proto().ops if has_trait(op, Trait.INPLACE_UPDATE) and op.type != "Iter"]
    assert updates and {op.device_option.device_id for op in updates} == {0}


def test_on_by_default_off_on_request_and_ignored_for_a_shared_model():
    def replica_updates(**options) -> list:
        return [op for op in _model([0, 1], **options).net.Proto().ops
                if op.type == "MomentumSGDUpdate" and op.device_option.device_id == 1]

    assert not replica_updates() and replica_updates(cpu_update_once=False)
    assert not any(op.type == "Alias" for op in _model([0, 1], shared_model=True).net.Proto().ops)


def test_state_fed_to_one_replica_alone_is_replaced_by_the_first_devices():
    model = _model([0, 1], **ON)
    rng = np.random.default_rng(0)
    for d in range(2):
        workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((3, 6), dtype=np.float32))
        workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 3, 3).astype(np.int32))
    dpm.RunInitNet(model)
    dpm.RunNet(model, 1)
    workspace.FeedBlob("cpu_1/fc1_w_momentum", np.full((8, 6), 7.0, np.float32))  # one replica alone
    dpm.RunNet(model, 1)
    for name in ("fc1_w", "fc1_w_momentum", "pred_b"):
        assert workspace.FetchTensor(f"cpu_1/{name}") is workspace.FetchTensor(f"cpu_0/{name}")


def test_dag_stress_matches_simple_and_a_test_model_reads_the_shared_params():
    def run(net_type: str) -> tuple[dict, np.ndarray]:
        model = _model([0, 1, 2, 3], net_type=net_type, **ON)
        _train_steps(model, 4, 25)
        test = model_helper.ModelHelper(name="update_once_test", init_params=False)
        dpm.Parallelize(test, input_builder_fun=lambda m: None,
                        forward_pass_builder_fun=lambda m, s: mlp(m, s, dim_in=6, hidden=(8,), num_classes=3),
                        devices=[0, 1, 2, 3], cpu_device=True)
        workspace.RunNetOnce(test.param_init_net)
        workspace.CreateNet(test.net)
        workspace.RunNet(test.net)
        softmax = [workspace.FetchBlob(f"cpu_{d}/softmax") for d in range(4)]
        names = [n for n in workspace.Blobs() if n.startswith("cpu_") and ("_w" in n or "_b" in n)]
        return {n: workspace.FetchBlob(n) for n in names}, np.stack(softmax)

    dag, dag_softmax = run("dag")
    simple, simple_softmax = run("simple")
    assert_identical(dag, simple)
    np.testing.assert_array_equal(dag_softmax, simple_softmax)
    for name, value in dag.items():
        np.testing.assert_array_equal(value, dag[name.replace(name.split("/")[0], "cpu_0")], err_msg=name)


def test_gradient_accumulation_trains_bit_identically():
    def run(on: bool) -> dict[str, np.ndarray]:
        workspace.ResetWorkspace()
        workspace.SetSeed(2)
        model = accumulating([0, 1], K, cpu_update_once=on)
        Trainer(model, _micro_batches(2 * K), max_iter=2).train()
        return {n: workspace.FetchBlob(n) for n in workspace.Blobs() if n.startswith("cpu_")}

    assert_identical(run(True), run(False))
