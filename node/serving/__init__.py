"""A request, from the API to a runner and back, on whichever node it arrives.

- `backend`: `NodeBackend`, the node's implementation of `api.backend.Backend`.
- `failover`: a generation whose instance breaks off goes on elsewhere.
- `attempts`: one try of a request, on this node's runner or a peer's entry.
- `routing`: a request accepted on any node runs on its instance's entry node.
- `model_sampling`: a served model's sampling defaults, for its model cards.

The request path reads in one direction: backend -> failover -> attempts -> a runner
(`node.runner.supervisor`) here, or `routing` to the entry node's attempts; nothing below calls up.
"""
