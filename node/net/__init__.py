"""Networking beneath the cluster state: identity, libp2p host, admission, gossip, requests, mDNS.

The layer above sees only `Mesh` (bytes in, bytes out) configured by `MeshConfig`.
"""

from node.net.config import MeshConfig, add_mesh_arguments, mesh_config_from_args
from node.net.events import Gossip, MeshStats, PeerEvent
from node.net.mesh import Mesh, RemoteError, RequestError, RequestHandler

__all__ = [
    "Gossip",
    "Mesh",
    "MeshConfig",
    "MeshStats",
    "PeerEvent",
    "RemoteError",
    "RequestError",
    "RequestHandler",
    "add_mesh_arguments",
    "mesh_config_from_args",
]
