"""Chat formats (a real tokenizer trained here, the real o200k harmony encoding) and the vocab checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from node.models.harmony_vocab import (
    VOCAB_FILE,
    HarmonyVocabError,
    check_harmony_vocab,
    load_harmony_encoding_offline,
    prepare_harmony_vocab,
)
from node.runner.formats import HarmonyFormat, PromptError, TemplateFormat, chat_format_for
from node.runner.parsers import HarmonyParser, TaggedTextParser
from protocol.chat import ChatMessage, ToolCallRef, ToolSpec

# A Hermes/Qwen-style ChatML template: tools in the system turn, tool calls as <tool_call> JSON, tool
# results as <tool_response>; it rejects roles it doesn't know and a misplaced system message.
CHATML_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% if not loop.first %}
{{- raise_exception('System message must be first') }}{% endif %}
{%- elif m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for tc in m.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}{{ raise_exception('Unknown role: ' + m.role) }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = ToolSpec(
    name="get_weather",
    description="Current weather in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TOOL_ROUND = (
    ChatMessage(role="system", content="You are terse."),
    ChatMessage(role="user", content="Weather in Paris?"),
    ChatMessage(
        role="assistant",
        reasoning="Need the tool.",
        tool_calls=(ToolCallRef(id="call_1", name="get_weather", arguments='{"city": "Paris"}'),),
    ),
    ChatMessage(role="tool", tool_call_id="call_1", content="18C, sunny"),
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE tokenizer with a ChatML template, made offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["You are a helpful assistant.", "What is the weather in Paris today?"], trainer)
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def hf_tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_harmony_vocab(tmp_path_factory.mktemp("data"))


# TemplateFormat ------------------------------------------------------------------------------------


def test_template_plain_chat(hf_tokenizer: Any) -> None:
    fmt = TemplateFormat(hf_tokenizer)
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]
    ids = fmt.prompt_tokens(messages, [], "auto")
    assert all(isinstance(i, int) for i in ids)
    assert hf_tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert fmt.stop_token_ids == frozenset({hf_tokenizer.convert_tokens_to_ids("<|im_end|>")})
    parser = fmt.new_parser()
    assert isinstance(parser, TaggedTextParser)
    assert [e.model_dump(exclude={"tokens"}) for e in parser.feed(0, "<think>x</think>y")] == [
        {"kind": "reasoning", "text": "x"},
        {"kind": "text", "text": "y"},
    ]


def test_template_tools_and_tool_messages(hf_tokenizer: Any) -> None:
    text = hf_tokenizer.decode(TemplateFormat(hf_tokenizer).prompt_tokens(TOOL_ROUND, [WEATHER], "auto"))
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_template_tool_choice(hf_tokenizer: Any) -> None:
    fmt = TemplateFormat(hf_tokenizer)
    other = ToolSpec(name="get_time")
    user = [ChatMessage(role="user", content="Hi")]
    assert "# Tools" not in hf_tokenizer.decode(fmt.prompt_tokens(user, [WEATHER, other], "none"))
    forced = hf_tokenizer.decode(fmt.prompt_tokens(user, [WEATHER, other], "get_time"))
    assert "get_time" in forced and "get_weather" not in forced
    with pytest.raises(PromptError) as info:
        fmt.prompt_tokens(user, [WEATHER], "nope")
    assert info.value.param == "tool_choice"


def test_template_exception_becomes_prompt_error(hf_tokenizer: Any) -> None:
    fmt = TemplateFormat(hf_tokenizer)
    bad = [ChatMessage(role="user", content="Hi"), ChatMessage(role="system", content="late")]
    with pytest.raises(PromptError, match="System message must be first"):
        fmt.prompt_tokens(bad, [], "auto")
    with pytest.raises(PromptError, match="Unknown role: developer"):
        fmt.prompt_tokens([ChatMessage(role="developer", content="x")], [], "auto")


def test_template_bad_replayed_arguments(hf_tokenizer: Any) -> None:
    call = ToolCallRef(id="c", name="get_weather", arguments="{not json")
    messages = [ChatMessage(role="user", content="Hi"), ChatMessage(role="assistant", tool_calls=(call,))]
    with pytest.raises(PromptError) as info:
        TemplateFormat(hf_tokenizer).prompt_tokens(messages, [WEATHER], "auto")
    assert info.value.param == "messages[1].tool_calls[0].function.arguments"


def test_template_missing(hf_tokenizer: Any) -> None:
    hf_tokenizer.chat_template = None
    with pytest.raises(PromptError, match="model has no chat template"):
        TemplateFormat(hf_tokenizer).prompt_tokens([ChatMessage(role="user", content="Hi")], [], "auto")


def test_template_open_think_starts_in_reasoning(hf_tokenizer: Any) -> None:
    hf_tokenizer.chat_template = CHATML_TEMPLATE + "{% if add_generation_prompt %}<think>\n{% endif %}"
    fmt = TemplateFormat(hf_tokenizer)
    prompt = fmt.prompt_tokens([ChatMessage(role="user", content="Hi")], [], "auto")
    events = fmt.new_parser().feed(0, "hmm</think>Hello")
    assert [(e.kind, getattr(e, "text", None)) for e in events] == [("reasoning", "hmm"), ("text", "Hello")]
    assert [e.kind for e in fmt.new_parser(prompt).feed(0, "hmm")] == ["reasoning"]


def test_template_through_mlx_lm_wrapper(hf_tokenizer: Any) -> None:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    wrapped = TokenizerWrapper(hf_tokenizer)
    fmt = chat_format_for("llama", wrapped, vocab_dir=None)
    assert isinstance(fmt, TemplateFormat)
    ids = fmt.prompt_tokens(TOOL_ROUND, [WEATHER], "auto")
    assert ids == TemplateFormat(hf_tokenizer).prompt_tokens(TOOL_ROUND, [WEATHER], "auto")


# HarmonyFormat -------------------------------------------------------------------------------------


def test_harmony_render_with_tools(vocab_dir: Path) -> None:
    fmt = chat_format_for("gpt_oss", None, vocab_dir=vocab_dir)
    assert isinstance(fmt, HarmonyFormat)
    encoding = load_harmony_encoding_offline(vocab_dir)
    messages = [ChatMessage(role="system", content="You are terse."), ChatMessage(role="user", content="Hi")]
    text = encoding.decode(fmt.prompt_tokens(messages, [WEATHER], "auto"))
    assert text.startswith("<|start|>system<|message|>")
    assert "<|start|>developer<|message|># Instructions\n\nYou are terse." in text
    assert "type get_weather = " in text and "Current weather in a city." in text
    assert text.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert fmt.stop_token_ids == frozenset(encoding.encode("<|call|><|return|>", allowed_special="all"))
    assert isinstance(fmt.new_parser(), HarmonyParser)


def test_harmony_render_tool_round(vocab_dir: Path) -> None:
    fmt = chat_format_for("gpt_oss", None, vocab_dir=vocab_dir)
    encoding = load_harmony_encoding_offline(vocab_dir)
    text = encoding.decode(fmt.prompt_tokens(TOOL_ROUND, [WEATHER], "auto"))
    assert (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
    ) in text
    assert (
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>18C, sunny<|end|>" in text
    )
    assert text.endswith("<|start|>assistant")
    assert "get_weather" not in encoding.decode(fmt.prompt_tokens(TOOL_ROUND[:2], [WEATHER], "none"))


def test_harmony_tool_result_needs_known_call(vocab_dir: Path) -> None:
    fmt = chat_format_for("gpt_oss", None, vocab_dir=vocab_dir)
    orphan = [ChatMessage(role="user", content="Hi"), ChatMessage(role="tool", tool_call_id="x", content="1")]
    with pytest.raises(PromptError) as info:
        fmt.prompt_tokens(orphan, [], "auto")
    assert info.value.param == "messages[1].tool_call_id"


# The vocab -----------------------------------------------------------------------------------------


def test_prepare_is_idempotent(tmp_path: Path) -> None:
    folder = prepare_harmony_vocab(tmp_path)
    assert folder == tmp_path / "vocab"
    before = (folder / VOCAB_FILE).stat().st_mtime_ns
    assert prepare_harmony_vocab(tmp_path) == folder
    assert (folder / VOCAB_FILE).stat().st_mtime_ns == before
    assert [p.name for p in folder.iterdir()] == [VOCAB_FILE]
    check_harmony_vocab(folder)


def test_prepare_replaces_a_corrupt_file(tmp_path: Path) -> None:
    (tmp_path / "vocab").mkdir()
    (tmp_path / "vocab" / VOCAB_FILE).write_text("junk")
    check_harmony_vocab(prepare_harmony_vocab(tmp_path))


def test_missing_vocab(tmp_path: Path) -> None:
    with pytest.raises(HarmonyVocabError, match=rf"{VOCAB_FILE} is missing.*make install"):
        check_harmony_vocab(tmp_path)
    with pytest.raises(HarmonyVocabError, match="missing"):
        chat_format_for("gpt_oss", None, vocab_dir=tmp_path)
    with pytest.raises(HarmonyVocabError, match="no vocab folder"):
        chat_format_for("gpt_oss", None, vocab_dir=None)


def test_corrupt_vocab(tmp_path: Path, vocab_dir: Path) -> None:
    data = bytearray((vocab_dir / VOCAB_FILE).read_bytes())
    data[100] ^= 1
    (tmp_path / VOCAB_FILE).write_bytes(bytes(data))
    with pytest.raises(HarmonyVocabError, match=rf"{tmp_path / VOCAB_FILE} is corrupt"):
        check_harmony_vocab(tmp_path)
    with pytest.raises(HarmonyVocabError, match="corrupt"):
        load_harmony_encoding_offline(tmp_path)


def test_other_models_never_touch_the_vocab(hf_tokenizer: Any, tmp_path: Path) -> None:
    assert isinstance(chat_format_for("qwen3", hf_tokenizer, vocab_dir=tmp_path / "nothing"), TemplateFormat)
