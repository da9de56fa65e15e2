"""Pipeline stages: one model split by layer ranges across processes (and machines).

- `shard`: load only layers [start, end) of a model folder (plus the embedding on the first stage,
  the final norm and head on the last), never reading the other layers' weights.
- `frames`: what crosses a hop, as bytes (kinds, header, tensor); pure.
- `hop`: the TCP link between neighbouring stages: framed tensors, heartbeats, bounded waits.
- `link_auth`, `gate`: only members of the instance get a link (a handshake on the instance's key
  before any frame; with a cluster secret, sealed frames); the gate runs it for a listening port.
- `stage`: a stage process (`python -m node.pipeline.stage`) that runs its layers for every request.
- `driver`: `PipelineGenerator`, the first stage, which drives a request around the ring and yields
  tokens as `mlx_lm.stream_generate` would.
- `ring`: the driver's two links (out to stage 1, in from the last stage) and the requests on them.

Greedy output is identical to one process running the whole model: every stage runs the same
operations on the same shapes, and hidden states cross the wire as their raw bytes.
"""
