"""What Parallelize builds for a rendezvous (no processes run): the exact cross-shard ops, their order
and communicators, the loss scale, the rendezvous checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from graphpar import data_parallel_model as dpm
from graphpar import model_helper, optimizer
from graphpar.core.schema import Trait, has_trait
from graphpar.distributed import parse_rendezvous
from graphpar.errors import ParallelizeError
from tests.multihost.workers import feed, forward


def _model(tmp_path: Path, devices=(0, 1), shard: int = 0, num_shards: int = 2, **options):
    scales = []

    def fwd(model, loss_scale):
        scales.append(loss_scale)
        return forward("mlp")(model, loss_scale)

    model = model_helper.ModelHelper(name="build")
    rendezvous = {"shard_id": shard, "num_shards": num_shards, "kv_handler": torch.distributed.FileStore(
        str(tmp_path / "store"), -1)}
    dpm.Parallelize(model, lambda m: None, fwd, optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1),
                    devices=list(devices), cpu_device=True, rendezvous=rendezvous, **options)
    return model, scales


def test_each_gradient_is_summed_locally_all_reduced_across_shards_and_copied_back(tmp_path: Path) -> None:
    model, scales = _model(tmp_path, max_concurrent_distributed_ops=2)
    assert scales == [0.25, 0.25]  # 1 / (2 devices * 2 shards)
    ops = model.net.Proto().ops
    reduction = [(op.type, op.inputs, op.outputs) for op in ops if has_trait(op, Trait.CROSS_DEVICE)
                 or op.name == "dpm"]
    # first every replica's losses checked together across the shards (issue 32 item 1)
    checked = "_losses_checked_across_shards"
    expected = [("CheckFiniteAcrossShards", ["graphpar_cw_0", "cpu_0/scaled_loss", "cpu_1/scaled_loss"], [checked])]
    for k, grad in enumerate(["pred_b_grad", "pred_w_grad", "fc1_b_grad", "fc1_w_grad"]):
        expected += [("Sum", [f"cpu_0/{grad}", f"cpu_1/{grad}"], [f"cpu_0/{grad}"]),
                     ("Allreduce", [f"graphpar_cw_{k % 2}", f"cpu_0/{grad}"], [f"cpu_0/{grad}"]),
                     ("Copy", [f"cpu_0/{grad}"], [f"cpu_1/{grad}"])]
    assert reduction == expected
    allreduces = [op for op in ops if op.type == "Allreduce"]
    # one chain per communicator: up to two in flight, none before the losses' check
    assert [op.control_inputs for op in allreduces] == [[checked], [checked], [checked, "cpu_0/pred_b_grad"],
                                                        [checked, "cpu_0/pred_w_grad"]]
    assert model.net.Proto().num_workers == 2 * 4 + 2


def test_the_init_net_creates_the_communicators_then_broadcasts_from_shard_0(tmp_path: Path) -> None:
    model, _ = _model(tmp_path, max_concurrent_distributed_ops=3)
    init = model.param_init_net.Proto().ops
    creates = [i for i, op in enumerate(init) if op.type == "CreateCommonWorld"]
    first_collective = next(i for i, op in enumerate(init) if op.type == "Broadcast")
    assert creates == list(range(first_collective - 3, first_collective))
    assert [init[i].outputs[0] for i in creates] == ["graphpar_cw_0", "graphpar_cw_1", "graphpar_cw_2"]
    assert [bool(init[i].args["signature"]) for i in creates] == [True, False, False]
    assert {(init[i].args["rank"], init[i].args["size"]) for i in creates} == {(0, 2)}
    broadcasts = [op for op in init if op.type == "Broadcast"]
    assert all(op.args["root"] == 0 and op.inputs[1].startswith("cpu_0/") for op in broadcasts)
    assert [op.type for op in model._parallel.init_nets[1].Proto().ops] == ["CreateCommonWorld", "Barrier"]


def test_the_signature_tells_device_counts_and_shapes_apart(tmp_path: Path) -> None:
    from graphpar.passes.distributed import model_signature

    (a, _), (b, _) = _model(tmp_path), _model(tmp_path, devices=(0, 1, 2))
    assert model_signature(a._parallel) != model_signature(b._parallel)
    (c, _) = _model(tmp_path, shard=1)
    assert model_signature(a._parallel) == model_signature(c._parallel)


@pytest.mark.parametrize("settings", [{"base_learning_rate": 0.2}, {"momentum": 0.5}, {"policy": "step", "stepsize": 3, "gamma": 0.5},
                                      {"nesterov": True}])
def test_the_signature_tells_optimizer_settings_apart(tmp_path: Path, settings: dict) -> None:
    """Issue 23 item 5: shards with lr 0.1 and 0.2 passed the check and trained apart."""
    from graphpar.passes.distributed import model_signature

    def built(shard: int, **overrides):
        model = model_helper.ModelHelper(name="build")
        options = {"base_learning_rate": 0.1, "momentum": 0.9, **overrides}
        rendezvous = {"shard_id": shard, "num_shards": 2, "kv_handler": torch.distributed.FileStore(
            str(tmp_path / "store"), -1)}
        dpm.Parallelize(model, lambda m: None, forward("mlp"),
                        optimizer_builder_fun=lambda m: optimizer.build_sgd(m, **options), devices=[0, 1],
                        cpu_device=True, rendezvous=rendezvous)
        return model_signature(model._parallel)

    assert built(0) == built(1)
    assert built(0) != built(1, **settings)


def test_one_device_per_shard_still_all_reduces_and_buckets_across_shards(tmp_path: Path) -> None:
    model, scales = _model(tmp_path, devices=(0,), gradient_bucket_bytes=1 << 20, first_bucket_bytes=1 << 20)
    assert scales == [0.5]
    types = [op.type for op in model.net.Proto().ops if has_trait(op, Trait.DISTRIBUTED)]
    assert types == ["CheckFiniteAcrossShards", "Allreduce"]  # the losses' check, one bucket of the four gradients


def test_one_shard_builds_what_no_rendezvous_builds(tmp_path: Path) -> None:
    model, scales = _model(tmp_path, num_shards=1)
    assert scales == [0.5, 0.5]
    assert not any(has_trait(op, Trait.DISTRIBUTED) for net in (model.net, model.param_init_net)
                   for op in net.Proto().ops)
    dpm.Synchronize(model)  # returns at once


def test_add_distributed_blob_sync_all_reduces_across_shards_only(tmp_path: Path) -> None:
    model, _ = _model(tmp_path)
    dpm.AddDistributedBlobSync(model, ["cpu_0/fc1_w"])
    last = model.net.Proto().ops[-1]
    assert (last.type, last.inputs[1:], last.outputs) == ("Allreduce", ["cpu_0/fc1_w"], ["cpu_0/fc1_w"])
    plain = model_helper.ModelHelper(name="plain")
    dpm.Parallelize(plain, lambda m: None, forward("mlp"), devices=[0], cpu_device=True,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1))
    before = len(plain.net.Proto().ops)
    dpm.AddDistributedBlobSync(plain, ["cpu_0/fc1_w"])
    assert len(plain.net.Proto().ops) == before


def test_sparse_gradients_are_gathered_locally_then_across_shards(tmp_path: Path) -> None:
    from graphpar.models.dlrm import dlrm

    model = model_helper.ModelHelper(name="sparse")
    dpm.Parallelize(model, lambda m: None, lambda m, s: dlrm(m, s), devices=[0, 1], cpu_device=True,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1),
                    rendezvous={"shard_id": 0, "num_shards": 2, "kv_handler": "store"})
    ops = model.net.Proto().ops
    k = next(i for i, op in enumerate(ops) if op.type == "Allgather")
    assert [op.type for op in ops[k - 2:k + 2]] == ["Copy", "Concat", "Allgather", "Copy"]
    assert ops[k].inputs[1] == ops[k].outputs[0] == ops[k - 1].outputs[0] == "cpu_0/indices_1_concat"
    assert ops[k + 1].outputs == ["cpu_1/indices_1_concat"]


def test_without_kv_handler_shards_come_from_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    rdv = parse_rendezvous({"kv_handler": None})
    assert (rdv.shard_id, rdv.num_shards, rdv.engine, rdv.kv_handler) == (1, 3, "GLOO", None)
    with pytest.raises(ParallelizeError, match=r"rendezvous\['shard_id'\] is 0 but .* says 1"):
        parse_rendezvous({"kv_handler": None, "shard_id": 0})
    with pytest.raises(ParallelizeError, match="must be a dict"):
        parse_rendezvous([("shard_id", 0)])
    with pytest.raises(ParallelizeError, match="timeout_sec"):
        parse_rendezvous({"timeout_sec": 0})
    with pytest.raises(ParallelizeError, match="mpi_rendezvous"):
        parse_rendezvous({"mpi_rendezvous": True})


def test_save_checkpoint_writes_on_shard_0_or_a_lone_process_only(tmp_path: Path) -> None:
    from graphpar import checkpoint

    other, _ = _model(tmp_path, shard=1)
    assert dpm.save_checkpoint(other, tmp_path / "other.safetensors") is False
    assert not (tmp_path / "other.safetensors").exists()
    alone = model_helper.ModelHelper(name="alone")
    dpm.Parallelize(alone, lambda m: None, forward("mlp"), devices=[0], cpu_device=True,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1))
    feed("mlp", 0, 0, 1, [0])
    dpm.RunInitNet(alone)
    assert dpm.save_checkpoint(alone, tmp_path / "alone.safetensors", metadata={"epoch": 1}) is True
    assert checkpoint.read_metadata(tmp_path / "alone.safetensors")["metadata"] == {"epoch": 1}


class _Rendezvous:
    """A communicator stand-in: its allreduce on channel "wait" blocks until channel "set" ran."""

    def __init__(self, event, role: str) -> None:
        self.event, self.role = event, role

    def allreduce(self, tensor) -> None:
        if self.role == "set":
            self.event.set()
        elif not self.event.wait(10):
            raise RuntimeError("the other collective never ran: collectives did not overlap")


def test_collectives_of_two_communicators_overlap_under_the_dag_executor_even_with_one_thread(monkeypatch):
    """The first collective (program order) can only finish once the second has run: a serial run
    would time out. With a budget of one thread, cross-process collectives still get slots of their own."""
    import threading

    from graphpar import distributed, workspace
    from graphpar.core.ir import NetDef, OperatorDef
    from graphpar.executor.dag import make_schedules

    monkeypatch.setenv("GRAPHPAR_NUM_THREADS", "1")
    event = threading.Event()
    for name, role in (("cw_wait", "wait"), ("cw_set", "set")):
        workspace.FeedBlob(name, torch.tensor(distributed.register_world(_Rendezvous(event, role))))
    workspace.FeedBlob("x", torch.ones(3))
    # the collectives reduce values the run makes, as gradients (one on a fed blob would be an update,
    # run in the second phase)
    net = NetDef("overlap", [OperatorDef("Scale", ["x"], ["a"]), OperatorDef("Scale", ["x"], ["b"]),
                             OperatorDef("Allreduce", ["cw_wait", "a"], ["a"]), OperatorDef("Relu", ["b"], ["c"]),
                             OperatorDef("Allreduce", ["cw_set", "b"], ["b"])], ["cw_wait", "cw_set", "x"])
    net.type, net.num_workers = "dag", 4
    plan = workspace.get_workspace().create_net(net)
    (schedule,) = make_schedules(plan)
    assert (schedule.concurrency, schedule.waits, schedule.wait_slots) == (1, frozenset({2, 4}), 2)
    workspace.RunNet("overlap")
    assert event.is_set() and workspace.FetchBlob("c").tolist() == [1.0, 1.0, 1.0]


def _cnn_model(tmp_path: Path, shard: int, combine: object):
    model = model_helper.ModelHelper(name="bn_groups")
    rendezvous = {"shard_id": shard, "num_shards": 4, "kv_handler": torch.distributed.FileStore(
        str(tmp_path / "store"), -1)}
    dpm.Parallelize(model, lambda m: None, forward("cnn"), optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1),
                    devices=[0, 1], cpu_device=True, rendezvous=rendezvous, combine_spatial_bn=combine,
                    max_concurrent_distributed_ops=1)
    return model


@pytest.mark.parametrize("shard, rank", [(1, 0), (3, 1)])
def test_batch_norm_statistics_are_all_reduced_within_the_group_of_shards(tmp_path: Path, shard: int, rank: int):
    model = _cnn_model(tmp_path, shard, [[0, 2], [1, 3]])
    train, init = model.net.Proto().ops, model.param_init_net.Proto().ops
    by_world = {w: [op.inputs[1] for op in train if op.type == "Allreduce" and op.inputs[0] == w]
                for w in ("graphpar_bn_cw", "graphpar_cw_0")}
    # the statistics forward and the scale / bias sums backward: within the group of shards
    assert by_world["graphpar_bn_cw"] == ["cpu_0/conv1_sums", "cpu_0/conv1_sumsq", "cpu_0/conv1_count",
                                          "cpu_0/bn1_s_grad", "cpu_0/bn1_b_grad"]
    assert {"cpu_0/conv1_w_grad", "cpu_0/bn1_s_grad", "cpu_0/pred_w_grad"} <= set(by_world["graphpar_cw_0"])
    assert {op.args["num_batches"] for op in train if op.type in ("SpatialBN", "SpatialBNGradient")} == {4}
    group = next(op for op in init if op.type == "CreateCommonWorld" and op.outputs == ["graphpar_bn_cw"])
    assert (group.args["size"], group.args["rank"], group.args["name"]) == (2, rank, "graphpar_bn_cw/1-3")
    alone = _cnn_model(tmp_path, 2, [[0, 1, 3], [2]])  # a group of one shard: this shard's devices
    assert not any(op.inputs[0] == "graphpar_bn_cw" for op in alone.net.Proto().ops if op.type == "Allreduce")
    everyone = _cnn_model(tmp_path, 2, [[0, 1, 2, 3]])  # every shard: as combine_spatial_bn=True
    assert {op.args["num_batches"] for op in everyone.net.Proto().ops if op.type == "SpatialBN"} == {8}


def test_bad_groups_of_shards_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ParallelizeError, match=r"groups \[\[0, 1\]\] must name shards 0..3 .* this shard \(2\)"):
        _cnn_model(tmp_path, 2, [[0, 1]])
    with pytest.raises(ParallelizeError, match=r"\[5\] are not shards"):
        _cnn_model(tmp_path, 0, [[0, 5]])
    with pytest.raises(ParallelizeError, match="each shard in one group at most"):
        _cnn_model(tmp_path, 0, [[0, 1], [1, 2]])
    with pytest.raises(ParallelizeError, match="groups of shard ids"):
        _cnn_model(tmp_path, 0, [["a"]])
