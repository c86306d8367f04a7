"""llama-server's native bodies: `POST /completion` and `POST /infill` (the one IDE
plugins such as llama.vscode send), read as the OpenAI completion each stands for, with
llama.cpp's defaults and sampler order.

- Defaults as llama-server's: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05;
  `n_predict: -1` runs until the model stops or the context is full; `n_predict: 0`
  evaluates the prompt (into the prefix cache) and generates nothing.
- `samplers` and the samplers specd has not: router/llamacpp_sampling.py. Refused too,
  naming the field, where set: llama.cpp's presence and frequency penalties (its window
  differs from OpenAI's), `post_sampling_probs`, `lora`, `n_cmpl` > 1.
- `logit_bias` as pairs `[[token id or text, bias or false], ...]` or an object; false is
  -100 (OpenAI's floor, never drawn in practice); a text biases each of its tokens.
- `grammar` is GBNF and `json_schema` a JSON schema (router/llamacpp_sampling.py).
- `/infill` builds llama-server's prompt: with the model's repository and file-separator
  tokens, `<repo>myproject\\n<sep>{filename}\\n{text}...<sep>filename\\n`, else each extra
  chunk after a `--- snippet ---` line; then `<pre>{prefix}{prompt}<suf>{suffix}<mid>`,
  the prefix's last 1536 tokens and the suffix's first 512 less the prompt's (llama-server's
  3:1 split of its 2048-token batch), and of the extra context the last tokens that leave
  the generation its room in the context.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from router.body import BodyError, Request, Strict
from router.llamacpp_sampling import LlamaSamplers
from router.openai_schema import CompletionBody
from specd.params import MAX_LOGPROBS

# the samplers whose defaults a server's overrides set here too (a repetition penalty is
# llama.cpp's own, over a window: off unless a body names it)
OVERRIDABLE = ("temperature", "top_k", "top_p", "min_p")
BATCH = 2048  # llama-server's batch: /infill keeps 3/4 of it for the prefix, 1/4 the suffix
LIMITLESS = -1


class LlamaCompletionBody(Request, LlamaSamplers):
    prompt: str | list[int | str] | list[str | list[int | str]] = ""
    n_predict: Annotated[int, Field(ge=-1)] = LIMITLESS
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: Annotated[int, Field(ge=-1, lt=1 << 64)] = -1  # -1: random
    stop: list[str] = []
    stream: bool = False
    ignore_eos: bool = False
    logit_bias: list[list[int | str | float | bool]] | dict[str, float | bool] | None = None
    n_probs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] = 0
    return_tokens: bool = False
    response_fields: list[str] | None = None
    n_indent: Annotated[int, Field(ge=0)] = 0
    t_max_predict_ms: Annotated[int, Field(ge=0)] = 0
    # llama.cpp's own penalties (its window differs from OpenAI's): accepted where off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    post_sampling_probs: bool = False
    lora: list[dict[str, Any]] | None = None
    n_cmpl: int = 1
    model: str | None = None
    # specd's per-request speculation
    route: str | None = None
    speculation: Literal["auto", "on", "off"] | None = None

    def unsupported(self) -> dict[str, bool]:
        return {
            **self.llama_refused(),
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "post_sampling_probs": self.post_sampling_probs,
            "lora": bool(self.lora),
            "n_cmpl": self.n_cmpl != 1,
        }

    # -- the OpenAI completion it stands for ------------------------------------------------
    def prompts(self) -> list[str | list[int | str]]:
        """The prompts: a list of texts, or of token lists, is several (an answer each);
        a list of ids (texts among them) one."""
        p = self.prompt
        several = isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p)
        return list(p) if several else [p]

    def completion_body(
        self,
        prompt_ids: list[int],
        bias: dict[int, float],
        overrides: dict | None = None,
        seed: int | None = None,
    ) -> CompletionBody:
        """The OpenAI completion of `prompt_ids` with this body's sampling: its samplers
        named, so that the OpenAI door's own mapping of them applies (LlamaSamplers.chain);
        a sampler the body leaves out takes the server's `overrides` (as llama-server's
        --temp, --top-k, ... set its defaults) where they name it, else llama-server's;
        an unseeded body the server's `seed` (as llama-server's -s sets it)."""
        given = {**(overrides or {}), **self.model_dump(include=self.model_fields_set)}
        sampler = {k: given.get(k, getattr(self, k)) for k in OVERRIDABLE}
        return CompletionBody.model_construct(
            model="",
            prompt=prompt_ids,
            max_tokens=self.max_new_tokens(),
            **sampler,
            samplers=self.sampler_names(),
            seed=self.seed if self.seed >= 0 else seed,
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
            logit_bias={str(t): b for t, b in bias.items()} or None,
            logprobs=self.n_probs or None,
            route=self.route,
            speculation=self.speculation,
            json_schema=self.json_schema,
            grammar=self.grammar,
        )

    def max_new_tokens(self) -> int:
        """n_predict as the wire's: -1 until the context is full; 0 one token, which the
        answer leaves out (the prompt is still evaluated and cached, as llama.cpp does)."""
        return self.n_predict if self.n_predict != 0 else 1

    def sampler_order(self) -> dict[str, Any]:
        """This body's samplers as specd's parameters (LlamaSamplers.chain)."""
        return self.chain(self.temperature, self.top_k, self.top_p, self.min_p)

    def bias_items(self) -> list[tuple[int | str, float]]:
        """`logit_bias` as (token id or text, bias) pairs; false is -100."""
        given = self.logit_bias or []
        pairs = list(given.items()) if isinstance(given, dict) else given
        out = []
        for pair in pairs:
            if len(pair) != 2:
                raise BodyError("logit_bias: each entry is [token, bias]", "logit_bias")
            token, bias = pair
            if isinstance(token, str) and token.isascii() and token.isdigit():
                token = int(token)
            if bias is False:
                bias = -100.0
            if isinstance(token, (bool, float)) or isinstance(bias, (bool, str)):
                raise BodyError("logit_bias: a token id or text, then a number", "logit_bias")
            if not -100 <= bias <= 100:
                raise BodyError("logit_bias: a bias is in [-100, 100] (or false)", "logit_bias")
            out.append((token, float(bias)))
        return out


class ExtraChunk(Strict):
    text: str
    filename: str = "tmp"
    time: float | None = None  # llama.vscode's; not read


class InfillBody(LlamaCompletionBody):
    prompt: str = ""  # after the middle marker
    input_prefix: str
    input_suffix: str
    input_extra: list[ExtraChunk] = []


class LlamaTokenizeBody(Request):
    """llama-server's /tokenize: `content` text, ids, or both mixed."""

    content: str | list[int | str]
    add_special: bool = False  # the model's BOS before a leading text
    parse_special: bool = True  # a special token's text is that token
    with_pieces: bool = False  # each id with its text
