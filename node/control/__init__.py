"""Instances: where models run. The leader decides, every node asks it.

- `leader`: the leader's side: place, preview and delete on request; re-place what lost a node.
- `requests`: what any node asks the leader (and `shoal run --model X`).
- `finder`, `shapes`: a model by the name the cluster shows, and what a node reads of a model to
  place it.
- `instances`: `InstanceManager`, which composes these with `node.hosting` for the backend.
"""
