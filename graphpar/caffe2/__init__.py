"""What graphpar keeps only for Caffe2 compatibility, apart from the core, passes and runtime.

`proto` (Caffe2's protobuf messages and their conversion to graphpar's IR; needs protobuf), `plan`
(`ExecutionStep` and `Plan`, also `core.Plan`), `run_plan`, `immediate` and `workspace_extras` (the
Caffe2 functions `graphpar.workspace` re-exports: RunPlan, immediate mode, `Predictor`, GlobalInit,
...), `predictor` (export and load of predict nets), `cnn` (CNNModelHelper), `scope`, and Caffe2's
test helpers (`test_util`, `hypothesis_test_util`, `dyndep`, `experiment_util`, `timeout_guard`).
Their old paths (`graphpar.proto`, `graphpar.cnn`, ...) import the same modules (`graphpar._moved`).
"""
