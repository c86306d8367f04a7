"""Conversions between protobuf messages and specd's own types (done at the edges).

Torch-free (the router uses this module); the drafter's proposals, which carry tensors,
convert in specd/wire_proposals.py.
"""

from __future__ import annotations

from protos.specd.v1 import common_pb2
from specd.constraint import Constraint
from specd.params import SamplingParams

# max_new_tokens on the wire (router and verifier requests): as many tokens as the model's
# context leaves after the prompt (llama.cpp's n_predict -1; what vLLM and the OpenAI API
# do for a chat request that names no limit)
UNTIL_CONTEXT = -1

# trailing metadata of a refused request: the OpenAI API's error code where one fits
# ("context_length_exceeded"), for the HTTP door to answer with it
ERROR_CODE_KEY = "error-code"


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Proto3 zeros mean "unset": top_p 0 -> 1 (off); repetition_penalty unset -> 1."""
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.top_p != 0 else 1.0,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        min_tokens=msg.min_tokens,
        temperature_last=msg.temperature_last,
        infill=msg.infill,
        allowed_token_ids=tuple(sorted(set(msg.allowed_token_ids))),
        bad_words=tuple(tuple(word.ids) for word in msg.bad_words),
    )


def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_tokens=p.min_tokens,
        temperature_last=p.temperature_last,
        infill=p.infill,
        allowed_token_ids=p.allowed_token_ids,
        bad_words=[common_pb2.TokenSequence(ids=word) for word in p.bad_words],
    )
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    if p.seed is not None:
        msg.seed = p.seed
    msg.logit_bias.update(dict(p.logit_bias))
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def speculation_to_proto(stats, k: int) -> common_pb2.SpeculationInfo:
    """A request's speculation totals (verifier_service.sequence.SpecStats) as sent."""
    return common_pb2.SpeculationInfo(
        enabled=stats.rounds > 0,
        reason=stats.reason,
        num_draft_tokens=k,
        rounds=stats.rounds,
        drafted=stats.drafted,
        accepted=stats.accepted,
        acceptance_rate=stats.acceptance_rate,
        mean_accepted_length=stats.mean_accepted_length,
        mean_draft_tokens=stats.drafted / stats.rounds if stats.rounds else 0.0,
        lookup_rounds=stats.lookup_rounds,
        predicted_drafted=stats.predicted_drafted,
        predicted_accepted=stats.predicted_accepted,
    )


def constraint_from_proto(msg: common_pb2.Constraint) -> Constraint | None:
    """Unset -> None. Only the kind is checked here; Constraint.grammar() checks the rest."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object" and not msg.json_object:
        raise ValueError("constraint.json_object must be true when set")
    text = "" if kind == "json_object" else getattr(msg, kind)
    return Constraint(kind, text, msg.after_thinking)


def constraint_to_proto(c: Constraint | None) -> common_pb2.Constraint:
    if c is None:
        return common_pb2.Constraint()
    value = True if c.kind == "json_object" else c.text
    return common_pb2.Constraint(**{c.kind: value}, after_thinking=c.after_thinking)
