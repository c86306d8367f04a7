"""The verifier's stats lines in its log, every few seconds while it works, as vLLM's
engine writes them: prompt and generation throughput, running and waiting requests, KV
cache usage and prefix cache hit rate; and where it speculated, how drafts fared."""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)


class StatsLog:
    """Counts what the verifier's responses carried since the last line (`add`), and says
    it with the engine's load every `interval` seconds (`run`)."""

    def __init__(self, engine, interval: float):
        self.engine, self.interval = engine, interval
        self._since = time.monotonic()
        self._load = engine.load()
        self._reset()

    def _reset(self) -> None:
        self.prompt_tokens = 0  # of requests whose first token came
        self.tokens = 0  # generated
        self.drafts = 0  # rounds that verified drafts
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # of which accepted
        self.per_position: list[int] = []  # rounds whose draft at position i was accepted

    def add(self, outputs, prompt_tokens: int = 0) -> None:
        """One response's step outputs; `prompt_tokens`: its request's prompt, with the
        request's first token."""
        self.prompt_tokens += prompt_tokens
        for out in outputs:
            self.tokens += len(out.tokens)
            if out.drafted:
                self.drafts += 1
                self.drafted += out.drafted
                self.accepted += out.accepted
                while len(self.per_position) < out.accepted:
                    self.per_position.append(0)
                for position in range(out.accepted):
                    self.per_position[position] += 1

    def lines(self) -> list[str]:
        """The lines for the time since the last call (none when nothing ran in it and
        nothing runs or waits now); the counts start again."""
        now, load = time.monotonic(), self.engine.load()
        seconds, last = max(now - self._since, 1e-9), self._load
        busy = self.tokens or self.prompt_tokens or load.running or load.waiting
        queries = load.prefix_queries - last.prefix_queries
        hits = load.prefix_hits - last.prefix_hits
        out = []
        if busy:
            out.append(
                f"Avg prompt throughput: {self.prompt_tokens / seconds:.1f} tokens/s, "
                f"Avg generation throughput: {self.tokens / seconds:.1f} tokens/s, "
                f"Running: {load.running} reqs, Waiting: {load.waiting} reqs, "
                f"KV cache usage: {load.kv_utilization:.1%}, "
                f"Prefix cache hit rate: {hits / queries if queries else 0.0:.1%}"
            )
        if busy and self.drafts:
            rates = ", ".join(f"{n / self.drafts:.3f}" for n in self.per_position) or "-"
            out.append(
                "Speculative decoding: "
                f"Mean acceptance length: {1 + self.accepted / self.drafts:.2f}, "
                f"Accepted throughput: {self.accepted / seconds:.2f} tokens/s, "
                f"Drafted throughput: {self.drafted / seconds:.2f} tokens/s, "
                f"Accepted: {self.accepted} tokens, Drafted: {self.drafted} tokens, "
                f"Per-position acceptance rate: {rates}, "
                f"Avg draft acceptance rate: {self.accepted / self.drafted:.1%}"
            )
        self._since, self._load = now, load
        self._reset()
        return out

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            for line in self.lines():
                log.info("%s", line)
