"""The Trainer records global scalars under a rendezvous, and `graphpar.comm` gathers across real gloo
processes (Detectron2's comm tests, here over a FileStore rendezvous)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.multihost import comm_workers, workers
from tests.multihost.helpers import run_processes
from tests.optional import needs

STEPS = 4
RUNS = [{}, {"accumulate_gradients": 2, "record_period": 3}]  # 3: one gather of 3 iterations, then 1


def _load(path: Path) -> dict[str, np.ndarray]:
    assert not path.with_name(path.name + ".error").exists(), path.with_name(path.name + ".error").read_text()
    with np.load(path, allow_pickle=True) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.slow
def test_two_shards_of_two_devices_record_the_losses_of_one_shard_of_four(tmp_path: Path) -> None:
    """Every shard records the global batch's mean loss, bit-identical to 1 process x 4 devices (it was
    the local shard's mean / 2), and to one device on the whole batch within float tolerance; comm's
    all_gather / gather / reduce_dict over the model's communicator give every shard's values."""
    single = tmp_path / "single"
    single.mkdir()
    ref_runs = [{**run, "devices": devices} for run in RUNS for devices in ([0, 1, 2, 3], [0])]
    codes = run_processes(comm_workers.trainer_scalars_all, [(str(single / "ref"), ref_runs)] + [
        (str(tmp_path / f"shard{r}"), RUNS) for r in range(2)],
        [dict(shard=0, num_shards=1, store=str(single), steps=STEPS)]
        + [dict(shard=r, num_shards=2, devices=[0, 1], store=str(tmp_path), steps=STEPS) for r in range(2)])
    assert codes == [0, 0, 0]
    for k in range(len(RUNS)):
        four, one = _load(single / f"ref_{2 * k}.npz"), _load(single / f"ref_{2 * k + 1}.npz")
        assert len(four["loss"]) == STEPS and four["loss"][0] > 0.5  # a 3-class softmax loss starts near ln 3
        np.testing.assert_allclose(four["loss"], one["loss"], rtol=1e-5)
        for r in range(2):
            got = _load(tmp_path / f"shard{r}_{k}.npz")
            np.testing.assert_array_equal(got["loss"], four["loss"])
            assert list(got["gathered"]) == [[0], [0, 1]]
            assert list(got["gather0"]) == (["shard0", "shard1"] if r == 0 else [])
            np.testing.assert_array_equal(got["reduced"], [1.5, 5.0, 3.0])
            assert "different names" in str(got["mismatch"])
        assert list(four["gathered"]) == [[0]] and list(four["gather0"]) == ["shard0"]


@pytest.mark.slow
def test_local_process_groups_split_the_default_group_by_machine(tmp_path: Path) -> None:
    from graphpar import launch

    launch.launch(comm_workers.local_groups, 2, args=(str(tmp_path),), backend="gloo")
    for rank in range(2):
        seen = eval((tmp_path / f"rank{rank}").read_text())  # noqa: S307 - written by the test's own worker
        assert seen[:3] == [1, [rank], 1]
        assert "exists already" in seen[3]
        assert seen[4:] == [2, [0, 1], {"x": 1.5}, [0, 1] if rank == 0 else []]


@pytest.mark.slow
@needs("yacs", "graphpar.config")
def test_default_trainer_over_two_processes_matches_one_process_of_two_devices(tmp_path: Path) -> None:
    """Detectron2's layout, one device per process: 2 processes x 1 device train as 1 x 2 devices (the
    same global batches; float tolerance, the rows reach the devices in another order), record the
    same losses on both processes, and the test accuracy gathered from both is the main process's."""
    from graphpar import launch

    assert run_processes(comm_workers.default_trainer, [(str(tmp_path), 2)]) == [0]
    launch.launch(comm_workers.default_trainer, 2, args=(str(tmp_path), 1), backend="gloo")
    ref = np.load(tmp_path / "d2_rank0.npz")
    got = [np.load(tmp_path / f"d1_rank{r}.npz") for r in range(2)]
    np.testing.assert_array_equal(got[0]["loss"], got[1]["loss"])
    np.testing.assert_allclose(got[0]["loss"], ref["loss"], rtol=1e-5)
    for name in ("fc1_w", "pred_w"):
        np.testing.assert_allclose(got[0][name], ref[name], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got[0][name], got[1][name])
    assert float(got[0]["top1"]) == float(ref["top1"]) and float(got[1]["top1"]) == -1.0  # on the main process only
    assert float(ref["top1"]) * 8 == round(float(ref["top1"]) * 8)  # counted over all 8 test samples


@pytest.mark.slow
def test_batch_norm_synced_over_each_shard_only(tmp_path: Path) -> None:
    """combine_spatial_bn="shard" (SyncBatchNorm with a process group per process): after a step of 2 shards
    x 2 devices, shard s normalised with the statistics of one process of 2 devices fed shard s's half
    of the batch (combined over its devices), so the shards differ; combine_spatial_bn=True gives both
    shards the statistics of the whole batch."""
    single = tmp_path / "single"
    single.mkdir()
    ref_runs = [{"slice_of": s} for s in range(2)]
    codes = run_processes(comm_workers.bn_stats_all, [(str(single / "ref"), ref_runs)] + [
        (str(tmp_path / f"shard{r}"), [{"combine": "shard"}, {"combine": True}]) for r in range(2)],
        [dict(shard=0, num_shards=1, store=str(single), combine=True)]
        + [dict(shard=r, num_shards=2, slice_of=r, store=str(tmp_path)) for r in range(2)])
    assert codes == [0, 0, 0]
    halves = [_load(single / f"ref_{s}.npz") for s in range(2)]
    for r in range(2):
        got = _load(tmp_path / f"shard{r}_0.npz")
        for key, value in got.items():
            np.testing.assert_allclose(value, halves[r][key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert not np.allclose(halves[0]["0/sm"], halves[1]["0/sm"])
    synced = [_load(tmp_path / f"shard{r}_1.npz") for r in range(2)]
    np.testing.assert_array_equal(synced[0]["0/sm"], synced[1]["1/sm"])
    np.testing.assert_allclose(synced[0]["0/sm"], (halves[0]["0/sm"] + halves[1]["0/sm"]) / 2, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_batch_norm_synced_over_groups_of_shards(tmp_path: Path) -> None:
    """combine_spatial_bn=[[0, 2], [1]] (SyncBatchNorm's process_group, from new_group's ranks): each of 3
    shards normalises with the statistics of its group's batch (torch's batch statistics of the conv
    output on the group's slices), while the gradients are all-reduced over all 3 shards: after the
    step every shard holds the same params."""
    groups = [[0, 2], [1]]
    codes = run_processes(comm_workers.bn_group_stats, [(str(tmp_path / f"shard{r}.npz"),) for r in range(3)],
                          [dict(shard=r, num_shards=3, store=str(tmp_path), slices=[r], combine=groups)
                           for r in range(3)])
    assert codes == [0] * 3
    got = [_load(tmp_path / f"shard{r}.npz") for r in range(3)]
    x, _ = workers.batch("cnn", 0)
    parts = np.split(np.arange(workers.GLOBAL_BATCH), 4)
    for r in range(3):
        group = next(g for g in groups if r in g)
        rows = np.concatenate([parts[s] for s in group])
        conv = torch.nn.functional.conv2d(torch.from_numpy(x[rows]), torch.from_numpy(got[r]["initial"]), padding=1)
        mean, var = conv.mean(dim=(0, 2, 3)), conv.var(dim=(0, 2, 3), unbiased=False)
        np.testing.assert_allclose(got[r]["0/sm"], mean.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"shard {r}")
        np.testing.assert_allclose(got[r]["0/siv"], (1 / torch.sqrt(var + 1e-5)).numpy(), rtol=1e-4,
                                   err_msg=f"shard {r}")
        for name in ("initial", "conv1_w", "pred_w"):
            np.testing.assert_array_equal(got[r][name], got[0][name], err_msg=f"shard {r} {name}")
    assert not np.allclose(got[0]["0/sm"], got[1]["0/sm"])


def test_training_sampler_without_a_seed_shares_one_random_order_over_the_processes(tmp_path: Path) -> None:
    """Issue 32 item 6: TrainingSampler(seed=None) drew each process's own random order, so the ranks'
    indices overlapped and missed samples. As Detectron2, seed=None is one random seed the processes
    share (comm.shared_random_seed): the ranks' indices are disjoint and cover each epoch (2 processes,
    gloo on a FileStore)."""
    codes = run_processes(comm_workers.sampler_indices, [(str(tmp_path / f"rank{r}.npy"), r, 2, str(tmp_path))
                                                         for r in range(2)], limit=60)
    assert codes == [0, 0]
    ranks = [np.load(tmp_path / f"rank{r}.npy") for r in range(2)]
    for epoch in range(2):
        indices = np.concatenate([r[epoch * 6:(epoch + 1) * 6] for r in ranks])
        assert sorted(indices) == list(range(12))
    assert list(ranks[0][:6]) != sorted(ranks[0][:6]) or list(ranks[1][:6]) != sorted(ranks[1][:6])  # shuffled


def test_training_sampler_without_a_seed_needs_a_group_of_its_world() -> None:
    from graphpar.loaders import TrainingSampler

    with pytest.raises(ValueError, match="world=2 processes cannot agree on a random seed"):
        TrainingSampler(12, seed=None, rank=0, world=2)
    first = list(itertools.islice(iter(TrainingSampler(12, seed=None)), 12))
    assert sorted(first) == list(range(12))  # one process: its own random order, every index once
