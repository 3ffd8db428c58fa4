"""Sharded optimizer state across processes: real gloo processes over loopback, a FileStore in a temp dir.

2 shards x 2 CPU devices with sharded state train bit-identically to 1 shard x 4 devices without it
when the cross-shard sums follow the tree (`reduce_order="tree"`: each shard adds its two replicas,
then the `ReduceScatter` adds the shards' partial sums, as one process's tree adds four devices);
gloo's ring reduce-scatter adds in another order, within float rounding. The MLP's params (48, 8, 24
and 3 elements) cut unevenly over 4 replicas, the last one leaving a replica nothing. The checkpoint
the sharded shards write is byte-identical to the 1 x 4 unsharded run's, and the shards resume from
it exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.multihost import workers
from tests.multihost.helpers import assert_identical, load, run_processes

STEPS = 3


@pytest.mark.slow
def test_two_shards_of_two_devices_sharded_train_as_one_of_four_unsharded(tmp_path: Path) -> None:
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref_runs = [{"kind": "mlp", "steps": STEPS, "save_to": str(ref_dir / "ckpt.safetensors")},
                {"kind": "mlp", "steps": STEPS + 2}]
    shard_runs = [{"kind": "mlp", "steps": STEPS, "reduce_order": "tree", "shard_optimizer_state": True,
                   "save_to": str(tmp_path / "ckpt.safetensors")},
                  {"kind": "mlp", "steps": STEPS, "reduce_order": "tree", "shard_gradients": True},
                  {"kind": "mlp", "steps": STEPS, "reduce_order": "ring", "shard_gradients": True},
                  {"kind": "mlp", "steps": STEPS + 2, "reduce_order": "tree", "shard_gradients": True,
                   "resume_from": str(tmp_path / "ckpt.safetensors")}]
    codes = run_processes(workers.train_all, [(str(ref_dir / "ref"), ref_runs)] + [
        (str(tmp_path / f"shard{r}"), shard_runs) for r in range(2)],
        [dict(shard=0, num_shards=1, devices=[0, 1, 2, 3], store=str(ref_dir))] + [
            dict(shard=r, num_shards=2, devices=[0, 1], store=str(tmp_path), seed=r) for r in range(2)])
    assert codes == [0, 0, 0]
    errors = sorted(tmp_path.rglob("*.error"))
    assert not errors, errors[0].read_text()
    ref, longer = load(ref_dir / "ref_0.npz"), load(ref_dir / "ref_1.npz")
    for r in range(2):
        assert_identical(load(tmp_path / f"shard{r}_0.npz"), ref)
        assert_identical(load(tmp_path / f"shard{r}_1.npz"), ref)
        ring = load(tmp_path / f"shard{r}_2.npz")
        for key, value in ring.items():  # gloo's ring adds the two shards' sums in its own order
            np.testing.assert_allclose(value, ref[key], rtol=1e-6, atol=1e-7, err_msg=key)
        resumed = load(tmp_path / f"shard{r}_3.npz")
        assert {k.split("/")[0] for k in resumed} == {"init", str(STEPS), str(STEPS + 1)}
        assert_identical({k: v for k, v in resumed.items() if not k.startswith("init")}, longer)
    assert (tmp_path / "ckpt.safetensors").read_bytes() == (ref_dir / "ckpt.safetensors").read_bytes()
