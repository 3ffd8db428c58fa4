"""Collectives: the reference all-reduce and broadcast, their schemas, and real NCCL on >= 2 GPUs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphpar.core.ir import CPU, CUDA, DeviceOption, OperatorDef
from graphpar.core.schema import NOT_DIFFERENTIABLE, check_operator, get_schema
from graphpar.ops.collective import TORCH_NCCL, current_nccl, nccl_backend
from tests.fake_nccl import FakeNccl
from tests.ops.helpers import make_op, randn, run_kernel, run_op

DTYPES = st.sampled_from([torch.float32, torch.float64])
SHAPES = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)


@pytest.mark.parametrize("op_type", ["NCCLAllreduce", "NCCLBroadcast"])
def test_not_differentiable(op_type: str) -> None:
    assert get_schema(op_type).gradient is NOT_DIFFERENTIABLE


@given(n=st.integers(1, 5), shape=SHAPES, dtype=DTYPES, seed=st.integers(0, 2**16))
def test_allreduce_reference(n: int, shape: tuple, dtype: torch.dtype, seed: int) -> None:
    xs = [randn(shape, dtype, seed + i) for i in range(n)]
    originals = [x.clone() for x in xs]
    outs = run_kernel("NCCLAllreduce", xs, n_outputs=n)
    want = xs[0]
    for x in xs[1:]:
        want = want + x
    assert len(outs) == n
    for out in outs:
        assert out.dtype == dtype and torch.equal(out, want)
    assert len({id(o) for o in outs}) == n  # one buffer per device
    assert all(torch.equal(x, o) for x, o in zip(xs, originals))


@given(n=st.integers(1, 5), shape=SHAPES, dtype=DTYPES, seed=st.integers(0, 2**16), data=st.data())
def test_broadcast_reference(n: int, shape: tuple, dtype: torch.dtype, seed: int, data: st.DataObject) -> None:
    root = data.draw(st.integers(0, n - 1))
    xs = [randn(shape, dtype, seed + i) for i in range(n)]
    outs = run_kernel("NCCLBroadcast", xs, n_outputs=n, root=root)
    assert len(outs) == n and all(torch.equal(o, xs[root]) and o.dtype == dtype for o in outs)
    assert torch.equal(xs[0], randn(shape, dtype, seed))


def test_in_place_rules() -> None:
    check_operator(OperatorDef("NCCLAllreduce", ["a", "b"], ["a", "b"]))
    check_operator(OperatorDef("NCCLAllreduce", ["a", "b"], ["a2", "b2"]))
    with pytest.raises(ValueError, match="in place"):
        check_operator(OperatorDef("NCCLAllreduce", ["a", "b"], ["b", "a"]))
    check_operator(OperatorDef("NCCLBroadcast", ["a", "b"], ["a", "b"], {"root": 1}))
    with pytest.raises(ValueError, match="in place"):
        check_operator(OperatorDef("NCCLBroadcast", ["a", "b"], ["a", "c"]))


def test_errors() -> None:
    with pytest.raises(ValueError, match="one output per input"):
        run_op(OperatorDef("NCCLAllreduce", ["a", "b"], ["a"]), [randn((2,)), randn((2,))])
    with pytest.raises(ValueError, match="copy 1 is"):
        run_kernel("NCCLAllreduce", [randn((2,)), randn((3,))], n_outputs=2)
    with pytest.raises(ValueError, match="root 2"):
        run_kernel("NCCLBroadcast", [randn((2,)), randn((2,))], n_outputs=2, root=2)


def test_outputs_follow_the_input_devices() -> None:
    xs = [randn((3,)).to("meta"), randn((3,))]
    a, b = run_kernel("NCCLBroadcast", xs, n_outputs=2, root=1)
    assert a.device.type == "meta" and b.device.type == "cpu"


def test_device_inference() -> None:
    infer = get_schema("NCCLAllreduce").device_inference
    gpu0 = DeviceOption(CUDA, 0)
    placed = OperatorDef("NCCLAllreduce", ["a/g", "b/g"], ["a/g", "b/g"], {"input_device_ids": [2, 5]})
    assert infer(placed, gpu0) == ([DeviceOption(CUDA, 2), DeviceOption(CUDA, 5)],) * 2
    plain = make_op("NCCLBroadcast", 3)  # no ids: Caffe2's rule, input i on device i
    assert get_schema("NCCLBroadcast").device_inference(plain, gpu0)[0] == [DeviceOption(CUDA, i) for i in range(3)]
    names = OperatorDef("NCCLAllreduce", ["gpu_2/g", "gpu_5/g"], ["gpu_2/g", "gpu_5/g"])  # names place nothing
    assert infer(names, gpu0)[0] == [DeviceOption(CUDA, 0), DeviceOption(CUDA, 1)]
    cpu = infer(OperatorDef("NCCLAllreduce", ["x", "y"], ["x", "y"], {"input_device_ids": [0, 1]}), DeviceOption())
    assert cpu[0] == [DeviceOption(CPU, 0), DeviceOption(CPU, 1)]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_real_nccl_matches_the_reference() -> None:
    n = torch.cuda.device_count()
    cpu = [randn((64, 33), torch.float32, i) for i in range(n)]
    gpu = [x.to(f"cuda:{i}") for i, x in enumerate(cpu)]
    want = run_kernel("NCCLAllreduce", cpu, n_outputs=n)
    got = run_kernel("NCCLAllreduce", gpu, n_outputs=n)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.device == torch.device("cuda", i)
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(x.cpu(), c) for x, c in zip(gpu, cpu))
    got = run_kernel("NCCLBroadcast", gpu, n_outputs=n, root=1)
    assert all(torch.equal(g.cpu(), cpu[1]) and g.device == torch.device("cuda", i) for i, g in enumerate(got))


def test_nccl_broadcast_enforces_in_place_for_any_device_count():
    from graphpar.core.ir import OperatorDef
    from graphpar.core.schema import check_operator

    names = [f"gpu_{i}/w" for i in range(2000)]
    check_operator(OperatorDef("NCCLBroadcast", names, list(names)))
    with pytest.raises(ValueError, match="in place"):
        check_operator(OperatorDef("NCCLBroadcast", names, [*names[:-1], "other"]))


def test_the_nccl_branch_runs_through_the_injected_backend() -> None:
    """With a backend that accepts the inputs, the kernels call it (on clones) instead of the reference."""
    xs = [randn((4, 3), torch.float64, i) for i in range(3)]
    originals = [x.clone() for x in xs]
    fake = FakeNccl()
    with nccl_backend(fake):
        assert current_nccl() is fake
        summed = run_kernel("NCCLAllreduce", xs, n_outputs=3)
        broadcast = run_kernel("NCCLBroadcast", xs, n_outputs=3, root=2)
    assert current_nccl() is TORCH_NCCL
    assert fake.calls == {"all_reduce": 1, "broadcast": 1}
    want = xs[0] + xs[1] + xs[2]
    for out, b in zip(summed, broadcast):
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
        assert torch.equal(b, xs[2])
    assert all(torch.equal(x, o) for x, o in zip(xs, originals))  # inputs untouched: NCCL ran on clones
