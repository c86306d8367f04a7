"""The body of SGLang's native `/generate` (io_struct.GenerateReqInput and its
sampling_params, with SGLang's defaults), checked as strictly as SGLang's dataclasses take
it: a field SGLang does not define is refused."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from router.body import BodyError
from router.openai_schema import (
    Bias,
    CompletionBody,
    Penalty,
    Strict,
    StructuralTags,
    TokenId,
)
from router.sglang_fields import SglangExtras, asks_for_something

MAX_PROMPTS = 64  # prompts x n in one request, as the OpenAI door's batch


class SglangSampling(Strict):
    max_new_tokens: Annotated[int, Field(ge=0, lt=1 << 31)] = 128  # 0: the prompt only
    min_new_tokens: Annotated[int, Field(ge=0, lt=1 << 31)] = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    # absent: the model's recommended values (SGLang's --sampling-defaults model), else
    # temperature 1 and the rest off
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1: off
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # the stop string stays in the text
    n: Annotated[int, Field(ge=1, le=MAX_PROMPTS)] = 1
    json_schema: str | None = None  # a JSON schema, as text
    regex: str | None = None
    ebnf: str | None = None  # GBNF, as llama.cpp's (converted for llguidance)
    structural_tag: str | None = None  # JSON text: {type, structures, triggers}, as vLLM's
    logit_bias: dict[str, Bias] | None = None  # token id -> added to its logit
    sampling_seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None  # accepted: every step is sent
    # refused where given
    stop_regex: Any = None
    beam_width: Any = None
    custom_params: Any = None
    watermark: Any = None

    def completion_body(
        self,
        prompt_ids: list[int],
        logprobs: int | None,
        route: str,
        speculation: str,
        *,
        prompt_logprobs: bool = False,
        cache_salt: str | None = None,
    ) -> CompletionBody:
        """The OpenAI completion of `prompt_ids` with these parameters (the door's own
        mapping of each then applies); `logprobs`: top log-probabilities per token, None
        for none, and `prompt_logprobs`: the prompt's too. `max_new_tokens: 0` makes one
        token, which the answer leaves out."""
        for name in ("stop_regex", "beam_width", "custom_params", "watermark"):
            if asks_for_something(name, getattr(self, name)):
                raise BodyError(f"{name!r} is not supported by specd", f"sampling_params.{name}")
        if not self.spaces_between_special_tokens:
            raise BodyError(
                "spaces_between_special_tokens: false is not served",
                "spaces_between_special_tokens",
            )
        constraints = [self.json_schema, self.regex, self.ebnf, self.structural_tag]
        if sum(c is not None for c in constraints) > 1:
            raise BodyError(
                "at most one of json_schema, regex, ebnf and structural_tag", "sampling_params"
            )
        tags = None
        if self.structural_tag is not None:
            tags = StructuralTags.from_text(self.structural_tag, "sampling_params.structural_tag")
        return CompletionBody.model_construct(
            model="",
            prompt=prompt_ids,
            echo=prompt_logprobs,
            max_tokens=max(1, self.max_new_tokens),
            min_tokens=self.min_new_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.no_stop_trim,
            seed=self.sampling_seed,
            logit_bias=self.logit_bias,
            logprobs=logprobs,
            guided_json=self.json_schema,
            guided_regex=self.regex,
            grammar=self.ebnf,
            guided_grammar=tags,
            cache_salt=cache_salt,
            route=route or None,
            speculation=speculation or None,
        )


class GenerateBody(SglangExtras):
    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SglangSampling | list[SglangSampling] | None = None
    return_logprob: bool | None = None
    # the prompt's log-probabilities from this position on (-1, null: none)
    logprob_start_len: Annotated[int, Field(ge=-1)] | None = None
    top_logprobs_num: Annotated[int, Field(ge=0, le=20)] | None = None
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    # prefix caches of their own, as the OpenAI door's cache_salt
    extra_key: Annotated[str, Field(min_length=1)] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # specd's: the route and speculation mode, as the x-route and x-speculation headers
    route: str | None = None
    speculation: str | None = None

    def unsupported(self) -> dict[str, bool]:
        return self.sglang_refused()

    @property
    def top(self) -> int | None:
        """Top log-probabilities per token, None for no log-probabilities."""
        return (self.top_logprobs_num or 0) if self.return_logprob else None

    def prompt_logprobs_from(self, prompt_len: int) -> int | None:
        """The prompt position its log-probabilities start at, None for none (as SGLang,
        only with return_logprob)."""
        start = self.logprob_start_len
        if not self.return_logprob or start is None or start == -1:
            return None
        if start > prompt_len:
            raise BodyError(
                f"logprob_start_len {start} is past the prompt's {prompt_len} tokens",
                "logprob_start_len",
            )
        return start

    def prompts(self, tokenize) -> list[list[int]]:
        """Each prompt's ids (`tokenize`: text -> ids, as SGLang adds the model's BOS)."""
        if (self.text is None) == (self.input_ids is None):
            raise BodyError("give one of text and input_ids", "text")
        if self.text is not None:
            texts = [self.text] if isinstance(self.text, str) else self.text
            prompts = [tokenize(t) for t in texts]
        else:
            ids = self.input_ids
            prompts = ids if ids and isinstance(ids[0], list) else [ids]
        if not prompts or not all(prompts):
            raise BodyError("each prompt needs at least one token", "text")
        return prompts

    def batch(self) -> bool:
        """A list of prompts, answered with a list (one prompt with n > 1 too)."""
        return isinstance(self.text, list) or bool(
            self.input_ids and isinstance(self.input_ids[0], list)
        )

    def sampling(self, count: int) -> list[SglangSampling]:
        """Each prompt's parameters: one for all, or one each."""
        given = self.sampling_params
        if isinstance(given, list):
            if len(given) != count:
                raise BodyError(
                    f"sampling_params: {len(given)} given for {count} prompts", "sampling_params"
                )
            return given
        return [given or SglangSampling()] * count

    def ids(self, count: int) -> list[str | None]:
        """Each answer's id as the client named it, where it did."""
        if isinstance(self.rid, list):
            if len(self.rid) != count:
                raise BodyError(f"rid: {len(self.rid)} given for {count} answers", "rid")
            return list(self.rid)
        return [self.rid] * count if count == 1 else [None] * count
