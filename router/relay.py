"""One attempt on one verifier replica: the request it is sent, and its stream relayed as
text deltas (detokenized, cut at stop strings) with the verifier's account at the end."""

from __future__ import annotations

import time

import grpc
from opentelemetry import trace

from protos.specd.v1 import common_pb2, router_pb2, verifier_pb2
from router.decide import Decision
from router.detok import IncrementalDetokenizer, StopStrings
from router.prepare import Prepared, RequestError
from router.replicas import Serving
from specd.telemetry import inject_metadata


async def attempt(replica, prep: Prepared, decision: Decision, span, buffered: bool, tokenizer):
    """One Generate call on one replica, relayed as (arrival time, message) (buffered:
    every message read before the first is handed on, so a failure mid-way can still be
    retried; each keeps the time it arrived)."""
    call = replica.stub.Generate(
        verifier_request(prep, decision),
        timeout=remaining(prep.deadline),
        metadata=inject_metadata(trace.set_span_in_context(span)) if span else None,
    )
    serving = Serving(len(prep.prompt_ids), prep.max_new_tokens, prep.params)
    replica.serving[serving.task] = serving
    try:
        messages = relay(call, prep, decision, tokenizer, serving)
        if buffered:
            for arrived in [(time.perf_counter(), m) async for m in messages]:
                yield arrived
            return
        async for msg in messages:
            yield time.perf_counter(), msg
    finally:
        del replica.serving[serving.task]
        replica.finished = time.monotonic()
        call.cancel()  # no-op when done; frees the verifier's KV when we stop early


async def relay(call, prep: Prepared, decision: Decision, tokenizer, serving: Serving):
    """The verifier's messages as the client's: text deltas, and at the end the finish
    reason, usage and the verifier's account of speculation; `serving` counts the tokens."""
    request = prep.request
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    stops = StopStrings(list(request.stop), include=request.include_stop_str_in_output)
    ids: list[int] = []
    finish, spec, usage = "", common_pb2.SpeculationInfo(), common_pb2.Usage()
    async for resp in call:
        new, logprobs = list(resp.token_ids), list(resp.logprobs)
        # a stop token's text is left out, as vLLM leaves it (the id stays in token_ids)
        shown = new[:-1] if resp.stop_token and not request.include_stop_str_in_output else new
        text, kept = _read(shown, len(ids), prep.params.min_tokens, detok, stops)
        if stops.stopped:  # the tokens a round accepted past the stop string: never output
            new, logprobs = new[:kept], logprobs[:kept]
        ids.extend(new)
        serving.decoded, serving.cached = len(ids), resp.usage.cached_prompt_tokens
        serving.new_line = serving.new_line or "\n" in text
        usage, finish = resp.usage, resp.finish_reason
        if resp.HasField("speculation"):
            spec = resp.speculation
        if stops.stopped:
            finish = "stop"
            usage = common_pb2.Usage(
                prompt_tokens=len(prep.prompt_ids),
                completion_tokens=len(ids),
                cached_prompt_tokens=usage.cached_prompt_tokens,
            )
            call.cancel()
        if finish:
            text += stops.flush()
            # the verifier's account is the truth (as of its last message where a stop
            # string cut the request); the arrival's rides beside it, and says why where
            # the router held the request off (the verifier then had nothing to decide)
            spec.arrival_reason = decision.reason
            if decision.reason.startswith("off:") and spec.reason in ("", "off:request"):
                spec.reason = decision.reason
                spec.num_draft_tokens = decision.k
            final = router_pb2.GenerateStreamResponse(
                text=text,
                token_ids=new,
                logprobs=logprobs,
                prompt_logprobs=resp.prompt_logprobs,
                finish_reason=finish,
                usage=usage,
                speculation=spec,
                route=prep.route,
                warnings=prep.warnings,
            )
            if stops.stopped:
                final.stop_string = stops.matched
            elif resp.stop_token and new[-1] in request.stop_token_ids:
                final.stop_token_id = new[-1]
            yield final
            return
        if text or resp.token_ids:
            yield router_pb2.GenerateStreamResponse(
                text=text,
                token_ids=resp.token_ids,
                logprobs=resp.logprobs,
                prompt_logprobs=resp.prompt_logprobs,
            )


def _read(shown: list[int], before: int, min_tokens: int, detok, stops) -> tuple[str, int]:
    """The text `shown` releases, and how many of its tokens the output keeps: fed one token
    at a time, so that a stop string ends the output at the token that completes it, with
    speculation as without (a round may accept tokens past it); `before`: the tokens output
    so far (stop strings are not matched in the first `min_tokens` tokens' text)."""
    if not stops.stops:  # nothing can cut it: the round's tokens at once
        return stops.feed(detok.push(shown)), len(shown)
    text = ""
    for n, token in enumerate(shown, start=1):
        text += stops.feed(detok.push([token]), search=before + n > min_tokens)
        if stops.stopped:
            return text, n
    return text, len(shown)


def remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
    return left


def verifier_request(prep: Prepared, decision: Decision) -> verifier_pb2.VerifyGenerateRequest:
    request, policy = prep.request, prep.policy
    return verifier_pb2.VerifyGenerateRequest(
        prompt_ids=prep.prompt_ids,
        params=request.params,
        max_new_tokens=prep.max_new_tokens,
        stop_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        constraint=request.constraint,
        num_draft_tokens=decision.k,
        route=prep.route,
        auto=decision.auto,
        # the route's soft bounds, applied by the verifier every step
        draft_below_batch=policy.max_batch_size if decision.auto else 0,
        max_kv_utilization=policy.max_kv_utilization if decision.auto else 0.0,
        min_acceptance=policy.min_acceptance if decision.auto else 0.0,
        proposer=policy.proposer,
        suffix_private=not policy.suffix_shared or bool(request.cache_salt),
        cache_salt=request.cache_salt,
        prediction_ids=prep.prediction_ids,
    )
