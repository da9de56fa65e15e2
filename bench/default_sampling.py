"""How often the built-in model answers a plain question right with the default sampling settings.

One real node serving the built-in SmolLM2-135M (imported into a temporary data dir, as a new
user's first `shoal run` does); 20 seeded chat completions (seed 0..19) of "What is the capital of
France?", each with no sampling field but the seed, so the model's defaults apply (its
generation_config.json over the server's, `protocol.sampling`). An answer counts when it says
"Paris". For comparison, the same 20 seeds with what an omitted temperature used to mean
(temperature 1.0, no top-p, top-k or min-p cut), with the model card's settings, and greedy.

    .venv/bin/python bench/default_sampling.py [--tries 20] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.nodes import RunningNode, start_node

QUESTION = "What is the capital of France?"
SETTINGS: dict[str, dict[str, Any]] = {
    "model defaults (no sampling field)": {},
    "temperature 1.0, no cut (the old default)": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0},
    "SmolLM2's model card (temperature 0.2, top_p 0.9)": {"temperature": 0.2, "top_p": 0.9},
    "greedy (temperature 0)": {"temperature": 0},
}


def answers(
    client: httpx.Client, node: RunningNode, extra: dict[str, Any], tries: int, tokens: int
) -> list[str]:
    """The answers to QUESTION for seeds 0..tries-1, with `extra` added to each request."""
    out = []
    for seed in range(tries):
        body = {
            "model": node.model_id,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": tokens,
            "seed": seed,
            **extra,
        }
        response = client.post(f"{node.base_url}/v1/chat/completions", json=body)
        response.raise_for_status()
        out.append(response.json()["choices"][0]["message"]["content"] or "")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="JSON",
        help='more settings to compare, e.g. {"temperature": 0.1}',
    )
    args = parser.parse_args()
    settings = {**SETTINGS, **{extra: json.loads(extra) for extra in args.also}}
    with tempfile.TemporaryDirectory() as data, httpx.Client(timeout=120) as client:
        node = start_node(data_dir=Path(data), model="smollm2-135m", ready_timeout=300)
        try:
            served = client.get(f"{node.base_url}/v1/models").json()["data"][0]
            print(f"model {served['id']}; defaults: {served.get('sampling_defaults')}")
            for name, extra in settings.items():
                said = answers(client, node, extra, args.tries, args.max_tokens)
                right = sum("paris" in text.lower() for text in said)
                print(f"\n{name}: {right}/{len(said)} answers say Paris")
                for seed, text in enumerate(said):
                    mark = "ok " if "paris" in text.lower() else "-- "
                    print(f"  {mark}seed {seed:2d}: {' '.join(text.split())[:90]}")
        finally:
            node.stop()


if __name__ == "__main__":
    main()
