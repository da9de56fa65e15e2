"""Single-node serving overhead: Shoal's streaming API vs `mlx_lm.stream_generate` in one process.

Same model, same prompt, same run, greedy: decode tokens/s and time to first token on both paths.
Models: the built-in SmolLM2-135M (float32) and a random-weight llama of a few hundred MB.
The node runs plain MLX too (`--no-fast-path`) and caches no prefixes (`--prefix-cache-tokens 0`:
every repeat sends the same prompt), so the difference is what serving adds: HTTP, the runner
process, detokenizing and SSE. `runner_speed.py` measures what the fast path gains. Last, per
model: how soon a client hanging up mid-stream frees the runner (the hang-up is the cancel; tests
check only that the generation ends cancelled).

    .venv/bin/python bench/serving.py [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PROMPT, Run, builtin_model, chat_body, median_run, random_380mb, stream_chat, timed
from tests.nodes import start_node
from tests.waiting import wait_until


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

        return timed(stream_generate(self.model, self.tokenizer, self.prompt, max_tokens=tokens))[0]


def shoal_run(client: httpx.Client, base_url: str, model_id: str, tokens: int) -> Run:
    body = chat_body(model_id, [{"role": "user", "content": PROMPT}], tokens)
    return stream_chat(client, base_url, body).run()


def hangup_to_idle_s(client: httpx.Client, base_url: str, model_id: str) -> float:
    """Seconds from hanging up a long stream after 5 content chunks to the runner reporting no
    request in flight (read every 5 ms through /health, which adds its own milliseconds)."""
    body = chat_body(model_id, [{"role": "user", "content": PROMPT}], 1500)
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        content = (line for line in response.iter_lines() if '"content":"' in line)
        for _ in range(5):
            next(content)
    hung_up = time.perf_counter()

    def idle() -> bool:
        return all(r["active_requests"] == 0 for r in client.get(f"{base_url}/health").json()["runners"])

    wait_until(idle, 60, "the runner idle after the hang-up", interval=0.005)
    return time.perf_counter() - hung_up


def compare(model_dir: Path, data_dir: Path, tokens: int, repeats: int) -> tuple[Run, Run, float]:
    """Alternate the two paths run by run, so drifting background load hits both alike."""
    plain = PlainMlxLm(model_dir)
    node = start_node("--no-fast-path", "--prefix-cache-tokens", "0", data_dir=data_dir, model=str(model_dir))
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
            hangups = [hangup_to_idle_s(client, node.base_url, node.model_id) for _ in range(repeats)]
    finally:
        node.stop()
    return median_run(plain_runs), median_run(shoal_runs), statistics.median(hangups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    builtin = builtin_model()
    with tempfile.TemporaryDirectory() as tmp:
        random_big = random_380mb(Path(tmp), builtin)
        print(f"{'model':<16} {'path':<22} {'TTFT ms':>9} {'decode tok/s':>13}")
        for name, model_dir in (("smollm2-135m", builtin), ("random-380mb", random_big)):
            plain, shoal, hangup = compare(model_dir, Path(tmp) / "data", args.tokens, args.repeats)
            for path, run in (("mlx_lm.stream_generate", plain), ("shoal API (stream)", shoal)):
                print(f"{name:<16} {path:<22} {run.ttft_s * 1e3:>9.0f} {run.decode_tps:>13.2f}")
            print(
                f"{name:<16} {'ratio / overhead':<22} {(shoal.ttft_s - plain.ttft_s) * 1e3:>+9.0f} "
                f"{shoal.decode_tps / plain.decode_tps:>12.3f}x"
            )
            print(f"{name:<16} {'hang-up -> runner idle':<22} {hangup * 1e3:>9.0f}")


if __name__ == "__main__":
    main()
