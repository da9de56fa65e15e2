"""Every setting of a node in one place, each default with its reason."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from node.net.config import MeshConfig

DEFAULT_MODEL = "smollm2-135m"
"""The built-in model: small enough for any laptop, real enough to answer questions."""


@dataclass(frozen=True)
class NodeConfig:
    data_dir: Path
    """Models, the harmony vocab and the node identity live here."""
    mesh: MeshConfig
    """How this node finds, admits and talks to its peers (cluster name, secret, ports, mDNS)."""
    model: str | None = DEFAULT_MODEL
    """A model reference (built-in name, folder, .gguf file or Hugging Face repo id); None serves nothing."""
    api_host: str = "0.0.0.0"
    """All interfaces: any machine of the cluster's network may send requests to any node."""
    api_port: int = 52415
    """0 picks a free port (the log says which)."""
    prefill_step_size: int = 512
    """Tokens per prefill chunk: smaller means more progress events and cancel points, slightly slower."""
    max_concurrent: int = 8
    """Requests to one model decoded together. Batching reads the weights once per step for all of
    them: aggregate tokens/s grow with it while each stream slows a little; 8 is past the knee on a
    small CPU."""
    max_queued: int = 32
    """Requests that may wait for a place in the batch; past max_concurrent + max_queued in flight the
    API answers 429 at once instead of letting a client wait for minutes."""
    prefix_cache_tokens: int = 8192
    """KV cache kept from finished requests so the next turn of a chat prefills only its new tokens;
    0 = off. Memory: tokens x layers x 2 x kv_heads x head_dim x 4 bytes (float32), e.g. 8192 tokens
    = 0.4 GB for SmolLM2-135M, 1.9 GB for Qwen3-0.6B."""
    keepalive_s: float = 10.0
    """An SSE comment goes out after this long without events, so proxies keep the stream open."""
    fast_path: bool = True
    """Runners use the BLAS fast path where it is available (Linux CPU); off = plain MLX, for
    comparisons and as the escape hatch should the fast path misbehave on some machine."""
