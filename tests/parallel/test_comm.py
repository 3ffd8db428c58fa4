"""graphpar.comm and one process per GPU: the local-rank -> GPU mapping (with a GPU-count stand-in), the
default backend and engine, and the main job's devices per process (Detectron2's comm / launch tests)."""

from __future__ import annotations

import datetime

import pytest
import torch

from graphpar import comm, devices, distributed, launch
from graphpar.examples import train


@pytest.mark.parametrize("gpus, processes, per, expected", [
    (2, 2, None, [[0], [1]]),            # --num-processes K on a K-GPU machine: one GPU each
    (4, 2, None, [[0, 1], [2, 3]]),
    (8, 4, 2, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (5, 2, None, [[0, 1], [2, 3]]),      # G // K each; GPU 4 unused
    (4, 1, 3, [[0, 1, 2]]),
])
def test_process_r_of_k_owns_gpus_r_times_d_onwards(gpus, processes, per, expected) -> None:
    got = [comm.local_devices(per, r, processes, gpus) for r in range(processes)]
    assert got == expected
    owned = [g for ids in got for g in ids]
    assert len(owned) == len(set(owned)) and max(owned) < gpus  # no GPU twice


def test_overlapping_or_missing_gpus_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"2 processes x 2 GPUs need 4 GPUs but 3 are visible, so processes would "
                                         r"share GPUs \(process 1 would own GPUs \[2, 3\]\); use at most 1"):
        comm.local_devices(2, 0, 2, 3)
    with pytest.raises(ValueError, match="4 processes on this machine but 2 GPU"):
        comm.local_devices(None, 0, 4, 2)
    with pytest.raises(ValueError, match="local_rank 2 must be < local_size 2"):
        comm.local_devices(1, 2, 2, 4)
    with pytest.raises(ValueError, match="num_devices must be an int >= 1"):
        comm.local_devices(0, 0, 1, 4)


def test_the_mapping_reads_the_launcher_environment_and_the_visible_gpus(monkeypatch) -> None:
    monkeypatch.setattr(devices, "num_cuda_devices", lambda: 4)  # a 4-GPU machine, stood in on the CPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    owned = []
    for rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        owned.append(comm.local_devices())
    assert owned == [[0], [1], [2], [3]]
    assert comm.get_local_size() == 4


def test_the_main_job_gives_each_process_its_own_gpus(monkeypatch) -> None:
    monkeypatch.setattr(devices, "num_cuda_devices", lambda: 2)
    monkeypatch.setattr(train, "num_cuda_devices", lambda: 2)
    args = train.parse_args(["--num-processes", "2"])
    assert args.devices == 1 and not args.cpu
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for rank in range(2):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert train.process_devices(args) == [rank]
    assert train.parse_args(["--devices", "2"]).devices == 2  # one process: both GPUs
    cpu = train.parse_args(["--num-processes", "2", "--cpu"])
    assert cpu.devices == 4 and train.process_devices(cpu) == [0, 1, 2, 3]  # CPU devices are per process


def test_the_main_job_refuses_processes_that_would_share_a_gpu(monkeypatch, capsys) -> None:
    monkeypatch.setattr(devices, "num_cuda_devices", lambda: 2)
    monkeypatch.setattr(train, "num_cuda_devices", lambda: 2)
    with pytest.raises(SystemExit):
        train.parse_args(["--num-processes", "2", "--devices", "2"])
    assert "processes would share GPUs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--num-processes", "3"])
    assert "3 processes on this machine but 2 GPU(s) visible" in capsys.readouterr().err


def test_nccl_is_the_default_only_when_every_device_is_a_real_gpu(monkeypatch) -> None:
    assert distributed.default_engine(False) == "GLOO"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert distributed.default_engine(True) == "NCCL" and distributed.default_engine(False) == "GLOO"
    with devices.cuda_on_cpu():
        assert distributed.default_engine(True) == "GLOO"
    rdv = {"shard_id": 0, "num_shards": 2, "kv_handler": "store"}
    assert distributed.parse_rendezvous(rdv, default_engine="NCCL").engine == "NCCL"
    assert distributed.parse_rendezvous({**rdv, "engine": "GLOO"}, default_engine="NCCL").engine == "GLOO"
    assert launch.default_backend(2) == "nccl" and launch.default_backend(3) == "gloo"
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert distributed.default_engine(True) == "GLOO" and launch.default_backend(1) == "gloo"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert "engine" not in launch.rendezvous() and launch.rendezvous("GLOO")["engine"] == "GLOO"


def test_a_failed_init_names_the_backend_init_method_and_url(monkeypatch, caplog) -> None:
    port = launch.free_port()  # nobody listens there
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    caplog.set_level("INFO", logger=launch.__name__)  # graphpar.parallel.launch
    with pytest.raises(RuntimeError, match=rf"process 1 of 2: init_process_group\('gloo'\) failed with init method "
                                           rf"env:// at tcp://127.0.0.1:{port}"):
        launch.init_process_group("gloo", datetime.timedelta(seconds=1))
    assert f"init method env:// at tcp://127.0.0.1:{port}" in caplog.text
    assert not torch.distributed.is_initialized()


def test_comm_on_one_process_needs_no_group() -> None:
    assert comm.all_gather({"a": 1}) == [{"a": 1}] and comm.gather(3) == [3]
    assert comm.reduce_dict({"loss": 2.0}) == {"loss": 2.0}
    comm.synchronize()
    with pytest.raises(RuntimeError, match="default group is not initialised"):
        comm.create_local_process_group(1)
    with pytest.raises(RuntimeError, match="call create_local_process_group"):
        comm.get_local_process_group()
