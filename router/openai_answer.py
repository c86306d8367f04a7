"""The OpenAI API's response objects for one request: the whole completion, or its
Server-Sent Event chunks (usage, and specd's speculation account beside the standard
fields), for each of its `n` choices; a chat's tool calls read out of its text
(`router.tools`)."""

from __future__ import annotations

import time

from google.protobuf.json_format import MessageToDict

from protos.specd.v1 import common_pb2
from router.openai_errors import error_event
from router.reasoning import AnswerReader
from router.tools import ToolUse


class Answer:
    """One request's response objects, whole or as stream chunks, for its `n` choices."""

    END = b"data: [DONE]\n\n"  # after a stream's last chunk

    def __init__(
        self,
        obj: str,
        rid: str,
        model: str,
        body,
        prompts: list[list[int]],
        token_text=None,
        tools: ToolUse | None = None,
        reasoning: str | None = None,
    ):
        """`prompts`: each prompt's ids (a batch's choices: `n` for each, in order);
        `token_text`: ids -> their text (the tokenizer's decode), for log-probabilities;
        `tools`: a chat's tool use, whose calls are read out of each choice's text;
        `reasoning`: the router's reasoning parser (router.reasoning), whose thinking a
        chat answers apart as `reasoning_content`, as vLLM does."""
        self.chat = obj == "chat.completion"
        self.obj = obj
        self.head = {"id": rid, "object": obj, "created": int(time.time()), "model": model}
        self.body = body
        self.n_each = body.n or 1
        self.n = len(prompts) * self.n_each
        self.prompts = prompts
        self.token_text = token_text
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.continuous = self.include_usage and body.stream_options.continuous_usage_stats
        self.so_far = [0] * self.n  # each streamed choice's tokens, for continuous usage
        asked = body.logprobs_asked() is not None
        as_ids = body.return_tokens_as_token_ids
        self.logprobs = (
            [Logprobs(token_text, self.chat, as_ids) for _ in range(self.n)] if asked else None
        )
        self.opened: set[int] = set()  # streamed chat choices whose role delta went out
        # a completion's `echo`: its prompt's text before each choice's (once a choice)
        self.echo = None if self.chat or not body.echo else body.echo_texts(token_text)
        self.echoed: set[int] = set()
        self.chat_echo = body.echoed() if self.chat else ""  # a chat's `echo`
        self.prompt_only = bool(getattr(body, "prompt_only", False))
        self.tools = tools
        self.reasoning = reasoning if self.chat else None
        self.show_thinking = self.chat and body.include_reasoning  # as reasoning_content
        self.readers = [
            AnswerReader(self.reasoning, tools.reader() if tools else None) for _ in range(self.n)
        ]
        self.calls = [0] * self.n  # each choice's calls so far (a stream's call index)
        # a prompt is counted once, whatever its n; completion tokens as choices finish
        self.usage = common_pb2.Usage(prompt_tokens=sum(len(p) for p in prompts))
        self.predicted = [0, 0]  # drafts from the prediction accepted, rejected

    def _read(self, index: int, text: str, finish: str | None) -> tuple[str, str, list, str | None]:
        """Choice `index`'s next text as (thinking, content, tool calls completed, finish
        reason); the calls are read in the answer after the thinking."""
        thinking, content, calls = self.readers[index].read(text, final=bool(finish))
        self.calls[index] += len(calls)
        if finish and self.tools:
            finish = self.tools.finish(finish, self.calls[index] > 0)
        return thinking, content, calls, finish

    def _with_prompt(self, index: int, msg, text: str) -> tuple[str, list, list]:
        """A choice's text, token ids and log-probabilities, led by the prompt's in its
        first (a completion's `echo`; the prompt's first token has no log-probability)."""
        ids = list(msg.token_ids) if msg is not None else []
        entries = list(msg.logprobs) if msg is not None else []
        if self.echo is None or index in self.echoed:
            return text, ids, entries
        self.echoed.add(index)
        prompt = []
        if self.logprobs is not None:  # `logprobs`' count of top tokens, not prompt_logprobs'
            prompt = [None, *(cut(lp, self.body.logprobs or 0) for lp in msg.prompt_logprobs)]
        which = index // self.n_each
        return self.echo[which] + text, self.prompts[which] + ids, prompt + entries

    def _without_output(self, msg):
        """`echo` with `max_tokens: 0`: the message less the one token the engine made
        (the answer is the prompt alone, finished by length, no completion tokens)."""
        if not self.prompt_only:
            return msg
        out = type(msg)()
        out.CopyFrom(msg)
        out.text = ""
        del out.token_ids[:]
        del out.logprobs[:]
        out.usage.completion_tokens = 0
        if out.finish_reason:
            out.finish_reason = "length"
        return out

    def _choice(self, index: int, msg, text: str, finish: str | None, delta=None) -> dict:
        choice = {"index": index}
        ids, entries = (msg.token_ids, msg.logprobs) if msg is not None else ([], [])
        if not self.chat:
            choice["text"], ids, entries = self._with_prompt(index, msg, text)
        elif delta is not None:
            choice["delta"] = delta
        else:
            thinking, content, calls, finish = self._read(index, text, finish)
            content = self.chat_echo + content
            choice["message"] = {"role": "assistant", "content": content}
            if self.reasoning:
                shown = thinking if self.show_thinking else ""
                choice["message"]["reasoning_content"] = shown or None
            if calls:  # content null beside calls where the model wrote none, as OpenAI
                choice["message"] |= {
                    "content": content or None,
                    "tool_calls": [c.as_dict() for c in calls],
                }
        choice["logprobs"] = None
        if self.logprobs is not None and msg is not None:
            choice["logprobs"] = self.logprobs[index].of(ids, entries)
        choice["finish_reason"] = finish
        choice["stop_reason"] = stop_reason(msg) if finish else None
        if self.body.return_token_ids:
            choice["token_ids"] = list(msg.token_ids) if msg is not None else []
        return choice

    def whole(self, resps: list) -> dict:
        """The answer from each choice's GenerateResponse; with n > 1 each choice carries
        its own speculation account too (the top level's is choice 0's)."""
        choices = []
        for i, resp in enumerate(self._without_output(r) for r in resps):
            choices.append(self._choice(i, resp, resp.text, resp.finish_reason))
            self._count(i, resp)
            if self.n > 1:
                choices[-1]["speculation"] = extension_dict(resp)["speculation"]
        out = {
            **self.head,
            "choices": choices,
            "usage": self._usage(),
            **extension_dict(resps[0]),
        }
        if self.body.prompt_logprobs is not None:  # vLLM's: a chat's once, a completion's each
            field = [self._prompt_logprobs(i, r) for i, r in enumerate(resps)]
            if self.chat:
                out["prompt_logprobs"] = field[0]
            else:
                for choice, each in zip(choices, field, strict=True):
                    choice["prompt_logprobs"] = each
        if self.body.return_token_ids and len(self.prompts) == 1:
            out["prompt_token_ids"] = self.prompts[0]
        elif self.body.return_token_ids:  # a batch: each choice its prompt's
            for i, choice in enumerate(choices):
                choice["prompt_token_ids"] = self.prompts[i // self.n_each]
        return out

    def _prompt_logprobs(self, index: int, resp) -> list[dict | None]:
        """vLLM's `prompt_logprobs` of choice `index`'s prompt: None for its first token,
        then at each position {token id: {logprob, rank, decoded_token}} for the prompt's
        token and the `prompt_logprobs` most likely ones (ranks 1, 2, ...)."""
        ids, top = self.prompts[index // self.n_each], self.body.prompt_logprobs
        out: list[dict | None] = [None]
        for token, lp in zip(ids[1:], resp.prompt_logprobs, strict=True):
            entries = [(token, lp.logprob, lp.rank)]
            tops = zip(lp.top_ids, lp.top_logprobs, strict=True)
            entries += [(i, v, rank) for rank, (i, v) in enumerate(tops, start=1)]
            at = {}
            for i, v, r in entries[: top + 1]:  # the prompt's token first, as in vLLM
                text = self.token_text([i])
                at.setdefault(
                    str(i), {"logprob": max(v, Logprobs.FLOOR), "rank": r, "decoded_token": text}
                )
            out.append(at)
        return out

    def chunks(self, index: int, msg) -> list[dict]:
        """The chunks of choice `index`'s stream message (a chat choice's first opens
        with its role delta; its last carries its speculation account)."""
        head = {**self.head, "object": f"{self.obj}.chunk" if self.chat else self.obj}
        msg = self._without_output(msg)
        usage = self._usage_so_far(index)
        out = []
        if self.chat and index not in self.opened:
            self.opened.add(index)
            delta = {"role": "assistant", "content": self.chat_echo}
            out.append({**head, "choices": [self._choice(index, None, "", None, delta)], **usage})
        self.so_far[index] += len(msg.token_ids)
        usage = self._usage_so_far(index)
        finish = msg.finish_reason or None
        if msg.text or msg.token_ids or msg.prompt_logprobs or finish:
            text, calls, thinking = msg.text, [], ""
            if self.chat:
                first = self.calls[index]
                thinking, text, calls, finish = self._read(index, msg.text, finish)
            if self.reasoning and not self.show_thinking:
                thinking = ""
                if not (text or calls or finish or self.logprobs):
                    return out  # thinking or its tags alone: nothing to send
            delta = {"content": text} if text or not (finish or calls or thinking) else {}
            if thinking:
                delta = {"reasoning_content": thinking, **delta}
            if calls:
                delta["tool_calls"] = [c.as_dict(first + i) for i, c in enumerate(calls)]
            chunk = {**head, "choices": [self._choice(index, msg, text, finish, delta)]}
            out.append({**chunk, **usage, **(extension_dict(msg) if finish else {})})
        if finish:
            self._count(index, msg)
        return out

    def _usage_so_far(self, index: int) -> dict:
        """A chunk's usage field: none unless asked; null but on the last chunk; with
        continuous usage, choice `index`'s prompt and its tokens so far (as vLLM)."""
        if not self.continuous:
            return {"usage": None} if self.include_usage else {}
        so_far = common_pb2.Usage(
            prompt_tokens=len(self.prompts[index // self.n_each]),
            completion_tokens=self.so_far[index],
        )
        return {"usage": usage_dict(so_far)}

    def _count(self, index: int, msg) -> None:
        """A finished choice's tokens (its last message's); its prompt's cached ones once
        (from its first choice), as the prompt is counted once."""
        self.usage.completion_tokens += msg.usage.completion_tokens
        if index % self.n_each == 0:
            self.usage.cached_prompt_tokens += msg.usage.cached_prompt_tokens
        self.predicted[0] += msg.speculation.predicted_accepted
        self.predicted[1] += msg.speculation.predicted_drafted - msg.speculation.predicted_accepted

    def _usage(self) -> dict:
        """The whole answer's usage; with a prediction, OpenAI's count of its tokens the
        output took (the drafts from it accepted) and of those it did not (rejected)."""
        out = usage_dict(self.usage)
        if self.body.prediction is not None:
            accepted, rejected = self.predicted
            out["completion_tokens_details"] = {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": rejected,
            }
        return out

    def failed(self, exc) -> dict:
        """An error after the stream began (its HTTP status already sent)."""
        return error_event(exc)

    def closing(self) -> list[dict]:
        """After every choice finished: the usage chunk, where the request asked for it."""
        if not self.include_usage:
            return []
        head = {**self.head, "object": f"{self.obj}.chunk" if self.chat else self.obj}
        return [{**head, "choices": [], "usage": self._usage()}]


class Logprobs:
    """A choice's `logprobs` in the endpoint's shape, message by message: chat's
    `content` list of {token, logprob, bytes, top_logprobs}, or the completions API's
    tokens, token_logprobs, top_logprobs (the emitted token's beside the top ones, as in
    the OpenAI API) and text_offset (counted on across a stream's chunks). A token's text
    is its own decoding, special tokens included, as vLLM shows them; a token a constraint
    forbids (-inf) reads FLOOR, as in vLLM (JSON has no infinity)."""

    FLOOR = -9999.0

    def __init__(self, token_text, chat: bool, as_ids: bool = False):
        """`as_ids`: each token named `token_id:{id}` (vLLM's return_tokens_as_token_ids,
        for clients that must know the ids exactly)."""
        self.text = (lambda i: f"token_id:{i}") if as_ids else (lambda i: token_text([i]))
        self.chat = chat
        self.offset = 0  # the completion's characters before the next token

    def of(self, ids, logprobs) -> dict:
        if self.chat:
            return {
                "content": [self._chat_entry(i, lp) for i, lp in zip(ids, logprobs, strict=True)]
            }
        tokens = [self.text(i) for i in ids]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        tops = [  # None: an echoed prompt's first token, as in vLLM
            None if lp is None else {**self._top(lp), token: self._value(lp.logprob)}
            for token, lp in zip(tokens, logprobs, strict=True)
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else self._value(lp.logprob) for lp in logprobs],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entry(self, token_id: int, lp) -> dict:
        top = [self._entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        return {**self._entry(token_id, lp.logprob), "top_logprobs": top}

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self.text(token_id)
        return {"token": token, "logprob": self._value(logprob), "bytes": list(token.encode())}

    def _top(self, lp) -> dict:
        return {
            self.text(i): self._value(v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
        }

    def _value(self, logprob: float) -> float:
        return max(logprob, self.FLOOR)


def cut(lp: common_pb2.TokenLogprob, top: int) -> common_pb2.TokenLogprob:
    """A token's log-probability with its `top` most likely tokens only."""
    out = common_pb2.TokenLogprob()
    out.CopyFrom(lp)
    del out.top_ids[top:], out.top_logprobs[top:]
    return out


def stop_reason(msg) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or the id of `stop_token_ids` that ended the
    choice; None for an end-of-sequence token, a complete constraint or a length."""
    which = msg.WhichOneof("stop_reason") if msg is not None else None
    return getattr(msg, which) if which is not None else None


def usage_dict(u: common_pb2.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


def extension_dict(msg) -> dict:
    """specd's fields beside the standard ones: the speculation account and the route."""
    spec = MessageToDict(
        msg.speculation,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    out = {"speculation": spec, "route": msg.route}
    if msg.warnings:
        out["warnings"] = list(msg.warnings)
    return out
