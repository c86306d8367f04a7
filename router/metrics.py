"""The router's Prometheus metrics: requests, tokens, latencies and decisions by route."""

from __future__ import annotations

import time


class RouterMetrics:
    def __init__(self, telemetry):
        from specd import telemetry as names

        t = telemetry
        route = ("route",)
        self.requests = t.counter(names.REQUESTS, "Requests finished", ("route", "finish_reason"))
        self.decisions = t.counter(names.DECISIONS, "Speculation decisions", ("route", "reason"))
        self.tokens = t.counter(names.TOKENS_OUT, "Tokens generated", route)
        self.ttft = t.histogram(names.TTFT, "Time to first token", route)
        self.tpot = t.histogram(
            names.TPOT, "Time per output token after the first", ("route", "speculation")
        )
        self.e2e = t.histogram(names.E2E, "End-to-end request latency", route)
        self.affinity = t.counter(
            names.PREFIX_AFFINITY, "Replica choices by prefix affinity", ("outcome",)
        )

    def chosen(self, outcome: str) -> None:
        """A replica chosen by prefix affinity: cached, busy or new (router.affinity)."""
        self.affinity.labels(outcome).inc()

    def finished(self, route: str, final, started: float, first, tokens: int) -> None:
        now = time.perf_counter()
        self.requests.labels(route, final.finish_reason).inc()
        self.tokens.labels(route).inc(tokens)
        self.e2e.labels(route).observe(now - started)
        if first is not None:
            self.ttft.labels(route).observe(first - started)
            if tokens > 1:
                spec = "on" if final.speculation.enabled else "off"
                self.tpot.labels(route, spec).observe((now - first) / (tokens - 1))
