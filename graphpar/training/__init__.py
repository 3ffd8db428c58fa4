"""Training loops over a parallelized model: batches scattered and fed to its devices (`data`,
`feeder`), the `Trainer` and its hooks (`engine`), loaders, evaluation, and the yacs configs of the
default trainer (`config`, `defaults`)."""
