"""The Parallelize passes, one module each, run in order by `passes.pipeline.PIPELINE`.

Every pass reads and rewrites the model's NetDefs and its `ParallelState` (`passes.state`) and never
executes anything; `common` holds the replica layout and op helpers they share, `reducers` the ways
to combine per-device copies, and `predictor` cuts prediction nets out of train nets.
"""
