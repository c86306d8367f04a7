"""llama-server's sampler fields, which its clients send to every endpoint (llama.vscode's
chat edit sends them to /v1/chat/completions): `samplers`, which says which samplers
apply and in which order, and the samplers specd has not, accepted where they are off;
and its constraints, `json_schema` (a JSON schema) and `grammar` (GBNF, converted for
llguidance).

`samplers` (names, or their letters as a string) maps onto specd's parameters: one left
out does not apply (no `temperature`: 1); specd applies top-k, top-p, min-p in that order,
with the temperature before all of them or after all of them (llama.cpp's default), and
llama.cpp's `infill` sampler after them; an order outside that is refused. `dry`, `typ_p`,
`xtc`, `top_n_sigma` and `penalties` may be listed while their parameters leave them off.
"""

from __future__ import annotations

from typing import Any

from router.body import BodyError, Strict

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


class LlamaSamplers(Strict):
    samplers: list[str] | str | None = None
    json_schema: dict[str, Any] | str | None = None  # str: JSON text, as SGLang's
    grammar: str | None = None  # GBNF
    # samplers specd has not: accepted where they are off
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
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
    # accepted, without effect in specd
    cache_prompt: bool = True  # the prefix cache is on wherever it cannot change an output
    id_slot: int = -1
    n_keep: int = 0
    n_cache_reuse: int = 0
    t_max_prompt_ms: int | None = None
    timings_per_token: bool = False
    return_progress: bool = False
    sse_ping_interval: float | None = None

    def llama_refused(self) -> dict[str, bool]:
        """Field -> whether it turns on a sampler specd has not."""
        return {
            "dynatemp_range": self.dynatemp_range != 0,
            "typical_p": self.typical_p != 1,
            "repeat_penalty": self.repeat_penalty != 1,
            "dry_multiplier": self.dry_multiplier != 0,
            "xtc_probability": self.xtc_probability > 0 and self.xtc_threshold <= 0.5,
            "mirostat": self.mirostat != 0,
            "top_n_sigma": self.top_n_sigma > 0,
            "min_keep": self.min_keep > 1,
        }

    def chain(self, temperature: float, top_k: int, top_p: float, min_p: float) -> dict:
        """The samplers listed, with these values, as specd's parameters: top_k, top_p,
        min_p, temperature (those not listed off), temperature_last and infill."""
        names = self.sampler_names()
        active = [n for n in names if n not in ("dry", "typ_p", "xtc", "top_n_sigma", "penalties")]
        if len(set(active)) != len(active):
            raise BodyError("samplers: each sampler at most once", "samplers")
        truncations = [n for n in active if n != "temperature"]
        if truncations != [n for n in TRUNCATIONS if n in truncations]:
            raise BodyError(f"samplers: specd applies them in the order {TRUNCATIONS}", "samplers")
        order = {
            "top_k": top_k if "top_k" in active else 0,
            "top_p": top_p if "top_p" in active else 1.0,
            "min_p": min_p if "min_p" in active else 0.0,
            "temperature": temperature if "temperature" in active else 1.0,
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

    def llama_constraints(self) -> list[tuple[str, dict]]:
        """(field, keywords of specd.constraint.named) for `json_schema` and `grammar`."""
        grammar = gbnf_to_lark(self.grammar, "grammar") if self.grammar is not None else None
        return [
            ("json_schema", {"json_schema": self.json_schema}),
            ("grammar", {"grammar": grammar}),
        ]

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


def gbnf_to_lark(gbnf: str, param: str) -> str:
    """A GBNF grammar as llguidance's Lark; BodyError naming `param` where it is not one."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(gbnf)
    except Exception as exc:  # its parser's own errors
        raise BodyError(f"{param}: not GBNF llguidance reads: {exc}", param) from None
