"""The router's Prometheus metrics: requests, tokens, latencies and decisions by route, and
the same requests under vLLM's names (and llama-server's: router/llamacpp_metrics.py) for
the dashboards a fleet already has."""

from __future__ import annotations

import time

from router.llamacpp_metrics import LlamaCppMetrics


class RequestClock:
    """When a request started and when each step's tokens reached the router from the
    verifier (stamped on arrival, also when the reply is sent whole at the end)."""

    def __init__(self):
        self.started = time.perf_counter()
        self.first: float | None = None  # the first token's arrival
        self.last: float | None = None  # the last token's
        self.gaps: list[float] = []  # between successive steps' tokens
        self.tokens = 0

    def arrived(self, at: float, tokens: int) -> None:
        if not tokens:
            return
        if self.first is None:
            self.first = at
        else:
            self.gaps.append(at - self.last)
        self.last = at
        self.tokens += tokens


class RouterMetrics:
    def __init__(self, telemetry, model_name: str = "", replicas=None):
        """`replicas`: the router's ReplicaSet (llama-server's running and waiting gauges)."""
        from specd import telemetry as names

        t = telemetry
        route = ("route",)
        self.requests = t.counter(names.REQUESTS, "Requests finished", ("route", "finish_reason"))
        self.decisions = t.counter(names.DECISIONS, "Speculation decisions", ("route", "reason"))
        self.tokens = t.counter(names.TOKENS_OUT, "Tokens generated", route)
        self.prompt_tokens = t.counter(names.PROMPT_TOKENS, "Prompt tokens", route)
        self.request_prompt = t.histogram(
            names.REQUEST_PROMPT_TOKENS, "Prompt tokens per request", route
        )
        self.request_tokens = t.histogram(
            names.REQUEST_TOKENS_OUT, "Tokens generated per request", route
        )
        self.ttft = t.histogram(names.TTFT, "Time to first token", route)
        self.itl = t.histogram(names.ITL, "Time between a request's successive steps", route)
        self.tpot = t.histogram(
            names.TPOT, "Time per output token after the first", ("route", "speculation")
        )
        self.e2e = t.histogram(names.E2E, "End-to-end request latency", route)
        self.affinity = t.counter(
            names.PREFIX_AFFINITY, "Replica choices by prefix affinity", ("outcome",)
        )
        self._restarted = (0, 0)  # the rounds and accepted drafts at the last restart
        model = {"model_name": model_name}
        t.view(names.VLLM_SUCCESS, self.requests, model, {"finish_reason": "finished_reason"})
        self.llama = LlamaCppMetrics(telemetry, replicas)
        for name, source in (
            (names.VLLM_PROMPT_TOKENS, self.prompt_tokens),
            (names.VLLM_TOKENS_OUT, self.tokens),
            (names.VLLM_REQUEST_PROMPT_TOKENS, self.request_prompt),
            (names.VLLM_REQUEST_TOKENS_OUT, self.request_tokens),
            (names.VLLM_TTFT, self.ttft),
            (names.VLLM_ITL, self.itl),
            (names.VLLM_TPOT, self.tpot),
            (names.VLLM_E2E, self.e2e),
        ):
            t.view(name, source, model)

    def accept_length(self) -> float | None:
        """Tokens a drafting round made, on average since start or the last
        restart_accept_length (SGLang's avg_spec_accept_length); None before any round."""
        rounds = self.llama.drafts - self._restarted[0]
        accepted = self.llama.accepted - self._restarted[1]
        return 1 + accepted / rounds if rounds else None

    def restart_accept_length(self) -> None:
        """Average the rounds from now on (SGLang's /flush_cache does)."""
        self._restarted = (self.llama.drafts, self.llama.accepted)

    def chosen(self, outcome: str) -> None:
        """A replica chosen by prefix affinity: cached, busy or new (router.affinity)."""
        self.affinity.labels(outcome).inc()

    def finished(self, route: str, final, clock: RequestClock) -> None:
        now, tokens = time.perf_counter(), clock.tokens
        self.requests.labels(route, final.finish_reason).inc()
        self.tokens.labels(route).inc(tokens)
        self.prompt_tokens.labels(route).inc(final.usage.prompt_tokens)
        self.request_prompt.labels(route).observe(final.usage.prompt_tokens)
        self.request_tokens.labels(route).observe(tokens)
        self.e2e.labels(route).observe(now - clock.started)
        self.llama.finished(final, clock)
        if clock.first is not None:
            self.ttft.labels(route).observe(clock.first - clock.started)
            itl = self.itl.labels(route)
            for gap in clock.gaps:
                itl.observe(gap)
            if tokens > 1:
                spec = "on" if final.speculation.enabled else "off"
                tpot = (clock.last - clock.first) / (tokens - 1)
                self.tpot.labels(route, spec).observe(tpot)
