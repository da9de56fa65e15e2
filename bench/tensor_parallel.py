"""Two nodes decode faster than one: a tensor-parallel instance against one node, side by side.

Per model, in one run, each through the streamed chat API of real `shoal run` nodes (a warm-up
request, then decode of 64 greedy tokens after a short prompt and prefill of a ~500-token one,
as `bench/side_by_side.py` times them; memory: the peak RSS of each node with its children):
1. one node on one core (`taskset`), 2. one node on both cores, 3. a 2-node tensor-parallel
instance and 4. a 2-node pipeline instance, the nodes on the emulated LAN (`tests/lan.py`: network
namespaces on a bridge, 1 Gbit/s per link, mDNS inside), each node pinned to its own core.
Models: a random GGUF shaped like Llama-3.2-3B (hidden 3072, 28 layers, 24 query and 8 KV heads,
MLP 8192, SmolLM2's 49k vocabulary) and the 1B one of `bench/vs_llamacpp.py`, both Q4_0, made once
with llama-quantize and imported once (cached in `$SHOAL_BENCH_CACHE`). The issue's targets on the
3B shape are printed as met or missed, with what `"sharding": "auto"` chose on the same two nodes.

    sudo .venv/bin/python bench/tensor_parallel.py [--models 3b 1b] [--delay-ms 0.1] [--rate 1gbit]

Where the kernel has no `netem` (these Firecracker VMs), the LAN gets the rate but not the delay;
the table says so, and gives the link's measured round trip with each tensor row.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.llamacpp import (
    LlamaShape,
    bench_cache,
    ensure_llamacpp,
    prepare_ggufs,
    quantize_gguf,
    write_random_gguf,
)
from bench.side_by_side import PeakRss
from node.cpu.calibration import cpu_model
from tests.lan import emulated_lan
from tests.nodes import RunningNode, agreed_leader, start_node
from tests.waiting import wait_until

LLAMA_3B = LlamaShape(layers=28, hidden=3072, intermediate=8192, heads=24, kv_heads=8)
"""Llama-3.2-3B's shape (with a 49k vocabulary instead of 128k: ~3.1B parameters)."""
TARGETS = {"decode vs 1 core": 1.6, "prefill vs 1 core": 1.6, "decode vs 2 cores": 0.9}
MEMORY_TARGET = 0.55
"""Resident memory of each node of the tensor instance, at most this share of one node's."""
OUTPUT_TOKENS = 64
PROMPT_TOKENS = 500


def model_folder(name: str, threads: int) -> Path:
    """The Q4_0 model `name` ("1b", "3b") imported as an MLX folder, made and cached when missing."""
    from node.models.builtin import builtin_gguf_path
    from node.models.gguf_convert import convert

    cache = bench_cache()
    if name == "1b":
        gguf = prepare_ggufs(["q4_0"], False, ensure_llamacpp(threads), threads)["q4_0"]
    else:
        gguf = cache / "llama-3b-q4_0.gguf"
        if not gguf.is_file():
            f16 = cache / "llama-3b-f16.gguf"
            if not f16.is_file():
                print(
                    f"  writing {f16} ({LLAMA_3B.params(49152) / 1e9:.2f}B random parameters, F16)",
                    flush=True,
                )
                write_random_gguf(f16, LLAMA_3B, builtin_gguf_path())
            print(f"  llama-quantize {f16.name} -> {gguf.name}", flush=True)
            quantize_gguf(ensure_llamacpp(threads), f16, gguf, "Q4_0", threads)
            f16.unlink()  # 6 GB, needed only to make the Q4_0 file
    folder = cache / "imports" / f"tp-{gguf.stem}"
    if not (folder / "config.json").is_file():
        print(f"  importing {gguf.name}", flush=True)
        convert(gguf, folder)
    return folder


# ---- the client: runs where the entry node's API is reachable (inside its namespace) ----------------


def client(url: str, model: str, place: dict[str, Any] | None, prompt_tokens: int) -> dict[str, Any]:
    """With `place`: place the instance and wait for its first answer (a warm-up). Without: time a
    decode and a prefill. What `main` prints, as JSON."""
    import httpx

    from bench.common import chat_body, stream_chat
    from bench.runner_speed import STORY, messages

    with httpx.Client(timeout=1800) as http:
        auto = _auto_choice(http, url, place["model"]) if place and place["sharding"] == "tensor" else ""
        if place is not None:
            placed = http.post(f"{url}/v1/instances", json=place)
            if placed.status_code != 201:
                return {"error": f"placing: {placed.status_code} {placed.text[:300]}"}
        stream_chat(http, url, chat_body(model, messages(STORY), 8))  # warm-up: waits for the load
        if place is not None:
            return {"placed": placed.json()["id"], "auto": auto}
        decode = stream_chat(http, url, chat_body(model, messages(STORY), OUTPUT_TOKENS))
        long_text = STORY * max(1, prompt_tokens // 40)
        prefill = stream_chat(http, url, chat_body(model, messages(long_text), 2))
    prompt = int(prefill.usage["prompt_tokens"])
    return {
        "decode_tps": decode.run().decode_tps,
        "prefill_tps": prompt / prefill.ttft,
        "prompt_tokens": prompt,
        "output_tokens": int(decode.usage["completion_tokens"]),
    }


def _auto_choice(http: Any, url: str, model: str) -> str:
    """What `"sharding": "auto"` picks for `model` on these nodes, once each measured the other."""
    for _ in range(60):  # the nodes measure a new peer within a second or two
        members = http.get(f"{url}/v1/cluster").json()["members"]
        if all(m["round_trips_us"] for m in members):
            break
        time.sleep(0.5)
    preview = http.get(f"{url}/v1/instances/preview", params={"model": model, "nodes": 2, "sharding": "auto"})
    return str(preview.json().get("sharding_reason", preview.text[:300]))


# ---- the configurations ------------------------------------------------------------------------------


@dataclass
class Row:
    label: str
    decode_tps: float = float("nan")
    prefill_tps: float = float("nan")
    rss: list[int] = field(default_factory=list)
    """Peak RSS of each node (with its runner or rank process)."""
    parts: list[dict[str, int]] = field(default_factory=list)
    """Of each node, the peak RSS of each of its processes."""
    link: str = ""
    auto: str = ""
    """What "sharding": "auto" chose on the same nodes, and why (`protocol.auto_sharding`)."""
    error: str = ""


def _measure(row: Row, nodes: list[RunningNode], run: Any) -> Row:
    samplers = [PeakRss(node.process.pid) for node in nodes]
    try:
        result = run()
    finally:
        for sampler in samplers:
            sampler.stop()
    row.rss = [s.peak_sum for s in samplers]
    row.parts = [dict(s.peaks) for s in samplers]
    if "error" in result:
        row.error = result["error"]
    else:
        row.decode_tps, row.prefill_tps = result["decode_tps"], result["prefill_tps"]
    return row


def one_node(label: str, folder: Path, cores: list[str], root: Path) -> Row:
    """One node on loopback serving `folder` (on the cores given, all when empty)."""
    prefix = ["taskset", "-c", ",".join(cores)] if cores else []
    args = ("--prefix-cache-tokens", "0")
    node = start_node(
        *args, data_dir=root / label.replace(" ", "-"), model=str(folder), prefix=prefix, ready_timeout=900
    )
    try:
        model = node.model_id or folder.name
        return _measure(Row(label), [node], lambda: client(node.base_url, model, None, PROMPT_TOKENS))
    finally:
        node.stop(timeout=30)


def lan_instance(label: str, folder: Path, sharding: str, root: Path, rate: str, delay_ms: float) -> Row:
    """Two model-less nodes on the emulated LAN, each on its own core; `folder` placed over both."""
    with emulated_lan(2, rate=rate, delay_ms=delay_ms) as lan:
        nodes: list[RunningNode] = []
        try:
            for i, ns in enumerate(lan.namespaces):
                args = [*lan.node_args(i), "--prefix-cache-tokens", "0", "--cluster", lan.tag]
                nodes.append(
                    start_node(
                        *args, data_dir=root / f"{label}-{i}", model=None, netns=ns, prefix=lan.pinned(i)
                    )
                )
            wait_until(lambda: agreed_leader(nodes), 60, "the LAN's nodes agree on a leader")
            place = {"model": str(folder), "nodes": 2, "sharding": sharding}
            command = [sys.executable, __file__, "client", nodes[0].base_url, folder.name]

            def run(*extra: str) -> dict[str, Any]:
                done = lan.run_in(0, [*command, *extra], timeout=3600)
                result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
                return result

            row = Row(label, link=lan.describe())
            if "error" in (placed := run(json.dumps(place))):
                row.error = placed["error"]
                return row
            row.auto = placed.get("auto", "")
            return _measure(row, nodes, run)  # memory from here on, as for one node: after the load
        finally:
            for node in nodes:
                node.stop(timeout=30)


def _print(model: str, rows: dict[str, Row]) -> None:
    print(f"\n{model}:", flush=True)
    print(f"  {'configuration':<64} {'decode tok/s':>12} {'prefill tok/s':>13} {'peak RSS per node MB':>22}")
    for row in rows.values():
        rss = " + ".join(f"{r / 1e6:.0f}" for r in row.rss) or "-"
        cells = f"{row.decode_tps:>12.2f} {row.prefill_tps:>13.1f} {rss:>22}"
        print(f"  {row.label:<64} {cells}{'  ' + row.error if row.error else ''}")
        for i, parts in enumerate(row.parts):
            print(f"      node {i}: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in sorted(parts.items())))
        if row.link:
            print(f"      {row.link}")
        if row.auto:
            print(f'      "auto" on these nodes: {row.auto}')
    one, both, tensor = rows["1 node, 1 core"], rows["1 node, 2 cores"], rows["tensor"]
    ratios = {
        "decode vs 1 core": tensor.decode_tps / one.decode_tps,
        "prefill vs 1 core": tensor.prefill_tps / one.prefill_tps,
        "decode vs 2 cores": tensor.decode_tps / both.decode_tps,
    }
    for name, value in ratios.items():
        verdict = "met" if value >= TARGETS[name] else "MISSED"
        print(f"  tensor {name}: {value:.2f}x (target >= {TARGETS[name]}x: {verdict})")
    if tensor.rss and one.rss:
        share = max(tensor.rss) / one.rss[0]
        verdict = "met" if share <= MEMORY_TARGET else "MISSED"
        print(f"  tensor memory per node: {share:.2f}x one node's (target <= {MEMORY_TARGET}x: {verdict})")
    if "pipeline" in rows:
        print(f"  pipeline decode vs 1 core: {rows['pipeline'].decode_tps / one.decode_tps:.2f}x")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        place = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
        print(json.dumps(client(sys.argv[2], sys.argv[3], place, PROMPT_TOKENS)), flush=True)
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=("3b", "1b"), default=["3b", "1b"])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--delay-ms", type=float, default=0.1)
    parser.add_argument("--no-pipeline", action="store_true", help="skip the 2-node pipeline rows")
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}", flush=True)
    for name in args.models:
        folder = model_folder(name, threads=2)
        with tempfile.TemporaryDirectory(prefix="shoal-tp-") as tmp:
            root = Path(tmp)
            rows = {
                "1 node, 1 core": one_node("1 node, 1 core", folder, ["0"], root),
                "1 node, 2 cores": one_node("1 node, 2 cores", folder, [], root),
                "tensor": lan_instance(
                    "2 nodes, tensor, 1 core each", folder, "tensor", root, args.rate, args.delay_ms
                ),
            }
            if not args.no_pipeline:
                rows["pipeline"] = lan_instance(
                    "2 nodes, pipeline, 1 core each", folder, "pipeline", root, args.rate, args.delay_ms
                )
            _print(f"{name} Q4_0 ({folder.name})", rows)


if __name__ == "__main__":
    main()
