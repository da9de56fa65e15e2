"""Child processes of a node, runners and pipeline stages alike: one way to start them, hand them
their spec, wait for their ready frame, restart them after a backoff, and tie them to our life.

- `process`: synchronous: start a child tied to this process (`spawn`), stop it, read its first
  frame; and the child's own side of the tie (`exit_when_orphaned`).
- `supervisor`: the trio shell: a running `Child` (frames out, bytes in, its exit), `running`
  (start, spec frame, stop on the way out), `Child.handshake` and `keep_restarting`.

Its own floor: it imports only `protocol/`, so `pipeline/` (the stage process) and `runner/` both
use it.
"""
