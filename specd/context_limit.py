"""A request past the model's context, in the words its clients read to shorten a
conversation and retry: vLLM's and the OpenAI API's (`ContextExceeded`, the verifier's
refusal, with the OpenAI error code `CODE`) and Anthropic's (`in_anthropic_words`, for the
Messages door, read back from the first)."""

from __future__ import annotations

import re

CODE = "context_length_exceeded"  # the OpenAI API's error code


class ContextExceeded(ValueError):
    """prompt + max_new tokens past `context`, said as vLLM and the OpenAI API say it."""

    code = CODE

    def __init__(self, context: int, prompt: int, max_new: int):
        super().__init__(
            f"This model's maximum context length is {context} tokens. However, you "
            f"requested {prompt + max_new} tokens ({prompt} in the prompt, {max_new} in the "
            "completion). Please reduce the length of the prompt or completion."
        )


_NUMBERS = re.compile(
    r"maximum context length is (\d+) tokens\. However, you requested \d+ tokens "
    r"\((\d+) in the prompt, (\d+) in the completion\)"
)


def in_anthropic_words(message: str) -> str | None:
    """A ContextExceeded message as Anthropic's API says it (Claude Code and LiteLLM read
    "prompt is too long" as the context window's end); None for any other message."""
    found = _NUMBERS.search(message)
    if found is None:
        return None
    context, prompt, max_new = map(int, found.groups())
    if prompt > context:
        return f"prompt is too long: {prompt} tokens > {context} maximum"
    return (
        f"input length and `max_tokens` exceed context limit: {prompt} + {max_new} > "
        f"{context}, decrease input length or `max_tokens` and try again"
    )
