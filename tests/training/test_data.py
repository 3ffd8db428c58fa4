"""graphpar.data: splitting a batch over devices, feeding every replica, and minibatch indices."""

from __future__ import annotations

import numpy as np
import pytest

from graphpar import data_parallel_model as dpm
from graphpar import model_helper, workspace
from graphpar.data import feed_batch, minibatches, split_batch


def test_split_batch_gives_contiguous_views_in_order() -> None:
    x = np.arange(12).reshape(6, 2)
    parts = split_batch(x, 3)
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    assert all(np.shares_memory(p, x) for p in parts)  # views: FeedBlob makes the copies
    assert [p.tolist() for p in split_batch(x, 1)] == [x.tolist()]
    assert [len(p) for p in split_batch(np.zeros((0, 2)), 2)] == [0, 0]


@pytest.mark.parametrize("array, parts, message", [
    (np.zeros(5), 2, "batch of 5 cannot be split evenly over 2 devices"),
    (np.zeros(4), 0, "parts must be a positive int"),
    (np.zeros(4), -2, "parts must be a positive int"),
    (np.zeros(4), 2.0, "parts must be a positive int"),
    (np.float32(1.0), 1, "cannot split a scalar"),
])
def test_split_batch_rejects_what_does_not_split(array, parts, message) -> None:
    with pytest.raises(ValueError, match=message):
        split_batch(array, parts)


def _parallelized(devices: list[int]) -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name="data_feed", init_params=False)
    dpm.Parallelize(model, input_builder_fun=lambda m: None,
                    forward_pass_builder_fun=lambda m, scale: [m.net.Relu("data", "out")],
                    devices=devices, cpu_device=True)
    return model


def test_feed_batch_gives_device_i_the_ith_chunk() -> None:
    model = _parallelized([0, 2, 5])  # positions, not ids, pick the chunk
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.array([0, 1, 2, 0, 1, 2], dtype=np.int32)
    feed_batch(model, {"data": x, "label": y})
    for position, device in enumerate([0, 2, 5]):
        np.testing.assert_array_equal(workspace.FetchBlob(f"cpu_{device}/data"), x[2 * position:2 * position + 2])
        np.testing.assert_array_equal(workspace.FetchBlob(f"cpu_{device}/label"), y[2 * position:2 * position + 2])
    assert workspace.FetchBlob("cpu_2/label").dtype == np.int32
    x[0, 0] = 100.0  # the workspace holds copies
    assert workspace.FetchBlob("cpu_0/data")[0, 0] == 0.0


def test_feed_batch_feeds_nothing_when_the_batch_does_not_split() -> None:
    model = _parallelized([0, 1])
    with pytest.raises(ValueError, match="batch of 3 cannot be split evenly over 2 devices.*uneven_batches=True"):
        feed_batch(model, {"data": np.ones((3, 2), dtype=np.float32), "label": np.zeros(3, dtype=np.int32)})
    with pytest.raises(ValueError, match=r"same batch size \(axis 0\), got \{\"batch\['data'\]\": 4, \"batch\['label'\]\": 3\}"):
        feed_batch(model, {"data": np.ones((4, 2), dtype=np.float32), "label": np.zeros(3, dtype=np.int32)})
    with pytest.raises(ValueError, match="has no rows.*bias the gradient.*drop_last=True"):
        feed_batch(model, {"data": np.ones((0, 2), dtype=np.float32)})
    assert workspace.Blobs() == []


def test_feed_batch_needs_a_parallelized_model() -> None:
    with pytest.raises(RuntimeError, match="Parallelize"):
        feed_batch(model_helper.ModelHelper(name="plain"), {"data": np.ones((2, 2), dtype=np.float32)})
    assert workspace.Blobs() == []


def test_minibatches_in_order_and_dropping_the_last_partial_batch() -> None:
    assert [b.tolist() for b in minibatches(7, 3)] == [[0, 1, 2], [3, 4, 5]]
    assert [b.tolist() for b in minibatches(7, 3, drop_last=False)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [b.tolist() for b in minibatches(6, 3, drop_last=False)] == [[0, 1, 2], [3, 4, 5]]
    assert list(minibatches(2, 3)) == [] and list(minibatches(0, 3, drop_last=False)) == []


def test_minibatches_shuffle_is_a_seeded_permutation() -> None:
    first = np.concatenate(list(minibatches(10, 5, np.random.default_rng(3))))
    again = np.concatenate(list(minibatches(10, 5, np.random.default_rng(3))))
    assert sorted(first.tolist()) == list(range(10)) and first.tolist() != list(range(10))
    np.testing.assert_array_equal(first, again)


@pytest.mark.parametrize("n, batch_size", [(10, 0), (10, -1), (10, 2.5), (-1, 2)])
def test_minibatches_rejects_bad_sizes_at_the_call(n, batch_size) -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive int|sample count must be >= 0"):
        minibatches(n, batch_size)  # no next() needed


def test_training_sampler_shards_are_disjoint_seeded_epochs_in_every_order() -> None:
    from itertools import islice

    from graphpar.data import TrainingSampler

    size, world = 10, 3
    streams = [list(islice(iter(TrainingSampler(size, seed=4, rank=r, world=world)), 20)) for r in range(world)]
    merged = [streams[p % world][p // world] for p in range(60)]  # the global stream, position by position
    for epoch in range(6):
        assert sorted(merged[epoch * size:(epoch + 1) * size]) == list(range(size))
    assert merged[:size] != list(range(size))  # shuffled
    again = list(islice(iter(TrainingSampler(size, seed=4, rank=1, world=world)), 20))
    assert again == streams[1]
    assert list(islice(iter(TrainingSampler(4, shuffle=False, rank=0, world=2)), 4)) == [0, 2, 0, 2]


def test_inference_sampler_gives_contiguous_shards_with_the_remainder_first() -> None:
    from graphpar.data import InferenceSampler

    shards = [list(InferenceSampler(10, rank=r, world=4)) for r in range(4)]
    assert shards == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [len(InferenceSampler(2, rank=r, world=4)) for r in range(4)] == [1, 1, 0, 0]
    assert list(InferenceSampler(5)) == [0, 1, 2, 3, 4]  # one process: everything
    with pytest.raises(ValueError, match="0 <= rank < world"):
        InferenceSampler(5, rank=2, world=2)


def test_a_bare_tuple_batch_is_refused_with_the_dict_form():
    """A TensorDataset's (x, y) names no blob: refused before anything is fed, the message shows the dict."""
    import re

    from graphpar import optimizer
    from graphpar.data import feed
    from graphpar.examples.train import add_cnn

    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="tuple_batch")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=add_cnn,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=[0, 1], cpu_device=True)
    x, y = np.zeros((4, 1, 8, 8), np.float32), np.zeros(4, np.int32)
    for batch in [(x, y), [x, y]]:
        with pytest.raises(ValueError, match=re.escape("(the model reads 'data', 'label'): feed(model, "
                                                       "{'data': batch[0], 'label': batch[1]})")):
            feed(model, batch)
    assert not workspace.HasBlob("cpu_0/0") and not workspace.HasBlob("cpu_0/data")
    feed(model, {"data": x, "label": y})  # the dict form works
    assert workspace.FetchBlob("cpu_1/label").shape == (2,)


def test_pad_to_devices_copies_the_last_row_of_every_array_until_each_device_has_one():
    import torch

    from graphpar.data import DataContainer, pad_to_devices

    batch = {"x": np.arange(6).reshape(2, 3), "t": torch.tensor([1.0, 2.0]), "meta": "m",
             "dc": DataContainer(np.array([5, 6]), stack=True), "pair": (np.array([7, 8]), 3)}
    padded, rows = pad_to_devices(batch, 4)
    assert rows == 2 and padded["meta"] == "m" and padded["pair"][1] == 3
    np.testing.assert_array_equal(padded["x"], [[0, 1, 2], [3, 4, 5], [3, 4, 5], [3, 4, 5]])
    assert padded["t"].tolist() == [1.0, 2.0, 2.0, 2.0]
    assert padded["dc"].data.tolist() == [5, 6, 6, 6] and padded["dc"].stack
    assert padded["pair"][0].tolist() == [7, 8, 8, 8]
    assert batch["x"].shape == (2, 3)  # the batch itself is left as it was
    assert pad_to_devices(batch, 2) == (batch, None)  # enough rows already
