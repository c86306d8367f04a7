"""How a request samples: the parameters every service applies, checked once (torch-free,
so the router validates requests without loading torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specd import json_text

MAX_LOGPROBS = 20  # the most likely tokens a request may ask for at each position (vLLM's)
# the infill sampler compares every candidate's text with every other's: top-k bounds them
MAX_INFILL_CANDIDATES = 256


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off (CTRL-style: logit / r if > 0 else logit * r)
    seed: int | None = None
    presence_penalty: float = 0.0  # 0: off; subtracted from a token already generated
    frequency_penalty: float = 0.0  # 0: off; subtracted once per time it was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # each token's log-probability and this many top ones
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    min_tokens: int = 0  # no end-of-sequence or stop token (nor stop string) before this many
    temperature_last: bool = False  # top-k/top-p/min-p on the untempered logits (llama.cpp)
    infill: bool = False  # llama.cpp's infill sampler after them (specd/infill_filter.py)
    allowed_token_ids: tuple[int, ...] = ()  # only these may be generated; () = all
    # token sequences never generated: the last of each is banned where the output ends
    # with the others (vLLM's bad_words, the verifier's ban; the drafter is not told)
    bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether greedy's argmax is taken of adjusted logits (a bias or a penalty)."""
        biased = bool(self.logit_bias) or bool(self.allowed_token_ids)
        return biased or self.repetition_penalty != 1.0 or self.output_penalised

    @property
    def output_penalised(self) -> bool:
        """Whether the frequency or presence penalty applies (to generated tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        """Refuse out-of-range values, NaN and +/-inf included (a NaN compares false with
        everything, so every check is written as "not inside the valid range")."""
        finite = math.isfinite
        if not (finite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        rp = self.repetition_penalty
        if not (finite(rp) and rp > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {rp}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also refuses NaN
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:  # also refuses NaN
                raise ValueError(
                    f"logit_bias must map token ids >= 0 to values in [-100, 100], "
                    f"got {token}: {bias}"
                )
        if any(t < 0 for t in self.allowed_token_ids):
            raise ValueError("allowed_token_ids must be token ids >= 0")
        if any(not word or min(word) < 0 for word in self.bad_words):
            raise ValueError("bad_words must be non-empty sequences of token ids >= 0")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.infill and (self.greedy or not 0 < self.top_k <= MAX_INFILL_CANDIDATES):
            raise ValueError(
                f"the infill sampler needs temperature > 0 and top_k in "
                f"[1, {MAX_INFILL_CANDIDATES}] before it, got {self.temperature} and {self.top_k}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")


# the sampling fields a server may give a default for (a model's generation_config.json,
# vLLM's --override-generation-config), with the values a request could send for each
DEFAULTABLE = {
    "temperature": lambda v: math.isfinite(v) and v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: isinstance(v, int) and v >= -1,  # -1 or 0: off
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: math.isfinite(v) and v > 0,
}


def valid_default(name: str, value) -> bool:
    """Whether `value` may be the default of the sampling field `name` (DEFAULTABLE)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return name in DEFAULTABLE and number and DEFAULTABLE[name](value)


def sampling_overrides(text: str) -> dict[str, float]:
    """vLLM's --override-generation-config: a JSON object of sampling defaults ("" = none),
    as a dict; ValueError names a key or value a request could not send."""
    if not text:
        return {}
    given = json_text.loads_object(text, "override_generation_config")
    for name, value in given.items():
        if name not in DEFAULTABLE:
            raise ValueError(
                f"override_generation_config: {name!r} is not one of {', '.join(DEFAULTABLE)}"
            )
        if not valid_default(name, value):
            raise ValueError(f"override_generation_config: {name} = {value!r} is out of range")
    return given
