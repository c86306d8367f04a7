"""The OpenAI Responses API's request body (`POST /v1/responses`), the parts specd serves,
checked strictly, and the chat request it is: `instructions` a system message, `input`
the conversation (messages, earlier function calls and their outputs), `tools` and
`text.format` as the chat endpoint takes them. The router then serves it as that chat
(`router.responses_answer` writes the answer back in the Responses API's shape).

specd keeps no responses: `previous_response_id`, `conversation`, `background` and a
stored `prompt` are refused (400, naming the field); send the whole conversation as
`input`, as a stateless client does (`store` is accepted and answered false).
`truncation: "auto"` is refused: a conversation longer than the context is refused as the
chat endpoint refuses it. Output log-probabilities (`top_logprobs`) are not served here
(the chat endpoint serves them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Discriminator, Field, Tag

from router.body import BodyError, Request, Strict
from router.openai_schema import ChatBody, Positive
from router.tools import Call

TEXT_PARTS = ("input_text", "output_text")


class TextContent(Strict):
    """A text part of a message: the user's (`input_text`) or an earlier answer's."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # an earlier answer's, as the API returned it
    logprobs: list | None = None


def _text(content: str | list[TextContent]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class Message(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]
    id: str | None = None  # an earlier answer's item, handed back
    status: str | None = None
    phase: str | None = None


class FunctionCall(Strict):
    """A call the model made earlier (an earlier answer's output item)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    # what OpenAI's own items carry, handed back by clients that echo them whole
    caller: dict[str, Any] | None = None
    namespace: str | None = None
    async_: bool | None = Field(None, validation_alias=AliasChoices("async", "async_"))


class FunctionCallOutput(Strict):
    """What the caller's function returned for a call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]
    id: str | None = None
    status: str | None = None
    caller: dict[str, Any] | None = None
    name: str | None = None
    namespace: str | None = None


class ReasoningItem(Strict):
    """An earlier answer's thinking, handed back: left out of the prompt, as the chat
    templates of reasoning models leave earlier turns' thinking out."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


KINDS = ("message", "function_call", "function_call_output", "reasoning")


def _kind(item: Any) -> str:
    """An input item's type; a message may leave it out (the API's "easy" message)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if kind in KINDS else "message"


Item = Annotated[
    Annotated[Message, Tag("message")]
    | Annotated[FunctionCall, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_kind),
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema's
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint specd's models ignore


class Reasoning(Strict):
    """Accepted for the clients that always send it; specd's models do not reason apart."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(Strict):
    include_obfuscation: bool | None = None  # specd pads no events


class ResponsesBody(Request):
    model: str
    input: list[Item] | str  # the list first: a bad item's error names its path
    instructions: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_output_tokens: Positive | None = None
    temperature: float | None = None
    top_p: Annotated[float, Field(gt=0)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None  # answered back
    store: bool | None = None  # specd keeps nothing: answered false
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["disabled", "auto"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None  # of built-in tools: specd has none
    # what a stateless server cannot do
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    # extensions, as the chat endpoint takes them (vLLM's names) and specd's own
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    route: str | None = None
    speculation: Literal["auto", "on", "off"] | None = None

    def unsupported(self) -> dict[str, bool]:
        return {
            "previous_response_id": self.previous_response_id is not None,
            "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "background": bool(self.background),
            "truncation": self.truncation == "auto",
            "top_logprobs": bool(self.top_logprobs),
            "include": any("logprobs" in x for x in self.include or []),
        }

    def chat_body(self) -> ChatBody:
        """The chat request this is (the chat endpoint's checks apply to it too)."""
        chat: dict[str, Any] = {"model": self.model, "messages": self._messages()}
        chat["stream"] = self.stream
        same = ["temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p"]
        same += ["repetition_penalty", "ignore_eos", "route", "speculation"]
        chat |= {name: getattr(self, name) for name in same if getattr(self, name) is not None}
        if self.max_output_tokens is not None:
            chat["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            chat["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, FunctionChoice):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        if (fmt := self.response_format()) is not None:
            chat["response_format"] = fmt
        return ChatBody.model_validate(chat)

    def response_format(self) -> dict | None:
        """`text.format` as the chat endpoint's `response_format`."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return None if fmt is None else {"type": fmt.type}
        if fmt.schema_ is None or fmt.name is None:
            raise BodyError("text.format json_schema needs a name and a schema", "text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}

    def _messages(self) -> list[dict]:
        """`instructions` and `input` as chat messages: consecutive calls an assistant
        message's tool_calls (after its text, where it wrote some), each output a tool
        message."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [Message(role="user", content=self.input)] if isinstance(self.input, str) else []
        for item in items or self.input:
            if isinstance(item, ReasoningItem):
                continue
            if isinstance(item, Message):
                out.append({"role": item.role, "content": _text(item.content)})
            elif isinstance(item, FunctionCallOutput):
                out.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
                )
            else:
                call = Call(item.name, item.arguments, item.call_id).as_dict()
                last = out[-1] if out else None
                if last is None or last["role"] != "assistant":
                    out.append(last := {"role": "assistant", "content": ""})
                last.setdefault("tool_calls", []).append(call)
        if not out:
            raise BodyError("input holds no message", "input")
        return out
