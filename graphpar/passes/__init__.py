"""The Parallelize passes, one module each; `graphpar.data_parallel_model.Parallelize` calls them in order.

(after the input and forward builders) validate_params → group_by_device (params) →
[pre_grad_net_transformer_fun] → loss_gradients + autodiff → [net_transformer_fun] → [forward-only
models stop here: infer_devices, analyze] → (interleave → inter_device_bn, with combine_spatial_bn) → validate_params →
group_by_device (gradients) → infer_devices → broadcast_computed → allreduce (or bucketing, with
gradient_bucket_bytes) → (shared_model pruning)
→ [the update builders] → sync.compute_blobs_to_sync → analyze → sync.sync_blobs (end of
param_init_net) → [post-sync builder] → (shared_model remapping).
`common` holds the replica layout and op helpers they share, and `predictor` cuts prediction nets
out of train nets. Passes read and rewrite NetDefs and the model's bookkeeping; they never execute
anything.
"""
