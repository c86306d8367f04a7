"""The engine for asyncio callers (verifier_service/frontend.py): when each step's outputs
go to the event loop."""

import asyncio

import pytest

from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from tests.conftest import run_engine
from verifier_service.engine import Engine
from verifier_service.frontend import AsyncEngine
from verifier_service.request import Request

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9], [20, 31, 42, 53, 64, 75, 86]]


def _engine(tiny_pair, drafting: bool) -> Engine:
    target, draft = tiny_pair
    proposer = DraftModelProposer(draft, num_blocks=128, block_size=4) if drafting else None
    return Engine(target, EngineConfig(num_blocks=256, block_size=4), proposer, eos_ids=set())


@pytest.mark.parametrize("drafting", [False, True])
def test_a_steps_outputs_go_to_the_event_loop_where_the_next_step_leaves_python(
    tiny_pair, drafting
):
    """Each step's outputs are sent once the next step has planned, just before the thread
    waits on the drafter's round (a drafting step) or on the forward (a plain one), so the
    event loop's work on them runs beside the model, not in the GIL while the next step
    plans; sent as their step ends, they came before its planning. Every request still
    gets all its tokens, in order, and what it gets stepping the engine directly."""
    k = 2 if drafting else 0
    reqs = [dict(prompt=p, max_new_tokens=16, num_draft=k) for p in PROMPTS]
    want = list(run_engine(_engine(tiny_pair, drafting), reqs).values())
    engine = _engine(tiny_pair, drafting)
    events = []
    schedule, forward = engine.scheduler.schedule, engine.model.forward

    def traced_schedule(*args):
        events.append("plan")
        return schedule(*args)

    def traced_forward(kv, seqs):
        events.append("forward")
        return forward(kv, seqs)

    engine.scheduler.schedule = traced_schedule
    engine.model.forward = traced_forward
    if drafting:
        propose = engine.proposer.propose
        engine.proposer.propose = lambda states: events.append("draft") or propose(states)

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
        del engine.model.forward  # back to the class's method (the model is shared)
    assert got == want
    assert engine.kv.allocator.num_used == 0
    sends = [i for i, e in enumerate(events) if e == "send"]
    assert len(sends) >= 8
    for i in sends:
        if "forward" not in events[i + 1 :]:
            continue  # the last outputs: sent when the work ran out
        assert events[i - 1] == "plan", events[i - 3 : i + 3]
        assert events[i + 1] in ("draft", "forward"), events[i - 3 : i + 3]
    if drafting:  # sent before the drafter's round, which the thread waits on too
        assert sum(events[i + 1] == "draft" for i in sends[:-1]) >= 4
