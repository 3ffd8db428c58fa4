"""What sharded optimizer state refuses: Parallelize raises ParallelizeError naming the reason and the way
out, and leaves the model as it was (no op recorded, not parallelized)."""

from __future__ import annotations

from typing import Any

import pytest

from graphpar import brew, model_helper, optimizer
from graphpar import data_parallel_model as dpm
from graphpar.errors import ParallelizeError
from graphpar.model_helper import PseudoFP16Initializer
from tests.parallel.test_sharded_training import LR, mlp


def _embedding(model: Any, loss_scale: float) -> list:
    table = model.param_init_net.UniformFill([], "table", shape=[20, 4])
    model.params.append(table)
    rows = model.net.Gather([table, "indices"], "rows")
    pred = brew.fc(model, model.net.Flatten(rows, "flat"), "pred", dim_in=8, dim_out=3)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def _fp16_masters(model: Any, loss_scale: float) -> list:
    pred = brew.fc(model, "data", "pred", dim_in=6, dim_out=3, WeightInitializer=PseudoFP16Initializer,
                   BiasInitializer=PseudoFP16Initializer)
    _, loss = model.net.SoftmaxWithLoss([model.net.HalfToFloat(pred, "pred32"), "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


CASES = {
    "clipping_stage2": (mlp, lambda m: optimizer.build_sgd(m, LR, max_gradient_norm=1.0), {"shard_gradients": True},
                        r"SumSqrElements\(cpu_0/fc1_w_grad .*only each replica's part of the summed gradient"),
    "lars_stage2": (mlp, lambda m: optimizer.build_sgd(m, LR, lars=0.5), {"shard_gradients": True},
                    r"Lars\(cpu_0/fc1_w, cpu_0/fc1_w_grad.*shard_gradients=False"),
    "lars_after_weight_decay": (mlp, lambda m: optimizer.build_sgd(m, LR, weight_decay=0.1, lars=0.5),
                                {"shard_optimizer_state": True},
                                r"Lars.* reads the whole of 'cpu_0/fc1_w_grad', but an element-wise update before "
                                r"it wrote only each replica's part"),
    "ftrl": (mlp, lambda m: optimizer.build_ftrl(m, alpha=0.1), {"shard_optimizer_state": True},
             r"Ftrl\(.*writes 'cpu_0/fc1_w' whole.*does not work element by element"),
    "wngrad": (mlp, lambda m: optimizer.build_wngrad(m, 0.1), {"shard_optimizer_state": True},
               r"Wngrad\(.*writes 'cpu_0/fc1_w' whole"),
    "sparse": (_embedding, lambda m: optimizer.build_sgd(m, LR), {"shard_optimizer_state": True},
               r"does not support sparse \(GradientSlice\) gradients, and params \['table'\]"),
    "fp16_master_by_random_fill": (_fp16_masters, lambda m: optimizer.build_multi_precision_sgd(m, LR, momentum=0.9),
                                   {"shard_optimizer_state": True},
                                   r"FloatToHalf\(cpu_0/pred_w_fp32 -> cpu_0/pred_w\) .*writes 'cpu_0/pred_w' whole"),
    "shared_model": (mlp, lambda m: optimizer.build_sgd(m, LR), {"shard_optimizer_state": True, "shared_model": True},
                     "shard_optimizer_state is not supported with shared_model"),
    "buckets_stage2": (mlp, lambda m: optimizer.build_sgd(m, LR), {"shard_gradients": True, "bucket_cap_mb": 1},
                       "does not go with gradient buckets"),
    "allreduce_dtype_stage2": (mlp, lambda m: optimizer.build_sgd(m, LR),
                               {"shard_gradients": True, "allreduce_dtype": "bfloat16"},
                               "does not go with allreduce_dtype"),
    "loss_scale_stage2_across_shards": (mlp, lambda m: optimizer.build_sgd(m, LR),
                                        {"shard_gradients": True, "loss_scale": 128.0,
                                         "rendezvous": {"shard_id": 0, "num_shards": 2, "kv_handler": None}},
                                        "does not go with loss_scale across shards"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_before_the_model_changes(case):
    forward, opt, options, message = CASES[case]
    model = model_helper.ModelHelper(name=case)
    with pytest.raises(ParallelizeError, match=message):
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                        optimizer_builder_fun=opt, devices=[0, 1], cpu_device=True, **options)
    assert getattr(model, "_parallel", None) is None
    assert not model.net.Proto().ops and not model.param_init_net.Proto().ops and not model.params


def test_bmuf_refuses_sharded_state():
    model = model_helper.ModelHelper(name="bmuf")
    with pytest.raises(ParallelizeError, match="Parallelize_BMUF: shard_optimizer_state / shard_gradients are not"):
        dpm.Parallelize_BMUF(model, lambda m: None, mlp, lambda m: None, devices=[0, 1], cpu_device=True,
                             shard_optimizer_state=True)
    assert getattr(model, "_parallel", None) is None


def _momentum_update(state_fill: str = "ConstantFill", only_device: str | None = None, read_state: str = ""):
    """A per-replica update builder: momentum SGD with state made by `state_fill`."""
    from graphpar import brew
    from graphpar.core.scope import CurrentNameScope

    def build(model: Any) -> None:
        if only_device is not None and CurrentNameScope() != only_device:
            return
        lr = model.net.LearningRate([brew.iter(model, "iter")], "lr", base_lr=LR, policy="fixed")
        for param in model.GetParams():
            args = {"value": 0.0} if state_fill == "ConstantFill" else {}
            state = getattr(model.param_init_net, state_fill)([param], f"{param}_mom".split("/")[-1], **args)
            grad = model.param_to_grad[param]
            if read_state == "before":
                model.net.SumSqrElements([state], f"{param}_mom_norm".split("/")[-1])
            model.net.MomentumSGDUpdate([grad, state, lr, param], [grad, state, param], momentum=0.9)
            if read_state == "after":
                model.net.SumSqrElements([state], f"{param}_mom_norm".split("/")[-1])

    return build


UPDATE_CASES = {
    "random_state": (_momentum_update("GaussianFill"), r"it is created by GaussianFill\(cpu_0/fc1_w -> "
                                                       r"cpu_0/fc1_w_mom\).*one fill that draws no random numbers"),
    "some_devices": (_momentum_update(only_device="cpu_0/"), r"param 'fc1_w' is updated on devices \[0\] only"),
    "state_read_before": (_momentum_update(read_state="before"), r"SumSqrElements\(cpu_0/fc1_w_mom -> .* uses "
                                                                 r"optimizer state 'cpu_0/fc1_w_mom' whole"),
    "state_read_after": (_momentum_update(read_state="after"), r"reads the whole of 'cpu_0/fc1_w_mom', but it is "
                                                               r"optimizer state, of which each replica keeps only"),
}


@pytest.mark.parametrize("case", sorted(UPDATE_CASES))
def test_per_replica_updates_that_cannot_be_split_are_refused(case):
    build, message = UPDATE_CASES[case]
    model = model_helper.ModelHelper(name=case)
    with pytest.raises(ParallelizeError, match=message):
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=mlp,
                        param_update_builder_fun=build, devices=[0, 1], cpu_device=True, shard_optimizer_state=True)
    assert getattr(model, "_parallel", None) is None and not model.net.Proto().ops
