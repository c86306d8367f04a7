"""What the verifier reports about its load: rolling acceptance per route, tokens/s."""

from __future__ import annotations

import time
from collections import deque


class RouteAcceptance:
    """Exponentially weighted acceptance rate per route (weight by drafted tokens)."""

    def __init__(self, half_life_tokens: float = 200.0):
        self.decay = 0.5 ** (1 / half_life_tokens)
        self._drafted: dict[str, float] = {}
        self._accepted: dict[str, float] = {}

    def record(self, route: str, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        d = self.decay**drafted
        self._drafted[route] = self._drafted.get(route, 0.0) * d + drafted
        self._accepted[route] = self._accepted.get(route, 0.0) * d + accepted

    def rates(self) -> dict[str, float]:
        return {r: self._accepted[r] / self._drafted[r] for r in self._drafted}


class TokenRate:
    """Tokens generated per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = 1.0):
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()

    def add(self, n: int) -> None:
        self._events.append((time.monotonic(), n))

    def rate(self) -> float:
        cutoff = time.monotonic() - self.window_s
        while self._events and self._events[0][0] < cutoff:
            self._events.popleft()
        return sum(n for _, n in self._events) / self.window_s


class VerifierMetrics:
    """The verifier's Prometheus metrics (names in specd.telemetry)."""

    def __init__(self, telemetry, servicer):
        from specd import telemetry as names

        t, self.servicer = telemetry, servicer
        self.drafts = t.counter(names.NUM_DRAFTS, "Speculation rounds")
        self.draft_tokens = t.counter(names.NUM_DRAFT_TOKENS, "Draft tokens proposed")
        self.accepted = t.counter(names.NUM_ACCEPTED, "Draft tokens accepted")
        self.per_pos = t.counter(names.ACCEPTED_PER_POS, "Accepted draft tokens by position")
        self.tokens = t.counter(names.TOKENS_OUT, "Tokens generated")
        t.gauge(names.KV_USAGE, self._kv, "Fraction of KV blocks in use")
        t.gauge(names.RUNNING, self._running, "Sequences running")
        t.gauge(names.WAITING, self._waiting, "Sequences waiting")

    def step(self, route: str, out) -> None:
        labels = {"route": route}
        self.tokens.add(len(out.tokens), labels)
        if out.drafted:
            self.drafts.add(1, labels)
            self.draft_tokens.add(out.drafted, labels)
            self.accepted.add(out.accepted, labels)
            for position in range(out.accepted):
                self.per_pos.add(1, {"route": route, "position": str(position)})

    def _kv(self, options):
        from opentelemetry.metrics import Observation

        yield Observation(self.servicer.engine.kv.allocator.utilization())

    def _running(self, options):
        from opentelemetry.metrics import Observation

        yield Observation(len(self.servicer.engine.scheduler.running))

    def _waiting(self, options):
        from opentelemetry.metrics import Observation

        yield Observation(len(self.servicer.engine.scheduler.waiting))
