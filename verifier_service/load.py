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

        t, self.servicer, route = telemetry, servicer, ("route",)
        self._routes: dict[str, _RouteSeries] = {}
        self.drafts = t.counter(names.NUM_DRAFTS, "Speculation rounds", route)
        self.draft_tokens = t.counter(names.NUM_DRAFT_TOKENS, "Draft tokens proposed", route)
        self.accepted = t.counter(names.NUM_ACCEPTED, "Draft tokens accepted", route)
        self.lookups = t.counter(names.LOOKUP_DRAFTS, "Rounds drafted by a lookup", route)
        self.per_pos = t.counter(
            names.ACCEPTED_PER_POS, "Accepted draft tokens by position", ("route", "position")
        )
        self.tokens = t.counter(names.TOKENS_OUT, "Tokens generated", route)
        self.k = t.histogram(names.SPEC_K, "Draft tokens per decode step (0: plain)", route)
        self.gain = t.histogram(names.SPEC_GAIN, "Predicted tokens/s of the step vs plain", route)
        self.reasons = t.counter(
            names.SPEC_DECISIONS, "Controller decisions per decode step", ("route", "reason")
        )
        self.phases = (  # a finished request's, by route
            t.histogram(names.QUEUE_TIME, "Arrival to the first prefill chunk", route),
            t.histogram(names.PREFILL_TIME, "First prefill chunk to the first token", route),
            t.histogram(names.DECODE_TIME, "First token to the last", route),
            t.histogram(names.INFERENCE_TIME, "First prefill chunk to the last token", route),
        )
        load = lambda: servicer.engine.load()  # noqa: E731  (read at each scrape)
        t.gauge(names.KV_USAGE, lambda: load().kv_utilization, "Fraction of KV blocks in use")
        t.gauge(names.RUNNING, lambda: load().running, "Sequences running")
        t.gauge(names.WAITING, lambda: load().waiting, "Sequences waiting")
        pace = lambda: servicer.engine.observed.pace  # noqa: E731
        t.gauge(names.SPEC_PACE, pace, "Step time vs the prices held")
        # totals since start, counters read at each scrape
        t.total(names.PREFIX_QUERIES, lambda: load().prefix_queries, "Prompt tokens looked up")
        t.total(names.PREFIX_HITS, lambda: load().prefix_hits, "Prompt tokens found cached")
        t.total(names.PREEMPTIONS, lambda: load().preemptions, "Sequences preempted for KV room")
        t.total(names.STEP_SECONDS, lambda: load().step_seconds, "Seconds running steps")
        t.total(names.CONTROL_SECONDS, lambda: load().control_seconds, "Seconds deciding k")
        priced = lambda: load().priced  # noqa: E731  (steps the control priced)
        t.total(names.SPEC_PRICED_STEPS, lambda: priced().steps, "Decode steps priced")
        t.total(names.SPEC_EXPECTED_TOKENS, lambda: priced().expected_tokens, "Tokens expected")
        t.total(names.SPEC_PRICED_TOKENS, lambda: priced().tokens, "Tokens they emitted")
        t.total(names.SPEC_EXPECTED_SECONDS, lambda: priced().expected_seconds, "Seconds expected")
        t.total(names.SPEC_PRICED_SECONDS, lambda: priced().seconds, "Seconds they took")
        # the same load under vLLM's names, for an inference gateway's endpoint picker, and
        # the speculation and prefix cache series its dashboards read
        model = {"model_name": servicer.model_name}
        t.gauge(names.VLLM_RUNNING, lambda: load().running, "Requests running", model)
        t.gauge(names.VLLM_WAITING, lambda: load().waiting, "Requests waiting", model)
        t.gauge(names.VLLM_KV_USAGE, lambda: load().kv_utilization, "KV cache usage, 0-1", model)
        t.total(names.VLLM_PREEMPTIONS, lambda: load().preemptions, "Preemptions", model)
        t.total(names.VLLM_PREFIX_QUERIES, lambda: load().prefix_queries, "Prompt tokens", model)
        t.total(names.VLLM_PREFIX_HITS, lambda: load().prefix_hits, "Cached prompt tokens", model)
        for name, source in (
            (names.VLLM_NUM_DRAFTS, self.drafts),
            (names.VLLM_NUM_DRAFT_TOKENS, self.draft_tokens),
            (names.VLLM_NUM_ACCEPTED, self.accepted),
        ):
            t.view(name, source, model)
        t.view(names.VLLM_ACCEPTED_PER_POS, self.per_pos, model, {"position": "position"})
        vllm_phases = (
            names.VLLM_QUEUE_TIME,
            names.VLLM_PREFILL_TIME,
            names.VLLM_DECODE_TIME,
            names.VLLM_INFERENCE_TIME,
        )
        for name, source in zip(vllm_phases, self.phases, strict=True):
            t.view(name, source, model)
        blocks = servicer.engine.kv.allocator
        cache = {"block_size": str(blocks.block_size), "num_gpu_blocks": str(blocks.num_blocks)}
        t.gauge(names.VLLM_CACHE_CONFIG, lambda: 1.0, "KV cache configuration", model | cache)

    def step(self, route: str, out) -> None:
        """One sequence's step (every step of every stream: its route's series are bound
        once, not looked up by label each time)."""
        m = self._routes.get(route) or self._bind(route)
        m.tokens.inc(len(out.tokens))
        reason, gain = out.decision
        if reason:  # a decode step (prefill chunks decide nothing)
            m.k.observe(out.drafted)
            m.gain.observe(gain)
            m.reason(reason).inc()
        if out.drafted:
            m.drafts.inc()
            m.lookups.inc(out.lookup)
            m.draft_tokens.inc(out.drafted)
            m.accepted.inc(out.accepted)
            for position in range(out.accepted):
                m.position(position).inc()

    def finished(self, route: str, timing: tuple[int, int, int, int]) -> None:
        """A request's phases from its last output's timestamps (StepOutput.timing)."""
        arrived, scheduled, first, end = timing
        if not (scheduled and first):  # never scheduled, or no token (an abort's output)
            return
        spans = (scheduled - arrived, first - scheduled, end - first, end - scheduled)
        for histogram, ns in zip(self.phases, spans, strict=True):
            histogram.labels(route).observe(ns / 1e9)

    def _bind(self, route: str) -> _RouteSeries:
        self._routes[route] = series = _RouteSeries(self, route)
        return series


class _RouteSeries:
    """One route's series of VerifierMetrics."""

    def __init__(self, metrics: VerifierMetrics, route: str):
        self.tokens = metrics.tokens.labels(route)
        self.k, self.gain = metrics.k.labels(route), metrics.gain.labels(route)
        self.drafts, self.lookups = metrics.drafts.labels(route), metrics.lookups.labels(route)
        self.draft_tokens = metrics.draft_tokens.labels(route)
        self.accepted = metrics.accepted.labels(route)
        self._metrics, self._route = metrics, route
        self._reasons: dict[str, object] = {}
        self._positions: list = []

    def reason(self, reason: str):
        if reason not in self._reasons:
            self._reasons[reason] = self._metrics.reasons.labels(self._route, reason)
        return self._reasons[reason]

    def position(self, position: int):
        while len(self._positions) <= position:
            n = str(len(self._positions))
            self._positions.append(self._metrics.per_pos.labels(self._route, n))
        return self._positions[position]
