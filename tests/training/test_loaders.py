"""graphpar.loaders, in the style of Detectron2's data tests: datasets of dicts, retrying mapper, samplers
sharded over processes and workers, aspect-ratio grouping, and the per-device batch of SOLVER.IMS_PER_BATCH."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch.utils.data as torchdata

from graphpar import loaders
from graphpar.loaders import (
    AspectRatioGroupedDataset,
    DatasetFromList,
    InferenceSampler,
    MapDataset,
    ToIterableDataset,
    TrainingSampler,
    build_test_loader,
    build_train_loader,
    single_device_batch_size,
)


@pytest.mark.parametrize("serialize", [True, False])
def test_dataset_from_list_gives_deep_copies_a_mapper_may_edit(serialize) -> None:
    items = [{"a": 1, "annotations": [{"box": [0, 0, 2, 2]}]}, {"a": 2, "annotations": []}]
    dataset = DatasetFromList(items, serialize=serialize)
    first = dataset[0]
    first["a"] = 10
    first["annotations"][0]["box"][0] = 5  # a mapper editing a nested field in place (Detectron2's do)
    first["annotations"].append({"box": [1, 1, 1, 1]})
    assert items[0] == {"a": 1, "annotations": [{"box": [0, 0, 2, 2]}]} == dataset[0] and len(dataset) == 2
    assert dataset[-1] == items[-1] and dataset[1] is not items[1]
    assert DatasetFromList(items, copy=False, serialize=False)[1] is items[1]
    assert DatasetFromList(items, copy=False)[1] is not items[1]  # serialized: a fresh object each time
    with pytest.raises(IndexError):
        dataset[2]
    with pytest.raises(TypeError, match="item 1 cannot be pickled .*serialize=False"):
        DatasetFromList([{"f": 1}, {"f": lambda: 0}])


def test_map_dataset_replaces_a_failed_sample_and_gives_up_after_max_retries(caplog) -> None:
    dataset = MapDataset(DatasetFromList(list(range(10))), lambda x: None if x % 2 else x * 10)
    assert dataset[4] == 40
    got = [dataset[1] for _ in range(20)]  # an odd index fails: another (even) sample replaces it
    assert all(v % 20 == 0 and v < 100 for v in got) and len(set(got)) > 1
    never = MapDataset(DatasetFromList(list(range(4))), lambda x: None, max_retries=7)
    with pytest.raises(RuntimeError, match=r"every sample of the dataset mapped to None \(4 tried in a row"):
        never[0]  # all 4 failed before max_retries (the message said 7)
    assert "samples in a row failed to map" in caplog.text
    failing = MapDataset(DatasetFromList(list(range(40))), lambda x: None, max_retries=5)
    with pytest.raises(RuntimeError, match=r"5 samples in a row mapped to None \(starting at index 3; max_retries=5"):
        failing[3]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_map_dataset_and_aspect_ratio_grouping_refuse_bad_counts(bad) -> None:
    """Issue 32 item 13: MapDataset(max_retries=0) raised on every sample with a false message ("0
    samples in a row mapped to None"); AspectRatioGroupedDataset(batch_size=0) yielded no batch (an
    endless loop over an endless sampler)."""
    with pytest.raises(ValueError, match="max_retries must be an int >= 1"):
        MapDataset(DatasetFromList([1, 2]), lambda x: x, max_retries=bad)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        AspectRatioGroupedDataset([{"width": 1, "height": 2}], bad)


def test_training_sampler_shards_one_seeded_order_over_the_processes() -> None:
    whole = list(itertools.islice(TrainingSampler(10, seed=3, rank=0, world=1), 30))
    assert sorted(whole[:10]) == list(range(10)) and sorted(whole[10:20]) == list(range(10))
    assert whole[:10] != list(range(10))  # shuffled
    shards = [list(itertools.islice(TrainingSampler(10, seed=3, rank=r, world=3), 10)) for r in range(3)]
    assert [shards[k % 3][k // 3] for k in range(30)] == whole  # interleaved, they are the global order
    assert list(itertools.islice(TrainingSampler(4, shuffle=False, rank=0, world=1), 6)) == [0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize("size, world", [(10, 3), (2, 4), (8, 2)])
def test_inference_sampler_gives_each_process_a_contiguous_part(size, world) -> None:
    parts = [list(InferenceSampler(size, r, world)) for r in range(world)]
    assert [i for part in parts for i in part] == list(range(size))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_to_iterable_dataset_shards_the_sampler_over_workers() -> None:
    dataset = ToIterableDataset(DatasetFromList(list(range(12))), InferenceSampler(12, 0, 1))
    assert list(dataset) == list(range(12))
    loader = torchdata.DataLoader(dataset, batch_size=None, num_workers=2)
    assert sorted(loader) == list(range(12))  # each index once over both workers, not twice
    unsharded = torchdata.DataLoader(ToIterableDataset(DatasetFromList(list(range(4))), range(4), shard_sampler=False),
                                     batch_size=None, num_workers=2)
    assert sorted(unsharded) == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(TypeError, match="iterable already"):
        ToIterableDataset(dataset, range(3))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_batches_do_not_depend_on_the_number_of_workers() -> None:
    """shard_chunk_size: batch k is the sampler's k-th chunk with 0, 2 or 3 DataLoader workers."""
    def batches(workers: int, chunk: int) -> list[list[int]]:
        dataset = ToIterableDataset(DatasetFromList(list(range(24))), list(range(23, -1, -1)), shard_chunk_size=chunk)
        loader = torchdata.DataLoader(dataset, batch_size=4, num_workers=workers, collate_fn=list)
        return list(loader)

    expected = [list(range(23 - 4 * k, 19 - 4 * k, -1)) for k in range(6)]
    assert batches(0, 4) == batches(2, 4) == batches(3, 4) == expected
    assert batches(2, 1) != expected  # index by index, two workers interleave into other batches
    data = [{"image": np.full(2, k, np.float32), "label": k} for k in range(10)]
    loaders_ = [build_train_loader(data, None, total_batch_size=4, num_workers=w, seed=2,
                                   collate_fn=lambda s: [d["label"] for d in s]) for w in (0, 2)]
    assert [list(itertools.islice(loader, 5)) for loader in loaders_][0] == list(itertools.islice(loaders_[1], 5))


class _Stream(torchdata.IterableDataset):
    """An iterable dataset, as Detectron2 takes one: it yields its samples itself (no sampler)."""

    def __iter__(self):  # noqa: ANN204
        return iter([{"image": np.full(2, k, np.float32), "label": k} for k in range(7)])


def test_train_loader_takes_an_iterable_dataset_collate_fn_drop_last_and_a_per_device_batch() -> None:
    def mapper(d):  # noqa: ANN001, ANN202 - drops odd labels: an iterable dataset leaves them out
        return None if d["label"] % 2 else {"data": d["image"], "label": np.int32(d["label"])}

    loader = build_train_loader(_Stream(), mapper, single_gpu_batch_size=1, num_devices=2, drop_last=False)
    assert [b["label"].tolist() for b in loader] == [[0, 2], [4, 6]]
    labels = build_train_loader(_Stream(), None, total_batch_size=3, drop_last=False,
                                collate_fn=lambda samples: [d["label"] for d in samples])
    assert list(labels) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(build_train_loader(_Stream(), None, total_batch_size=3, collate_fn=len)) == [3, 3]  # drop_last
    per_device = next(iter(build_train_loader([{"x": k} for k in range(8)], None, single_gpu_batch_size=3,
                                              num_devices=2, collate_fn=len)))
    assert per_device == 6
    with pytest.raises(ValueError, match="iterable dataset yields its samples itself: pass sampler=None"):
        build_train_loader(_Stream(), None, total_batch_size=2, sampler=range(3))
    with pytest.raises(ValueError, match="exactly one"):
        build_train_loader(_Stream(), None, total_batch_size=2, single_gpu_batch_size=1)
    with pytest.raises(ValueError, match="exactly one"):
        build_train_loader(_Stream(), None)
    with pytest.raises(ValueError, match="needs drop_last=True"):
        build_train_loader(_Stream(), None, total_batch_size=2, aspect_ratio_grouping=True, drop_last=False)


def test_aspect_ratio_grouping_batches_one_orientation() -> None:
    samples = [{"width": w, "height": h, "id": k} for k, (w, h) in enumerate([(4, 2), (2, 4), (3, 1), (1, 3), (5, 1)])]
    batches = list(AspectRatioGroupedDataset(samples, 2))
    assert [[s["id"] for s in b] for b in batches] == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="'width' and 'height'"):
        list(AspectRatioGroupedDataset([{"id": 0}], 2))


def test_the_global_batch_is_split_over_every_device_of_every_process() -> None:
    assert single_device_batch_size(16, 2, world=4) == 2
    with pytest.raises(ValueError, match=r"IMS_PER_BATCH=12 must be a multiple of the 8 devices \(4 processes x 2"):
        single_device_batch_size(12, 2, world=4)


def test_train_loader_maps_collates_and_yields_this_process_share(monkeypatch) -> None:
    data = [{"image": np.full(3, k, np.float32), "label": k, "width": 2 if k % 2 else 1, "height": 1}
            for k in range(8)]

    def mapper(d):
        return {"data": d["image"] * 2, "label": np.int32(d["label"]), "width": d["width"], "height": d["height"]}

    monkeypatch.setenv("WORLD_SIZE", "2")  # two processes, this one rank 0
    monkeypatch.setenv("RANK", "0")
    loader = build_train_loader(data, mapper, total_batch_size=8, seed=1, num_devices=2)
    first = next(iter(loader))
    assert first["data"].shape == (4, 3) and first["label"].dtype == np.int32  # 8 over 2 processes
    order = list(itertools.islice(TrainingSampler(8, seed=1, rank=0, world=2), 4))
    np.testing.assert_array_equal(first["label"], order)
    np.testing.assert_array_equal(first["data"][:, 0], 2.0 * np.array(order))
    grouped = next(iter(build_train_loader(data, mapper, 8, seed=1, num_devices=2, aspect_ratio_grouping=True)))
    assert len(set(grouped["width"].tolist())) == 1 and len(grouped["label"]) == 4
    test = list(build_test_loader(data, mapper, batch_size=3))
    assert [b["label"].tolist() for b in test] == [[0, 1, 2], [3]]  # rank 0's half, in order


def test_dataset_catalog_registers_and_names_what_is_missing() -> None:
    catalog = loaders._Catalog()
    catalog.register("a", lambda: [{"x": 1}])
    assert catalog.get("a") == [{"x": 1}]
    with pytest.raises(ValueError, match="already registered"):
        catalog.register("a", list)
    with pytest.raises(KeyError, match=r"no dataset 'b'; registered: \['a'\]"):
        catalog.get("b")
