"""The compiled step across processes: the collectives between shards (gloo) run eagerly between the
compiled regions, which compile every shard's share of the step (`executor.compiled`).

2 shards x 2 CPU devices compiled == 1 shard x 4 devices compiled (both "aot_eager", which runs the
same aten ops: bit for bit, as the uncompiled runs are, see test_training.py), and both equal the
uncompiled 1 x 4 run within float reassociation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.multihost import workers
from tests.multihost.helpers import assert_identical, load, run_processes

STEPS = 4
COMPILED = {"kind": "cnn", "compile": {"backend": "aot_eager"}, "combine_spatial_bn": True}


@pytest.mark.slow
def test_two_shards_of_two_devices_compiled_train_as_one_shard_of_four(tmp_path: Path) -> None:
    single = tmp_path / "single"
    single.mkdir()
    ref_runs = [{**COMPILED, "shard": 0, "num_shards": 1, "devices": [0, 1, 2, 3], "store": str(single),
                 "steps": STEPS}, {"kind": "cnn", "combine_spatial_bn": True, "shard": 0, "num_shards": 1,
                                   "devices": [0, 1, 2, 3], "store": str(single), "steps": STEPS}]
    codes = run_processes(workers.train_all, [(str(single / "ref"), ref_runs)] + [
        (str(tmp_path / f"shard{r}"), [COMPILED]) for r in range(2)],
        [{}] + [dict(shard=r, num_shards=2, devices=[0, 1], store=str(tmp_path), steps=STEPS, seed=r)
                for r in range(2)], limit=150)
    assert codes == [0, 0, 0]
    errors = [p.read_text() for p in tmp_path.rglob("*.error")]
    assert not errors, errors
    compiled, eager = load(single / "ref_0.npz"), load(single / "ref_1.npz")
    for r in range(2):
        got = load(tmp_path / f"shard{r}_0.npz")
        assert_identical(got, compiled)
        assert set(got) == {key for key in compiled if key.split("/")[1] in ("cpu_0", "cpu_1")}
    for key, value in eager.items():
        np.testing.assert_allclose(compiled[key], value, rtol=1e-4, atol=1e-6, err_msg=key)
