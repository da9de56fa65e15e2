"""The tokenizer a GGUF file describes, rebuilt as `tokenizer.json` + `tokenizer_config.json`.

A GGUF holds no `tokenizer.json`: llama.cpp keeps the vocabulary, the merges, the token types, the
special ids and the chat template as metadata, and names the pre-tokenizer (how text is cut before
BPE) only by a key, `tokenizer.ggml.pre`. We build the tokenizer ourselves with the `tokenizers`
library (the one transformers and mlx-lm run underneath) instead of asking transformers to:

- `AutoTokenizer.from_pretrained(folder, gguf_file=...)` needs `torch` (its GGUF reader imports
  it): a 700 MB dependency for reading a few lists.
- transformers' converter has no entry for `pre == "smollm"` and falls back to plain GPT-2
  splitting. That happens to give the same ids for SmolLM2 (its vocabulary has no multi-digit
  tokens) but is wrong in principle; here each known `pre` maps to the splitting llama.cpp uses
  (llama-vocab.cpp), and an unknown one is refused rather than guessed.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are supported; SentencePiece
ones (`"llama"`: Llama 2, Mistral, TinyLlama) are refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

TOKEN_TYPE_CONTROL = 3
"""llama.cpp's token type for special tokens like `<|im_start|>`: matched whole, skipped on decode."""
TOKEN_TYPE_USER_DEFINED = 4
"""Added tokens that are not special (e.g. `<think>`): matched whole, kept on decode."""

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""o200k (gpt-4o, gpt-oss): cased words keep their case run and contraction, `/` stays with newlines."""


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    """GPT-2's regex (built into `ByteLevel(use_regex=True)`)."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    """Every digit on its own, then GPT-2's regex (llama.cpp: `\\p{N}` then the GPT-2 pattern)."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _regex_split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


_PRE_TOKENIZERS = {
    "default": _gpt2_split,
    "gpt-2": _gpt2_split,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "llama-bpe": lambda: _regex_split(_LLAMA3_SPLIT),
    "llama3": lambda: _regex_split(_LLAMA3_SPLIT),
    "qwen2": lambda: _regex_split(_QWEN2_SPLIT),
    "gpt-4o": lambda: _regex_split(_O200K_SPLIT),
}
"""`tokenizer.ggml.pre` -> how text is split before BPE, as llama.cpp's llama-vocab.cpp does it."""


class GGUFTokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing or of a kind we cannot rebuild."""


def check_tokenizer_kind(meta: Mapping[str, Any]) -> str:
    """The pre-tokenizer name, once the vocabulary kind and that name are ones we rebuild; raises
    `GGUFTokenizerError`. Reads two keys only, so the header check (preflight) refuses before the start."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(
            f"tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') vocabularies are"
        )
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in _PRE_TOKENIZERS:
        raise GGUFTokenizerError(f"pre-tokenizer {pre!r} is not supported; known: {sorted(_PRE_TOKENIZERS)}")
    return pre


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """The `tokenizers.Tokenizer` (vocab, merges, pre-tokenizer, special tokens) of a GGUF's metadata.

    `meta` holds plain Python values (as `gguf.read_gguf` returns them). Raises `GGUFTokenizerError`.
    """
    pre = check_tokenizer_kind(meta)
    tokens = _str_list(meta, "tokenizer.ggml.tokens")
    merges = [_split_merge(m) for m in _str_list(meta, "tokenizer.ggml.merges")]

    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()

    types = _int_list(meta.get("tokenizer.ggml.token_type", ()))
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind_ in zip(tokens, types, strict=False)
            if kind_ == TOKEN_TYPE_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind_ in zip(tokens, types, strict=False)
            if kind_ == TOKEN_TYPE_USER_DEFINED
        ]
    )
    tokenizer.post_processor = _post_processor(meta, tokens)
    return tokenizer


def tokenizer_config(meta: Mapping[str, Any], *, context_length: int | None) -> dict[str, Any]:
    """`tokenizer_config.json`: special tokens by text, BOS/EOS flags and the chat template.

    The class is the generic `PreTrainedTokenizerFast`, so transformers loads `tokenizer.json` as
    it is instead of rebuilding a model-specific pipeline around its vocabulary.
    """
    tokens = _str_list(meta, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for field, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        token_id = meta.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            config[field] = tokens[token_id]
    if context_length:
        config["model_max_length"] = context_length
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return config


def _post_processor(meta: Mapping[str, Any], tokens: Sequence[str]) -> processors.PostProcessor:
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and isinstance(bos_id, int) and 0 <= bos_id < len(tokens):
        bos = tokens[bos_id]
        return processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    return processors.ByteLevel(trim_offsets=False)


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise GGUFTokenizerError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
    return left, right


def _str_list(meta: Mapping[str, Any], key: str) -> list[str]:
    value = meta.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise GGUFTokenizerError(f"the GGUF has no {key} (a list of strings)")
    return value


def _int_list(value: object) -> list[int]:
    if isinstance(value, list | tuple):
        return [int(v) for v in value]
    return []
