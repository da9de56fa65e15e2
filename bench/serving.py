"""Single-node serving overhead: Shoal's streaming API vs `mlx_lm.stream_generate` in one process.

Same model, same prompt, same run, greedy: decode tokens/s and time to first token on both paths.
Models: the built-in SmolLM2-135M (float32) and a random-weight llama of a few hundred MB.

    .venv/bin/python bench/serving.py [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.models import default_data_dir, ensure_builtin_model
from tests.model_factory import make_random_model
from tests.nodes import start_node

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Run:
    ttft_s: float
    decode_tps: float


def _rate(tokens: int, first: float, last: float) -> float:
    return (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")


class PlainMlxLm:
    """The model loaded in this process, generating as a user of `mlx_lm.stream_generate` would."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm import load

        self.model, self.tokenizer = load(str(model_dir))[:2]
        self.prompt = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True
        )

    def run(self, tokens: int) -> Run:
        from mlx_lm import stream_generate

        start = time.perf_counter()
        first = last = 0.0
        count = 0
        for _ in stream_generate(self.model, self.tokenizer, self.prompt, max_tokens=tokens):
            last = time.perf_counter()
            first = first or last
            count += 1
        return Run(first - start, _rate(count, first, last))


def shoal_run(client: httpx.Client, base_url: str, model_id: str, tokens: int) -> Run:
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = 0.0
    completion_tokens = 0
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            if any(c["delta"].get("content") for c in chunk["choices"]):
                last = time.perf_counter()
                first = first or last
    return Run(first - start, _rate(completion_tokens, first, last))


def compare(model_dir: Path, data_dir: Path, tokens: int, repeats: int) -> tuple[Run, Run]:
    """Alternate the two paths run by run, so drifting background load hits both alike."""
    plain = PlainMlxLm(model_dir)
    node = start_node(data_dir=data_dir, model=str(model_dir))
    plain_runs, shoal_runs = [], []
    try:
        assert node.model_id is not None
        with httpx.Client(timeout=600) as client:
            for i in range(repeats + 1):  # the first round warms both up
                plain_run = plain.run(tokens)
                api_run = shoal_run(client, node.base_url, node.model_id, tokens)
                if i:
                    plain_runs.append(plain_run)
                    shoal_runs.append(api_run)
    finally:
        node.stop()
    return _median(plain_runs), _median(shoal_runs)


def _median(runs: list[Run]) -> Run:
    return Run(statistics.median(r.ttft_s for r in runs), statistics.median(r.decode_tps for r in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    builtin = ensure_builtin_model(default_data_dir())
    with tempfile.TemporaryDirectory() as tmp:
        random_big = make_random_model(
            Path(tmp) / "random-380mb",
            tokenizer_from=builtin,
            num_layers=8,
            hidden_size=768,
            intermediate_size=2048,
            num_heads=12,
            num_kv_heads=4,
        )
        print(f"{'model':<16} {'path':<22} {'TTFT ms':>9} {'decode tok/s':>13}")
        for name, model_dir in (("smollm2-135m", builtin), ("random-380mb", random_big)):
            plain, shoal = compare(model_dir, Path(tmp) / "data", args.tokens, args.repeats)
            for path, run in (("mlx_lm.stream_generate", plain), ("shoal API (stream)", shoal)):
                print(f"{name:<16} {path:<22} {run.ttft_s * 1e3:>9.0f} {run.decode_tps:>13.2f}")
            print(
                f"{name:<16} {'ratio / overhead':<22} {(shoal.ttft_s - plain.ttft_s) * 1e3:>+9.0f} "
                f"{shoal.decode_tps / plain.decode_tps:>12.3f}x"
            )


if __name__ == "__main__":
    main()
