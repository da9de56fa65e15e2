"""The runner's prefix cache and continuous batching, measured through the API of real nodes.

(b) Second-turn time to first token of a ~1,000-token conversation, on a node with the prefix cache
    and on one without (`--prefix-cache-tokens 0`); the two answers must be the same.
(c) Aggregate decode tokens/s with 1, 2, 4 and 8 concurrent streamed requests (different prompts),
    over the window in which all of them decode together. Tokens are counted by their content chunks,
    scaled by each stream's completion_tokens / chunks (a token that only adds a space, say, sends
    its text with the next one).

One node runs at a time (two would share the CPU). Default model: the built-in SmolLM2-135M.

    .venv/bin/python bench/runner_features.py [--random] [--repeats 3] [--tokens 64]

`--random` uses a random-weight llama instead (made under a temp dir): a quick check, not a figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PROMPT, Stream, builtin_model, chat_body, stream_chat
from tests.model_factory import make_random_model
from tests.nodes import RunningNode, start_node

LONG_TEXT = " ".join(
    f"Paragraph {i}: the harbour master logged ship number {i * 7 % 101}, its cargo of "
    f"{['salt', 'timber', 'wool', 'copper', 'grain'][i % 5]}, and the tide at {i % 12 + 1} o'clock."
    for i in range(30)
)
"""~1,000 tokens of filler the conversation is about."""
PROMPTS = [
    PROMPT,
    "Explain in detail how a steam engine works, step by step.",
    "Describe the water cycle to a ten year old, with many examples.",
    "List the planets of the solar system and tell me one fact about each.",
    "What should I pack for a week of hiking in the mountains? Be thorough.",
    "Tell me about the history of the printing press and its effects on Europe.",
    "Give me a recipe for bread and explain why each step matters.",
    "Compare cats and dogs as pets, covering cost, time and temperament.",
]


def stream(client: httpx.Client, node: RunningNode, messages: list[dict[str, str]], tokens: int) -> Stream:
    return stream_chat(client, node.base_url, chat_body(node.model_id, messages, tokens))


def second_turn(client: httpx.Client, node: RunningNode, nonce: str, tokens: int) -> Stream:
    """Turn 1 about LONG_TEXT, then the timed turn 2 with turn 1's answer in the history."""
    conversation = [
        {"role": "system", "content": f"You are a careful clerk (session {nonce})."},
        {"role": "user", "content": f"Here is the harbour log:\n{LONG_TEXT}\nWhat did ship 14 carry?"},
    ]
    first = stream(client, node, conversation, tokens)
    conversation += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Which cargo appears most often in the log?"},
    ]
    return stream(client, node, conversation, tokens)


def aggregate_decode(
    client: httpx.Client, node: RunningNode, n: int, tokens: int
) -> tuple[float, float, list[str]]:
    """(aggregate tokens/s while all n decode together, mean time to first token, the n answers)."""
    barrier = threading.Barrier(n)

    def one(prompt: str) -> Stream:
        barrier.wait(timeout=60)
        return stream(client, node, [{"role": "user", "content": prompt}], tokens)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, PROMPTS[:n]))
    begin = max(r.times[0] for r in results)
    end = min(r.times[-1] for r in results)
    in_window = 0.0
    for r in results:
        per_chunk = int(r.usage["completion_tokens"]) / len(r.times)
        in_window += per_chunk * sum(1 for t in r.times if begin < t <= end)
    answers = [r.text for r in results]
    return in_window / (end - begin), statistics.mean(r.ttft for r in results), answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random", action="store_true", help="random-weight llama instead of SmolLM2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        builtin = builtin_model()
        model_dir = (
            make_random_model(Path(tmp) / "random", tokenizer_from=builtin) if args.random else builtin
        )
        print(f"model: {model_dir.name}; fast path: {os.environ.get('SHOAL_FAST_PATH', 'default (on)')}")
        client = httpx.Client(timeout=600)

        # (b) second-turn TTFT, with and without the prefix cache
        ttft: dict[str, list[float]] = {}
        answers: dict[str, list[str]] = {}
        prompt_tokens = cached_tokens = 0
        for label, flags in (("cache", ()), ("no cache", ("--prefix-cache-tokens", "0"))):
            node = start_node(*flags, data_dir=Path(tmp) / label.replace(" ", "-"), model=str(model_dir))
            try:
                second_turn(client, node, "warm-up", 4)
                for r in range(args.repeats):
                    result = second_turn(client, node, f"run{r}", args.tokens)
                    ttft.setdefault(label, []).append(result.ttft)
                    answers.setdefault(label, []).append(result.text)
                    if label == "cache":
                        prompt_tokens = int(result.usage["prompt_tokens"])
                        details = result.usage["prompt_tokens_details"]
                        cached_tokens = int(details["cached_tokens"])
            finally:
                node.stop()
        with_cache, without = statistics.median(ttft["cache"]), statistics.median(ttft["no cache"])
        print(f"\n(b) second turn of a conversation: {prompt_tokens} prompt tokens, {cached_tokens} cached")
        print(f"{'':>12} {'TTFT median':>12} {'runs':>24}")
        for label in ("no cache", "cache"):
            runs = ", ".join(f"{t:.3f}" for t in ttft[label])
            print(f"{label:>12} {statistics.median(ttft[label]):>11.3f}s {runs:>24}")
        print(f"ratio cache / no cache: {with_cache / without:.3f} (target <= 0.2)")
        print(f"same answers with and without the cache: {answers['cache'] == answers['no cache']}")

        # (c) aggregate decode throughput for 1, 2, 4, 8 concurrent requests
        node = start_node(
            "--max-concurrent",
            "8",
            "--prefix-cache-tokens",
            "0",
            data_dir=Path(tmp) / "batch",
            model=str(model_dir),
        )
        try:
            # Each prompt alone first: the reference every batched answer must equal (and a warm-up).
            alone = [
                stream(client, node, [{"role": "user", "content": p}], args.tokens).text for p in PROMPTS
            ]
            rates: dict[int, list[float]] = {}
            ttfts: dict[int, list[float]] = {}
            same: dict[int, int] = {}
            for _ in range(args.repeats):
                for n in (1, 2, 4, 8):
                    rate, first, texts = aggregate_decode(client, node, n, args.tokens)
                    rates.setdefault(n, []).append(rate)
                    ttfts.setdefault(n, []).append(first)
                    same[n] = same.get(n, 0) + sum(a == b for a, b in zip(texts, alone, strict=False))
        finally:
            node.stop()
        base = statistics.median(rates[1])
        print(f"\n(c) decode with concurrent requests ({args.tokens} tokens each, greedy)")
        header = f"{'requests':>8} {'aggregate tok/s':>16} {'per stream':>11} {'vs 1':>6} {'mean TTFT':>10}"
        print(f"{header} {'answers = alone':>16}")
        for n in (1, 2, 4, 8):
            rate = statistics.median(rates[n])
            mean_ttft = statistics.median(ttfts[n])
            row = f"{n:>8} {rate:>16.1f} {rate / n:>11.1f} {rate / base:>5.2f}x {mean_ttft:>9.3f}s"
            print(f"{row} {same[n]:>10}/{n * args.repeats}")
        print("target: 4 requests >= 2.5x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
