"""The body of SGLang's native `/generate` (io_struct.GenerateReqInput and its
sampling_params, with SGLang's defaults), checked as strictly as SGLang's dataclasses take
it: a field SGLang does not define is refused."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from router.body import BodyError, Request
from router.openai_schema import Bias, CompletionBody, Penalty, Strict, TokenId

MAX_PROMPTS = 64  # prompts x n in one request, as the OpenAI door's batch


class SglangSampling(Strict):
    max_new_tokens: Annotated[int, Field(ge=1, lt=1 << 31)] = 128
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
    logit_bias: dict[str, Bias] | None = None  # token id -> added to its logit
    sampling_seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None  # accepted: every step is sent

    def completion_body(
        self, prompt_ids: list[int], logprobs: int | None, route: str, speculation: str
    ) -> CompletionBody:
        """The OpenAI completion of `prompt_ids` with these parameters (the door's own
        mapping of each then applies); `logprobs`: top log-probabilities per token, None
        for none."""
        if not self.spaces_between_special_tokens:
            raise BodyError(
                "spaces_between_special_tokens: false is not served",
                "spaces_between_special_tokens",
            )
        return CompletionBody.model_construct(
            model="",
            prompt=prompt_ids,
            max_tokens=self.max_new_tokens,
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
            route=route or None,
            speculation=speculation or None,
        )


class GenerateBody(Request):
    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SglangSampling | list[SglangSampling] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: the output's log-probabilities only
    top_logprobs_num: Annotated[int, Field(ge=0, le=20)] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    log_metrics: bool = True
    lora_path: Any = None  # refused where given
    # specd's: the route and speculation mode, as the x-route and x-speculation headers
    route: str | None = None
    speculation: str | None = None

    def unsupported(self) -> dict[str, bool]:
        # one model, without adapters; the output's log-probabilities only
        return {
            "lora_path": self.lora_path is not None,
            "logprob_start_len": self.logprob_start_len != -1,
        }

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
