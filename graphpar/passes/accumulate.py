"""Pass: gradient accumulation over k micro-batches, one all-reduce and one update per k (DDP's `no_sync`).

With `Parallelize(accumulate_gradients=k)`, k > 1, this pass runs after the gradient ops exist and
before anything moves gradients between replicas. It builds `state.accumulate_net`: a copy of the
train net so far (forward and backward, inter-device batch norm included) followed, per replica and
data-parallel gradient g, by `Sum(g_accumulated, g) -> g_accumulated`. It appends to the train net,
per gradient, `Sum(g, g_accumulated) -> g`, `Scale(g, 1/k) -> g` and `ConstantFill(g) ->
g_accumulated` (zeros again); the all-reduce and the updates that later passes append then act on
the mean gradient of the k micro-batches. `param_init_net` creates every `g_accumulated` as zeros
shaped like its param; `state.reset_accumulated_net` makes them zeros again, for a step that wrote
nothing back: one the loss scale skipped on an overflow (whose micro-batches may have put an inf in
the sums) or one that raised (`data_parallel_model.RunNet` and the `Trainer` run it through
`data_parallel_model.reset_accumulated_gradients`, so the next step starts from zero sums).

A step is then k - 1 runs of the accumulate net and one run of the train net, each on its own
micro-batch (`engine.Trainer` does this): the same update as one step on the k-times batch (equal
micro-batches; batch-norm running statistics move once per micro-batch, as with DDP's `no_sync`).
"""

from __future__ import annotations

import copy

from graphpar.core.ir import GradientSlice, NetDef
from graphpar.core.naming import accumulated_grad_name
from graphpar.core.net import Net
from graphpar.errors import ParallelizeError
from graphpar.passes.common import declare_external_inputs, make_op
from graphpar.passes.state import ParallelState


def accumulate_gradients(state: ParallelState) -> None:
    """Build `state.accumulate_net` and add the accumulation ops (see the module docstring).

    Input: the train net holds the forward and backward ops and no gradient collective yet;
    `state.grad_names` are grouped. Guarantees: every data-parallel gradient copy has a zero-filled
    `_accumulated` blob on its device; the accumulate net has no op that moves data between replicas
    unless the forward or backward had one (inter-device batch norm).

    Raises:
        ParallelizeError: a sparse (GradientSlice) gradient, or a shared model.
    """
    k = state.options.accumulate_gradients
    model, layout = state.model, state.layout
    if state.options.shared_model:
        raise ParallelizeError("Parallelize: accumulate_gradients is not supported with shared_model")
    sparse = [name for name in state.grad_names
              if any(isinstance(g, GradientSlice) for g in state.grouped[name].values())]
    if sparse:
        raise ParallelizeError(f"Parallelize: accumulate_gradients needs dense gradients; {sparse} are sparse "
                               f"(GradientSlice)")
    param_of = {str(g): str(p) for p, g in model.param_to_grad.items() if not isinstance(g, GradientSlice)}
    net = model.net.Proto()
    micro = copy.deepcopy(net)
    micro.name = f"{net.name}_accumulate"
    init = model.param_init_net.Proto()
    reset = NetDef(f"{net.name}_reset_accumulated")
    for name in state.grad_names:
        for device, grad in state.grouped[name].items():
            grad, option = str(grad), layout.option(device)
            acc = accumulated_grad_name(grad)
            init.ops.append(make_op("ConstantFill", [param_of[grad]], [acc], option, value=0.0))
            reset.ops.append(make_op("ConstantFill", [param_of[grad]], [acc], option, value=0.0))
            micro.ops.append(make_op("Sum", [acc, grad], [acc], option))
            net.ops += [make_op("Sum", [grad, acc], [grad], option),
                        make_op("Scale", [grad], [grad], option, scale=1.0 / k),
                        make_op("ConstantFill", [grad], [acc], option, value=0.0)]
    declare_external_inputs(micro)
    declare_external_inputs(reset)
    state.accumulate_net = Net(micro)
    state.reset_accumulated_net = Net(reset)
