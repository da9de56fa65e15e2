"""A tensor-parallel rank other than 0: load its slice, join the group, run the steps rank 0 sends.

    python -m node.tensor.follower --model-path P --rank R --group A0,A1,... [--listen HOST:PORT]

`--group` lists every rank's HOST:PORT in rank order; this rank listens at its own entry (or at
`--listen`, where the group reaches it through another address). The instance's link key comes
from the environment (`link_auth.LINK_ENV`; without it `OPEN`). Once the group is connected it
prints one line, `ready rank R`, on stdout. It exits when rank 0 closes the link (0) or the link
fails (1): the group is broken then, and whoever placed it starts a new one.
"""

from __future__ import annotations

import argparse
import logging
import sys

from node.children.process import exit_when_orphaned
from node.pipeline.hop import CONNECT_TIMEOUT, listen, parse_address
from node.pipeline.link_auth import LinkSecurity
from node.tensor.mesh import LINK_TIMEOUT, connect_group

log = logging.getLogger("shoal.tensor")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.tensor.follower", description=__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--group", required=True, help="every rank's HOST:PORT, in rank order")
    parser.add_argument("--listen", help="HOST:PORT to listen at (default: this rank's --group entry)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT)
    parser.add_argument("--link-timeout", type=float, default=LINK_TIMEOUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if args.parent_pid is not None:
        exit_when_orphaned(args.parent_pid)
    group = [parse_address(a) for a in args.group.split(",")]
    if not 0 < args.rank < len(group):
        parser.error(f"--rank must name a rank other than 0 of the {len(group)} in --group")
    listener = listen(*parse_address(args.listen) if args.listen else group[args.rank])

    from node.cpu.dtype import apply_dtype_policy
    from node.tensor.shard import load_tensor_shard

    shard = load_tensor_shard(args.model_path, rank=args.rank, size=len(group), prepare=apply_dtype_policy)
    link = connect_group(
        args.rank,
        group,
        listener,
        security=LinkSecurity.from_env(),
        timeout=args.connect_timeout,
        link_timeout=args.link_timeout,
    )
    listener.close()
    shard.attach(link)
    print(f"ready rank {args.rank}", flush=True)
    while True:
        payload = link.receive(-1.0)
        if not payload:
            closed = "closed" in link.error
            (log.info if closed else log.warning)("the group's link ended: %s", link.error)
            return 0 if closed else 1
        shard.run_command(payload)


if __name__ == "__main__":
    sys.exit(main())
