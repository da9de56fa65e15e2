"""Tensor-parallel instances: every rank holds a slice of every layer, and the ranks sum.

- `protocol.tensor_split` (pure, so placement reads it too): which heads, MLP rows and
  vocabulary rows each rank holds.
- `shard`: load one rank's slice of a model folder and run it (`TensorShard`), summing over the
  group's link (`native/kernels/tensor_link.h`) twice a layer and gathering the head's slices.
- `mesh`: the group's sockets, each proven with the instance's key (`node.pipeline.link_auth`).
- `follower`: a rank other than 0 (`python -m node.tensor.follower`), which runs the steps rank 0
  sends it. Rank 0 drives generation as a runner (`TensorGenerator`).
"""
