"""What the verifier reports about its load: tokens/s, and its Prometheus metrics."""

from __future__ import annotations

import time
from collections import deque


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
        self.k = t.histogram(names.SPEC_K, "1", "Draft tokens per decode step (0: plain)")
        self.gain = t.histogram(names.SPEC_GAIN, "1", "Predicted tokens/s of the step vs plain")
        self.reasons = t.counter(names.SPEC_DECISIONS, "Controller decisions per decode step")
        t.gauge(names.KV_USAGE, self._kv, "Fraction of KV blocks in use")
        t.gauge(names.RUNNING, self._running, "Sequences running")
        t.gauge(names.WAITING, self._waiting, "Sequences waiting")

    def step(self, route: str, out) -> None:
        labels = {"route": route}
        self.tokens.add(len(out.tokens), labels)
        reason, gain = out.decision
        if reason:  # a decode step (prefill chunks decide nothing)
            self.k.record(out.drafted, labels)
            self.gain.record(gain, labels)
            self.reasons.add(1, {"route": route, "reason": reason})
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
