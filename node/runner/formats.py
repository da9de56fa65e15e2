"""Chat formats: how a model's prompt is built from messages, and which parser reads its output.

Two formats: `HarmonyFormat` for GPT-OSS (openai-harmony renders the conversation) and
`TemplateFormat` for every other model (the tokenizer's Jinja chat template). `chat_format_for`
picks one by `model_type`. Nothing here touches MLX.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2

from node.models.harmony_vocab import HarmonyVocabError, load_harmony_encoding_offline
from node.runner.parsers import HarmonyParser, OutputParser, TaggedTextParser
from protocol.chat import ChatMessage, ToolSpec

HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
"""Chat templates' end-of-turn tokens; any the tokenizer has as an added token also ends generation
(some models' configs name only the end-of-text token as eos)."""


class PromptError(ValueError):
    """The messages can't be rendered for this model (roles the template rejects, a bad tool call...).

    A fault in the request, not in the server: the API answers it with HTTP 400. `param` names the
    offending request field when known (`messages[2].tool_call_id`).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ChatFormat(Protocol):
    def prompt_tokens(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], tool_choice: str
    ) -> list[int]:
        """The prompt's token ids, ending where the assistant's answer starts. Raises `PromptError`."""
        ...

    def new_parser(self, prompt: Sequence[int] | None = None) -> OutputParser:
        """A parser for one generation's output (stateful: one per request).

        `prompt`: the ids `prompt_tokens` returned for this request; without it, a format may go by
        the last prompt it rendered.
        """
        ...

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end generation, besides the tokenizer's eos."""
        ...


def chat_format_for(model_type: str, tokenizer: Any, *, vocab_dir: Path | None) -> ChatFormat:
    """The chat format for a model. `vocab_dir` (the prepared o200k folder) matters only for GPT-OSS.

    Raises `HarmonyVocabError` for a GPT-OSS model whose vocab is missing or corrupt; never for
    other models.
    """
    if model_type in HARMONY_MODEL_TYPES:
        if vocab_dir is None:
            raise HarmonyVocabError(
                "a GPT-OSS model needs the o200k vocab, but no vocab folder was given; run `make install`"
            )
        return HarmonyFormat(load_harmony_encoding_offline(vocab_dir))
    return TemplateFormat(tokenizer)


def selected_tools(tools: Sequence[ToolSpec], tool_choice: str) -> list[ToolSpec]:
    """The tools to show the model: none for "none", only the named one for a forced function."""
    if tool_choice == "none":
        return []
    if tool_choice in ("auto", "required"):
        return list(tools)
    chosen = [t for t in tools if t.name == tool_choice]
    if not chosen:
        raise PromptError(f"tool_choice names {tool_choice!r}, which is not in tools", param="tool_choice")
    return chosen


def parse_arguments(arguments: str, *, param: str) -> dict[str, Any]:
    """A replayed tool call's JSON arguments as a dict ("" counts as no arguments)."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError as exc:
        raise PromptError(f"tool call arguments are not valid JSON: {exc}", param=param) from exc
    if not isinstance(value, dict):
        raise PromptError("tool call arguments must be a JSON object", param=param)
    return value


class TemplateFormat:
    """Any model with a Jinja chat template (an HF tokenizer or mlx-lm's `TokenizerWrapper`).

    Messages become the HF dict form; tools the OpenAI function dicts. Output is read by
    `TaggedTextParser`, starting in reasoning when the rendered prompt ends with an open `<think>`.
    A model without a chat template is refused (`PromptError`): no made-up fallback format.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._starts_in_reasoning = False
        added: Mapping[str, int] = _added_vocab(tokenizer)
        self._stop_ids = frozenset(added[t] for t in END_OF_TURN_TOKENS if t in added)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_ids

    def prompt_tokens(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], tool_choice: str
    ) -> list[int]:
        if not _has_chat_template(self._tokenizer):
            raise PromptError("model has no chat template")
        shown = selected_tools(tools, tool_choice)
        dicts = [_hf_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        tool_dicts = [_openai_tool(t) for t in shown] or None
        try:
            out = self._tokenizer.apply_chat_template(
                dicts, tools=tool_dicts, add_generation_prompt=True, tokenize=True
            )
        except jinja2.TemplateError as exc:
            raise PromptError(f"the model's chat template rejected the messages: {exc}") from exc
        ids = _as_ids(out)
        self._starts_in_reasoning = self._opens_reasoning(ids)
        return ids

    def new_parser(self, prompt: Sequence[int] | None = None) -> OutputParser:
        """Starts in reasoning if `prompt` (default: the last prompt rendered) ends in `<think>`."""
        opens = self._starts_in_reasoning if prompt is None else self._opens_reasoning(prompt)
        return TaggedTextParser(starts_in_reasoning=opens)

    def _opens_reasoning(self, prompt: Sequence[int]) -> bool:
        tail: str = self._tokenizer.decode(list(prompt[-8:]))
        return tail.endswith(("<think>", "<think>\n"))


class HarmonyFormat:
    """GPT-OSS: openai-harmony renders the conversation and parses the output tokens.

    System and developer messages become the developer message's instructions (joined in order);
    tools become `functions.*` in it. Assistant turns: reasoning -> analysis, tool calls ->
    commentary to `functions.NAME`, content -> final (commentary, as a preamble, when the turn also
    calls tools). Tool results come from `functions.NAME`, the name taken from `name` or looked up
    by `tool_call_id`.
    """

    def __init__(self, encoding: Any) -> None:
        self._encoding = encoding
        self._stop_ids = frozenset(encoding.stop_tokens_for_assistant_actions())

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_ids

    def new_parser(self, prompt: Sequence[int] | None = None) -> OutputParser:
        return HarmonyParser(self._encoding)

    def prompt_tokens(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], tool_choice: str
    ) -> list[int]:
        from openai_harmony import Conversation, HarmonyError, Role

        conversation = Conversation.from_messages(_harmony_messages(messages, tools, tool_choice))
        try:
            return list(self._encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))
        except HarmonyError as exc:
            raise PromptError(f"the conversation cannot be rendered for GPT-OSS: {exc}") from exc


def _harmony_messages(
    messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], tool_choice: str
) -> list[Any]:
    from openai_harmony import (
        Author,
        DeveloperContent,
        Message,
        Role,
        SystemContent,
        ToolDescription,
    )

    shown = selected_tools(tools, tool_choice)
    instructions = [m.content for m in messages if m.role in ("system", "developer") and m.content]
    out: list[Any] = [Message.from_role_and_content(Role.SYSTEM, SystemContent.new())]
    if instructions or shown:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if shown:
            developer = developer.with_function_tools(
                [ToolDescription.new(t.name, t.description or "", t.parameters or None) for t in shown]
            )
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m.role == "user":
            out.append(Message.from_role_and_content(Role.USER, m.content or ""))
        elif m.role == "assistant":
            if m.reasoning:
                out.append(_assistant(m.reasoning, "analysis"))
            if m.content:
                out.append(_assistant(m.content, "commentary" if m.tool_calls else "final"))
            for j, call in enumerate(m.tool_calls):
                parse_arguments(call.arguments, param=f"messages[{i}].tool_calls[{j}].function.arguments")
                call_names[call.id] = call.name
                out.append(
                    _assistant(call.arguments or "{}", "commentary")
                    .with_recipient(f"functions.{call.name}")
                    .with_content_type("<|constrain|>json")
                )
        elif m.role == "tool":
            name = m.name or call_names.get(m.tool_call_id or "")
            if not name:
                raise PromptError(
                    "a tool message must answer an earlier assistant tool call (unknown tool_call_id)",
                    param=f"messages[{i}].tool_call_id",
                )
            out.append(
                Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), m.content or "")
                .with_channel("commentary")
                .with_recipient("assistant")
            )
    return out


def _assistant(text: str, channel: str) -> Any:
    from openai_harmony import Message, Role

    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def _hf_message(m: ChatMessage, param: str) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.role == "assistant":
        if m.reasoning:
            out["reasoning_content"] = m.reasoning
        if m.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.name,
                        "arguments": parse_arguments(
                            c.arguments, param=f"{param}.tool_calls[{j}].function.arguments"
                        ),
                    },
                }
                for j, c in enumerate(m.tool_calls)
            ]
    elif m.role == "tool":
        out["tool_call_id"] = m.tool_call_id or ""
    if m.name is not None:
        out["name"] = m.name
    return out


def _openai_tool(t: ToolSpec) -> dict[str, Any]:
    parameters = t.parameters or {"type": "object", "properties": {}}
    function: dict[str, Any] = {"name": t.name, "parameters": parameters}
    if t.description:
        function["description"] = t.description
    return {"type": "function", "function": function}


def _has_chat_template(tokenizer: Any) -> bool:
    flag = getattr(tokenizer, "has_chat_template", None)  # mlx-lm's TokenizerWrapper
    if isinstance(flag, bool):
        return flag
    return getattr(tokenizer, "chat_template", None) is not None


def _added_vocab(tokenizer: Any) -> Mapping[str, int]:
    get = getattr(tokenizer, "get_added_vocab", None)
    if get is None:
        return {}
    vocab = get()
    return vocab if isinstance(vocab, Mapping) else {}


def _as_ids(out: Any) -> list[int]:
    """`apply_chat_template(tokenize=True)` output as a flat id list (transformers 5 gives a dict)."""
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    ids = list(out)
    if ids and isinstance(ids[0], list | tuple):
        ids = list(ids[0])
    return [int(i) for i in ids]
