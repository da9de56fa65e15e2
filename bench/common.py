"""What the benchmarks share: the prompt, timing a stream of tokens, medians, the models, real nodes.

Each script puts the repository root on `sys.path` before it imports this module (`bench` is a
package only so that the scripts and this module have one name each).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from node.models import default_data_dir, ensure_builtin_model
from tests.model_factory import make_random_model
from tests.nodes import RunningNode, agreed_leader, start_node
from tests.waiting import wait_until

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
"""The chat message the serving and pipeline benchmarks send (one user turn, greedy)."""

T = TypeVar("T")


@dataclass
class Run:
    """One generation: seconds to its first token and its decode rate after that."""

    ttft_s: float
    decode_tps: float


def rate(tokens: int, first: float, last: float) -> float:
    """Decode tokens/s: the tokens after the first over the time from the first to the last; nan
    when there is nothing to divide."""
    return (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")


def timed(items: Iterable[T]) -> tuple[Run, list[T]]:
    """Consume `items` (tokens, or mlx-lm responses), timing each arrival from the call."""
    start = time.perf_counter()
    first = last = 0.0
    out: list[T] = []
    for item in items:
        last = time.perf_counter()
        first = first or last
        out.append(item)
    return Run(first - start, rate(len(out), first, last)), out


def median_run(runs: list[Run]) -> Run:
    """The median TTFT and the median decode rate (each on its own) of `runs`."""
    return Run(statistics.median(r.ttft_s for r in runs), statistics.median(r.decode_tps for r in runs))


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (`/proc/loadavg`), as `0.42 0.76 1.40`."""
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def builtin_model() -> Path:
    """The built-in SmolLM2-135M (float32) folder, imported on first use."""
    return ensure_builtin_model(default_data_dir())


def random_380mb(parent: Path, builtin: Path) -> Path:
    """A random-weight llama of ~380 MB in float32 (8 layers, hidden 768) in `parent`/random-380mb,
    with the built-in model's tokenizer."""
    return make_random_model(
        parent / "random-380mb",
        tokenizer_from=builtin,
        num_layers=8,
        hidden_size=768,
        intermediate_size=2048,
        num_heads=12,
        num_kv_heads=4,
    )


def start_cluster(size: int, root: Path, *args: str, timeout: float = 60) -> list[RunningNode]:
    """`size` model-less nodes (`root`/n0, n1, ...; each bootstrapping to the first, `args` added to
    every one), returned once all agree on the lowest id as leader. Stops them all if that fails."""
    first = start_node(*args, data_dir=root / "n0", model=None)
    nodes = [first]
    try:
        for i in range(1, size):
            nodes.append(start_node("--peer", first.p2p_addr, *args, data_dir=root / f"n{i}", model=None))
        wait_until(lambda: agreed_leader(nodes) == min(n.node_id for n in nodes), timeout, "agreed")
    except BaseException:
        stop_all(nodes)
        raise
    return nodes


def stop_all(nodes: list[RunningNode]) -> None:
    for node in nodes:
        node.stop()


def chat_body(model: str | None, messages: list[dict[str, str]], tokens: int) -> dict[str, Any]:
    """A streamed greedy chat completion of at most `tokens` tokens that ends with its usage."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class Stream:
    """A streamed chat completion as the client saw it: when each content chunk came, the text, and
    the usage of the last chunk that carried one."""

    start: float
    times: list[float] = field(default_factory=list)
    text: str = ""
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.start

    def run(self) -> Run:
        """TTFT and the decode rate over the completion tokens (chunks may carry several)."""
        return Run(self.ttft, rate(int(self.usage["completion_tokens"]), self.times[0], self.times[-1]))


def stream_chat(client: httpx.Client, base_url: str, body: dict[str, Any]) -> Stream:
    """POST a streamed chat completion to `base_url` and read it to the end."""
    result = Stream(time.perf_counter())
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if content := choice["delta"].get("content"):
                    result.times.append(time.perf_counter())
                    result.text += content
            result.usage = chunk.get("usage") or result.usage
    return result
