"""`"sharding": "auto"`: tensor-parallel when the round trip between the chosen nodes and the
model's shape say a token comes sooner that way, else pipeline. Pure: the leader passes the round
trips its nodes measured (`NodeProfile.links`).

The rule, per decoded token (decode is memory-bound on a CPU: a token reads every weight once):
- one node (or a pipeline, whose stages run in turn) takes `T1 = token bytes / NODE_BYTES_PER_S`;
- N ranks each read 1/N of the bytes, and exchange `2 x layers + 3` times (a sum after attention
  and after the MLP of every layer; the embedding's sum, the head's gather and rank 0's command),
  each costing the round trip plus `EXCHANGE_COST_S`;
- tensor wins when `T1 x (1 - 1/N) > exchanges x (round trip + EXCHANGE_COST_S)`.

The figures behind the constants (Intel(R) Xeon(R) Processor, `bench/tensor_parallel.py`, nodes on
an emulated 1 Gbit/s LAN with a 21 us round trip, one core each):
- a Llama-3.2-3B-shaped Q4_0 (1.9 GB a token) decoded 6.45 tok/s on one core (155 ms), 10.97 on two
  tensor ranks (91 ms, against 77.5 for half the bytes): 13.7 ms over 59 exchanges, 232 us each;
- the 1B-shaped Q4_0 (0.75 GB): 15.5 tok/s on one core (64 ms), 24.0-26.7 on two ranks (37-42 ms,
  against 32): 150-290 us over each of 35 exchanges;
- one node on both cores read 21-22 GB/s (28.3 tok/s on the 1B, 11.85 on the 3B).
So at a LAN's 0.2 ms round trip a 1B model on two nodes is (just) faster tensor-parallel, a 3B one
clearly; at a Wi-Fi's 2 ms neither is; SmolLM2-135M (0.1 GB) never is. A mixture of experts
counts the experts a token is routed to (`ModelShape.token_bytes`), not all it stores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from protocol.ids import NodeId
from protocol.model_shape import ModelShape
from protocol.sharding import Sharding

NODE_BYTES_PER_S = 20e9
"""Weights one node reads a second while it decodes on all its cores: what this project's 2-core
hosts measured (21-22 GB/s, above), and about what a dual-channel desktop sustains."""
EXCHANGE_COST_S = 250e-6
"""What each exchange of a tensor-parallel token costs beyond the round trip (the ranks wait for
the slower one, add, and pass through the kernel's sockets): 150-290 us measured (above)."""


@dataclass(frozen=True, slots=True)
class AutoChoice:
    sharding: Sharding
    reason: str
    """One line a user can read: the figures the choice was made on."""


def token_bytes(shape: ModelShape) -> int:
    """Weights one decoded token reads: every layer (of a mixture of experts, the routed experts
    only: `ModelShape.token_bytes`), and the head (the embedding when tied)."""
    if shape.token_bytes:
        return shape.token_bytes
    return sum(shape.layer_bytes) + (shape.embedding_bytes if shape.tied_embeddings else shape.head_bytes)


def exchanges(shape: ModelShape) -> int:
    """The tensor-parallel exchanges of one token: two a layer, and three more (module doc)."""
    return 2 * shape.num_layers + 3


def worst_round_trip(links: Mapping[NodeId, Mapping[NodeId, int]], nodes: Sequence[NodeId]) -> int | None:
    """The slowest round trip (us) between any two of `nodes`, each pair as either end measured it
    (the lower of the two); None when a pair has not been measured by either end."""
    worst = 0
    for i, a in enumerate(nodes):
        for b in nodes[i + 1 :]:
            seen = [t for t in (links.get(a, {}).get(b), links.get(b, {}).get(a)) if t is not None]
            if not seen:
                return None
            worst = max(worst, min(seen))
    return worst


def choose_sharding(shape: ModelShape, ranks: int, round_trip_us: int | None) -> AutoChoice:
    """Tensor-parallel on `ranks` nodes whose slowest round trip is `round_trip_us`, or pipeline."""
    if round_trip_us is None:
        return AutoChoice("pipeline", "no round trip between the chosen nodes measured yet")
    one = token_bytes(shape) / NODE_BYTES_PER_S
    saved = one * (1 - 1 / ranks)
    count = exchanges(shape)
    added = count * (round_trip_us * 1e-6 + EXCHANGE_COST_S)
    figures = (
        f"{ranks} ranks would save ~{saved * 1e3:.1f} ms of a {one * 1e3:.1f} ms token; "
        f"{count} exchanges at a {round_trip_us} us round trip cost ~{added * 1e3:.1f} ms"
    )
    if saved > added:
        return AutoChoice("tensor", f"tensor: {figures}")
    return AutoChoice("pipeline", f"pipeline: {figures}")
