"""Reuse kernels: an op rewriting a value the run owns writes into its storage, where nothing can see it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.ops import aten

from graphpar import brew, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core import CPU, DeviceOption, NetDef, OperatorDef
from graphpar.core.schema import KernelContext, get_schema, parse_args
from graphpar.errors import OperatorError
from graphpar.executor import plan, program
from tests.executor import toy_ops

CPU0, CPU1 = DeviceOption(CPU, 0), DeviceOption(CPU, 1)  # two CPU replicas: "dag" runs them on workers
NET_TYPES = ("simple", "dag")


@pytest.fixture(autouse=True)
def _two_threads(monkeypatch: pytest.MonkeyPatch) -> None:  # (and small values are reused: tests/conftest.py)
    monkeypatch.setenv("GRAPHPAR_NUM_THREADS", "2")
    toy_ops.REUSED.clear()


def _run(name: str, ops: list[OperatorDef], net_type: str, **args: object) -> None:
    """Run the ops, plus an independent op on a second CPU device so that "dag" uses its workers."""
    workspace.FeedBlob("other", np.zeros(2, np.float32))
    side = OperatorDef("Scale", ["other"], ["other_scaled"], device_option=CPU1)
    net = NetDef(f"{name}_{net_type}", [*ops, side], type=net_type, num_workers=2, args=args)
    workspace.CreateNet(net)  # (RunNetOnce keeps the workspace's blobs to restore on error: no reuse of those)
    workspace.RunNet(net.name)


@pytest.mark.parametrize("net_type", NET_TYPES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_value_the_run_made_and_rewrites_is_reused(net_type: str, dynamic: bool):
    _run("made", [OperatorDef("ConstantFill", [], ["x"], {"shape": [3], "value": 1.0}, device_option=CPU0),
                  OperatorDef("_TestAddOne", ["x"], ["x"], name="again", device_option=CPU0),
                  OperatorDef("Scale", ["x"], ["y"], {"scale": 2.0}, device_option=CPU0)],
         net_type, **({"dynamic_memory_management": 1, "blobs_to_keep": ["y"]} if dynamic else {}))
    assert toy_ops.REUSED == ["again"]
    np.testing.assert_array_equal(workspace.FetchBlob("y"), [4.0] * 3)


@pytest.mark.parametrize("net_type", NET_TYPES)
def test_a_loaded_blob_that_only_the_workspace_holds_is_updated_in_place(net_type: str):
    workspace.FeedBlob("x", np.ones(3, np.float32))
    tensor = workspace.get_workspace().blobs["x"]
    address = tensor.data_ptr()
    del tensor
    _run("loaded", [OperatorDef("_TestAddOne", ["x"], ["x"], name="update", device_option=CPU0)], net_type)
    assert toy_ops.REUSED == ["update"]
    assert workspace.get_workspace().blobs["x"].data_ptr() == address
    np.testing.assert_array_equal(workspace.FetchBlob("x"), [2.0] * 3)


@pytest.mark.parametrize("net_type", NET_TYPES)
def test_a_loaded_blob_someone_else_holds_is_not_overwritten(net_type: str):
    workspace.FeedBlob("x", np.ones(3, np.float32))
    held = workspace.get_workspace().blobs["x"]
    _run("held", [OperatorDef("_TestAddOne", ["x"], ["x"], device_option=CPU0)], net_type)
    assert toy_ops.REUSED == []
    np.testing.assert_array_equal(held.numpy(), [1.0] * 3)  # the caller's tensor kept its values
    np.testing.assert_array_equal(workspace.FetchBlob("x"), [2.0] * 3)


@pytest.mark.parametrize("net_type", NET_TYPES)
def test_a_run_that_fails_before_its_updates_leaves_a_reusable_loaded_blob_as_it_was(net_type: str):
    workspace.FeedBlob("x", np.ones(3, np.float32))
    workspace.FeedBlob("z", np.zeros(3, np.float32))
    net = NetDef(f"fails_{net_type}", [OperatorDef("_TestAddOne", ["x"], ["x"], device_option=CPU0),
                                       OperatorDef("_TestFail", ["z"], ["w"], device_option=CPU1)],
                 type=net_type, num_workers=2)
    workspace.CreateNet(net)
    assert workspace.get_workspace().nets[net.name].updates == {0}  # reusing a loaded blob makes it an update
    with pytest.raises(OperatorError, match="boom"):
        workspace.RunNet(net.name)
    assert toy_ops.REUSED == []
    np.testing.assert_array_equal(workspace.FetchBlob("x"), [1.0] * 3)


def test_plain_sgd_updates_params_in_their_storage():
    model = model_helper.ModelHelper(name="sgd")
    pred = brew.fc(model, "data", "pred", dim_in=6, dim_out=3)
    model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    model.AddGradientOperators(["loss"])
    optimizer.build_sgd(model, 0.1)  # WeightedSum([pred_w, one, pred_w_grad, lr], pred_w)
    workspace.RunNetOnce(model.param_init_net)
    workspace.FeedBlob("data", np.ones((4, 6), np.float32))
    workspace.FeedBlob("label", np.zeros(4, np.int32))
    workspace.CreateNet(model.net)
    address, before = workspace.get_workspace().blobs["pred_w"].data_ptr(), workspace.FetchBlob("pred_w")
    workspace.RunNet(model.net.Name())
    assert workspace.get_workspace().blobs["pred_w"].data_ptr() == address
    assert not np.array_equal(workspace.FetchBlob("pred_w"), before)


@pytest.mark.parametrize("net_type", NET_TYPES)
@pytest.mark.parametrize("sharer", [
    OperatorDef("StopGradient", ["x"], ["seen"], device_option=CPU0),  # the same tensor under another name
    OperatorDef("Reshape", ["x"], ["seen", "old_shape"], {"shape": [3, 1]}, device_option=CPU0),  # a view of it
])
def test_a_value_another_blob_shares_is_not_overwritten(net_type: str, sharer: OperatorDef):
    _run("shared", [OperatorDef("ConstantFill", [], ["x"], {"shape": [3], "value": 1.0}, device_option=CPU0),
                    sharer.copy(),
                    OperatorDef("_TestAddOne", ["x"], ["x"], device_option=CPU0)], net_type)
    assert toy_ops.REUSED == []
    np.testing.assert_array_equal(workspace.FetchBlob("seen").reshape(-1), [1.0] * 3)
    np.testing.assert_array_equal(workspace.FetchBlob("x"), [2.0] * 3)


@pytest.mark.parametrize("net_type", NET_TYPES)
def test_a_value_whose_elements_share_memory_is_not_overwritten(net_type: str):
    """A stride-0 tensor holds its storage alone, yet writing one element would change another."""
    _run("expanded", [OperatorDef("ConstantFill", [], ["x"], {"shape": [3], "value": 1.0}, device_option=CPU0),
                      OperatorDef("_TestBroadcast", ["x"], ["e"], device_option=CPU0),
                      OperatorDef("_TestAddOne", ["e"], ["e"], device_option=CPU0),
                      OperatorDef("Scale", ["e"], ["y"], device_option=CPU0)],
         net_type, dynamic_memory_management=1, blobs_to_keep=["y"])
    assert toy_ops.REUSED == []
    np.testing.assert_array_equal(workspace.FetchBlob("y"), np.full((2, 3), 2.0))


def test_values_shape_inference_knows_to_be_small_are_allocated_anew(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(plan, "REUSE_MIN_BYTES", 4 * 100)
    for name, size in (("small", 99), ("large", 100)):
        _run(name, [OperatorDef("ConstantFill", [], ["x"], {"shape": [size], "value": 1.0}, device_option=CPU0),
                    OperatorDef("_TestAddOne", ["x"], ["x"], name=name, device_option=CPU0)], "simple")
    assert toy_ops.REUSED == ["large"]


def test_an_op_that_writes_another_blob_never_reuses_its_input():
    _run("renamed", [OperatorDef("ConstantFill", [], ["x"], {"shape": [3], "value": 1.0}, device_option=CPU0),
                     OperatorDef("_TestAddOne", ["x"], ["z"], device_option=CPU0)], "simple")
    assert toy_ops.REUSED == []
    np.testing.assert_array_equal(workspace.FetchBlob("x"), [1.0] * 3)


def _kernels(op: OperatorDef) -> tuple:
    schema = get_schema(op.type)
    ctx = KernelContext(op=op, device=torch.device("cpu"), device_of=lambda d: torch.device("cpu"),
                        random_stream=lambda: None)
    args = parse_args(schema, op.args, op.type)
    return schema.kernel(args, ctx), schema.reuse.kernel(args, ctx), schema.reuse.input


def _as_tuple(result: object) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _activation_ops(name: str, y: object, ints: bool = True, **args: object) -> list:
    """`name` on X and its gradient on (Y, dY), for float32 and float16 and (`ints`) forward on int64."""
    ops = []
    for dtype in (torch.float32, torch.float16):
        ops += [(OperatorDef(name, ["x"], ["x"], args), lambda g, d=dtype: [torch.randn(64, 33, generator=g).to(d)]),
                (OperatorDef(f"{name}Gradient", ["y", "dy"], ["dy"], args),
                 lambda g, d=dtype: [y(torch.randn(64, 33, generator=g)).to(d), torch.randn(64, 33, generator=g).to(d)])]
    ints = [(OperatorDef(name, ["x"], ["x"], args), lambda g: [torch.randint(-5, 5, (7,), generator=g)])] if ints else []
    return ops + ints


REUSING_OPS = [
    *_activation_ops("Relu", torch.relu),
    *_activation_ops("LeakyRelu", torch.nn.functional.leaky_relu, ints=False, alpha=0.2),
    *_activation_ops("Sigmoid", torch.sigmoid),
    *_activation_ops("Tanh", torch.tanh),
    (OperatorDef("Scale", ["x"], ["x"], {"scale": 0.3}), lambda g: [torch.randn(50, generator=g)]),
    (OperatorDef("Scale", ["x"], ["x"], {"scale": 0.3}), lambda g: [torch.randint(0, 9, (50,), generator=g)]),
    (OperatorDef("Sum", ["a", "b", "c"], ["a"]), lambda g: [torch.randn(5, 7, generator=g) for _ in range(3)]),
    (OperatorDef("WeightedSum", ["g", "one", "p", "wd"], ["g"]),
     lambda g: [torch.randn(40, generator=g), torch.ones(1), torch.randn(40, generator=g), torch.tensor([1e-4])]),
    *[(OperatorDef("MomentumSGDUpdate", ["g", "m", "lr", "p"], ["g", "m", "p"],
                   {"momentum": 0.9, "nesterov": nesterov}),
       lambda g: [torch.randn(300, generator=g), torch.randn(300, generator=g), torch.tensor([0.05]),
                  torch.randn(300, generator=g)]) for nesterov in (False, True)],
]


@pytest.mark.parametrize(("op", "inputs"), REUSING_OPS, ids=lambda v: getattr(v, "type", None))
def test_reuse_kernels_give_the_ordinary_kernels_bits(op: OperatorDef, inputs):  # noqa: ANN001
    plain, reuse, position = _kernels(op)
    for seed in range(5):
        values = inputs(torch.Generator().manual_seed(seed))
        copies = [v.clone() for v in values]
        expected = [t.clone() for t in _as_tuple(plain(*values))]
        state = [v.clone() for v in values]  # what `plain` left in its inputs (updates change m and p)
        got = _as_tuple(reuse(*copies))
        for e, r in zip(expected, got):
            assert torch.equal(e, r)
        for k, (s, c) in enumerate(zip(state, copies)):
            if k != position:  # only the reused input may differ
                assert torch.equal(s, c)


def test_relu_gradient_with_unlike_inputs_falls_back_to_a_new_tensor():
    _, reuse, _ = _kernels(OperatorDef("ReluGradient", ["y", "dy"], ["dy"]))
    y, dy = torch.randn(4, 3), torch.randn(4, 3, dtype=torch.float64)
    out = reuse(y, dy)
    assert out.data_ptr() != dy.data_ptr() and torch.equal(out, aten.threshold_backward(dy, y, 0))


def _train(devices: int, net_type: str, steps: int = 3) -> dict[str, np.ndarray]:
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="reuse")

    def forward(model: model_helper.ModelHelper, loss_scale: float) -> list:
        h = brew.fc(model, "data", "fc1", dim_in=6, dim_out=16)
        h = brew.relu(model, h, h)
        pred = brew.fc(model, h, "pred", dim_in=16, dim_out=3)
        _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
        return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]

    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9, nesterov=True),
                    devices=list(range(devices)), cpu_device=True, net_type=net_type)
    rng = np.random.default_rng(0)
    for d in range(devices):
        workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((4, 6)).astype(np.float32))
        workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 3, 4).astype(np.int32))
    dpm.RunInitNet(model)
    for _ in range(steps):
        workspace.RunNet(model.net.Proto().name)
    return {name: workspace.FetchBlob(name) for name in workspace.Blobs() if name.startswith("cpu_0/")}


@pytest.mark.parametrize("net_type", NET_TYPES)
def test_training_with_reuse_equals_training_without_it_bit_for_bit(net_type: str,
                                                                    monkeypatch: pytest.MonkeyPatch):
    owned, owns = [], program.owns
    monkeypatch.setattr(program, "owns", lambda frame, slot, holders=0: owned.append(owns(frame, slot, holders))
                        or owned[-1])
    reused = _train(4, net_type)
    assert sum(owned) >= 4 * 3  # at least each replica's in-place Relu, on every step
    monkeypatch.setattr(program, "owns", lambda frame, slot, holders=0: False)
    plain = _train(4, net_type)
    assert reused.keys() == plain.keys()
    for name in reused:
        np.testing.assert_array_equal(reused[name], plain[name], err_msg=name)
