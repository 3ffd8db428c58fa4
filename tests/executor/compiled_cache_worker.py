"""Run by test_compiled.py in a fresh process: compile a tiny MLP's step with inductor and print the
first run's seconds and inductor's FX-graph cache hits and misses (one JSON line)."""

from __future__ import annotations

import json
import time

import numpy as np
from torch._dynamo.utils import counters

from graphpar import brew, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.model_helper import ModelHelper


def forward(model: ModelHelper, loss_scale: float) -> list:
    h = brew.relu(model, brew.fc(model, "data", "fc1", dim_in=6, dim_out=8), "h")
    _, loss = model.net.SoftmaxWithLoss([brew.fc(model, h, "pred", dim_in=8, dim_out=3), "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def main() -> None:
    model = ModelHelper(name="cached")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                    devices=[0], cpu_device=True, compile=True)
    workspace.FeedBlob("cpu_0/data", np.ones((4, 6), np.float32))
    workspace.FeedBlob("cpu_0/label", np.zeros(4, np.int32))
    dpm.RunInitNet(model)
    began = time.perf_counter()
    dpm.RunNet(model, 1)
    inductor = counters["inductor"]
    print(json.dumps({"seconds": time.perf_counter() - began, "hits": inductor["fxgraph_cache_hit"],
                      "misses": inductor["fxgraph_cache_miss"]}))


if __name__ == "__main__":
    main()
