"""A tensor-parallel rank other than 0: load its slice, then run the steps rank 0 sends it.

    python -m node.tensor.follower --model-path P --rank R --size N [--listen HOST:PORT]

It loads its slice, listens (port 0: any free one) and writes one `StageReady` frame on stdout
(`node.pipeline.stage_wire`, as a pipeline stage does: start 0, end the layer count). Rank 0 then
connects and says who else is in the group (`mesh.join_group`); the instance's link key comes from
the environment (`link_auth.LINK_ENV`; without it `OPEN`). When the link ends (rank 0 closed it,
another rank failed) it waits for rank 0 again with the slice still loaded: the next request forms
the group anew at the cost of a few connections, not a reload.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from node.children.process import exit_when_orphaned, keep_beating
from node.pipeline.hop import CONNECT_TIMEOUT, listen, parse_address
from node.pipeline.link_auth import LinkSecurity
from node.pipeline.stage_wire import StageReady, encode_ready
from node.tensor.mesh import LINK_TIMEOUT, MAX_GROUP, join_group

log = logging.getLogger("shoal.tensor")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.tensor.follower", description=__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True, help="ranks in the group, rank 0 included")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: any free one)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT)
    parser.add_argument("--link-timeout", type=float, default=LINK_TIMEOUT)
    args = parser.parse_args(argv)
    if not 0 < args.rank < args.size <= MAX_GROUP:
        parser.error(f"--rank must be 1 .. --size - 1, and --size at most {MAX_GROUP}")
    logging.basicConfig(level=logging.INFO, format="tensor: %(message)s", stream=sys.stderr)
    if args.parent_pid is not None:
        exit_when_orphaned(args.parent_pid)
    security = LinkSecurity.from_env()

    import mlx.core as mx

    from node.cpu.dtype import apply_dtype_policy
    from node.cpu.memory import release_free_heap
    from node.tensor.shard import TensorLinkError, load_tensor_shard

    shard = load_tensor_shard(args.model_path, rank=args.rank, size=args.size, prepare=apply_dtype_policy)
    mx.clear_cache()  # the full tensors each slice was cut from
    release_free_heap()  # and what loading freed (node.cpu.memory says why)
    listener = listen(*parse_address(args.listen))
    ready = StageReady(port=listener.getsockname()[1], start=0, end=shard.spec.num_layers, pid=os.getpid())
    frames = os.fdopen(os.dup(1), "wb")
    frames.write(encode_ready(ready))
    frames.flush()
    keep_beating(frames)
    os.dup2(2, 1)  # stdout is the log from now on: the pipe carries only heartbeats
    while True:
        link = join_group(
            args.rank,
            args.size,
            listener,
            security=security,
            timeout=args.connect_timeout,
            link_timeout=args.link_timeout,
        )
        shard.attach(link)
        sealed = ", its frames sealed" if link.sealed else ""
        log.info("rank %d of %d joined its group%s", args.rank, args.size, sealed)
        while payload := link.receive(-1.0):
            try:
                shard.run_command(payload)
            except TensorLinkError:
                break  # said below
            except Exception:  # a step that failed here fails rank 0's too; wait for a new group
                log.exception("a step failed")
                link.close()
        log.info("the group's link ended (%s); waiting for rank 0", link.error)


if __name__ == "__main__":
    sys.exit(main())
