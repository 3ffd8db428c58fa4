"""Multi-host training with real processes: gloo over loopback, a FileStore in a temp dir.

2 shards x 2 CPU devices train bit-identically to 1 shard x 4 devices: each shard sums its two
replicas onto its first device (g0 + g1, g2 + g3), the cross-shard all-reduce of two shards adds the
two partial sums (commutative, so the same on both ranks), and 1 x 4 devices' Sum tree computes
(g0 + g1) + (g2 + g3) too. One device on the concatenated batch matches to float tolerance only (its
sums run in another order).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tests.multihost import workers
from tests.multihost.helpers import assert_identical, load, run_processes

STEPS = 10
RUNS = [{"kind": "mlp"}, {"kind": "mlp", "gradient_bucket_bytes": 64, "first_bucket_bytes": 64},
        {"kind": "cnn"}, {"kind": "cnn", "gradient_bucket_bytes": 1 << 20, "average_computed_params": True},
        {"kind": "mlp", "bmuf": True}, {"kind": "cnn", "combine_spatial_bn": True}, {"kind": "dlrm"},
        {"kind": "mlp", "shard_optimizer_state": True}, {"kind": "cnn", "shard_gradients": True}]


@pytest.mark.slow
def test_two_shards_of_two_devices_train_bit_identically_to_one_shard_of_four(tmp_path: Path) -> None:
    """MLP and CNN with batch norm, with and without buckets (and averaged computed params), 10 momentum
    SGD steps, synchronised batch norm (combine_spatial_bn: statistics of all 4 replicas), DLRM (sparse embedding
    gradients, gathered across shards), and BMUF (10 blocks of 2 local steps, the global model averaged over every replica of
    every shard), sharded optimizer state (stage 1 on the MLP, stage 2 on the CNN: with two shards the
    ring's reduce-scatter adds the two partial sums as the tree does); shard 1 is seeded differently and
    still starts from shard 0's params. Every replica of every shard equals the 1 x 4 run's after init
    and after every step."""
    single = tmp_path / "single"
    single.mkdir()
    ref_runs = [{**run, "shard": 0, "num_shards": 1, "devices": [0, 1, 2, 3], "store": str(single),
                 "steps": STEPS} for run in RUNS]
    codes = run_processes(workers.train_all, [(str(single / "ref"), ref_runs)] + [
        (str(tmp_path / f"shard{r}"), RUNS) for r in range(2)],
        [{}] + [dict(shard=r, num_shards=2, devices=[0, 1], store=str(tmp_path), steps=STEPS, seed=r)
                for r in range(2)])
    assert codes == [0, 0, 0]
    for k in range(len(RUNS)):
        assert not list(tmp_path.glob(f"*_{k}.npz.error")), (tmp_path / f"shard0_{k}.npz.error").read_text()
        ref = load(single / f"ref_{k}.npz")
        for r in range(2):
            got = load(tmp_path / f"shard{r}_{k}.npz")
            # shard r's device d holds global replica 2r + d: all replicas are equal, compare each to ref's
            assert_identical(got, ref)
            assert set(got) == {key for key in ref if key.split("/")[1] in ("cpu_0", "cpu_1")}


def test_one_shard_of_two_devices_and_two_shards_of_one_match_one_device(tmp_path: Path) -> None:
    """2 shards x 1 device == 1 shard x 2 devices bit for bit, and one device on the whole batch to
    float tolerance (one process start per shard for both models)."""
    runs = [{"kind": "mlp", "steps": 4}]
    ref_dir, one_dir = tmp_path / "ref", tmp_path / "one"
    ref_dir.mkdir()
    one_dir.mkdir()
    codes = run_processes(workers.train_all, [
        (str(ref_dir / "two"), [{**runs[0], "devices": [0, 1]}, {**runs[0], "devices": [0], "steps": 4}]),
        (str(tmp_path / "shard0"), runs), (str(tmp_path / "shard1"), runs)],
        [dict(shard=0, num_shards=1, store=str(ref_dir))] + [
            dict(shard=r, num_shards=2, devices=[0], store=str(tmp_path), seed=5 * r) for r in range(2)])
    assert codes == [0, 0, 0]
    two = load(ref_dir / "two_0.npz")
    for r in range(2):
        assert_identical(load(tmp_path / f"shard{r}_0.npz"), two)
    one = load(ref_dir / "two_1.npz")
    for key, value in one.items():
        np.testing.assert_allclose(two[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_four_shards_of_one_device_match_one_of_four_exactly_in_tree_order(tmp_path: Path) -> None:
    """reduce_order='tree' sums (g0 + g1) + (g2 + g3) on every shard, as one process's tree over 4
    devices: bit for bit, with sharded state (ReduceScatter in tree order) too. gloo's ring all-reduce of
    4 shards adds in another order: float tolerance; its ring reduce-scatter in yet another one: within
    one float32 rounding per step of the ring all-reduce's run (the ulp of the largest param, per step)."""
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    runs = [{"kind": "mlp", "steps": 4, "reduce_order": "tree"}, {"kind": "mlp", "steps": 4},
            {"kind": "mlp", "steps": 4, "reduce_order": "tree", "shard_gradients": True},
            {"kind": "mlp", "steps": 4, "shard_gradients": True}]
    codes = run_processes(workers.train_all, [(str(ref_dir / "four"), runs[:1])] + [
        (str(tmp_path / f"shard{r}"), runs) for r in range(4)],
        [dict(shard=0, num_shards=1, devices=[0, 1, 2, 3], store=str(ref_dir))] + [
            dict(shard=r, num_shards=4, devices=[0], store=str(tmp_path), seed=r) for r in range(4)])
    assert codes == [0] * 5
    four = load(ref_dir / "four_0.npz")
    for r in range(4):
        assert_identical(load(tmp_path / f"shard{r}_0.npz"), four)
        assert_identical(load(tmp_path / f"shard{r}_2.npz"), four)
        ring = load(tmp_path / f"shard{r}_1.npz")
        for key, value in ring.items():
            np.testing.assert_allclose(value, four[key], rtol=1e-5, atol=1e-6, err_msg=key)
        for key, value in load(tmp_path / f"shard{r}_3.npz").items():
            when = key.split("/")[0]
            steps = 0 if when == "init" else int(when) + 1
            assert np.abs(value - ring[key]).max() <= steps * np.spacing(np.abs(ring[key]).max()), key
    assert_identical(load(tmp_path / "shard3_1.npz"), load(tmp_path / "shard0_1.npz"))  # ranks agree
    assert_identical(load(tmp_path / "shard3_3.npz"), load(tmp_path / "shard0_3.npz"))


def test_a_checkpoint_of_two_shards_resumes_on_four_shards_and_on_one_process_exactly(tmp_path: Path) -> None:
    """2 shards x 2 devices train 3 steps and save (shard 0 writes), once unsharded and once with
    sharded state (shard_gradients: every shard gathers its parts for the save, as a PeriodicCheckpointer
    does, and then trains 3 steps more, as if it had not saved): the two files are
    byte-identical. 4 shards x 1 device (tree order) and 1 process x 4 devices each load them,
    FinalizeAfterCheckpoint (cutting the state into parts where sharded) and train steps 3..5, the
    unsharded file unsharded and the sharded one the other way round: all equal the uninterrupted 1 x 4
    run of 6 steps."""
    ckpt, sharded = str(tmp_path / "two.safetensors"), str(tmp_path / "two_sharded.safetensors")
    for d in ("two", "four", "one"):
        (tmp_path / d).mkdir()
    saves = [{"kind": "mlp", "steps": 3, "save_to": ckpt},
             {"kind": "mlp", "steps": 6, "save_to": sharded, "save_after": 3, "shard_gradients": True}]
    codes = run_processes(workers.train_all, [(str(tmp_path / "two" / f"shard{r}"), saves) for r in range(2)] + [
        (str(tmp_path / "one" / "full"), [{"kind": "mlp", "steps": 6}])],
        [dict(shard=r, num_shards=2, devices=[0, 1], store=str(tmp_path / "two")) for r in range(2)]
        + [dict(shard=0, num_shards=1, devices=[0, 1, 2, 3], store=str(tmp_path / "one"))])
    assert codes == [0, 0, 0] and not list(tmp_path.glob("*/*.error"))
    assert Path(sharded).read_bytes() == Path(ckpt).read_bytes()
    resume = {"kind": "mlp", "steps": 6, "resume_from": ckpt}
    crosswise = [resume, {**resume, "resume_from": sharded, "shard_optimizer_state": True}]
    codes = run_processes(workers.train_all, [(str(tmp_path / "four" / f"shard{r}"), crosswise) for r in range(4)] + [
        (str(tmp_path / "one" / "resumed"), [{**resume, "shard_gradients": True}, {**resume, "resume_from": sharded}])],
        [dict(shard=r, num_shards=4, devices=[0], store=str(tmp_path / "four"), reduce_order="tree", seed=r)
         for r in range(4)] + [dict(shard=0, num_shards=1, devices=[0, 1, 2, 3], store=str(tmp_path / "one"))])
    errors = [p.read_text() for p in tmp_path.glob("*/*.error")]
    assert codes == [0] * 5 and not errors, errors
    full = load(tmp_path / "one" / "full_0.npz")
    for got in [load(tmp_path / "four" / f"shard{r}_{k}.npz") for r in range(4) for k in range(2)] + [
            load(tmp_path / "one" / f"resumed_{k}.npz") for k in range(2)] + [
            load(tmp_path / "two" / f"shard{r}_1.npz") for r in range(2)]:
        steps = [key for key in got if key.split("/")[0] in ("3", "4", "5")]
        assert len(steps) >= 12
        assert_identical(got, full, steps)


def test_a_shard_that_dies_makes_the_other_raise_within_its_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    codes = run_processes(workers.train_all, [(str(tmp_path / f"shard{r}"), [{"kind": "mlp"}]) for r in range(2)],
                          [dict(shard=r, num_shards=2, devices=[0, 1], store=str(tmp_path), steps=STEPS,
                                timeout_sec=10, die_at=3 if r == 1 else None) for r in range(2)], limit=60)
    assert codes == [0, 3]
    assert time.monotonic() - start < 60
    error = (tmp_path / "shard0_0.npz.error").read_text()
    assert "shard 0 of 2" in error and "Allreduce" in error and "graphpar_cw_" in error, error


def test_a_nan_loss_on_one_shard_stops_the_step_on_every_shard_and_training_goes_on(tmp_path: Path) -> None:
    """Issue 32 item 1: check_finite_loss raised on the shard with the NaN only; the other shard's step
    went on, its all-reduce met the failing shard's next step's (gradients of different steps summed)
    and a later step failed in Allreduce. Now every shard refuses the step and nothing changes: 2
    shards x 1 device, shard 1's batch holds a NaN at step 1, equal after every step to 1 process of
    2 devices with the same NaN (a local check), which skips that step."""
    nan = {"kind": "mlp", "steps": 4, "nan_at": (1, 1)}
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    codes = run_processes(workers.train_all, [(str(ref_dir / "ref"), [nan])] + [
        (str(tmp_path / f"shard{r}"), [nan]) for r in range(2)],
        [dict(shard=0, num_shards=1, devices=[0, 1], store=str(ref_dir))] + [
            dict(shard=r, num_shards=2, devices=[0], store=str(tmp_path), seed=r, timeout_sec=10) for r in range(2)],
        limit=60)
    assert codes == [0, 0, 0]
    assert not list(tmp_path.glob("**/*.error")), [p.read_text() for p in tmp_path.glob("**/*.error")]
    ref = load(ref_dir / "ref_0.npz")
    for key in (k for k in ref if k.startswith("1/")):  # the NaN step changed nothing
        np.testing.assert_array_equal(ref[key], ref[key.replace("1/", "0/", 1)], err_msg=key)
    for r in range(2):
        assert_identical(load(tmp_path / f"shard{r}_0.npz"), ref)
    assert "'cpu_1/" in (ref_dir / "ref_0.npz.step1").read_text()
    assert "is nan (not finite) on shard 1: the step stopped on every shard" in \
        (tmp_path / "shard1_0.npz.step1").read_text()
    assert "shard(s) [1] of 2 had a loss that is not finite: the step stopped on every shard" in \
        (tmp_path / "shard0_0.npz.step1").read_text()


def test_a_shard_with_another_model_fails_at_init_on_every_shard(tmp_path: Path) -> None:
    codes = run_processes(workers.train_all, [(str(tmp_path / f"shard{r}"), [{"kind": "mlp", "hidden": 8 + r}])
                                              for r in range(2)],
                          [dict(shard=r, num_shards=2, devices=[0, 1], store=str(tmp_path), steps=1, timeout_sec=10)
                           for r in range(2)], limit=60)
    assert codes == [0, 0]
    for r in range(2):
        error = (tmp_path / f"shard{r}_0.npz.error").read_text()
        assert "shard(s) [1] built a different model than shard 0" in error, error


def test_a_shard_with_another_learning_rate_fails_at_init_on_every_shard(tmp_path: Path) -> None:
    """Issue 23 item 5: lr 0.125 on shard 0 and 0.25 on shard 1 trained apart without an error."""
    codes = run_processes(workers.train_all, [(str(tmp_path / f"shard{r}"), [{"kind": "mlp", "lr": 0.125 * (1 + r)}])
                                              for r in range(2)],
                          [dict(shard=r, num_shards=2, devices=[0, 1], store=str(tmp_path), steps=1, timeout_sec=10)
                           for r in range(2)], limit=60)
    assert codes == [0, 0]
    for r in range(2):
        error = (tmp_path / f"shard{r}_0.npz.error").read_text()
        assert "shard(s) [1] built a different model than shard 0" in error and "'base_lr', 0.125" in error, error


def test_a_shard_that_hangs_makes_the_other_raise_after_the_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    codes = run_processes(workers.train_all, [(str(tmp_path / f"shard{r}"), [{"kind": "mlp"}]) for r in range(2)],
                          [dict(shard=r, num_shards=2, devices=[0], store=str(tmp_path), steps=STEPS, timeout_sec=5,
                                hang_at=2 if r == 1 else None) for r in range(2)], limit=90)
    assert codes == [0, 4]
    assert time.monotonic() - start < 50
    error = (tmp_path / "shard0_0.npz.error").read_text()
    assert "shard 0 of 2" in error and "timeout 5 s" in error, error


def test_blob_syncs_checkpoint_sync_and_barriers_cross_shards(tmp_path: Path) -> None:
    codes = run_processes(workers.sync_checks, [(str(tmp_path / f"shard{r}"), r, 2, str(tmp_path)) for r in range(2)],
                          limit=60)
    assert codes == [0, 0]
    assert not list(tmp_path.glob("*.error")), [p.read_text() for p in tmp_path.glob("*.error")]
    for r in range(2):
        got = load(tmp_path / f"shard{r}.npz")
        assert got["marker0"][0] == got["marker1"][0] == 0.0  # AddBlobSync: shard 0's first device
        assert got["total"][0] == 3.0  # AddDistributedBlobSync: 1 + 2, across shards only
        np.testing.assert_array_equal(got["fc1_w0"], np.zeros((8, 6), np.float32))  # FinalizeAfterCheckpoint
        np.testing.assert_array_equal(got["fc1_w1"], np.zeros((8, 6), np.float32))
        assert got["iteration"].tolist() == [3]  # issue 23 item 2: the counter is shard 0's too
        assert "one timeout for every call" in str(got["timeout_change"])
