"""The round-2 optimizers under Parallelize on 2 logical GPUs placed on the CPU (the iteration counter
on the host, the updates on each device): N devices train exactly like one device on the concatenated
batch, dense and sparse."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from graphpar import brew, data_parallel_model, optimizer, workspace
from graphpar.devices import cuda_on_cpu
from graphpar.model_helper import ModelHelper

RNG = np.random.default_rng(3)
DATA = RNG.standard_normal((8, 4)).astype(np.float32)
TARGET = RNG.standard_normal((8, 3)).astype(np.float32)
INDICES = np.array([0, 4, 4, 1, 2, 5, 0, 3], np.int32)
W0 = {"fc_w": RNG.standard_normal((3, 4)).astype(np.float32), "fc_b": RNG.standard_normal(3).astype(np.float32),
      "emb": RNG.standard_normal((6, 3)).astype(np.float32)}


def _forward(sparse: bool) -> Callable[[ModelHelper, float], list]:
    def forward(model: ModelHelper, scale: float) -> list:
        if sparse:
            emb = model.param_init_net.ConstantFill([], "emb", shape=[6, 3], value=0.0)
            model.params.append(emb)
            out = model.net.Gather([emb, "indices"], "rows")
        else:
            out = brew.fc(model, "data", "fc", 4, 3)
        loss = model.net.AveragedLoss(model.net.SquaredL2Distance([out, "target"], "dist"), "loss")
        return [model.net.Scale(loss, "scaled_loss", scale=scale)]

    return forward


def _train(devices: list[int], build: Callable, sparse: bool, steps: int = 3) -> dict[str, np.ndarray]:
    workspace.ResetWorkspace()
    model = ModelHelper("equivalence")
    data_parallel_model.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_forward(sparse),
                                    optimizer_builder_fun=build, devices=devices)
    rows = len(DATA) // len(devices)
    for k, d in enumerate(devices):
        part = slice(k * rows, (k + 1) * rows)
        feeds = {"target": TARGET[part], **({"indices": INDICES[part]} if sparse else {"data": DATA[part]})}
        for name, value in feeds.items():
            workspace.FeedBlob(f"gpu_{d}/{name}", value)
    data_parallel_model.RunInitNet(model)
    for d in devices:
        for name in ("emb",) if sparse else ("fc_w", "fc_b"):
            workspace.FeedBlob(f"gpu_{d}/{name}", W0[name])
    data_parallel_model.RunNet(model, steps)
    return {p: workspace.FetchBlob(f"gpu_0/{p}") for p in (("emb",) if sparse else ("fc_w", "fc_b"))}


CASES = {
    "storm": (lambda m: optimizer.build_storm(m, 0.5, momentum=3.0, beta=0.5), (False, True)),
    "decay_adagrad": (lambda m: optimizer.build_decay_adagrad(m, 0.2, beta1=0.5), (False, True)),
    "gftrl": (lambda m: optimizer.build_gftrl(m, alpha=0.5, beta=0.1, lambda1=0.01, lambda2=0.01), (False,)),
    "yellowfin": (lambda m: optimizer.build_yellowfin(m, 0.1, beta=0.9, curv_win_width=2), (False,)),
    "adam_smart_decay": (lambda m: optimizer.build_adam(m, 0.1, use_smart_decay=True), (False, True)),
    "adagrad_counter_halflife": (lambda m: optimizer.build_adagrad(m, 0.3, counter_halflife=2), (False, True)),
}


@pytest.mark.parametrize("name, sparse", [(n, s) for n, (_, modes) in CASES.items() for s in modes])
def test_two_logical_gpus_equal_one_on_the_concatenated_batch(name: str, sparse: bool) -> None:
    build = CASES[name][0]
    with cuda_on_cpu():
        two = _train([0, 1], build, sparse)
        one = _train([0], build, sparse)
    for param, value in one.items():
        assert not np.array_equal(value, W0[param]), param  # it trained
        np.testing.assert_allclose(two[param], value, rtol=2e-5, atol=1e-6, err_msg=param)
