"""The Parallelize passes, one module each; `graphpar.data_parallel_model.Parallelize` calls them in order.

validate_params → group_by_device → loss_gradients → (interleave → inter_device_bn, with
combine_spatial_bn) → infer_devices → broadcast_computed → allreduce → sync → analyze → shared_model.
`common` holds the replica layout and op helpers they share, and `predictor` cuts prediction nets
out of train nets. Passes read and rewrite NetDefs and the model's bookkeeping; they never execute
anything.
"""
