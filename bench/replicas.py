"""Replicas through the product: aggregate tokens/s of concurrent requests with 1 and with 2
replicas of one model on three real nodes.

Three `shoal run --no-model` nodes on 127.0.0.1 join with `--peer`, prefix cache off. `POST
/v1/instances {"model", "replicas": 1}`, wait until its runner is ready, send `--concurrent`
streamed greedy chat completions at once through a node that runs no replica (once to warm up,
then `--repeats` times), then ask for `"replicas": 2` (one more instance, on another node) and do
the same. "tok/s" is every completion token of a batch over the batch's wall time (first request
sent to last token received), the median of the repeats; "per replica" is how many requests of
the last batch each replica's entry reports it took (`/v1/cluster`).

On one machine the replicas share its cores: what a second replica adds is bounded by the cores
the first leaves idle (a runner decodes a batch on all cores), so the ratio measures the cost or
gain of splitting one machine's work, not what two machines give.

    .venv/bin/python bench/replicas.py [--tokens 64] [--concurrent 8] [--repeats 3] [--model smollm2]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    PROMPT,
    builtin_model,
    chat_body,
    loadavg,
    random_380mb,
    start_cluster,
    stop_all,
    stream_chat,
)
from tests.nodes import RunningNode
from tests.waiting import wait_until

READY_TIMEOUT = 300
"""Seconds for a replica's runner to load; the machine may be busy with other work."""


def replicas(node: RunningNode, model: str) -> list[dict[str, Any]]:
    return [i for i in node.cluster()["instances"] if i["model"] == model]


def served(node: RunningNode, model: str) -> dict[str, int]:
    return {i["id"]: (i["load"] or {}).get("served", 0) for i in replicas(node, model)}


def all_ready(node: RunningNode, model: str, count: int) -> bool:
    found = replicas(node, model)
    return len(found) == count and all((i["load"] or {}).get("ready") for i in found)


def taken_since(node: RunningNode, model: str, before: dict[str, int], total: int) -> list[int] | None:
    """Requests each replica took since `before`, largest first, once they add up to `total` and
    every entry has reported itself idle (so its count is final; attempts that failover moved
    count on both replicas)."""
    found = replicas(node, model)
    if not all(i["load"] and i["load"]["active"] == 0 for i in found):
        return None
    now = served(node, model)
    taken = sorted((now[i] - before.get(i, 0) for i in now), reverse=True)
    return taken if sum(taken) >= total else None


def batch(base_url: str, model: str, args: argparse.Namespace) -> tuple[float, int]:
    """`args.concurrent` streams at once: (tokens/s over the batch's wall time, tokens)."""
    body = chat_body(model, [{"role": "user", "content": PROMPT}], args.tokens)
    start = time.perf_counter()
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(args.concurrent) as pool:
        streams = list(pool.map(lambda _: stream_chat(client, base_url, body), range(args.concurrent)))
    end = max((s.times[-1] for s in streams if s.times), default=time.perf_counter())
    tokens = sum(int(s.usage.get("completion_tokens", 0)) for s in streams)
    if broken := sum("completion_tokens" not in s.usage for s in streams):
        print(f"    {broken} of {len(streams)} streams ended without usage (an error in the stream)")
    return tokens / (end - start), tokens


def measure(
    nodes: list[RunningNode], model_dir: Path, count: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Ask for `count` replicas, wait until all are ready, and time batches through a node without one."""
    placed = httpx.post(
        f"{nodes[0].base_url}/v1/instances", json={"model": str(model_dir), "replicas": count}, timeout=120
    )
    if placed.status_code not in (200, 201) or len(placed.json()["replicas"]) != count:
        raise RuntimeError(f"asking for {count} replicas of {model_dir.name}: {placed.text}")
    model = placed.json()["model"]
    entries = {i["stages"][0]["node_id"] for i in placed.json()["replicas"]}
    via = next(n for n in nodes if n.node_id not in entries)
    wait_until(lambda: all_ready(via, model, count), READY_TIMEOUT, f"{count} replicas ready")
    batch(via.base_url, model, args)  # warm-up
    rates: list[float] = []
    shares: list[int] = []
    for _ in range(args.repeats):
        before = served(via, model)
        rates.append(batch(via.base_url, model, args)[0])
        check = functools.partial(taken_since, via, model, before, args.concurrent)
        found = wait_until(check, 10, "loads reported")
        shares = found or []
    row = {"replicas": count, "tok_s": statistics.median(rates), "rates": rates, "shares": shares}
    print(
        f"  {count} replica(s): {row['tok_s']:.1f} tok/s (runs {[round(r, 1) for r in rates]}),"
        f" last batch per replica {shares}; load {loadavg()}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "random"])
    args = parser.parse_args()

    print(f"load average at the start: {loadavg()} (other work on this machine skews every figure)")
    builtin = builtin_model()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = builtin if args.model == "smollm2" else random_380mb(Path(tmp), builtin)
        nodes = start_cluster(3, Path(tmp), "--prefix-cache-tokens", "0")
        try:
            rows = [measure(nodes, model_dir, count, args) for count in (1, 2)]
        finally:
            stop_all(nodes)
    print(f"load average at the end: {loadavg()}")
    print(
        f"\n{model_dir.name}: {args.concurrent} concurrent requests of {args.tokens} tokens, greedy,"
        f" median of {args.repeats} batches after a warm-up"
    )
    print(f"{'replicas':>8} {'tok/s':>8} {'vs 1':>6}  per replica (last batch)")
    for row in rows:
        ratio = row["tok_s"] / rows[0]["tok_s"]
        print(f"{row['replicas']:>8} {row['tok_s']:>8.1f} {ratio:>5.2f}x  {row['shares']}")


if __name__ == "__main__":
    main()
