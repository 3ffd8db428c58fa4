"""The model layer (Caffe2's): `ModelHelper` and its nets and params (`model_helper`), layer helpers
(`brew`), optimizers that append their update ops (`optimizer`, `optimizer_context`). The model zoo
built with it is `graphpar.models`."""
