"""The "compiled" executor (`Parallelize(compile=...)`): each phase compiled by torch.compile.

Reference: the same model run op by op (`"simple"`): losses within rtol 1e-4 and params within rtol
1e-3 after 5 steps (float reassociation; "aot_eager" runs the same aten ops, so most configurations
are bit-identical). The backend is "aot_eager" (fast to compile; it traces, functionalizes and
partitions exactly as inductor does, without generating kernels) but in the tests marked inductor.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from graphpar import brew, models, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core.schema import register_op, scoped_registry
from graphpar.engine import Trainer
from graphpar.errors import OperatorError, ParallelizeError
from graphpar.executor.compiled import lower, lowered_of
from graphpar.model_helper import ModelHelper

FAST = {"backend": "aot_eager"}
ROOT = Path(__file__).resolve().parents[2]
_names = iter(range(10**6))


def _mlp(model: ModelHelper, loss_scale: float) -> list:
    h = brew.relu(model, brew.fc(model, "data", "fc1", dim_in=6, dim_out=16), "h")
    pred = brew.fc(model, h, "pred", dim_in=16, dim_out=4)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def _cnn(model: ModelHelper, loss_scale: float) -> list:
    h = brew.conv(model, "data", "conv1", dim_in=2, dim_out=4, kernel=3, pad=1, no_bias=1)  # BN's bias instead
    h = brew.spatial_bn(model, h, "bn1", dim_in=4, momentum=0.9)
    h = brew.relu(model, h, h)
    h = brew.max_pool(model, h, "pool1", kernel=2, stride=2)
    pred = brew.fc(model, h, "pred", dim_in=4 * 3 * 3, dim_out=4)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def _resnet(model: ModelHelper, loss_scale: float) -> list:
    return models.resnet18(model, loss_scale, num_classes=4, in_channels=2, width=4)


INPUTS = {_mlp: (6,), _cnn: (2, 6, 6), _resnet: (2, 8, 8)}
OPTIMIZERS: dict[str, Callable[[ModelHelper], object]] = {
    "sgd": lambda m: optimizer.build_sgd(m, 0.1, policy="step", stepsize=2, gamma=0.5),
    "momentum": lambda m: optimizer.build_sgd(m, 0.1, policy="step", stepsize=2, gamma=0.5, momentum=0.9,
                                             weight_decay=1e-3),
    "nesterov": lambda m: optimizer.build_sgd(m, 0.1, policy="multistep", stepsizes=[1, 3], gamma=0.5,
                                             momentum=0.9, nesterov=True),
    "adam": lambda m: optimizer.build_adam(m, 0.01, policy="step", stepsize=2, gamma=0.5),
    "adagrad": lambda m: optimizer.build_adagrad(m, 0.1),
}


def _batches(forward: Callable, count: int, rows: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"data": rng.standard_normal((rows, *INPUTS[forward])).astype(np.float32),
             "label": rng.integers(0, 4, rows).astype(np.int32)} for _ in range(count)]


def _model(forward: Callable, opt: str, devices: int, compile_: object, **options: object) -> ModelHelper:
    model = ModelHelper(name=f"compiled_{next(_names)}")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=OPTIMIZERS[opt], devices=list(range(devices)), cpu_device=True,
                    compile=compile_, **options)
    return model


def _train(forward: Callable, opt: str = "momentum", devices: int = 1, compile_: object = FAST, steps: int = 5,
           rows: int = 8, warmup: int = 2, steady: int = 0, **options: object) -> tuple[list[float], dict, dict]:
    """Losses per step and every checkpointed blob after `steps` steps on fresh batches, and the counts of
    dynamo's frames, graphs and graph breaks after `warmup` steps and after `steady` more steps in all."""
    workspace.ResetWorkspace()
    torch._dynamo.reset()
    counters.clear()
    model = _model(forward, opt, devices, compile_, **options)
    k = int(options.get("accumulate_gradients", 1))
    trainer = Trainer(model, _batches(forward, (max(steps, warmup + steady)) * k, rows), max_iter=warmup)
    trainer.train()
    counts = {"warm": _dynamo_counts()}
    if compile_:
        nets = [plan for plan in workspace.get_workspace().nets.values() if plan.netdef.type == "compiled"]
        counts["regions"] = sum(region.region.compiled for plan in nets for phase in lowered_of(plan).phases
                                for region in phase)
    trainer.max_iter = steps
    trainer.train()
    losses = [value for _, value in trainer.storage.history["scaled_loss"]]
    blobs = {name: workspace.FetchBlob(name) for name in sorted(dpm.GetCheckpointParams(model))}
    if steady:
        trainer.max_iter = warmup + steady
        trainer.train()
    counts["end"] = _dynamo_counts()
    assert int(workspace.FetchBlob("optimizer_iteration")[0]) == max(steps, warmup + steady)
    return losses, blobs, counts


def _dynamo_counts() -> dict[str, int]:
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"]["unique_graphs"],
            "frames": counters["frames"]["total"]}


def _assert_close(got: tuple, expected: tuple) -> None:
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-4)
    assert sorted(got[1]) == sorted(expected[1])
    for name, value in expected[1].items():
        np.testing.assert_allclose(got[1][name], value, rtol=1e-3, atol=1e-6, err_msg=name)


CONFIGS = {
    "mlp-sgd": (_mlp, "sgd", 1, {}),
    "mlp-nesterov": (_mlp, "nesterov", 1, {}),
    "mlp-adagrad": (_mlp, "adagrad", 1, {}),
    "cnn-momentum": (_cnn, "momentum", 1, {}),
    "cnn-adam-2dev": (_cnn, "adam", 2, {}),
    "mlp-momentum-4dev-tree": (_mlp, "momentum", 4, {"cpu_update_once": False}),
    "cnn-4dev-sync-bn": (_cnn, "momentum", 4, {"combine_spatial_bn": True}),
    "mlp-2dev-buckets": (_mlp, "momentum", 2, {"gradient_bucket_bytes": 256}),
    "mlp-2dev-accumulate": (_mlp, "momentum", 2, {"accumulate_gradients": 2}),
    "cnn-2dev-bf16-loss-scale": (_cnn, "momentum", 2, {"compute_dtype": "bfloat16", "loss_scale": 128.0}),
    "resnet18-nesterov": (_resnet, "nesterov", 1, {}),
    "mlp-adam-2dev-sharded-state": (_mlp, "adam", 2, {"shard_optimizer_state": True}),
    "cnn-2dev-sharded-gradients": (_cnn, "momentum", 2, {"shard_gradients": True}),
}


@pytest.mark.parametrize("config", [pytest.param(name, marks=pytest.mark.slow) if name.startswith("resnet") else name
                                    for name in CONFIGS])
def test_compiled_trains_as_simple_with_no_graph_break_or_recompilation(config):
    """5 steps against "simple"; over the 10 steps after two warm-up steps, while the learning rate
    changes (step and multistep policies) and the iteration counter advances: no new frame, no new
    graph, no graph break."""
    forward, opt, devices, options = CONFIGS[config]
    expected = _train(forward, opt, devices, compile_=False, net_type="simple", **options)
    got = _train(forward, opt, devices, steady=10, **options)
    _assert_close(got, expected)
    counts = got[2]
    # one graph per compiled region: the second step (CPU replicas share their params from then on) did
    # not compile again
    assert counts["warm"]["graph_breaks"] == 0 and counts["warm"]["unique_graphs"] == counts["regions"] >= 2
    assert counts["end"] == counts["warm"]


def test_compiled_regions_run_with_the_whole_thread_budget(monkeypatch):
    """A compiled region runs both replicas' ops one kernel at a time, so it gets the whole budget (inductor
    builds its kernels for the count it compiles under); eager steps keep the per-replica share (1 of 2)."""
    from graphpar.executor import compiled

    seen: dict[bool, set[int]] = {True: set(), False: set()}
    run = compiled._Region.run

    def recording(self, plan, frame):
        seen[self.region.compiled].add(torch.get_num_threads())
        run(self, plan, frame)

    monkeypatch.setattr(compiled._Region, "run", recording)
    monkeypatch.setenv("GRAPHPAR_NUM_THREADS", "2")
    _train(_mlp, "momentum", devices=2, steps=2, warmup=1, cpu_update_once=False)  # both replicas update
    assert seen == {True: {2}, False: {1}}


@pytest.mark.parametrize("cuda", [False, True])
def test_inductor_keeps_a_cpu_steps_layout(monkeypatch, cuda):
    """On CPU devices inductor compiles without its layout optimization (which made every convolution of
    ResNet-18's step copy to channels-last and back: 1.7x the step time); on CUDA devices it keeps it."""
    import torch._inductor.compile_fx as inductor

    patches: list = []

    def recording(graph, example_inputs, config_patches=None, **kwargs):
        patches.append(config_patches)
        return graph  # runs the traced graph as it is: no kernels built

    monkeypatch.setattr(inductor, "compile_fx", recording)
    from graphpar.devices import cuda_on_cpu

    workspace.ResetWorkspace()
    with cuda_on_cpu():
        model = ModelHelper(name=f"layout_{next(_names)}")
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_cnn,
                        optimizer_builder_fun=OPTIMIZERS["momentum"], devices=[0], cpu_device=not cuda,
                        compile=True)
        Trainer(model, _batches(_cnn, 1, 8), max_iter=1).train()
    assert patches and all((p or {}).get("layout_optimization", True) is cuda for p in patches)


def test_each_phase_has_one_compiled_region_with_the_host_steps_around_it():
    """Iter and LearningRate run before the updates' compiled region (the host prologue), CheckFinite
    after the forward and backward region: one compiled program per phase."""
    model = _model(_mlp, "momentum", 2, FAST)
    workspace.RunNetOnce(model.param_init_net)
    for batch in _batches(_mlp, 1, 4):
        for name, value in batch.items():
            for d in (0, 1):
                workspace.FeedBlob(f"cpu_{d}/{name}", value)
    plan = workspace.get_workspace().create_net(model.net)
    ops = plan.netdef.ops
    kinds = [[(region.compiled, sorted({ops[j].type for j in region.steps} - {"Alias"}))
              for region in phase] for phase in lower(plan)]
    assert [[compiled for compiled, _ in phase] for phase in kinds] == [[True, False], [False, True]]
    assert kinds[0][1][1] == ["CheckFinite"] and kinds[1][0][1] == ["Iter", "LearningRate"]
    assert "MomentumSGDUpdate" in kinds[1][1][1] and "FC" in kinds[0][0][1]


def test_a_compiled_region_returns_only_what_outlives_it():
    """With dynamic memory management (Parallelize's compile turns it on), the forward and backward
    region returns the gradients, the losses and the batch-norm statistics, not the activations."""
    model = _model(_cnn, "momentum", 1, FAST)
    workspace.RunNetOnce(model.param_init_net)
    for name, value in _batches(_cnn, 1, 4)[0].items():
        workspace.FeedBlob(f"cpu_0/{name}", value)
    plan = workspace.get_workspace().create_net(model.net)
    region = lower(plan)[0][0]
    outputs = {plan.frame.names[slot] for slot in region.outputs}
    assert {"cpu_0/conv1_w_grad", "cpu_0/bn1_rm", "cpu_0/scaled_loss"} <= outputs
    assert not outputs & {"cpu_0/conv1", "cpu_0/pool1", "cpu_0/pred", "cpu_0/softmax", "cpu_0/bn1", "cpu_0/loss"}


def test_the_compile_time_is_logged_once_per_phase(caplog):
    caplog.set_level(logging.INFO, logger="graphpar.executor.compiled")
    _train(_mlp, steps=3, warmup=1)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled ")]
    assert len(compiled) == 2 and "phase 0" in compiled[0] and "phase 1" in compiled[1]
    assert all(" s" in message for message in compiled)


# ---- ops that cannot be compiled ------------------------------------------------------------------


def _host_op_net(traceable: bool | None) -> tuple[str, Callable[[], None]]:
    """x -> Scale -> HostScale (a kernel branching on a value) -> Scale -> y, as a compiled net."""
    register_op("HostScale", kernel=lambda a, ctx: lambda x: x * 12.0 if bool(x.sum() > 0) else x,
                doc="x * 12 where sum(x) > 0: a Python branch on a value.", infer=lambda a, ctx, inputs: [inputs[0]],
                **({} if traceable is None else {"traceable": traceable}))
    from graphpar.core import Net

    net = Net("host")
    net.Proto().type = "compiled"
    net.Proto().args["compile_backend"] = "aot_eager"
    net.Scale("x", "a", scale=2.0)
    net.HostScale("a", "b")
    net.Scale("b", "y", scale=0.5)
    workspace.FeedBlob("x", np.arange(4, dtype=np.float32))
    workspace.CreateNet(net)
    return net.Name(), lambda: workspace.RunNet(net.Name())


def test_an_op_declared_untraceable_splits_the_phase_and_the_reason_is_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="graphpar.executor.compiled")
    with scoped_registry():
        name, run = _host_op_net(traceable=False)
        run()
        run()
        plan = workspace.get_workspace().nets[name]
        assert [region.compiled for region in lowered_of(plan).phases[0] and lower(plan)[0]] == [True, False, True]
    np.testing.assert_allclose(workspace.FetchBlob("y"), np.arange(4) * 2.0 * 12.0 * 0.5)
    told = [r.getMessage() for r in caplog.records if "eagerly" in r.getMessage()]
    assert len(told) == 1 and "HostScale" in told[0] and "traceable=False" in told[0]


def test_an_op_that_does_not_trace_is_named_at_the_first_run_and_nothing_changes():
    with scoped_registry():
        _name, run = _host_op_net(traceable=None)  # declared traceable (no trait), but reads a value
        with pytest.raises(OperatorError) as raised:
            run()
    message = str(raised.value)
    assert "op #1 (HostScale)" in message and "cannot be compiled" in message and "traceable=False" in message
    assert "recorded at" in message and "test_compiled.py" in message
    assert not workspace.HasBlob("y")


def test_a_kernel_error_inside_a_compiled_phase_names_the_op_and_changes_nothing():
    """A batch with the wrong feature count after the net compiled: the retrace fails inside FC's kernel;
    the error is the one "simple" gives for that op, and params and counters are unchanged."""
    model = _model(_mlp, "momentum", 1, FAST)
    trainer = Trainer(model, _batches(_mlp, 2, 4), max_iter=2)
    trainer.train()
    before = {name: workspace.FetchBlob(name).copy() for name in dpm.GetCheckpointParams(model)}
    workspace.FeedBlob("cpu_0/data", np.ones((4, 5), np.float32))
    with pytest.raises(OperatorError) as compiled_error:
        workspace.RunNet(model.net)
    assert "op #0 (FC)" in str(compiled_error.value) and "recorded at" in str(compiled_error.value)
    for name, value in before.items():
        np.testing.assert_array_equal(workspace.FetchBlob(name), value, err_msg=name)


# ---- options -----------------------------------------------------------------------------------------


def test_compile_options_and_their_refusals():
    model = _model(_mlp, "sgd", 1, {"backend": "aot_eager"})
    proto = model.net.Proto()
    assert proto.type == "compiled" and proto.args["compile_backend"] == "aot_eager"
    assert proto.args["dynamic_memory_management"]
    with pytest.raises(ParallelizeError, match="cuda_graph=True and compile"):
        dpm.Parallelize(ModelHelper(name="both"), input_builder_fun=lambda m: None,
                        forward_pass_builder_fun=_mlp, optimizer_builder_fun=OPTIMIZERS["sgd"], devices=[0],
                        compile=True, cuda_graph=True)
    for bad, error in (("fastest", ParallelizeError), ({"backend": "eager", "mode": "max-autotune"}, ParallelizeError),
                       ({"speed": 1}, TypeError), (3, TypeError)):
        with pytest.raises(error, match="compile"):
            _model(_mlp, "sgd", 1, bad)
    model = _model(_mlp, "sgd", 1, "reduce-overhead")
    assert model.net.Proto().args["compile_mode"] == "reduce-overhead"
    assert model.net.Proto().args["compile_backend"] == "inductor"


# ---- checkpoints -------------------------------------------------------------------------------------


def _checkpointed(tmp_path, compile_: object, max_iter: int, resume: bool) -> Trainer:
    from graphpar.engine import LRScheduler, PeriodicCheckpointer

    workspace.ResetWorkspace()
    workspace.SetSeed(1)
    model = _model(_cnn, "momentum", 1, compile_, **({} if compile_ else {"net_type": "simple"}))
    trainer = Trainer(model, _batches(_cnn, 7, 8), [LRScheduler(), PeriodicCheckpointer(tmp_path / "ckpt", 2)],
                      max_iter=max_iter)
    trainer.resume_or_load(resume=resume)
    trainer.train()
    return trainer


def test_a_checkpoint_of_a_compiled_run_resumes_compiled_and_uncompiled(tmp_path):
    """Resumed compiled == the uninterrupted compiled run, bit for bit; the same checkpoint resumed by an
    uncompiled model goes on as the compiled run does, within float reassociation."""
    full = _checkpointed(tmp_path / "full", FAST, 7, resume=False)
    expected = {name: workspace.FetchBlob(name) for name in dpm.GetCheckpointParams(full.model)}
    _checkpointed(tmp_path / "cut", FAST, 4, resume=False)
    shutil.copytree(tmp_path / "cut", tmp_path / "cut_again")
    for compile_, where in ((FAST, "cut"), (False, "cut_again")):
        resumed = _checkpointed(tmp_path / where, compile_, 7, resume=True)
        assert resumed.start_iter == 4
        for name, value in expected.items():
            got = workspace.FetchBlob(name)
            if compile_:
                np.testing.assert_array_equal(got, value, err_msg=name)
            else:
                np.testing.assert_allclose(got, value, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_inductor_reuses_what_the_last_process_compiled(tmp_path):
    """Two processes compile the same step with inductor and one on-disk cache: the second takes every
    compiled graph from the cache (inductor's FX-graph cache: no kernel is generated or built again)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "tests.executor.compiled_cache_worker"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["misses"] >= 2 and first["hits"] == 0
    assert second["hits"] == first["misses"] and second["misses"] == 0
    assert second["seconds"] < first["seconds"]


# ---- CUDA --------------------------------------------------------------------------------------------


def test_compiled_on_logical_cuda_devices_trains_as_simple():
    """Two logical CUDA devices placed on the CPU (the CUDA code paths of the passes: NCCL-free tree
    all-reduce, Parallelize's CUDA defaults) compile and train as "simple"."""
    from graphpar.devices import cuda_on_cpu

    def run(compile_: object) -> dict[str, np.ndarray]:
        workspace.ResetWorkspace()
        model = ModelHelper(name=f"cuda_{next(_names)}")
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_cnn,
                        optimizer_builder_fun=OPTIMIZERS["momentum"], devices=[0, 1], compile=compile_,
                        **({} if compile_ else {"net_type": "simple"}))
        Trainer(model, _batches(_cnn, 3, 8), max_iter=3).train()
        return {name: workspace.FetchBlob(name) for name in workspace.Blobs()
                if name.startswith(("gpu_0/", "gpu_1/")) and name.endswith(("_w", "_rm", "_momentum"))}

    with cuda_on_cpu():
        expected, got = run(False), run(FAST)
    assert "gpu_1/conv1_w" in got and got.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


def test_inductors_cuda_graphs_make_the_trainer_copy_what_it_reads_later():
    """With compile="reduce-overhead" the next step may overwrite the tensors a step left (inductor's
    CUDA graphs reuse their memory), so the executor says so and the Trainer holds copies of the
    losses; the default mode keeps them."""
    from graphpar.executor import get_executor
    from graphpar.training.engine import _overwritten

    graphs, default = _model(_mlp, "sgd", 1, "reduce-overhead"), _model(_mlp, "sgd", 1, True)
    executor = get_executor("compiled")
    assert not executor.keeps_outputs(graphs.net.Proto()) and executor.keeps_outputs(default.net.Proto())
    assert _overwritten(graphs) and not _overwritten(default)
    assert executor.op_by_op == "simple"


def test_a_new_input_shape_compiles_again_and_says_so_and_every_run_a_new_one_is_refused(caplog, monkeypatch):
    """A short last batch compiles the step once more (a warning names the blob and both shapes); a
    shape that changes at every run stops at torch.compile's limit with an error that says why, nothing
    changed."""
    caplog.set_level(logging.INFO, logger="graphpar.executor.compiled")
    model = _model(_mlp, "momentum", 1, FAST)
    trainer = Trainer(model, _batches(_mlp, 2, 8) + _batches(_mlp, 1, 5), max_iter=3)
    trainer.train()
    again = [r for r in caplog.records if "compiled again" in r.getMessage()]
    assert len(again) == 1 and again[0].levelno == logging.WARNING
    assert "cpu_0/data [8, 6] -> [5, 6]" in again[0].getMessage()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 3)  # torch's default is 8
    with pytest.raises(RuntimeError, match="took a new shape at 3 runs"):
        for rows in range(9, 30):
            batch = _batches(_mlp, 1, rows)[0]
            for name, value in batch.items():
                workspace.FeedBlob(f"cpu_0/{name}", value)
            before = workspace.FetchBlob("cpu_0/fc1_w")
            workspace.RunNet(model.net)
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_0/fc1_w"), before)
