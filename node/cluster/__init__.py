"""The cluster as this node sees it: membership, the replicated state and the leader.

- `service`: `ClusterService`, the trio driver of `protocol`'s pure cores (heartbeats, gossip,
  anti-entropy, failure detection, election) over the mesh.
- `reader`: `ClusterReader`, the part of the service most modules read, as a Protocol.
- `profile`: what this machine offers the cluster (host, OS, accelerator, memory).
"""
