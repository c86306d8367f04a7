"""The fields SGLang's servers take beyond vLLM's, on /generate and on the OpenAI
endpoints. SGLang's clients send them, and its Model Gateway (sglang-router, `smg`)
forwards every request with its own defaults filled in (`no_stop_trim: false`,
`separate_reasoning: true`, `return_hidden_states: false`, `model: null`, ...), so a
worker behind it takes them:

- served on the OpenAI endpoints (`SglangFields`): `no_stop_trim` (the stop string kept,
  vLLM's include_stop_str_in_output), `regex`, `ebnf` (GBNF) and `extra_key` (a prefix
  cache of its own, as `cache_salt`); `json_schema` as JSON text is llama-server's field;
- for what specd does not do (NOTHING_ASKED): taken at the values that ask for nothing,
  refused naming the field otherwise;
- logging, tracing and routing hints (NO_EFFECT): taken without effect.

A body built on `SglangExtras` takes these as extras; any other field it does not declare
is refused as unknown."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from router.body import BodyError, Request, Strict
from router.llamacpp_sampling import gbnf_to_lark

# Fields for adapters, other modalities, hidden states, experts, disaggregated prefill,
# sessions, data-parallel ranks and SGLang's extra outputs, with the values that ask for
# nothing (sglang.bench_serving sends `lora_path: null`, `return_routed_experts: false`).
# A batch may give one value per prompt.
NOTHING_ASKED: dict[str, tuple] = {
    **dict.fromkeys(
        [
            "lora_path",
            "lora_id",
            "input_embeds",
            "image_data",
            "video_data",
            "audio_data",
            "mm_hashes",
            "mm_content_hashes",
            "video_config",
            "modalities",
            "images_config",
            "mm_processor_kwargs",
            "max_dynamic_patch",
            "min_dynamic_patch",
            "token_ids_logprob",
            "return_sampling_mask",
            "sampling_logprobs_mode",
            "session_id",
            "session_params",
            "custom_logit_processor",
            "custom_params",
            "positional_embed_overrides",
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
            "bootstrap_pair_key",
            "decode_tp_size",
            "disagg_prefill_dp_rank",
            "max_thinking_tokens",
            "watermark",
            "kv_hints",
            "multi_item_delimiter_indices",
            "token_indices_to_pool",
            "encoder_urls",
            "stop_regex",
            "beam_width",
            "thinking",
            "task",
            "input_ids",
        ],
        (None,),
    ),
    **dict.fromkeys(
        [
            "use_audio_in_video",
            "return_flat_raw_top_logprobs",
            "return_flat_raw_output_top_logprobs",
            "return_hidden_states",
            "return_routed_experts",
            "return_indexer_topk",
            "return_bytes",
            "return_entropy",
            "return_prompt_token_ids",
            "return_meta_info",
            "return_input_ids_in_sglext",
            "return_output_ids_in_sglext",
            "background",
            "require_reasoning",
        ],
        (None, False),
    ),
    # the thinking a reasoning parser reads apart is answered apart, and streamed
    **dict.fromkeys(["separate_reasoning", "stream_reasoning"], (None, True)),
    "routed_experts_start_len": (None, 0),
    # one rank, one queue: rank 0 and priority 0 are what every request gets
    "routed_dp_rank": (None, 0),
    "data_parallel_rank": (None, 0),
    "priority": (None, 0),
}
# logging, tracing and routing hints; specd's answers always carry the cached tokens and
# the speculation's counts
NO_EFFECT = frozenset(
    [
        "model",
        "rid",
        "log_metrics",
        "no_logs",
        "custom_labels",
        "external_trace_header",
        "received_time",
        "routing_key",
        "conversation_id",
        "http_worker_ipc",
        "return_cached_tokens_details",
        "return_spec_tokens_details",
    ]
)


class SglangExtras(Request):
    """A body that takes SGLang's fields it does not declare (NOTHING_ASKED, NO_EFFECT)."""

    model_config = ConfigDict(extra="allow", strict=True)

    def sglang_refused(self) -> dict[str, bool]:
        """Field -> whether it asks for what specd does not do; BodyError for a field
        neither declared nor SGLang's."""
        refused = {}
        for name, value in (self.model_extra or {}).items():
            if name in NO_EFFECT:
                continue
            if name not in NOTHING_ASKED:
                raise BodyError(f"unknown field {name!r}", name)
            refused[name] = asks_for_something(name, value)
        return refused


def asks_for_something(name: str, value) -> bool:
    """Whether NOTHING_ASKED's field `name` asks for something (a batch's list: any)."""
    values = value if isinstance(value, list) else [value]
    return any(v not in NOTHING_ASKED[name] for v in values)


class SglangFields(Strict):
    """What SGLang's OpenAI endpoints serve beyond vLLM's fields."""

    no_stop_trim: bool = False
    regex: str | None = None
    ebnf: str | None = None  # GBNF, as llama.cpp's (converted for llguidance)
    extra_key: Annotated[str, Field(min_length=1)] | None = None

    def sglang_constraints(self) -> list[tuple[str, dict]]:
        """(field, keywords of specd.constraint.named) for `regex` and `ebnf`."""
        grammar = gbnf_to_lark(self.ebnf, "ebnf") if self.ebnf is not None else None
        return [("regex", {"regex": self.regex}), ("ebnf", {"grammar": grammar})]


def salt(extra_key: str | None, cache_salt: str | None) -> str | None:
    """The prefix cache's salt: SGLang's extra_key and cache_salt, each its own."""
    return "\n".join(s for s in (extra_key, cache_salt) if s) or None
