"""graphpar.data's nested scatter / feed / gather, DataContainer and collate.

References: torch.nn.parallel.scatter_gather's traversal (its Scatter / Gather made CPU chunk / cat),
numpy, and one device on the whole batch for uneven chunks with inter-device batch norm.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.nn.parallel import scatter_gather

from graphpar import brew, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.data import DataContainer, chunk_sizes, collate, feed, flatten, gather, scatter
from graphpar.model_helper import ModelHelper

Pair = namedtuple("Pair", "left right")


def _nested(n: int) -> dict:
    gen = torch.Generator().manual_seed(n)
    return {"img": torch.randn(n, 3, 2, generator=gen), "meta": ["a", 7, None],
            "boxes": (torch.arange(2 * n).reshape(n, 2), {"scale": torch.ones(n), "name": "x"}),
            "pair": Pair(torch.randn(n, generator=gen), 1.5), "flags": [torch.zeros(n, 1, dtype=torch.bool)]}


def _torch_scatter(batch, devices: int, split) -> list:
    """torch's own scatter traversal, its per-tensor Scatter replaced by a CPU split."""
    original = scatter_gather.Scatter.apply
    scatter_gather.Scatter.apply = staticmethod(lambda gpus, sizes, dim, t: split(t, len(gpus), dim))
    try:
        return scatter_gather.scatter(batch, list(range(devices)))
    finally:
        scatter_gather.Scatter.apply = original


def _assert_same(got, expected) -> None:
    assert type(got) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected)
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for k in expected:
            _assert_same(got[k], expected[k])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            _assert_same(g, e)
    else:
        assert got is expected  # non-tensor leaves are shared, not copied


@pytest.mark.parametrize("n, devices, split", [
    (8, 4, torch.chunk), (6, 3, torch.chunk), (5, 1, torch.chunk),
    (10, 4, torch.tensor_split), (7, 3, torch.tensor_split)])  # uneven: numpy's array_split rule
def test_scatter_matches_torch_scatter_on_nested_inputs(n, devices, split):
    batch = _nested(n)
    got = scatter(batch, devices)
    _assert_same(got, _torch_scatter(batch, devices, split))
    assert [len(c["img"]) for c in got] == chunk_sizes(n, devices)
    assert got[0]["img"].data_ptr() == batch["img"].data_ptr()  # views, not copies


def test_scatter_numpy_along_another_axis_and_explicit_sizes():
    x = np.arange(24).reshape(2, 12)
    parts = scatter({"x": x, "tag": "t"}, 3, dim=1, sizes=[2, 6, 4])
    np.testing.assert_array_equal(np.concatenate([p["x"] for p in parts], axis=1), x)
    assert [p["x"].shape[1] for p in parts] == [2, 6, 4] and all(p["tag"] == "t" for p in parts)


@pytest.mark.parametrize("call, message", [
    (lambda: chunk_sizes(3, 4), "cannot give each of 4 devices at least one row"),
    (lambda: chunk_sizes(8, 2, [3, 4]), r"chunk sizes \[3, 4\] must be 2 sizes >= 1 that add up to the batch of 8"),
    (lambda: chunk_sizes(8, 2, [0, 8]), "sizes >= 1"),
    (lambda: chunk_sizes(8, 0), "num_devices must be a positive int"),
    (lambda: scatter({"a": np.zeros(4), "b": np.zeros(3)}, 2), r"same batch size .*\['a'\]\": 4, \"batch\['b'\]\": 3"),
    (lambda: flatten({"a_b": 1, "a": {"b": 2}}), "both become blob 'a_b'"),
    (lambda: flatten({"a/b": 1}), "without '/'"),
])
def test_bad_splits_are_refused_with_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_scatter_takes_any_dict_keys_like_torch():
    batch = {1: torch.arange(4), (2, "x"): [torch.ones(4, 2)]}
    _assert_same(scatter(batch, 2), _torch_scatter(batch, 2, torch.chunk))


def test_flatten_names_nested_keys_and_indices():
    names = flatten({"img": 1, "meta": {"boxes": [2, 3]}, "pair": (4, {"s": 5})})
    assert names == {"img": 1, "meta_boxes_0": 2, "meta_boxes_1": 3, "pair_0": 4, "pair_1_s": 5}


# ---- feed and gather -------------------------------------------------------------------------------------


def _forward_only(devices, **options) -> ModelHelper:
    model = ModelHelper(name="feeding", init_params=False)
    dpm.Parallelize(model, input_builder_fun=lambda m: None,
                    forward_pass_builder_fun=lambda m, scale: [m.net.Relu("img", "out")],
                    devices=devices, cpu_device=True, **options)
    return model


def test_feed_writes_flattened_names_per_device_and_gather_concatenates_back():
    model = _forward_only([2, 5])
    batch = _nested(6)
    fed = feed(model, batch)
    assert fed.names == ["img", "boxes_0", "boxes_1_scale", "pair_0", "flags_0"] and fed.sizes == [3, 3]
    assert fed.host[1] == {"meta_0": "a", "meta_1": 7, "meta_2": None, "boxes_1_name": "x", "pair_1": 1.5}
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_5/boxes_0"), batch["boxes"][0][3:].numpy())
    dpm.RunInitNet(model)
    dpm.RunNet(model, 1)
    np.testing.assert_array_equal(gather(model, "out"), batch["img"].relu().numpy())
    both = gather(model, ["img", "flags_0"])
    np.testing.assert_array_equal(both["img"], batch["img"].numpy())
    assert both["flags_0"].dtype == np.bool_


def test_gather_stacks_scalars_like_data_parallel():
    model = _forward_only([0, 1])
    workspace.FeedBlob("cpu_0/loss", np.float32(1.5))
    workspace.FeedBlob("cpu_1/loss", np.float32(2.5))
    np.testing.assert_array_equal(gather(model, "loss"), [1.5, 2.5])  # torch's Gather unsqueezes scalars too


def test_feed_refuses_empty_uneven_and_inconsistent_batches_and_feeds_nothing():
    model = _forward_only([0, 1])
    x = np.ones((8, 2), dtype=np.float32)
    cases = [
        ({"img": x[:0]}, {}, "has no rows.*bias the gradient.*drop_last=True"),
        ({"img": x[:5]}, {}, r"batch of 5 cannot be split evenly over 2 devices.*multiple of 2.*uneven_batches=True"),
        ({"img": x}, {"sizes": [2, 6]}, r"rows per device \[2, 6\] differ; Parallelize\(..., uneven_batches=True\)"),
        ({"img": x, "label": np.zeros(7)}, {}, r"same batch size.*\['img'\]\": 8, \"batch\['label'\]\": 7"),
        ({"name": "only metadata"}, {}, "has no array to feed"),
    ]
    for batch, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            feed(model, batch, **kwargs)
    allowing = _forward_only([0, 1], uneven_batches=True)
    with pytest.raises(ValueError, match="a batch of 1 rows cannot give each of 2 devices at least one row"):
        feed(allowing, {"img": x[:1]})
    with pytest.raises(ValueError, match=r"gives a device no rows \(rows per device: \[4, 0\]\)"):
        feed(allowing, {"img": DataContainer([x[:4], x[:0]], stack=True)})  # a collated chunk left empty
    assert workspace.Blobs() == []


def test_a_failing_feed_restores_the_blobs_it_had_written():
    model = _forward_only([0, 1])
    workspace.FeedBlob("cpu_0/img", np.zeros((1, 2), dtype=np.float32))
    batch = {"img": np.ones((4, 2), dtype=np.float32), "mixed": np.array([1, "b", None, {}], dtype=object)}  # no numeric or text array
    with pytest.raises(TypeError):
        feed(model, batch)
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_0/img"), np.zeros((1, 2)))
    assert sorted(workspace.Blobs()) == ["cpu_0/img"]


# ---- uneven chunks: 2 + 6 with inter-device batch norm == one device on the 8-batch --------------------------


def _bn_net(model: ModelHelper, loss_scale: float) -> list:
    h = brew.conv(model, "data", "conv", dim_in=2, dim_out=3, kernel=3, pad=1)
    h = brew.spatial_bn(model, h, "bn", 3, epsilon=1e-3, is_test=False)
    h = brew.relu(model, h, "relu")
    pred = brew.fc(model, h, "pred", dim_in=3 * 4 * 4, dim_out=4)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def _train_bn(devices, sizes, **options) -> dict:
    workspace.ResetWorkspace()
    workspace.SetSeed(3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 2, 4, 4)).astype(np.float32) * 2 + 1
    y = rng.integers(0, 4, 8).astype(np.int32)
    model = ModelHelper(name=f"uneven_bn_{len(devices)}_{sizes}")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_bn_net,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                    devices=devices, cpu_device=True, **options)
    feed(model, {"data": x, "label": y}, sizes=sizes)
    dpm.RunInitNet(model)
    dpm.RunNet(model, 1)
    out = {"bn": gather(model, "bn")}
    if workspace.HasBlob(f"cpu_{devices[0]}/relu_grad"):  # memonger renames activation gradients
        out["relu_grad"] = gather(model, "relu_grad")
    for name in ("conv_w_grad", "bn_s_grad", "bn_b_grad", "pred_w_grad", "conv_w", "bn_rm", "bn_riv"):
        out[name] = workspace.FetchBlob(f"cpu_{devices[-1]}/{name}")
    feed(model, {"data": x[::-1].copy(), "label": y[::-1].copy()}, sizes=sizes)
    dpm.RunNet(model, 1)
    out["pred_w_after_two_steps"] = workspace.FetchBlob(f"cpu_{devices[0]}/pred_w")
    return out


@pytest.mark.parametrize("options", [{}, {"optimize_gradient_memory": True, "dynamic_memory_management": True,
                                      "blobs_to_keep": ["bn", "conv_w_grad", "bn_s_grad", "bn_b_grad", "pred_w_grad"]}, {"gradient_bucket_bytes": 256}])
def test_uneven_two_plus_six_with_combined_bn_equals_one_device_on_the_whole_batch(options):
    expected = _train_bn([0], None)
    got = _train_bn([0, 1], [2, 6], combine_spatial_bn=True, uneven_batches=True, **options)
    assert set(got) == set(expected) - ({"relu_grad"} if options.get("optimize_gradient_memory") else set())
    for name, value in got.items():  # forward, every gradient, params and running stats
        np.testing.assert_allclose(value, expected[name], rtol=2e-5, atol=2e-6, err_msg=name)


def test_equal_chunks_with_uneven_batches_allowed_are_bit_identical_to_the_default():
    default = _train_bn([0, 1], None, combine_spatial_bn=True)
    allowed = _train_bn([0, 1], None, combine_spatial_bn=True, uneven_batches=True)
    for name, value in default.items():
        np.testing.assert_array_equal(allowed[name], value, err_msg=name)


def test_uneven_chunks_without_bn_weight_each_loss_by_its_rows():
    expected = _train_bn([0], None)
    got = _train_bn([0, 1, 2], [1, 3, 4], uneven_batches=True)  # BN per device: compare the FC gradient only
    assert workspace.FetchBlob("cpu_0/_batch_weight") == np.float32(3 * 1 / 8)
    assert not np.allclose(got["pred_w_grad"], expected["pred_w_grad"])  # per-device BN differs ...
    combined = _train_bn([0, 1, 2], [1, 3, 4], uneven_batches=True, combine_spatial_bn=True)
    np.testing.assert_allclose(combined["pred_w_grad"], expected["pred_w_grad"], rtol=2e-5, atol=2e-6)


# ---- DataContainer and collate -------------------------------------------------------------------------------


def _samples() -> list[dict]:
    rng = np.random.default_rng(1)
    shapes = [(3, 4, 5), (3, 6, 2), (3, 2, 2), (3, 5, 7)]
    return [{"img": DataContainer(rng.random(s, dtype=np.float32), stack=True, padding_value=-1.0),
             "label": i, "meta": DataContainer({"id": i, "shape": s}, cpu_only=True),
             "boxes": DataContainer(np.full((i + 1, 4), i, dtype=np.float32))} for i, s in enumerate(shapes)]


def test_collate_pads_to_the_largest_sample_per_device_chunk_and_stacks():
    samples = _samples()
    batch = collate(samples, samples_per_device=2)
    img = batch["img"]
    assert isinstance(img, DataContainer) and img.stack and len(img.data) == 2
    assert img.data[0].shape == (2, 3, 6, 5) and img.data[1].shape == (2, 3, 5, 7)  # per chunk, not global
    for k, sample in enumerate(samples):
        chunk, row = img.data[k // 2][k % 2], sample["img"].data
        np.testing.assert_array_equal(chunk[:, :row.shape[1], :row.shape[2]], row)
        assert (chunk[:, row.shape[1]:, :] == -1.0).all() and (chunk[:, :, row.shape[2]:] == -1.0).all()
    np.testing.assert_array_equal(batch["label"], [0, 1, 2, 3])
    assert batch["meta"].data == [[{"id": 0, "shape": (3, 4, 5)}, {"id": 1, "shape": (3, 6, 2)}],
                                  [{"id": 2, "shape": (3, 2, 2)}, {"id": 3, "shape": (3, 5, 7)}]]
    assert [len(b) for b in batch["boxes"].data] == [2, 2] and batch["boxes"].data[1][1].shape == (4, 4)


def test_feed_of_a_collated_batch_feeds_stacked_fields_and_hands_back_cpu_only_ones():
    model = _forward_only([0, 1])
    batch = collate(_samples(), samples_per_device=2)
    fed = feed(model, batch)
    assert fed.names == ["img", "label"] and fed.sizes == [2, 2]
    assert workspace.FetchBlob("cpu_1/img").shape == (2, 3, 5, 7)  # chunks may differ in shape
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_1/label"), [2, 3])
    assert fed.host[1]["meta"] == [{"id": 2, "shape": (3, 2, 2)}, {"id": 3, "shape": (3, 5, 7)}]
    assert [b.shape for b in fed.host[0]["boxes"]] == [(1, 4), (2, 4)]  # unstacked: a list, not fed
    assert not workspace.HasBlob("cpu_0/meta") and not workspace.HasBlob("cpu_0/boxes")


def test_collate_of_tensors_and_errors():
    batch = collate([(torch.ones(2), DataContainer(torch.zeros(1, 3), stack=True, pad_dims=1)),
                     (torch.zeros(2), DataContainer(torch.ones(1, 5), stack=True, pad_dims=1))], samples_per_device=2)
    assert torch.equal(batch[0], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert torch.equal(batch[1].data[0], torch.tensor([[[0.0, 0, 0, 0, 0]], [[1.0, 1, 1, 1, 1]]]))
    with pytest.raises(ValueError, match="differ outside the last 1 padded axes"):
        collate([DataContainer(np.zeros((1, 3)), stack=True, pad_dims=1),
                 DataContainer(np.zeros((2, 3)), stack=True, pad_dims=1)], samples_per_device=2)
    with pytest.raises(ValueError, match="pad_dims must be None, 1, 2 or 3"):
        DataContainer(np.zeros(2), pad_dims=4)
    with pytest.raises(ValueError, match="no samples"):
        collate([])
    with pytest.raises(ValueError, match="collated DataContainer has 2 chunks for 3 devices"):
        scatter(collate(_samples(), 2), 3)


# ---- samplers and ArrayLoader ---------------------------------------------------------------------------------


def test_epoch_sampler_depends_only_on_seed_and_epoch():
    from graphpar.data import EpochSampler

    sampler = EpochSampler(10, seed=4)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    again = EpochSampler(10, seed=4)
    again.set_epoch(1)
    assert list(again) == second and list(EpochSampler(3, shuffle=False)) == [0, 1, 2]


def test_array_loader_batches_follow_the_sampler_and_drop_the_partial_batch():
    from graphpar.data import ArrayLoader

    x, y = np.arange(10) * 10, np.arange(10)
    loader = ArrayLoader({"x": x, "y": y}, 4, shuffle=False)
    assert len(loader) == 2 and [b["y"].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    tail = ArrayLoader({"x": x}, 4, shuffle=False, drop_last=False)
    assert len(tail) == 3 and [len(b["x"]) for b in tail] == [4, 4, 2]
    shuffled = ArrayLoader({"x": x, "y": y}, 5, seed=1)
    epoch0 = [b["y"].tolist() for b in shuffled]
    shuffled.set_epoch(1)
    assert epoch0 != [b["y"].tolist() for b in shuffled]
    assert all((b["x"] == b["y"] * 10).all() for b in shuffled)  # fields stay aligned
    with pytest.raises(ValueError, match="larger than the 10 samples"):
        ArrayLoader({"x": x}, 11)
    with pytest.raises(ValueError, match="arrays of one length"):
        ArrayLoader({"x": x, "y": y[:3]}, 2)
