"""Failover through the product: seconds from a kill -9 of the node serving a stream to the next
token its client receives, with a replica and without one.

Three `shoal run --no-model` nodes on 127.0.0.1 join with `--peer`, prefix cache off; the client
streams a long greedy chat completion through a node that runs no instance of the model, and the
node running its request is killed 8 content chunks in.

1. With a replica: `POST /v1/instances {"model", "replicas": 2}` puts an instance on two nodes;
   the other replica takes the request over (it prefills the prompt and the tokens sent so far).
2. Without one: on the two survivors, the model's instances are deleted and one is placed again;
   the request enters at the node without it, whose holder is killed: the leader declares it dead
   and re-places the instance on the entry node, which loads the model, then takes the request
   over. Its load time (the new runner's "started" to "ready" log lines) is shown beside.

Each stream's text is compared with an uninterrupted run's ("same text"). The issue's targets:
<= 10 s with a replica, <= load time + 5 s without.

    .venv/bin/python bench/failover.py [--model smollm2|random-380mb] [--tokens 400]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PROMPT, builtin_model, chat_body, loadavg, random_380mb, start_cluster, stop_all
from tests.nodes import RunningNode
from tests.waiting import wait_until

READY_TIMEOUT = 300
"""Seconds for a runner to load; the machine may be busy with other work."""
KILL_AFTER = 8
"""Content chunks the client has when the serving node is killed."""
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def instances(node: RunningNode, model: str) -> list[dict[str, Any]]:
    return [i for i in node.cluster()["instances"] if i["model"] == model]


def holders(node: RunningNode, model: str) -> set[str]:
    return {i["stages"][0]["node_id"] for i in instances(node, model)}


def stream(base_url: str, body: dict[str, Any], kill: Callable[[], None] | None) -> tuple[str, float | None]:
    """The streamed text, and (with `kill`, called `KILL_AFTER` content chunks in) the seconds
    from that call to the next content chunk."""
    text, chunks, killed_at, gap = "", 0, None, None
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            for choice in chunk.get("choices", []):
                if content := choice["delta"].get("content"):
                    if killed_at is not None and gap is None:
                        gap = time.perf_counter() - killed_at
                    text += content
                    chunks += 1
                    if kill is not None and chunks == KILL_AFTER:
                        kill()
                        killed_at = time.perf_counter()
    return text, gap


def load_seconds(node: RunningNode, model: str) -> float:
    """The last runner start to ready on `node`, from its log's timestamps."""

    def stamp(pattern: str) -> datetime:
        line = [entry for entry in node.log if re.search(pattern, entry)][-1]
        match = _STAMP.match(line)
        assert match, line
        return datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f")

    return (stamp(f"model {model} ready") - stamp(f"runner for {model} started")).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "random-380mb"], default="smollm2")
    parser.add_argument("--tokens", type=int, default=400)
    args = parser.parse_args()
    print(f"load average before: {loadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = builtin_model() if args.model == "smollm2" else random_380mb(root, builtin_model())
        nodes = start_cluster(3, root, "--prefix-cache-tokens", "0")
        try:
            run(nodes, folder, args.tokens)
        finally:
            stop_all(nodes)
    print(f"load average after: {loadavg()}")


def run(nodes: list[RunningNode], folder: Path, tokens: int) -> None:
    by_id = {n.node_id: n for n in nodes}
    leader = nodes[0]
    placed = httpx.post(
        f"{leader.base_url}/v1/instances", json={"model": str(folder), "replicas": 2}, timeout=60
    )
    assert placed.status_code in (200, 201), placed.text
    model = placed.json().get("model") or instances(leader, folder.name)[0]["model"]
    wait_until(lambda: len(holders(leader, model)) == 2, 30, "two replicas placed")
    for node_id in holders(leader, model):
        by_id[node_id].wait_for_log(f"model {model} ready", READY_TIMEOUT)
    client = next(n for n in nodes if n.node_id not in holders(leader, model))
    body = chat_body(model, [{"role": "user", "content": PROMPT}], tokens)
    whole, _ = stream(client.base_url, body, None)

    def serving() -> RunningNode | None:
        for node_id in holders(client, model):
            runners = by_id[node_id].health()["runners"]
            if any(r["active_requests"] for r in runners):
                return by_id[node_id]
        return None

    # 1. With a replica. Which one serves is known only once the request runs: a watcher finds it.
    victim: list[RunningNode] = []

    def watch() -> None:
        found = wait_until(serving, 60, "a replica serving")
        assert found is not None
        victim.append(found)

    watcher = threading.Thread(target=watch)
    watcher.start()

    def kill_serving() -> None:
        watcher.join(60)
        victim[0].process.send_signal(signal.SIGKILL)

    text, gap = stream(client.base_url, body, kill_serving)
    assert gap is not None
    print(f"with a replica:    kill -> next token {gap:6.2f} s   same text: {text == whole}")

    # 2. Without one: the model's instances deleted, one placed again on one of the two survivors;
    # the request enters at the other, and the holder is killed.
    survivors = [n for n in nodes if n not in victim]
    for instance in instances(client, model):
        httpx.delete(f"{client.base_url}/v1/instances/{instance['id']}", timeout=60).raise_for_status()
    wait_until(lambda: not instances(client, model), 60, "the instances deleted")
    placed = httpx.post(f"{client.base_url}/v1/instances", json={"model": str(folder)}, timeout=60)
    assert placed.status_code in (200, 201), placed.text
    wait_until(lambda: len(holders(client, model)) == 1, 30, "one instance placed")
    (holder_id,) = holders(client, model)
    holder = by_id[holder_id]
    entry = next(n for n in survivors if n is not holder)
    holder.wait_for_log(f"model {model} ready", READY_TIMEOUT)
    text, gap = stream(entry.base_url, body, lambda: holder.process.send_signal(signal.SIGKILL))
    assert gap is not None
    print(
        f"without a replica: kill -> next token {gap:6.2f} s   same text: {text == whole}   "
        f"(of which the re-placed runner's load: {load_seconds(entry, model):.2f} s)"
    )


if __name__ == "__main__":
    main()
