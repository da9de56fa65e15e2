"""A request, from the API to a runner and back, on whichever node it arrives.

- `backend`: `NodeBackend`, the node's implementation of `api.backend.Backend`.
- `failover`: a generation whose instance breaks off goes on elsewhere.
- `routing`: a request accepted on any node runs on its instance's entry node.
- `model_sampling`: a served model's sampling defaults, for its model cards.

The request path reads in one direction: backend -> failover -> routing -> a runner
(`node.runner.supervisor`), locally or on the entry node.
"""
