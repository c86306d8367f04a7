"""llama-server's native bodies: `POST /completion` and `POST /infill` (the one IDE
plugins such as llama.vscode send), read as the OpenAI completion each stands for, with
llama.cpp's defaults and sampler order.

- Defaults as llama-server's: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05;
  `n_predict: -1` runs until the model stops or the context is full; `n_predict: 0`
  evaluates the prompt (into the prefix cache) and generates nothing.
- `samplers` (names, or their letters as a string) say which samplers apply and in which
  order; one left out does not apply (no `temperature`: 1). specd applies top-k, top-p,
  min-p in that order, with the temperature before all of them or after all of them
  (llama.cpp's default), and llama.cpp's `infill` sampler after them; an order outside
  that is refused. `dry`, `typ_p`, `xtc`, `top_n_sigma` and `penalties` may be listed
  while their parameters leave them off (their defaults).
- Refused, naming the field, where set to do something: the DRY, XTC, typical, top-n-sigma,
  dynamic-temperature, Mirostat and penalty samplers, `post_sampling_probs`, `lora`,
  `n_cmpl` > 1. Accepted and without effect: `cache_prompt` (specd's prefix cache is
  always on), `id_slot`, `n_keep`, `n_cache_reuse`, `t_max_prompt_ms`, `timings_per_token`,
  `return_progress`, `sse_ping_interval`.
- `logit_bias` as pairs `[[token id or text, bias or false], ...]` or an object; false is
  -100 (OpenAI's floor, never drawn in practice); a text biases each of its tokens.
- `grammar` is GBNF (converted for llguidance) and `json_schema` a JSON schema.
- `/infill` builds llama-server's prompt: with the model's repository and file-separator
  tokens, `<repo>myproject\\n<sep>{filename}\\n{text}...<sep>filename\\n`, else each extra
  chunk after a `--- snippet ---` line; then `<pre>{prefix}<suf>{suffix}<mid>{prompt}`,
  the prefix's last 1536 tokens and the suffix's first 512 less the prompt's (llama-server's
  3:1 split of its 2048-token batch), and of the extra context the last tokens that leave
  the generation its room in the context.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from router.body import BodyError, Request, Strict
from router.openai_schema import CompletionBody
from specd.params import MAX_LOGPROBS

# llama.cpp's sampler names and the letters `samplers` may spell them with
LETTERS = {
    "d": "dry",
    "k": "top_k",
    "y": "typ_p",
    "p": "top_p",
    "s": "top_n_sigma",
    "m": "min_p",
    "x": "xtc",
    "t": "temperature",
    "i": "infill",
    "e": "penalties",
}
ALIASES = {"typical_p": "typ_p", "nucleus": "top_p", "temp": "temperature"}
DEFAULT_SAMPLERS = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc"]
DEFAULT_SAMPLERS += ["temperature"]
TRUNCATIONS = ("top_k", "top_p", "min_p", "infill")  # specd's order; top-k ignores temperature
BATCH = 2048  # llama-server's batch: /infill keeps 3/4 of it for the prefix, 1/4 the suffix
LIMITLESS = -1


class LlamaCompletionBody(Request):
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
    samplers: list[str] | str | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    return_tokens: bool = False
    response_fields: list[str] | None = None
    n_indent: Annotated[int, Field(ge=0)] = 0
    t_max_predict_ms: Annotated[int, Field(ge=0)] = 0
    # samplers specd has not: accepted where they are off
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] | None = None
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    top_n_sigma: float = -1.0
    min_keep: int = 0
    post_sampling_probs: bool = False
    lora: list[dict[str, Any]] | None = None
    n_cmpl: int = 1
    # accepted, without effect in specd
    cache_prompt: bool = True
    id_slot: int = -1
    n_keep: int = 0
    n_cache_reuse: int = 0
    t_max_prompt_ms: int | None = None
    timings_per_token: bool = False
    return_progress: bool = False
    sse_ping_interval: float | None = None
    model: str | None = None
    # specd's per-request speculation
    route: str | None = None
    speculation: Literal["auto", "on", "off"] | None = None

    def unsupported(self) -> dict[str, bool]:
        return {
            "dynatemp_range": self.dynatemp_range != 0,
            "typical_p": self.typical_p != 1,
            "repeat_penalty": self.repeat_penalty != 1,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "dry_multiplier": self.dry_multiplier != 0,
            "xtc_probability": self.xtc_probability > 0 and self.xtc_threshold <= 0.5,
            "mirostat": self.mirostat != 0,
            "top_n_sigma": self.top_n_sigma > 0,
            "min_keep": self.min_keep > 1,
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

    def completion_body(self, prompt_ids: list[int], bias: dict[int, float]) -> CompletionBody:
        """The OpenAI completion of `prompt_ids` with this body's sampling (llama.cpp's
        order is `sampler_order`'s to set on the request)."""
        order = self.sampler_order()
        constraint: dict[str, Any] = {}
        if self.json_schema is not None and self.grammar is not None:
            raise BodyError("at most one of json_schema and grammar", "grammar")
        if self.json_schema is not None:
            constraint["guided_json"] = self.json_schema
        if self.grammar is not None:
            constraint["guided_grammar"] = _lark(self.grammar)
        return CompletionBody.model_construct(
            model="",
            prompt=prompt_ids,
            max_tokens=self.max_new_tokens(),
            temperature=order["temperature"],
            top_k=order["top_k"],
            top_p=order["top_p"],
            min_p=order["min_p"],
            seed=self.seed if self.seed >= 0 else None,
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
            logit_bias={str(t): b for t, b in bias.items()} or None,
            logprobs=self.n_probs or None,
            route=self.route,
            speculation=self.speculation,
            **constraint,
        )

    def max_new_tokens(self) -> int:
        """n_predict as the wire's: -1 until the context is full; 0 one token, which the
        answer leaves out (the prompt is still evaluated and cached, as llama.cpp does)."""
        return self.n_predict if self.n_predict != 0 else 1

    def sampler_order(self) -> dict[str, Any]:
        """The samplers listed, as specd's parameters: top_k, top_p, min_p, temperature
        (those not listed off), temperature_last and infill."""
        names = self.sampler_names()
        active = [n for n in names if n not in ("dry", "typ_p", "xtc", "top_n_sigma", "penalties")]
        if len(set(active)) != len(active):
            raise BodyError("samplers: each sampler at most once", "samplers")
        truncations = [n for n in active if n != "temperature"]
        if truncations != [n for n in TRUNCATIONS if n in truncations]:
            raise BodyError(f"samplers: specd applies them in the order {TRUNCATIONS}", "samplers")
        order = {
            "top_k": self.top_k if "top_k" in active else 0,
            "top_p": self.top_p if "top_p" in active else 1.0,
            "min_p": self.min_p if "min_p" in active else 0.0,
            "temperature": self.temperature if "temperature" in active else 1.0,
            "temperature_last": False,
            "infill": "infill" in active,
        }
        order["top_p"] = min(order["top_p"], 1.0)  # llama.cpp's top_p >= 1 is off
        order["top_k"] = max(order["top_k"], 0)  # and so is its top_k <= 0
        if "temperature" in active:
            at = active.index("temperature")
            # top-k keeps the k likeliest at any temperature; the others do not
            after = [n for n in active[at + 1 :] if n != "top_k"]
            before = [n for n in active[:at] if n != "top_k"]
            if before and after:
                raise BodyError(
                    "samplers: specd applies the temperature before top_p, min_p and infill "
                    "or after them all",
                    "samplers",
                )
            order["temperature_last"] = bool(before)
        if order["temperature"] <= 0:
            order["temperature"] = 0.0  # greedy: the likeliest of what is kept
            if order["infill"] and not order["temperature_last"]:
                order["infill"] = False  # one token left: the infill sampler keeps it
            elif order["infill"]:
                raise BodyError(
                    "samplers: a greedy temperature after the infill sampler is not "
                    "supported; list temperature first",
                    "samplers",
                )
        return order

    def sampler_names(self) -> list[str]:
        """The samplers listed, by their names (the default chain where none are)."""
        if self.samplers is None:
            return list(DEFAULT_SAMPLERS)
        raw = list(self.samplers) if isinstance(self.samplers, str) else self.samplers
        table = LETTERS if isinstance(self.samplers, str) else {}
        names = []
        for given in raw:
            name = table.get(given, ALIASES.get(given, given))
            if name not in LETTERS.values():
                raise BodyError(f"samplers: unknown sampler {given!r}", "samplers")
            names.append(name)
        return names

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


def _lark(gbnf: str) -> str:
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(gbnf)
    except Exception as exc:  # its parser's own errors
        raise BodyError(f"grammar: not GBNF llguidance reads: {exc}", "grammar") from None
