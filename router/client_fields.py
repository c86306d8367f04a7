"""Fields OpenAI's and vLLM's clients send to the chat and completion endpoints that do
not shape the sampling: accepted as vLLM accepts them, or refused, naming the field,
where they ask for what specd does not do.

- OpenAI's fields about the service rather than the output (`metadata`, `store`,
  `service_tier`, `prompt_cache_key`, `safety_identifier`, `modalities` of text) are
  accepted without effect: specd stores nothing, has one tier, and its prefix cache needs
  no key. `prediction`, OpenAI's predicted output, is what speculation drafts from where
  the output follows it (specd/prediction.py; vLLM ignores it).
- vLLM's `request_id` names the answer (`chatcmpl-{request_id}`; an `X-Request-Id`
  header first, as vLLM reads it); `priority` other than 0 is refused (specd serves first
  come, first served, as vLLM does without its priority scheduler);
  `spaces_between_special_tokens` is accepted (it changes nothing with a fast
  tokenizer, in vLLM as here); beam search and `length_penalty` are refused.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from router.body import Strict


class PredictedText(Strict):
    type: Literal["text"]
    text: str


class Prediction(Strict):
    type: Literal["content"]
    content: str | list[PredictedText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ClientFields(Strict):
    # OpenAI's, without effect here but `prediction`
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: Prediction | None = None
    # vLLM's
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    priority: int | None = 0  # null: SGLang's default
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def client_refused(self) -> dict[str, bool]:
        """Field -> whether it asks for what specd does not do."""
        return {
            "priority": self.priority not in (None, 0),
            "use_beam_search": self.use_beam_search,
            "length_penalty": self.length_penalty != 1.0,
        }

    def answer_id(self, prefix: str, header: str | None, fresh: str) -> str:
        """The answer's id: `{prefix}-` and the X-Request-Id header, else `request_id`,
        else `fresh`."""
        return f"{prefix}-{header or self.request_id or fresh}"
