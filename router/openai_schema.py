"""The OpenAI API's request bodies (the parts specd serves), checked strictly. Torch-free
and server-free: `router.openai_http` wires it up, `router.openai_request` turns a body
into the `GenerateRequest` a gRPC client would send, so both doors give the same answer.

Where this differs from the OpenAI API, on purpose:
- unknown fields are refused (400), not ignored;
- `best_of` > 1, which specd does not implement, is refused;
- a completion's `echo` puts the prompt before the text, and with `logprobs` its tokens'
  log-probabilities before the output's (the first token's None), as vLLM does; with
  `max_tokens: 0` the prompt alone (0 is refused without `echo`);
- a completion's `suffix` fills in the middle where the model has FIM tokens
  (`router.fim`, as SGLang and llama.cpp's /infill do; vLLM refuses it), and is refused
  naming the field where it has none;
- `tools` and `tool_choice` work as vLLM's do (`router.tools`): with "auto" the text is
  read for calls in the format the model's chat template teaches, with "required" or a
  named function the output is constrained to calls, and "none" renders the tools only;
- `logit_bias` maps token ids (as strings, OpenAI's spelling) to values in [-100, 100];
- `n` choices (up to 128) are generated side by side as separate requests; a seeded
  request's choice i samples from seed + i, as in vLLM; a completion's batch of prompts
  gives each prompt's `n` in turn (128 choices in all at most);
- `logprobs` (and chat's `top_logprobs`) are the target's raw log-probabilities, before
  a logit bias, temperature and the other transforms (a constraint's mask applied), as vLLM returns
  them, -inf as -9999.0; up to 20 on both endpoints (the OpenAI API allows 5 on
  completions);
- `response_format` (`text`, `json_object`, `json_schema`, vLLM's `structural_tag`)
  constrains the output on both endpoints, as vLLM allows; so do vLLM's `guided_json`,
  `guided_regex`, `guided_grammar` (a Lark grammar, llguidance's dialect) and
  `guided_choice`, and their newer spelling `structured_outputs` ({json, regex, choice,
  grammar, json_object}), one constraint per request;
- extensions, as vLLM names them: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
  `return_token_ids`, `stop_token_ids`, `min_tokens`, `include_stop_str_in_output`,
  `skip_special_tokens`, and a chat's `add_generation_prompt`, `continue_final_message`
  and `chat_template_kwargs`; and specd's `route` and `speculation` ("auto", "on", "off");
- a completion that names no `max_tokens` gets the router's default (256; OpenAI's is 16),
  while a chat that names none runs until the model stops or its context is full, as in
  vLLM and the OpenAI API;
- absent sampling fields take the model's recommended values where its
  generation_config.json names them, as in vLLM and SGLang (`router.openai_request`);
- as in vLLM, `top_p` is in (0, 1] (0 is refused: temperature 0 is greedy) and `top_k: -1`
  is off, as 0 is;
- `model` may be left out (the served model), as vLLM and llama-server allow;
- llama-server's sampler fields, as llama-server's own OpenAI endpoints take them
  (`samplers`, `cache_prompt`, its samplers where they are off; router/llamacpp_sampling.py),
  and its `max_tokens: -1` (until the context is full);
- SGLang's fields, as its Model Gateway forwards them to every worker
  (router/sglang_fields.py: `no_stop_trim`, `regex`, `ebnf`, `extra_key` served, the
  rest taken where they ask for nothing);
- a string with a lone UTF-16 surrogate (a `\\ud800` escape, valid JSON but not text) is
  refused, naming its field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from protos.specd.v1 import common_pb2
from router.body import BodyError, Request, Strict, parse
from router.client_fields import ClientFields
from router.llamacpp_sampling import LlamaSamplers
from router.sglang_fields import SglangExtras, SglangFields
from router.tools import ToolUse
from specd.constraint import choice_grammar, named, structural_tag_grammar
from specd.params import MAX_LOGPROBS
from specd.wire import UNTIL_CONTEXT, constraint_to_proto


class StreamOptions(Strict):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far too
    continuous_usage_stats: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str | dict[str, Any]  # a JSON object as text (some clients send the object)


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


Positive = Annotated[int, Field(ge=1)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Bias = Annotated[float, Field(ge=-100, le=100)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
MAX_CHOICES = 128  # n, as the OpenAI API bounds it


class Function(Strict):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # a call a constraint forces is always strict


class Tool(Strict):
    type: Literal["function"]
    function: Function


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # specd's constraint is always strict


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` (the newer spelling of its guided_* fields): one of
    them."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None  # JSON text: {structures, triggers} (StructuralTags)


class StructuralTag(Strict):
    begin: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON
    end: str


class StructuralTags(Request):
    """vLLM's structural tags: free text, where a trigger opens one of the structures."""

    type: Literal["structural_tag"] = "structural_tag"
    structures: list[StructuralTag]
    triggers: list[str]

    @classmethod
    def from_text(cls, text: str, param: str) -> str:
        """The grammar of tags given as JSON text, read as a body is (`param`: the field)."""
        try:
            tags = parse(text.encode(), cls)
        except BodyError as exc:
            raise BodyError(f"{param}: {exc}", param) from None
        return tags.grammar(param)

    def grammar(self, param: str) -> str:
        tags = [(t.begin, t.schema_, t.end) for t in self.structures]
        try:
            return structural_tag_grammar(tags, self.triggers)
        except ValueError as exc:
            raise BodyError(str(exc), param) from None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama-server's json_object
    # vLLM's structural tags: free text, where a trigger opens one of the structures
    structures: list[StructuralTag] | None = None
    triggers: list[str] | None = None


class Body(SglangExtras, LlamaSamplers, ClientFields, SglangFields):
    """What both endpoints accept; CompletionBody and ChatBody add their own fields."""

    model_config = ConfigDict(extra="allow", strict=True)  # SGLang's (router/sglang_fields.py)

    model: str | None = None  # absent: the served model, as vLLM and llama-server take it
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Positive | Literal[-1] | None = None  # -1: until the context is full
    temperature: float | None = None
    top_p: Annotated[float, Field(gt=0)] | None = None  # 0 is unset on gRPC, refused here
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None  # choices, side by side
    user: str | None = None  # accepted; specd keeps no per-user state
    frequency_penalty: Penalty | None = None  # on the generated tokens, as vLLM
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None  # token id -> added to its logit
    # extensions (vLLM's names) and specd's per-request speculation
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1: off, as vLLM spells it
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # log-probabilities' tokens as `token_id:{id}`
    prompt_logprobs: TopLogprobs | None = None  # vLLM's: each prompt token's, and this many
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None  # only these
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None  # never generated
    # keep the prompt's last this many tokens; -1: what the model's context holds
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, lt=1 << 31)] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # a prefix cache of its own
    min_tokens: Annotated[int, Field(ge=0, lt=1 << 31)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    route: str | None = None
    speculation: Literal["auto", "on", "off"] | None = None
    # structured output
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None

    def unsupported(self) -> dict[str, bool]:
        return {
            **super().unsupported(),
            **self.llama_refused(),
            **self.client_refused(),
            **self.sglang_refused(),
        }

    def constraint(self, tools: ToolUse | None = None) -> common_pb2.Constraint | None:
        """The one constraint the body asks for, if any (checked by the router); `tools`:
        the chat's tool use, whose forced calls are one."""
        forced = tools.schema() if tools is not None else None
        asked = {
            field: kwargs
            for field, kwargs in [
                ("response_format", self._response_format()),
                ("guided_json", {"json_schema": self.guided_json}),
                ("guided_regex", {"regex": self.guided_regex}),
                ("guided_grammar", {"grammar": self.guided_grammar}),
                ("guided_choice", {"grammar": _choice(self.guided_choice, "guided_choice")}),
                ("structured_outputs", self._structured_outputs()),
                ("tool_choice", {"json_schema": forced}),
                *self.llama_constraints(),
                *self.sglang_constraints(),
            ]
            if any(v is not None for v in kwargs.values())
        }
        if len(asked) > 1:
            raise BodyError(f"at most one constraint per request, got {sorted(asked)}")
        return constraint_to_proto(named(**asked.popitem()[1])) if asked else None

    def _structured_outputs(self) -> dict:
        """The constraint `structured_outputs` names, as keywords of specd.constraint.named."""
        so = self.structured_outputs
        if so is None:
            return {}
        given = {
            "json_schema": so.json_,
            "regex": so.regex,
            "grammar": so.grammar,
            "choice": so.choice,
            "json_object": True if so.json_object else None,
            "structural_tag": so.structural_tag,
        }
        given = {k: v for k, v in given.items() if v is not None}
        if len(given) > 1:
            raise BodyError(
                "structured_outputs names more than one constraint", "structured_outputs"
            )
        if "choice" in given:
            return {"grammar": _choice(so.choice, "structured_outputs.choice")}
        if "structural_tag" in given:
            tags = so.structural_tag
            return {"grammar": StructuralTags.from_text(tags, "structured_outputs.structural_tag")}
        return given

    def _response_format(self) -> dict:
        """The constraint `response_format` names, as keywords of specd.constraint.named."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return {}
        if fmt.type == "json_object":  # with llama-server's `schema`, that schema
            return {"json_schema": fmt.schema_} if fmt.schema_ else {"json_object": True}
        if fmt.type == "structural_tag":
            tags = StructuralTags(structures=fmt.structures or [], triggers=fmt.triggers or [])
            return {"grammar": tags.grammar("response_format")}
        if fmt.json_schema is None:
            raise BodyError("response_format.json_schema is required", "response_format")
        return {"json_schema": fmt.json_schema.schema_}

    def max_new_tokens(self) -> int:
        return self.max_tokens or 0

    def bias(self) -> dict[int, float]:
        """`logit_bias` with its token ids as numbers."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit() or int(key) >= 1 << 31:
                raise BodyError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            out[int(key)] = value
        return out

    def logprobs_asked(self) -> int | None:
        """How many top tokens to return beside each token's log-probability; None:
        no log-probabilities."""
        return None

    def prompt_logprobs_asked(self) -> int | None:
        """The same for the prompt's tokens: vLLM's `prompt_logprobs`, in the whole
        answer only (as vLLM, a stream cannot carry them)."""
        if self.prompt_logprobs and self.stream:
            raise BodyError(
                "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )
        return self.prompt_logprobs


class CompletionBody(Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: TopLogprobs | None = None
    # 0: with echo, the prompt only; -1: until the context is full
    max_tokens: Annotated[int, Field(ge=0)] | Literal[-1] | None = None

    def unsupported(self) -> dict[str, bool]:
        if self.echo and self.suffix:
            raise BodyError("echo and suffix together are not supported", "echo")
        if self.max_tokens == 0 and not self.echo:
            raise BodyError("max_tokens: 0 generates nothing; it needs echo", "max_tokens")
        return {**super().unsupported(), "best_of": self.best_of not in (None, 1)}

    @property
    def prompt_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its log-probabilities) alone, as
        vLLM answers it; the engine makes one token, which the answer leaves out."""
        return bool(self.echo) and self.max_tokens == 0

    def max_new_tokens(self) -> int:
        return 1 if self.prompt_only else super().max_new_tokens()

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a batch's (a list of texts or of id lists, each its
        own choices, as vLLM serves them), or the one."""
        prompt = self.prompt
        batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        prompts = list(prompt) if batch else [prompt]
        if len(prompts) * (self.n or 1) > MAX_CHOICES:
            raise BodyError(f"prompts times n must be at most {MAX_CHOICES}", "prompt")
        return prompts

    def echo_texts(self, decode) -> list[str]:
        """Each prompt as `echo` returns it: its text, or its ids' decoding."""
        return [p if isinstance(p, str) else decode(list(p)) for p in self.prompts()]

    def prompt_logprobs_asked(self) -> int | None:
        """With `echo`, `logprobs` covers the prompt's tokens too (the engine gives the
        larger count of top tokens where `prompt_logprobs` asks too; the answer cuts each
        field to its own)."""
        echoed = self.logprobs if self.echo else None
        asked = [k for k in (echoed, super().prompt_logprobs_asked()) if k is not None]
        return max(asked) if asked else None

    def logprobs_asked(self) -> int | None:
        return self.logprobs


class ChatTemplateOptions(Strict):
    """How the chat template renders the messages, as vLLM takes it (transformers'
    apply_chat_template's arguments)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the output continues the last message
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    # variables of the same name for the template (as vLLM hands them on), under those
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def template_options(self) -> dict:
        """The fields of router_pb2.ChatMessages they set."""
        if self.add_generation_prompt and self.continue_final_message:
            raise BodyError(
                "continue_final_message needs add_generation_prompt: false",
                "continue_final_message",
            )
        named = {"documents": self.documents, "reasoning_effort": self.reasoning_effort}
        kwargs = {k: v for k, v in named.items() if v is not None}
        kwargs |= self.chat_template_kwargs or {}
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "chat_template_kwargs_json": json.dumps(kwargs, ensure_ascii=False) if kwargs else "",
        }


class ChatBody(Body, ChatTemplateOptions):
    model_config = Body.model_config  # ChatTemplateOptions' would refuse SGLang's fields
    messages: list[ChatMessage]
    max_completion_tokens: Positive | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False  # vLLM's: the answer led by the last message's text, an assistant's
    # vLLM's: false leaves the thinking a reasoning parser reads apart out of the answer
    include_reasoning: bool = True

    def echoed(self) -> str:
        """What `echo` puts before the answer: the last message's text where it is the
        assistant's (the role the answer has), as vLLM does; else nothing."""
        last = self.messages[-1] if self.messages else None
        return last.text() if self.echo and last is not None and last.role == "assistant" else ""

    def tool_use(self, call_format: str | None) -> ToolUse | None:
        """The tools and the choice among them, checked (None: no tools);
        `call_format`: the tool-call format the model's chat template teaches."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise BodyError("tool_choice needs tools", "tool_choice")
            return None
        choice = self.tool_choice or "auto"
        try:
            return ToolUse(
                tools=tool_dicts(self.tools),
                choice=choice if isinstance(choice, str) else choice.model_dump(),
                parallel=self.parallel_tool_calls is not False,
                format=call_format,
            )
        except ValueError as exc:
            raise BodyError(str(exc), "tool_choice") from None

    def max_new_tokens(self) -> int:
        """Named none: until the model stops or its context is full, as vLLM and the OpenAI
        API answer a chat (a completion without one gets the router's default)."""
        return self.max_completion_tokens or self.max_tokens or UNTIL_CONTEXT

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing: taken, as vLLM
            raise BodyError("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeBody(Request, ChatTemplateOptions):
    """vLLM's /tokenize: a prompt, or messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # a prompt's (a chat's template writes its own)
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None

    def unsupported(self) -> dict[str, bool]:
        if (self.prompt is None) == (self.messages is None):
            raise BodyError("one of prompt or messages is required")
        return {}


class DetokenizeBody(Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def tool_dicts(tools: list[Tool] | None) -> list[dict] | None:
    """Tools as the chat template takes them (the OpenAI API's JSON); None: none."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def _choice(options: list[str] | None, field: str) -> str | None:
    if options is None:
        return None
    try:
        return choice_grammar(options)
    except ValueError as exc:
        raise BodyError(f"{field}: {exc}", field) from None
