"""llama-server's answer to one /completion or /infill prompt: `content`, `tokens`,
`stop_type` (`eos`, `limit`, `word`) and `stopping_word`, token counts, `timings` (with
`draft_n` and `draft_n_accepted` where speculation drafted, as llama-server's), and
with `n_probs` the `completion_probabilities`; streamed, a `data:` event per message with
the new `content`, `stop: false`, and a last one with `stop: true` and the rest.

Two of llama-server's stop rules are the router's, read from the text as it comes:
- `n_indent`: a line after the first whose indentation is less ends the output there
  (the line's indentation stays, its text goes), as a limit;
- `t_max_predict_ms`: past that long since the first token, a message holding a newline
  ends the output after it, as a limit.
Closing the stream then cancels the request, which frees its KV."""

from __future__ import annotations

import math
import time

from router.llamacpp_schema import LlamaCompletionBody


class LlamaAnswer:
    def __init__(self, body: LlamaCompletionBody, model: str, prompt: str, evaluated: int, decode):
        """`prompt`: the prompt as text (llama-server returns it); `evaluated`: its tokens;
        `decode`: ids -> text, for the probabilities' tokens."""
        self.body, self.model, self.prompt, self.evaluated = body, model, prompt, evaluated
        self.decode = decode
        self.content = ""
        self.tokens: list[int] = []
        self.probs: list[dict] = []
        self.t_start = time.monotonic()
        self.t_first: float | None = None
        self.limited = False  # an n_indent or t_max_predict_ms stop
        self.indented = 0  # where the lines n_indent has passed end (`_indent_cut`)
        self.silent = body.n_predict == 0  # the one token generated is not answered

    def feed(self, msg) -> dict | None:
        """One message of the request's stream -> its streamed event (None: nothing new);
        `done` says whether the output ended here."""
        now = time.monotonic()
        if self.t_first is None:
            self.t_first = now
        text, ids = ("", []) if self.silent else (msg.text, list(msg.token_ids))
        text = self._indent_cut(text)
        if not self.limited and self.body.t_max_predict_ms and "\n" in text:
            self.limited = (now - self.t_first) * 1000 > self.body.t_max_predict_ms
        self.content += text
        self.tokens += ids
        probs = [self._probs(t, lp) for t, lp in zip(ids, msg.logprobs, strict=False)]
        self.probs += probs
        if not (text or ids):
            return None
        event = {"index": 0, "content": text, "tokens": ids, "stop": False, "id_slot": -1}
        event |= {"tokens_predicted": len(self.tokens), "tokens_evaluated": self.evaluated}
        if probs:
            event["completion_probabilities"] = probs
        return event

    @property
    def done(self) -> bool:
        return self.limited

    def final(self, msg, streamed: bool) -> dict:
        """The last answer, from the stream's last message (None: the output was cut by a
        stop rule); `streamed`: its content was sent already (llama-server then sends "")."""
        stop_type, word = "limit", ""
        cached = msg.usage.cached_prompt_tokens if msg is not None else 0  # cut: not told
        if msg is not None and not self.limited:
            stop_type = {"length": "limit"}.get(msg.finish_reason, "eos")
            if msg.WhichOneof("stop_reason") == "stop_string":
                stop_type, word = "word", msg.stop_string
        t_end = time.monotonic()
        first = self.t_first or t_end
        prompt_ms, predicted_ms = (first - self.t_start) * 1000, (t_end - first) * 1000
        predicted = len(self.tokens)
        out = {
            "index": 0,
            "content": "" if streamed else self.content,
            "tokens": self.tokens if (self.body.return_tokens or streamed) else [],
            "id_slot": -1,
            "stop": True,
            "model": self.model,
            "tokens_predicted": predicted,
            "tokens_evaluated": self.evaluated,
            "generation_settings": self._settings(),
            "prompt": self.prompt,
            "has_new_line": "\n" in self.content,
            "truncated": False,
            "stop_type": stop_type,
            "stopping_word": word,
            "tokens_cached": cached,
            "timings": {
                "cache_n": cached,
                "prompt_n": self.evaluated - cached,
                "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / max(self.evaluated - cached, 1),
                "prompt_per_second": _rate(self.evaluated - cached, prompt_ms),
                "predicted_n": predicted,
                "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / max(predicted, 1),
                "predicted_per_second": _rate(predicted, predicted_ms),
            },
        }
        if msg is not None and msg.speculation.drafted:  # as llama-server's speculation tells
            out["timings"]["draft_n"] = msg.speculation.drafted
            out["timings"]["draft_n_accepted"] = msg.speculation.accepted
        if self.probs and not streamed:
            out["completion_probabilities"] = self.probs
        return _fields(out, self.body.response_fields)

    def _indent_cut(self, text: str) -> str:
        """`text` as far as n_indent lets it go: a line after the output's first newline
        that starts with less indentation ends the output before its first character."""
        n = self.body.n_indent
        if not n or self.limited:
            return text
        whole = self.content + text
        start = whole.find("\n", self.indented)
        while start != -1:
            pos = start + 1
            while pos < len(whole) and whole[pos] in " \t":
                pos += 1
            if pos == len(whole):  # the line's indentation may still grow
                break
            if pos - start - 1 < n:  # a blank line too, as llama.cpp
                self.limited = True
                return whole[len(self.content) : pos] if pos > len(self.content) else ""
            self.indented = pos  # this line passed: look on from its text
            start = whole.find("\n", pos)
        return text

    def _probs(self, token: int, lp) -> dict:
        """One token's probabilities in llama-server's shape (log-probabilities)."""
        top = [
            self._token(t) | {"logprob": _finite(v)}
            for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
        ]
        return self._token(token) | {"logprob": _finite(lp.logprob), "top_logprobs": top}

    def _token(self, token: int) -> dict:
        text = self.decode([token])
        return {"id": token, "token": text, "bytes": list(text.encode())}

    def _settings(self) -> dict:
        order = self.body.sampler_order()
        return {
            "n_predict": self.body.n_predict,
            "temperature": order["temperature"],
            "top_k": order["top_k"],
            "top_p": order["top_p"],
            "min_p": order["min_p"],
            "seed": self.body.seed,
            "stop": self.body.stop,
            "n_probs": self.body.n_probs,
            "ignore_eos": self.body.ignore_eos,
            "n_indent": self.body.n_indent,
            "t_max_predict_ms": self.body.t_max_predict_ms,
            "samplers": self.body.sampler_names(),
            "model": self.model,
        }


def _fields(out: dict, paths: list[str] | None) -> dict:
    """llama-server's `response_fields`: only those paths ("a/b" read inside "a"), each
    under its path; a path that is not there is left out."""
    if not paths:
        return out
    picked = {}
    for path in paths:
        value, found = out, True
        for key in path.split("/"):
            found = found and isinstance(value, dict) and key in value
            value = value[key] if found else None
        if found:
            picked[path] = value
    return picked


def _rate(n: int, ms: float) -> float:
    return 1000.0 * n / ms if ms > 0 else 0.0


def _finite(v: float) -> float:
    return v if math.isfinite(v) else -9999.0  # JSON has no -inf
