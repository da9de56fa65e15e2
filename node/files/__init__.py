"""Model files between nodes: manifests of folders, serving them to members, fetching them from peers.

A node that holds a model offers its files (`FileServer`, behind `api.files`' route); a node that
needs them fetches them (`Fetcher`): from the peers that hold them, checked by SHA-256, resumable,
with the hub as the fallback (`hub_fallback`). Modules: `hashing` (folder manifests, the hash
cache), `signing` (the cluster-key signature on each request), `server`, `folders` (target and
staging folders), `pieces` (part files on disk), `download` (one ranged GET), `fetcher`,
`hub_fallback`, `progress` (what the cluster view shows while bytes move).
"""

from node.files.download import FetchError, Peer
from node.files.fetcher import Fetcher, FetchPolicy
from node.files.folders import CLUSTER_SUBDIR, cluster_model_dir, staging_dir
from node.files.hashing import HashCache, folder_manifest, sidecar_path
from node.files.hub_fallback import HubRef, fetch_from_hub
from node.files.progress import ProgressBoard, ProgressMeter
from node.files.server import FileServer

__all__ = [
    "CLUSTER_SUBDIR",
    "FetchError",
    "FetchPolicy",
    "Fetcher",
    "FileServer",
    "HashCache",
    "HubRef",
    "Peer",
    "ProgressBoard",
    "ProgressMeter",
    "cluster_model_dir",
    "fetch_from_hub",
    "folder_manifest",
    "sidecar_path",
    "staging_dir",
]
