"""Anthropic's Messages API request body (`POST /v1/messages`, and `/v1/messages/
count_tokens`), the parts specd serves, checked strictly, and the chat request it is:
`system` a system message, each message's `text` blocks its text, an assistant's
`tool_use` blocks its tool calls and a user's `tool_result` blocks tool messages, `tools`
(their `input_schema`) and `tool_choice` (`auto`, `any`, `tool`, `none`) as the chat
endpoint takes them (`router.anthropic_answer` writes the answer back in Anthropic's
shape). Images and documents are refused (400, naming the field); `thinking` is accepted
and has no effect (specd's models do not think apart), as `cache_control` marks, and
what Claude Code sends for Anthropic's betas: `context_management` (its edits are not
applied: the whole conversation is the prompt, and one past the context is refused in
Anthropic's words), a tool's `input_examples` and `defer_loading` (every tool is in the
prompt), and `output_config.task_budget`."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from router.body import BodyError, Request, Strict
from router.openai_schema import ChatBody, Positive
from router.tools import Call


class CacheControl(Strict):
    """Accepted where a client marks a prompt's parts for Anthropic's cache: specd's prefix
    cache keeps whatever prompts repeat, unasked."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list | None = None


class ToolUseBlock(Strict):
    """A call the model made earlier."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # what Anthropic's own blocks carry, handed back by clients that echo them whole
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(Strict):
    """What the caller's tool returned for a call."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(Strict):
    """An earlier answer's thinking, handed back: left out of the prompt, as the chat
    templates of reasoning models leave earlier turns' thinking out."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


def _kind(block: Any) -> str | None:
    return block.get("type") if isinstance(block, dict) else getattr(block, "type", None)


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")],
    Discriminator(_kind),
]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: list[Block] | str


class Tool(Strict):
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    defer_loading: bool | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # the tool, for "tool"
    disable_parallel_tool_use: bool | None = None


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class TaskBudget(Strict):
    type: Literal["tokens"]
    total: Annotated[int, Field(ge=0)]


class OutputConfig(Strict):
    format: OutputFormat | None = None
    effort: str | None = None  # a hint for Anthropic's models
    task_budget: TaskBudget | None = None  # advisory, on Anthropic's own


class ContextEdit(Strict):
    """One of Anthropic's context edits (`clear_tool_uses_20250919`,
    `clear_thinking_20251015`, ...), with whatever settings its type takes."""

    model_config = ConfigDict(extra="allow")
    type: str


class ContextManagement(Strict):
    edits: list[ContextEdit] = []


class Metadata(Strict):
    user_id: str | None = None


class _Conversation(Request):
    """What a message and its token count share."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None

    def chat(self, **more) -> ChatBody:
        """The chat request this is (the chat endpoint's checks apply to it too)."""
        chat: dict[str, Any] = {"model": self.model, "messages": self._messages(), **more}
        if self.tools:
            chat["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "parameters": t.input_schema,
                        **({"description": t.description} if t.description else {}),
                    },
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            chat["tool_choice"] = _tool_choice(choice)
            if choice.disable_parallel_tool_use:
                chat["parallel_tool_calls"] = False
        return ChatBody.model_validate(chat)

    def _messages(self) -> list[dict]:
        """A user's tool results first, as tool messages (Anthropic puts them first in
        the turn after the calls), then its text; an assistant's text with its calls."""
        out = [{"role": "system", "content": _text(self.system)}] if self.system else []
        for i, m in enumerate(self.messages):
            blocks = (
                [TextBlock(type="text", text=m.content)]
                if isinstance(m.content, str)
                else m.content
            )
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            calls = [b for b in blocks if isinstance(b, ToolUseBlock)]
            results = [b for b in blocks if isinstance(b, ToolResultBlock)]
            if (m.role == "user" and calls) or (m.role == "assistant" and results):
                raise BodyError(
                    f"messages[{i}]: a {m.role} message holds the other's blocks",
                    f"messages.{i}.content",
                )
            for r in results:
                content = r.content if isinstance(r.content, str) else _text(r.content)
                out.append({"role": "tool", "tool_call_id": r.tool_use_id, "content": content})
            if text or not results:
                out.append({"role": m.role, "content": text})
            if calls:
                out[-1]["tool_calls"] = [
                    Call(c.name, json.dumps(c.input, ensure_ascii=False), c.id).as_dict()
                    for c in calls
                ]
        return out


class MessagesBody(_Conversation):
    max_tokens: Positive
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    service_tier: str | None = None
    # vLLM's extension, and specd's own
    ignore_eos: bool | None = None
    route: str | None = None
    speculation: Literal["auto", "on", "off"] | None = None

    def chat_body(self) -> ChatBody:
        more: dict[str, Any] = {"stream": self.stream, "max_completion_tokens": self.max_tokens}
        fields = ["temperature", "top_p", "top_k", "ignore_eos", "route", "speculation"]
        more |= {f: getattr(self, f) for f in fields if getattr(self, f) is not None}
        if self.stop_sequences:
            more["stop"] = self.stop_sequences
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            more["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt.schema_},
            }
        return self.chat(**more)


class CountTokensBody(_Conversation):
    """`/v1/messages/count_tokens`: the prompt a message would have, counted."""


def _text(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "".join(b.text for b in blocks)


def _tool_choice(choice: ToolChoice) -> str | dict:
    if choice.type == "tool":
        if not choice.name:
            raise BodyError("tool_choice of type tool needs the tool's name", "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
