"""Mesh figures: agreement time for 3/5/8 real node processes, simulated convergence for 50/100 nodes,
leader failover, a frozen node's detection, newcomer discovery and gossip traffic at rest.

    .venv/bin/python bench/mesh.py [--sizes 3 5 8] [--rest-seconds 10]

Real nodes run `shoal run --no-model` on 127.0.0.1 with bootstrap peers (no multicast here).
Failure detection: kill -9 of the leader (its connections close: the fast signal) and SIGSTOP of a
follower (connections stay open: judged by silence), then SIGCONT; the same periods are checked on
trio's mock clock in tests/test_cluster_service.py. The simulation runs the real state, merge and
codec code over an in-memory network with message loss; one round is one heartbeat interval of the
real protocol.
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from protocol.cluster_sim import SimConfig, simulate
from protocol.membership import FailureDetectorConfig
from tests.nodes import RunningNode, agreed_leader, start_node, statuses
from tests.waiting import wait_until


def start_cluster(size: int, root: Path) -> tuple[list[RunningNode], float]:
    """Start `size` nodes (each bootstrapping to the first); seconds from the first start to agreement."""
    begin = time.monotonic()
    nodes = common.start_cluster(size, root)
    return nodes, time.monotonic() - begin


def newcomer_seen(nodes: list[RunningNode], root: Path) -> tuple[RunningNode, float]:
    """Seconds from a newcomer's p2p listener being up to every existing node listing it alive."""
    newcomer = start_node("--peer", nodes[0].p2p_addr, data_dir=root / "newcomer", model=None)
    begin = time.monotonic()
    try:
        wait_until(
            lambda: all(statuses(n).get(newcomer.node_id) == "alive" for n in nodes), 20, "newcomer seen"
        )
    except BaseException:
        newcomer.stop()
        raise
    return newcomer, time.monotonic() - begin


def traffic_at_rest(nodes: list[RunningNode], seconds: float) -> float:
    """Cluster bytes sent per node per second (gossip + anti-entropy), averaged over the nodes."""

    def sent(node: RunningNode) -> int:
        stats = node.health()["cluster"]
        return int(stats["gossip_bytes_out"] + stats["sync_bytes_out"])

    before = [sent(n) for n in nodes]
    time.sleep(seconds)
    after = [sent(n) for n in nodes]
    return sum(a - b for a, b in zip(after, before, strict=True)) / len(nodes) / seconds


def _logged_at(node: RunningNode, pattern: str, since: datetime) -> datetime:
    """When `node` first logged a line matching `pattern` at or after `since` (its log's clock)."""
    regex = re.compile(pattern)
    for line in node.log:
        if regex.search(line):
            at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            if at >= since:
                return at
    raise AssertionError(f"{node.node_id} never logged {pattern!r}")


def frozen(nodes: list[RunningNode]) -> tuple[float, float]:
    """SIGSTOP a follower: seconds until all the others mark it dead; after SIGCONT, seconds until
    all mark it alive again (from their log lines, as `failover`)."""
    leader_id = wait_until(lambda: agreed_leader(nodes), 20, "an agreed leader")
    follower = next(n for n in nodes if n.node_id != leader_id)
    others = [n for n in nodes if n is not follower]
    stopped = datetime.now()
    follower.process.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: all(statuses(o)[follower.node_id] == "dead" for o in others), 20, "dead")
    finally:
        woken = datetime.now()
        follower.process.send_signal(signal.SIGCONT)
    wait_until(lambda: all(statuses(o)[follower.node_id] == "alive" for o in others), 20, "alive")
    dead = max(_logged_at(o, f"member {follower.node_id}: \\w+ -> dead", stopped) for o in others)
    back = max(_logged_at(o, f"member {follower.node_id}: dead -> alive", woken) for o in others)
    return (dead - stopped).total_seconds(), (back - woken).total_seconds()


def failover(nodes: list[RunningNode]) -> tuple[float, float]:
    """kill -9 the leader: seconds until all survivors mark it dead, and until all follow a new one.

    Read from the nodes' own log lines (millisecond timestamps): polling 8 APIs on 2 cores would
    add its own seconds."""
    # A newcomer with the smallest id may still be taking over: wait for one view.
    leader_id = wait_until(lambda: agreed_leader(nodes), 10, "an agreed leader before the kill")
    leader = next(n for n in nodes if n.node_id == leader_id)
    survivors = [n for n in nodes if n is not leader]
    killed = datetime.now()
    leader.process.send_signal(signal.SIGKILL)
    wait_until(lambda: all(statuses(s)[leader.node_id] == "dead" for s in survivors), 20, "dead")
    wait_until(lambda: agreed_leader(survivors) not in (None, leader_id), 20, "new leader")
    new_leader = agreed_leader(survivors)
    dead = max(_logged_at(s, f"member {leader_id}: \\w+ -> dead", killed) for s in survivors)
    led = max(_logged_at(s, f"leader is {new_leader} ", killed) for s in survivors)
    return (dead - killed).total_seconds(), (led - killed).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 5, 8])
    parser.add_argument("--rest-seconds", type=float, default=10.0)
    args = parser.parse_args()

    round_s = FailureDetectorConfig().heartbeat_interval_s
    print("simulated convergence (real state/merge/codec, in-memory network)")
    header = ("nodes", "loss", "rounds after writes", "~seconds", "sim wall s", "KB sent")
    print(" ".join(f"{h:>{max(6, len(h))}}" for h in header))
    for count in (50, 100):
        start = time.perf_counter()
        result = simulate(SimConfig(nodes=count, loss=0.2, through_wire=True), random.Random(1))
        wall = time.perf_counter() - start
        assert result.converged
        rounds = result.rounds_after_writes
        print(
            f"{count:>6} {0.2:>6.0%} {rounds:>19} {rounds * round_s:>8.1f} {wall:>10.2f}"
            f" {result.wire_bytes / 1e3:>7.0f}"
        )

    print("\nreal node processes on 127.0.0.1 (shoal run --no-model, bootstrap peers)")
    print(
        f"{'nodes':>6} {'start->agreed s':>16} {'newcomer seen s':>16} {'rest B/s/node':>14}"
        f" {'frozen dead s':>14} {'woken alive s':>14} {'dead noticed s':>15} {'new leader s':>13}"
    )
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            nodes, agreed = start_cluster(size, Path(tmp))
            try:
                newcomer, seen = newcomer_seen(nodes, Path(tmp))
                nodes.append(newcomer)
                wait_until(lambda: agreed_leader(nodes), 30, "agreed with the newcomer")  # noqa: B023
                rest = traffic_at_rest(nodes, args.rest_seconds)
                silent, woken = frozen(nodes)
                dead, leader = failover(nodes)
            finally:
                for node in nodes:
                    node.process.send_signal(signal.SIGCONT)
                common.stop_all(nodes)
            print(
                f"{size:>6} {agreed:>16.2f} {seen:>16.2f} {rest:>14.0f} {silent:>14.2f} {woken:>14.2f}"
                f" {dead:>15.2f} {leader:>13.2f}"
            )


if __name__ == "__main__":
    main()
