"""A Mesh with mDNS on, for tests/test_net_mdns.py: run inside a network namespace.

    python -m tests.mdns_probe --data-dir D --listen IP --cluster NAME [--expect N] [--expect-ignored M]

Prints one JSON line when it has authenticated N peers found without any bootstrap address and
seen M announcements of other clusters (or when the timeout passes): {"peer_id", "addrs",
"discovered", "connected", "ignored", "elapsed_s", "ok"}; then keeps running, so the others can
finish too, until stdin closes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import trio

from node.net import Mesh, MeshConfig


async def _wait_stdin_closed() -> None:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stdin:
        while await stdin.receive_some(4096):
            pass


async def probe(args: argparse.Namespace) -> None:
    config = MeshConfig(
        data_dir=args.data_dir,
        cluster=args.cluster,
        secret=args.secret.encode() if args.secret else None,
        listen_host=args.listen,
        mdns=True,
        redial_min_s=0.2,
        redial_max_s=1.0,
    )
    mesh = Mesh(config)
    async with trio.open_nursery() as nursery:
        started = trio.current_time()
        addrs = await nursery.start(mesh.run)
        with trio.move_on_after(args.timeout):
            while len(mesh.connected_peers()) < args.expect:
                await mesh.events.receive()
            while mesh.stats.mdns_other_clusters < args.expect_ignored:
                await trio.sleep(0.05)  # a counter without an event
        report = {
            "peer_id": mesh.peer_id,
            "addrs": addrs,
            "discovered": sorted(mesh.known_peers()),
            "connected": sorted(mesh.connected_peers()),
            "elapsed_s": round(trio.current_time() - started, 3),
            "ignored": mesh.stats.mdns_other_clusters,
            "ok": len(mesh.connected_peers()) >= args.expect
            and mesh.stats.mdns_other_clusters >= args.expect_ignored,
        }
        print(json.dumps(report), flush=True)
        with trio.move_on_after(args.timeout):
            await _wait_stdin_closed()
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--cluster", default="shoal")
    parser.add_argument("--secret", default=None)
    parser.add_argument("--expect", type=int, default=1)
    parser.add_argument("--expect-ignored", type=int, default=0, help="other-cluster nodes to see")
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(relativeCreated)d %(name)s: %(message)s"
    )
    trio.run(probe, args)


if __name__ == "__main__":
    main()
