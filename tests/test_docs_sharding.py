"""docs/sharding.md's before/after listings are what Parallelize builds today, op for op.

The listings show a two-layer MLP on 2 CPU devices with momentum SGD: the optimizer state in
param_init_net and every op of the train net after the backward pass, without sharding
(`cpu_update_once=False`: each replica updates, as on GPUs) and with `shard_gradients=True`. Run this
file's `python -m tests.test_docs_sharding` to print them again after a change to the passes.
"""

from __future__ import annotations

import re
from pathlib import Path

from graphpar import brew, model_helper, optimizer
from graphpar import data_parallel_model as dpm
from graphpar.core.ir import OperatorDef
from graphpar.models.common import softmax_loss

DOC = Path(__file__).resolve().parents[1] / "docs" / "sharding.md"
SHOWN_ARGS = ("split", "starts", "ends", "shape")
LISTINGS = {"before": {"cpu_update_once": False}, "after": {"shard_gradients": True}}


def mlp(model: model_helper.ModelHelper, loss_scale: float) -> list:
    h = brew.relu(model, brew.fc(model, "data", "fc1", dim_in=4, dim_out=3), "fc1_relu")
    return softmax_loss(model, brew.fc(model, h, "pred", dim_in=3, dim_out=2), "label", loss_scale)


def _line(op: OperatorDef) -> str:
    args = ", ".join(f"{k}={op.args[k]}" for k in SHOWN_ARGS if k in op.args)
    return (f"{op.type}({', '.join(op.inputs)}) -> {', '.join(op.outputs)}" + (f"  [{args}]" if args else "")
            + f"  # cpu_{op.device_option.device_id}")


def listing(**options: object) -> str:
    """The optimizer state's ops in param_init_net and the train net's ops after the backward pass."""
    optimizer.reset_optimizer_instance_count()
    model = model_helper.ModelHelper(name="mlp")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=mlp,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                    devices=[0, 1], cpu_device=True, **options)
    ops = model.net.Proto().ops
    backward = max(i for i, op in enumerate(ops) if op.is_gradient_op)
    init = [op for op in model.param_init_net.Proto().ops if any("_momentum" in b for b in op.outputs)]
    return "\n".join(["# param_init_net: the optimizer state", *map(_line, init),
                      "# net: everything after the backward pass", *map(_line, ops[backward + 1:])])


def _documented(heading: str) -> str:
    section = DOC.read_text().split(f"### {heading}\n", 1)[1]
    return re.search(r"```text\n(.*?)\n```", section, re.S).group(1)


def test_the_documented_listings_are_what_parallelize_builds() -> None:
    for heading, options in (("Before", LISTINGS["before"]), ("After", LISTINGS["after"])):
        assert _documented(heading) == listing(**options), f"docs/sharding.md: regenerate the {heading} listing"


if __name__ == "__main__":
    for name, options in LISTINGS.items():
        print(f"--- {name}\n{listing(**options)}\n")
