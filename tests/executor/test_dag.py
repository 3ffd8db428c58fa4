"""The concurrent "dag" executor: real overlap, dependencies kept, simple's results and errors, no thread growth."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from graphpar import workspace
from graphpar.core import CPU, DeviceOption, NetDef, OperatorDef
from graphpar.core.schema import register_op, scoped_registry
from graphpar.errors import MissingBlobError, OperatorError
from graphpar.executor import get_executor
from graphpar.executor.runtime import runtime_of

CPU0, CPU1 = DeviceOption(CPU, 0), DeviceOption(CPU, 1)  # two CPU replicas: one intra-op thread each


@pytest.fixture(autouse=True)
def _two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHPAR_NUM_THREADS", "2")


def _rendezvous_op(barrier: threading.Barrier, seen: list) -> None:
    def kernel(a, ctx):  # noqa: ANN001, ANN202
        def run(x: torch.Tensor) -> torch.Tensor:
            seen.append(threading.current_thread().name)
            barrier.wait(timeout=10)  # both branches must be inside their kernels at once
            return x + 1
        return run

    register_op("_TestRendezvous", kernel=kernel, infer=lambda a, ctx, inputs: [inputs[0]],
                doc="Test op: waits for its twin on another thread.")


def test_independent_branches_run_at_the_same_time_on_worker_threads():
    barrier, seen = threading.Barrier(2), []
    with scoped_registry():
        _rendezvous_op(barrier, seen)
        workspace.FeedBlob("x", np.zeros(2, np.float32))
        net = NetDef("overlap", [OperatorDef("_TestRendezvous", ["x"], ["a"], device_option=CPU0),
                                 OperatorDef("_TestRendezvous", ["x"], ["b"], device_option=CPU1),
                                 OperatorDef("Add", ["a", "b"], ["c"])], type="dag", num_workers=2)
        workspace.RunNetOnce(net)
    np.testing.assert_array_equal(workspace.FetchBlob("c"), [2.0, 2.0])
    assert len(set(seen)) == 2 and all(name.startswith("graphpar-dag-") for name in seen)


def test_dependencies_are_kept_including_writes_after_reads():
    workspace.FeedBlob("x", np.ones(3, np.float32))
    ops = [OperatorDef("Scale", ["x"], ["y"], {"scale": 2.0}),
           OperatorDef("Scale", ["x"], ["z"], {"scale": 3.0}),
           OperatorDef("Scale", ["y"], ["x"], {"scale": 5.0}),  # must wait for both reads of x
           OperatorDef("Add", ["x", "z"], ["w"])]
    for net_type in ("simple", "dag"):
        workspace.FeedBlob("x", np.ones(3, np.float32))
        workspace.RunNetOnce(NetDef(f"deps_{net_type}", [op.copy() for op in ops], type=net_type, num_workers=4))
        np.testing.assert_array_equal(workspace.FetchBlob("w"), [13.0] * 3)


def test_a_failing_kernel_raises_simples_error_and_changes_nothing():
    def build(net_type: str) -> NetDef:
        return NetDef(f"fails_{net_type}", [OperatorDef("Relu", ["x"], ["h"]),
                                            OperatorDef("Relu", ["x"], ["g"]),
                                            OperatorDef("Add", ["h", "bad"], ["y"]),
                                            OperatorDef("Relu", ["y"], ["z"])], type=net_type, num_workers=2)

    messages = {}
    for net_type in ("simple", "dag"):
        workspace.ResetWorkspace()
        workspace.FeedBlob("x", np.ones(3, np.float32))
        workspace.FeedBlob("bad", np.ones(3, np.float32))
        workspace.CreateNet(build(net_type))
        workspace.FeedBlob("bad", np.ones(4, np.float32))  # a shape CreateNet did not see: fails at run
        with pytest.raises(OperatorError) as info:
            workspace.RunNet(f"fails_{net_type}")
        messages[net_type] = str(info.value).replace(net_type, "T")
        assert workspace.Blobs() == ["bad", "x"]
    assert messages["dag"] == messages["simple"] and "op #2 (Add)" in messages["dag"]
    workspace.FeedBlob("bad", np.ones(3, np.float32))  # the executor is still usable
    workspace.RunNet("fails_dag")
    np.testing.assert_array_equal(workspace.FetchBlob("z"), [2.0] * 3)


def test_repeated_runs_and_creates_start_no_new_threads():
    workspace.FeedBlob("x", np.ones(8, np.float32))
    net = NetDef("loop", [OperatorDef("Relu", ["x"], [f"y{i}"]) for i in range(6)], type="dag", num_workers=8)
    workspace.CreateNet(net)
    workspace.RunNet(net.name)
    before = threading.active_count()
    for _ in range(20):
        workspace.CreateNet(net, overwrite=True)
        workspace.RunNet(net.name, 3)
    assert threading.active_count() == before
    assert get_executor("dag").worker_count() <= 8


def test_concurrency_respects_the_thread_budget(monkeypatch: pytest.MonkeyPatch):
    from graphpar.executor.dag import make_schedules

    workspace.FeedBlob("x", np.ones(2, np.float32))
    net = NetDef("wide", [OperatorDef("Relu", ["x"], [f"y{i}"]) for i in range(8)], type="dag", num_workers=16)
    monkeypatch.setenv("GRAPHPAR_NUM_THREADS", "3")
    plan = workspace.get_workspace().create_net(net)
    assert plan.intra_op_threads == 3 and make_schedules(plan)[0].concurrency == 1
    cpu = [OperatorDef("Relu", ["x"], [f"y{i}"], device_option=DeviceOption(CPU, i % 4)) for i in range(8)]
    plan = workspace.get_workspace().create_net(NetDef("replicas", cpu, type="dag", num_workers=16))
    assert plan.intra_op_threads == 1 and make_schedules(plan)[0].concurrency == 3


def test_the_update_phase_gives_its_threads_to_the_replicas_that_update(monkeypatch: pytest.MonkeyPatch):
    """Two CPU replicas compute side by side with one thread each; when only the first updates (as
    CPU replicas that update once), its updates get both threads, in simple and dag alike, and the
    results are bit-identical."""
    from graphpar.executor.dag import make_schedules

    monkeypatch.setenv("GRAPHPAR_NUM_THREADS", "2")
    seen: dict[str, list[int]] = {"simple": [], "dag": []}

    def kernel(a, ctx):  # noqa: ANN001, ANN202
        def run(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            seen[a.tag].append(torch.get_num_threads())
            return p.sub_(g)
        return run

    results = {}
    for net_type in ("simple", "dag"):
        workspace.FeedBlob("p", np.ones(4, np.float32))
        workspace.FeedBlob("x", np.arange(4, dtype=np.float32))
        with scoped_registry():
            from graphpar.core.schema import Trait
            register_op("_TestUpdate", kernel=kernel, inputs=2, outputs=1, inplace={(0, 0)},
                        args={"tag": ""}, traits={Trait.INPLACE_UPDATE},
                        infer=lambda a, ctx, inputs: [inputs[0]], doc="Test op: an in-place update.")
            ops = [OperatorDef("Relu", ["x"], ["g0"], device_option=CPU0),
                   OperatorDef("Relu", ["x"], ["g1"], device_option=CPU1),
                   OperatorDef("Sum", ["g0", "g1"], ["g"], device_option=CPU0),
                   OperatorDef("_TestUpdate", ["p", "g"], ["p"], {"tag": net_type}, CPU0)]
            plan = workspace.get_workspace().create_net(NetDef(f"phases_{net_type}", ops, type=net_type,
                                                               num_workers=4))
            assert (plan.intra_op_threads, plan.staged_threads) == (1, 2)
            if net_type == "dag":
                assert [(s.threads, s.concurrency) for s in make_schedules(plan)] == [(1, 2), (2, 1)]
            workspace.RunNet(plan.name)
        results[net_type] = workspace.FetchBlob("p")
    assert seen == {"simple": [2], "dag": [2]}
    np.testing.assert_array_equal(results["simple"], results["dag"])
    np.testing.assert_array_equal(results["dag"], 1 - 2 * np.arange(4))


def _diamonds(width: int, depth: int, net_type: str) -> NetDef:
    """`width` independent chains, each value read by two ops, the chain's name reused each level (so a
    slot holds several versions), all joined at the end; only the result is kept."""
    ops = []
    for c in range(width):
        device = DeviceOption(CPU, c % 2)
        prev = "x"
        for _ in range(depth):
            a, b, out = f"a{c}", f"b{c}", f"h{c}"
            ops += [OperatorDef("Scale", [prev], [a], {"scale": 0.5}, device),
                    OperatorDef("Relu", [prev], [b], device_option=device),
                    OperatorDef("Add", [a, b], [out], device_option=device)]
            prev = out
    ops.append(OperatorDef("Sum", [f"h{c}" for c in range(width)], ["y"]))
    return NetDef(f"diamonds_{net_type}", ops, external_outputs=["y"], type=net_type, num_workers=4,
                  args={"dynamic_memory_management": 1})


def test_freeing_in_any_order_waits_for_every_user_of_a_value():
    workspace.FeedBlob("x", np.linspace(-1, 1, 64, dtype=np.float32))
    results = {}
    for net_type in ("simple", "dag"):
        net = _diamonds(6, 8, net_type)
        plan = workspace.get_workspace().create_net(net)
        assert plan.frame.frees_memory and len(plan.frame.version_slots) == 6 * 8 * 3
        for _ in range(10):  # concurrent runs must never read a freed value
            workspace.RunNet(net.name)
        results[net_type] = workspace.FetchBlob("y")
        assert workspace.Blobs() == ["x", "y"]
    np.testing.assert_array_equal(results["dag"], results["simple"])


def _thread_recording_net(name: str, seen: list, first_iter_serial: bool) -> NetDef:
    def kernel(a, ctx):  # noqa: ANN001, ANN202
        def run(x: torch.Tensor) -> torch.Tensor:
            seen.append(threading.current_thread().name)
            return x + 1
        return run

    register_op("_TestWhichThread", kernel=kernel, infer=lambda a, ctx, inputs: [inputs[0]],
                doc="Test op: records the thread that runs it.")
    args = {"first_iter_only_one_worker": 1} if first_iter_serial else {}
    return NetDef(name, [OperatorDef("_TestWhichThread", ["x"], ["a"], device_option=CPU0),
                         OperatorDef("_TestWhichThread", ["x"], ["b"], device_option=CPU1)],
                  args=args, type="dag", num_workers=2)


@pytest.mark.parametrize("first_iter_serial", [True, False])
def test_first_iter_only_one_worker_runs_the_first_run_in_the_calling_thread(first_iter_serial: bool):
    """Caffe2's hint (Parallelize sets it on the train net): the first run is serial, later ones are not."""
    seen: list = []
    with scoped_registry():
        workspace.FeedBlob("x", np.zeros(2, np.float32))
        net = _thread_recording_net(f"first_iter_{first_iter_serial}", seen, first_iter_serial)
        workspace.CreateNet(net)
        workspace.RunNet(net.name)
        first = list(seen)
        seen.clear()
        workspace.RunNet(net.name, 2)
    on_workers = all(name.startswith("graphpar-dag-") for name in first)
    assert (set(first) == {"MainThread"}) if first_iter_serial else on_workers
    assert len(seen) == 4 and all(name.startswith("graphpar-dag-") for name in seen)


def test_a_failed_first_run_stays_serial_until_one_completes():
    """`first_iter_only_one_worker` counts completed runs: a first run that failed does not count."""
    seen: list = []
    with scoped_registry():
        workspace.FeedBlob("x", np.zeros(2, np.float32))
        net = _thread_recording_net("first_iter_failing", seen, True)
        plan = workspace.get_workspace().create_net(net)
        workspace.get_workspace().remove_blob("x")
        with pytest.raises(MissingBlobError, match="no longer in workspace"):
            workspace.RunNet(net.name)
        assert runtime_of(plan).completed == 0
        workspace.FeedBlob("x", np.zeros(2, np.float32))
        workspace.RunNet(net.name)
        assert set(seen) == {"MainThread"} and runtime_of(plan).completed == 1


def test_run_time_state_lives_in_the_runtime_not_the_plan():
    """The CompiledNet is never changed by a run: programs, schedules, verified state and run counts are its
    Runtime's, and a copy of the plan (`with_steps`) starts with a fresh runtime."""
    workspace.FeedBlob("x", np.ones(2, np.float32))
    net = NetDef("runtime_state", [OperatorDef("Scale", ["x"], ["y"], {"scale": 2.0})], type="dag")
    plan = workspace.get_workspace().create_net(net)
    before = dict(vars(plan)), dict(vars(plan.state_guard))
    workspace.RunNet(net.name, 3)
    assert (dict(vars(plan)), dict(vars(plan.state_guard))) == before
    runtime = runtime_of(plan)
    assert runtime.completed == 3 and runtime.committed and runtime.schedules is not None
    assert runtime.programs is not None  # one launching thread: the straight-line programs ran
    copy = plan.with_steps(plan.steps)
    assert runtime_of(copy) is not runtime and runtime_of(copy).completed == 0


@pytest.mark.parametrize("net_type", ["simple", "dag"])
def test_a_replaced_net_is_freed_with_its_runtime(net_type: str):
    """Runtimes are kept per plan weakly: what they cache (programs, schedules) keeps no plan alive."""
    workspace.FeedBlob("x", np.ones(2, np.float32))
    net = NetDef(f"freed_{net_type}", [OperatorDef("Scale", ["x"], ["y"], {"scale": 2.0})], type=net_type)
    workspace.CreateNet(net)
    workspace.RunNet(net.name, 2)
    plan = weakref.ref(workspace.get_workspace().nets[net.name])
    assert runtime_of(plan()).completed == 2
    workspace.CreateNet(net, overwrite=True)
    gc.collect()
    assert plan() is None


def test_ctrl_c_in_the_caller_waits_for_the_running_steps_and_commits_nothing():
    """A KeyboardInterrupt while a run waits for its workers returns only once no worker is inside a
    kernel (one still running at interpreter exit aborts the process; a second Ctrl-C does not cut the
    wait short) and writes no output."""
    import signal
    import time

    started, finished = threading.Event(), threading.Event()

    def kernel(a, ctx):  # noqa: ANN001, ANN202
        def run(x: torch.Tensor) -> torch.Tensor:
            started.set()
            time.sleep(0.5)
            finished.set()
            return x + 1
        return run

    def interrupt() -> None:  # twice, as a terminal's and a launcher's SIGINT arrive: the second mid-drain
        started.wait(10)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.2)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    with scoped_registry():
        register_op("_TestSlow", kernel=kernel, infer=lambda a, ctx, inputs: [inputs[0]], doc="Test op: sleeps.")
        workspace.FeedBlob("x", np.zeros(2, np.float32))
        net = NetDef("interrupted", [OperatorDef("_TestSlow", ["x"], ["a"], device_option=CPU0),
                                     OperatorDef("Relu", ["x"], ["b"], device_option=CPU1),
                                     OperatorDef("Add", ["a", "b"], ["c"])], type="dag", num_workers=2)
        workspace.CreateNet(net)
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            workspace.RunNet(net.name)
        assert finished.is_set()
        assert not workspace.HasBlob("c") and not workspace.HasBlob("a")
        workspace.RunNet(net.name)  # the executor is still usable
    np.testing.assert_array_equal(workspace.FetchBlob("c"), [1.0, 1.0])
