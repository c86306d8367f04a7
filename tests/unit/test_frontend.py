"""The engine for asyncio callers (verifier_service/frontend.py): when each step's outputs
go to the event loop."""

import asyncio
import re
import threading

import pytest

from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from specd.constraint import Constraint
from tests.cluster import char_tokenizer
from tests.conftest import run_engine
from verifier_service.engine import Engine
from verifier_service.frontend import AsyncEngine
from verifier_service.request import Request

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9], [20, 31, 42, 53, 64, 75, 86]]


def _engine(tiny_pair, drafting: bool) -> Engine:
    target, draft = tiny_pair
    proposer = DraftModelProposer(draft, num_blocks=128, block_size=4) if drafting else None
    return Engine(target, EngineConfig(num_blocks=256, block_size=4), proposer, eos_ids=set())


@pytest.mark.parametrize("queued", [False, True])
@pytest.mark.parametrize("drafting", [False, True])
def test_a_steps_outputs_go_to_the_event_loop_where_the_next_step_leaves_python(
    tiny_pair, drafting, queued
):
    """Each step's outputs are sent once the next step has planned and drafted, just
    before the thread waits on the forward, so the event loop's work on them runs beside
    the model, not in the GIL while the next step plans or while its drafter round trip
    runs; on a device whose forward returns queued (a GPU's), once it is queued and
    before the wait for it, so that work runs while the device computes. Except where
    the step's drafter first catches up on a sequence's prompt: they go before that
    round, so a first token does not wait for it. Sent as their step ends, they came
    before its planning. Every request still gets all its tokens, in order, and what it
    gets stepping the engine directly."""
    k = 2 if drafting else 0
    reqs = [dict(prompt=p, max_new_tokens=16, num_draft=k) for p in PROMPTS]
    want = list(run_engine(_engine(tiny_pair, drafting), reqs).values())
    engine = _engine(tiny_pair, drafting)
    events = []
    schedule, forward = engine.scheduler.schedule, engine.model.forward
    was_queued = engine.model.queued

    def traced_schedule(*args):
        events.append("plan")
        return schedule(*args)

    def traced_forward(kv, seqs):
        events.append("forward")
        return forward(kv, seqs)

    engine.scheduler.schedule = traced_schedule
    engine.model.forward = traced_forward
    engine.model.synchronize = lambda: events.append("sync")
    engine.model.queued = queued
    if drafting:
        propose, seen = engine.proposer.propose, set()

        def traced_propose(states):  # "first": some sequence's first round (a catch-up)
            first = any(s.seq_id not in seen for s in states)
            seen.update(s.seq_id for s in states)
            events.append("draft first" if first else "draft")
            return propose(states)

        engine.proposer.propose = traced_propose

    async def one(frontend, request):
        return [t async for out in frontend.generate(Request(**request)) for t in out.tokens]

    async def main():
        loop = asyncio.get_running_loop()
        send = loop.call_soon_threadsafe

        def traced_send(callback, *args):
            if getattr(callback, "__name__", "") == "_deliver":  # (not asyncio's own)
                events.append("send")
            return send(callback, *args)

        loop.call_soon_threadsafe = traced_send
        frontend = AsyncEngine(engine)
        try:
            return await asyncio.gather(*(one(frontend, r) for r in reqs))
        finally:
            await frontend.close()

    try:
        got = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        del engine.model.forward, engine.model.synchronize  # the class's (a shared model)
        engine.model.queued = was_queued
    assert got == want
    assert engine.kv.allocator.num_used == 0
    sends = [i for i, e in enumerate(events) if e == "send"]
    assert len(sends) >= 8
    for i in sends:
        if "forward" not in events[i + 1 :]:
            continue  # the last outputs: sent when the work ran out
        around = events[i - 3 : i + 3]
        if events[i + 1] == "draft first":  # before a catch-up round
            assert events[i - 1] == "plan", around
        elif queued:  # after the forward is queued, before waiting for it
            assert events[i - 1] == "forward" and events[i + 1] == "sync", around
            assert events[i - 2] in ("plan", "draft"), around
        else:  # before the forward, after the step's planning and drafts
            assert events[i + 1] == "forward", around
            assert events[i - 1] in ("plan", "draft"), around
    assert events.count("sync") == events.count("forward")  # every forward waited for
    if drafting:
        before_catch_up = sum(events[i + 1] == "draft first" for i in sends[:-1])
        after_drafts = sum(events[i - 1 - queued] == "draft" for i in sends[:-1])
        assert 1 <= before_catch_up <= len(PROMPTS) and after_drafts >= 4


def test_a_caller_behind_the_steps_gets_what_arrived_in_one_batch(tiny_pair):
    """generate_batches hands over every output that arrived since the caller last asked:
    a caller that falls behind (a busy event loop) gets several steps at once, in order,
    and then the rest; one step at a time while it keeps up. The verifier sends each batch
    as one message."""
    reqs = [dict(prompt=PROMPTS[0], max_new_tokens=12)]
    want = list(run_engine(_engine(tiny_pair, False), reqs).values())[0]
    engine = _engine(tiny_pair, False)
    # the steps after the prefill wait until the caller has the prefill's token: a step's
    # outputs are handed on before the next forward, so the first batch holds one output
    # however late the event loop wakes
    caller_has_the_first, forward = threading.Event(), engine.model.forward
    prefilled = False

    def held_forward(kv, seqs):
        nonlocal prefilled
        if prefilled:
            assert caller_has_the_first.wait(30), "the caller never got the prefill's token"
        prefilled = True
        return forward(kv, seqs)

    engine.model.forward = held_forward

    async def main():
        frontend = AsyncEngine(engine)
        batches = []
        try:
            stream = frontend.generate_batches(Request(**reqs[0]))
            batches.append(await anext(stream))  # the prefill's token: in step with it
            caller_has_the_first.set()
            queue = next(iter(frontend._queues.values()))
            while queue.qsize() < 5:  # the caller is busy while five more steps arrive
                await asyncio.sleep(0.001)
            async for outputs in stream:
                batches.append(outputs)
        finally:
            await frontend.close()
        return batches

    batches = asyncio.run(asyncio.wait_for(main(), 60))
    assert [t for b in batches for out in b for t in out.tokens] == want
    assert len(batches[0]) == 1 and len(batches[1]) >= 5  # the five that waited, together
    assert all(out.finish_reason is None for b in batches for out in b[:-1])
    assert batches[-1][-1].finish_reason == "length"
    assert sum(len(b) for b in batches) == 12  # every step's output, none merged away
    assert engine.kv.allocator.num_used == 0


def test_the_verifier_sends_a_batch_as_one_message_and_counts_each_step(tiny_pair):
    """One response for the steps that arrived together: their tokens in order, the last
    one's finish and totals; the metrics count every step (tokens, rounds, decisions)."""
    import prometheus_client
    from opentelemetry import trace

    from protos.specd.v1 import verifier_pb2
    from specd import telemetry as names
    from verifier_service.sequence import SpecStats, StepOutput
    from verifier_service.server import VerifierServicer

    registry = prometheus_client.CollectorRegistry()
    telemetry = names.Telemetry("verifier", trace.NoOpTracer(), registry)
    servicer = VerifierServicer(AsyncEngine(_engine(tiny_pair, False)), "tiny", telemetry=telemetry)
    steps = [
        StepOutput(0, [7, 8, 9], None, drafted=3, accepted=2, decision=("on", 1.5)),
        StepOutput(0, [10], None, drafted=3, accepted=0, decision=("on", 1.2)),
        StepOutput(0, [11, 12], "length", 3, 1, stats=SpecStats(), decision=("on", 1.1)),
    ]
    request = verifier_pb2.VerifyGenerateRequest(prompt_ids=[1, 2], max_new_tokens=6)
    msg = servicer._response(request, "code", 3, steps, 6, None)
    assert list(msg.token_ids) == [7, 8, 9, 10, 11, 12] and msg.finish_reason == "length"
    assert msg.usage.completion_tokens == 6 and msg.HasField("speculation")

    def value(name, **labels):
        return registry.get_sample_value(name, {"route": "code", **labels})

    assert value(names.TOKENS_OUT + "_total") == 6
    assert value(names.NUM_DRAFTS + "_total") == 3
    assert value(names.NUM_ACCEPTED + "_total") == 3
    assert value(names.SPEC_DECISIONS + "_total", reason="on") == 3
    per_pos = names.ACCEPTED_PER_POS + "_total"
    assert [value(per_pos, position=str(j)) for j in range(2)] == [2, 1]  # accepted 2, 0, 1
    # another reason, and another route: their own series
    other = [StepOutput(1, [5], None, drafted=0, accepted=0, decision=("off:batch", 1.0))]
    servicer._response(request, "code", 0, other, 1, None)
    servicer._response(request, "chat", 0, other, 1, None)
    assert value(names.SPEC_DECISIONS + "_total", reason="on") == 3
    assert value(names.SPEC_DECISIONS + "_total", reason="off:batch") == 1
    assert (
        registry.get_sample_value(
            names.SPEC_DECISIONS + "_total", {"route": "chat", "reason": "off:batch"}
        )
        == 1
    )
    assert value(names.TOKENS_OUT + "_total") == 7


def test_a_constraint_compiles_off_the_event_loop_which_keeps_serving(tiny_pair):
    """Starting a new constraint compiles its lexer (up to a second for a large one): in a
    worker thread, while the event loop goes on serving the other streams."""
    target, _ = tiny_pair
    cfg = EngineConfig(num_blocks=256, block_size=4)
    engine = Engine(target, cfg, None, eos_ids=set(), load_tokenizer=char_tokenizer)
    start, loop, loop_ran = engine.grammars.start, None, threading.Event()

    def start_that_needs_the_loop(constraint):
        loop.call_soon_threadsafe(loop_ran.set)  # runs only while the loop is free
        assert loop_ran.wait(10), "the event loop stood still while a constraint compiled"
        return start(constraint)

    engine.grammars.start = start_that_needs_the_loop

    async def main():
        nonlocal loop
        loop = asyncio.get_running_loop()
        frontend = AsyncEngine(engine)
        request = Request(PROMPTS[0], max_new_tokens=8, constraint=Constraint("regex", "[a-z]{6}"))
        try:
            return [out async for out in frontend.generate(request)]
        finally:
            await frontend.close()

    outs = asyncio.run(asyncio.wait_for(main(), 60))
    text = "".join(chr(t + 32) for out in outs for t in out.tokens)  # the tiny vocabulary
    assert outs[-1].finish_reason == "stop" and re.fullmatch("[a-z]{6}", text), text
    assert engine.kv.allocator.num_used == 0
