"""The engine for asyncio callers: `generate` streams one request's outputs while one
loop task runs the engine's steps on the model thread, so the event loop keeps serving
while the model runs.

The model thread runs steps back to back for as long as there is work, and hands each
step's outputs to the event loop as it goes: the next step never waits for the loop to
wake, take the outputs and send the thread its next step. That round trip between the
threads was ~1 ms a step at c = 1 (a k = 1 chat step is ~60 ms) on the 2-core CPU
(docs/benchmarks-log.md section 50). It hands them on where the next step leaves Python,
so that the event loop's work on them runs beside the model, not before the step's own
Python (section 56)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from specd.model_thread import on_model_thread
from verifier_service.request import Request
from verifier_service.sequence import StepOutput

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine):
        """`engine`: a verifier_service.engine.Engine (it drives what it is given)."""
        self.engine = engine
        self._queues: dict[int, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._closing = False  # set by close(): the model thread stops after its step

    async def generate(self, request: Request) -> AsyncIterator[StepOutput]:
        """Yield each step's new tokens for one request; the last output has
        finish_reason. ValueError (before any output) when the request cannot be served.
        Leaving early (cancel, break) aborts the request and frees its KV."""
        batches = self.generate_batches(request)
        try:
            async for outputs in batches:
                for out in outputs:
                    yield out
        finally:
            await batches.aclose()

    async def generate_batches(self, request: Request) -> AsyncIterator[list[StepOutput]]:
        """As `generate`, but each time every output that has arrived for the request
        since the caller last asked: one step's, or several where the caller fell behind
        the steps (many streams on one event loop), so that it sends one message for them."""
        grammars, grammar = self.engine.grammars, None
        # reading the tokenizer (the first time) and compiling a new constraint's lexer
        # may take a second each: not on the event loop
        if grammars is not None and request.constraint is not None:
            grammar = await asyncio.to_thread(grammars.start, request.constraint)
        elif grammars is not None and request.params.infill:
            await asyncio.to_thread(grammars.prepare)
        seq_id = self.engine.add_request(request, grammar)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[seq_id] = queue
        self._ensure_loop()
        finished = False
        try:
            while not finished:
                outputs = [await queue.get()]
                while not queue.empty() and outputs[-1].finish_reason is None:
                    outputs.append(queue.get_nowait())
                finished = outputs[-1].finish_reason is not None
                yield outputs
        finally:
            self._queues.pop(seq_id, None)
            if not finished:
                self.engine.abort(seq_id)
                self._ensure_loop()

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, between two steps: -> the blocks forgotten."""
        forgotten = self.engine.reset_prefix_cache()
        self._ensure_loop()
        return await asyncio.wrap_future(forgotten)

    def _ensure_loop(self) -> None:
        self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stop the step loop (the servers call this on shutdown)."""
        self._closing = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            await on_model_thread("verifier", self._steps, loop)  # model_thread.py

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the model thread: steps until the work runs out (or close()), each step's
        outputs sent to the event loop in order, when the next step leaves Python for its
        forward, or for a drafter round that catches up (the engine's `before_forward`;
        at once after a step that ran no model, and when the work runs out). The event
        loop's work on them (the responses, gRPC) then runs while this thread waits
        outside the GIL. Sent as soon as their step ended, that work held the GIL while
        this thread began the next step: 0.69 ms between steps at c = 1, against 0.20 ms
        so (docs/benchmarks-log.md section 56)."""
        engine, pending = self.engine, []
        handed, closed = 0, False  # hand_on's calls; the event loop found closed

        def hand_on() -> None:
            nonlocal handed, closed
            handed += 1
            if not pending or closed:
                return
            outputs = pending.copy()
            pending.clear()
            try:
                loop.call_soon_threadsafe(self._deliver, outputs)
            except RuntimeError:  # the event loop is closed: no one is listening
                closed = True

        engine.before_forward = hand_on
        try:
            while engine.has_work() and not self._closing and not closed:
                before = handed
                try:
                    pending.extend(engine.step())
                except Exception:  # never leave requests waiting on a dead loop
                    log.exception("engine step failed; failing the running requests")
                    pending.extend(engine.fail_all())
                if handed == before:  # no model ran: nothing to hide the sending behind
                    hand_on()
            hand_on()
        finally:
            engine.before_forward = None

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.seq_id)
            if queue is not None:
                queue.put_nowait(out)
