"""Data parallelism: `Parallelize` and the runs of a parallelized model (`data_parallel_model`, with the
replicas' feed check in `feeds`), starting processes and who this one is (`launch`, on torch's elastic
agent: `agent`; a restarted job's checkpoints: `elastic`), and host-side reductions across them (`comm`)."""
