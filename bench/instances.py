"""Pipeline overhead through the product: one model as a 1-, 2- and 3-stage instance of three real
nodes, its decode tokens/s and time to first token as an HTTP client sees them.

Three `shoal run --no-model` nodes on 127.0.0.1 join with `--peer`, prefix cache off (every run
prefills the whole prompt, as the first one does). For 1, 2 and 3 nodes in turn: `POST
/v1/instances {"model", "nodes"}`, wait until the entry node's runner is ready, stream the same
greedy chat completion once to warm up and then `--repeats` times through the entry node and, while
a node holds no shard, through that node too (the two alternate), then `DELETE /v1/instances/{id}`
and wait until the runners and the stage processes have stopped. Figures are medians of the repeats.
"ms/hop/token" = (ms per token at N stages - ms per token at 1 stage) / (N - 1), the same way in at
both. Every run's text must equal the first 1-stage run's ("same text").

On one machine the stages share its cores and run one after another for each token, so the ratio
to 1 stage measures what splitting costs, not a speed-up (targets: 2 stages >= 0.95x, 3 >= 0.9x).
Only a quiet machine gives that figure: beside other busy processes, N stage processes (each with
its BLAS threads) may get a larger share of the cores than one runner, and ratios above 1 appear.
Models: the built-in SmolLM2-135M (float32) and a random-weight llama of ~380 MB.

    .venv/bin/python bench/instances.py [--tokens 64] [--repeats 3] [--models smollm2 random]
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    PROMPT,
    Run,
    builtin_model,
    chat_body,
    loadavg,
    median_run,
    random_380mb,
    start_cluster,
    stop_all,
    stream_chat,
)
from tests.nodes import RunningNode
from tests.waiting import wait_until

READY_TIMEOUT = 300
"""Seconds for an instance's runner (and stages) to load; the machine may be busy with other work."""
ENTRY, OUTSIDER = "entry", "no-shard node"


@dataclass
class Row:
    model: str
    stages: int
    via: str
    layers: str
    """Each stage's layer range, `[0,15) [15,30)`."""
    run: Run
    texts: list[str]


def place(nodes: list[RunningNode], model_dir: Path, count: int) -> dict[str, Any]:
    """Ask (through the first node, which forwards to the leader) for an instance on `count` nodes."""
    body = {"model": str(model_dir), "nodes": count}
    created = httpx.post(f"{nodes[0].base_url}/v1/instances", json=body, timeout=60)
    if created.status_code != 201:
        raise RuntimeError(f"placing {model_dir.name} on {count} nodes: {created.text}")
    instance: dict[str, Any] = created.json()
    return instance


def ready_model(node: RunningNode) -> str | None:
    """The model id of the node's ready runner, if it has one."""
    return next((r["model"] for r in node.health()["runners"] if r["state"] == "ready"), None)


def logged_since(node: RunningNode, mark: int, pattern: re.Pattern[str]) -> bool:
    return any(pattern.search(line) for line in node.log[mark:])


def remove(nodes: list[RunningNode], instance: dict[str, Any]) -> None:
    """DELETE the instance; return once no node has a runner and every stage process said it stopped."""
    by_id = {n.node_id: n for n in nodes}
    marks = {n.node_id: len(n.log) for n in nodes}
    deleted = httpx.delete(f"{nodes[0].base_url}/v1/instances/{instance['id']}", timeout=60)
    if deleted.status_code != 200:
        raise RuntimeError(f"deleting instance {instance['id']}: {deleted.text}")
    wait_until(lambda: all(n.health()["runners"] == [] for n in nodes), 60, "runners stopped")
    for stage in instance["stages"][1:]:
        holder = by_id[stage["node_id"]]
        stopped = re.compile(rf"stage \[{stage['start_layer']}, {stage['end_layer']}\) stopped")
        check = functools.partial(logged_since, holder, marks[holder.node_id], stopped)
        wait_until(check, 60, stopped.pattern)


def measure(
    client: httpx.Client, nodes: list[RunningNode], model_dir: Path, count: int, args: argparse.Namespace
) -> list[Row]:
    """One instance of `model_dir` on `count` nodes: a row per way in (entry, and a node without a
    shard when there is one)."""
    instance = place(nodes, model_dir, count)
    try:
        stages = instance["stages"]
        layers = " ".join(f"[{s['start_layer']},{s['end_layer']})" for s in stages)
        holders = {s["node_id"] for s in stages}
        ways = {ENTRY: next(n for n in nodes if n.node_id == stages[0]["node_id"])}
        if outsider := next((n for n in nodes if n.node_id not in holders), None):
            ways[OUTSIDER] = outsider
        wait_until(lambda: ready_model(ways[ENTRY]), READY_TIMEOUT, f"{model_dir.name} ready")
        model_id = ready_model(ways[ENTRY])
        body = chat_body(model_id, [{"role": "user", "content": PROMPT}], args.tokens)
        for node in ways.values():  # warm up; a node without a shard may learn the route a moment later
            wait_until(functools.partial(stream_chat, client, node.base_url, body), 60, "an answer")
        runs: dict[str, list[Run]] = {via: [] for via in ways}
        texts: dict[str, list[str]] = {via: [] for via in ways}
        for _ in range(args.repeats):
            for via, node in ways.items():
                stream = stream_chat(client, node.base_url, body)
                runs[via].append(stream.run())
                texts[via].append(stream.text)
    finally:
        remove(nodes, instance)
    return [Row(model_dir.name, count, via, layers, median_run(runs[via]), texts[via]) for via in ways]


def reference_text(rows: list[Row], model: str) -> str:
    """The text of the model's first 1-stage run through the entry node."""
    return next(r for r in rows if r.model == model and r.stages == 1 and r.via == ENTRY).texts[0]


def print_table(rows: list[Row]) -> None:
    header = ("model", "stages", "via", "TTFT ms", "decode tok/s", "ms/token", "vs 1 stage", "ms/hop/token")
    print("{:<14} {:>6} {:<14} {:>8} {:>12} {:>9} {:>10} {:>13}  {}".format(*header, "same text  layers"))
    for row in rows:
        one = next(r for r in rows if r.model == row.model and r.via == row.via and r.stages == 1)
        reference = reference_text(rows, row.model)
        ms, ms_one = 1e3 / row.run.decode_tps, 1e3 / one.run.decode_tps
        hop = f"{(ms - ms_one) / (row.stages - 1):>13.2f}" if row.stages > 1 else f"{'':>13}"
        same = sum(t == reference for t in row.texts)
        print(
            f"{row.model:<14} {row.stages:>6} {row.via:<14} {row.run.ttft_s * 1e3:>8.0f}"
            f" {row.run.decode_tps:>12.2f} {ms:>9.2f} {row.run.decode_tps / one.run.decode_tps:>9.3f}x"
            f" {hop}  {same:>4}/{len(row.texts):<4}  {row.layers}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="*", default=["smollm2", "random"], choices=["smollm2", "random"])
    args = parser.parse_args()

    print(f"load average at the start: {loadavg()} (other work on this machine skews every figure)")
    builtin = builtin_model()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"smollm2": builtin}
        if "random" in args.models:
            models["random"] = random_380mb(Path(tmp), builtin)
        nodes = start_cluster(3, Path(tmp), "--prefix-cache-tokens", "0")
        try:
            with httpx.Client(timeout=600) as client:
                for name in args.models:
                    for count in (1, 2, 3):
                        found = measure(client, nodes, models[name], count, args)
                        rows += found
                        for row in found:
                            print(
                                f"  {row.model} {count} stage(s) via {row.via}: {row.layers},"
                                f" TTFT {row.run.ttft_s * 1e3:.0f} ms, {row.run.decode_tps:.2f} tok/s;"
                                f" load {loadavg()}",
                                flush=True,
                            )
        finally:
            stop_all(nodes)
    print(f"load average at the end: {loadavg()}")
    print(f"\n{args.tokens} tokens, greedy, median of {args.repeats} runs after a warm-up")
    print_table(rows)
    different = [r for r in rows if set(r.texts) != {reference_text(rows, r.model)}]
    print("same text across 1/2/3 stages and ways in:", "yes" if not different else "NO")


if __name__ == "__main__":
    main()
