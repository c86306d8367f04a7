"""llama-server's Prometheus series (`llamacpp:*`, its `--metrics`) on the router's
/metrics, for the dashboards and alerts a llama.cpp fleet already has: this router's
requests counted as llama-server counts its own, timed as they reach the router (a
prompt's time runs to its first token, its wait in a queue included).

Left out: `n_decode_total` and `n_busy_slots_per_decode` (the verifiers' forwards, which the
router does not see; their `vllm:*` series count them) and the per-position acceptance
(the verifiers' `vllm:spec_decode_num_accepted_tokens_per_pos`)."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "llamacpp:"


@dataclass
class _Bucket:
    """Tokens, the forwards that made them and their seconds (llama-server's bucket)."""

    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, steps: int, seconds: float) -> None:
        self.tokens += tokens
        self.steps += steps
        self.seconds += seconds

    def rate(self) -> float:
        """Forwards a second, as llama-server's: a step's accepted drafts add none."""
        return self.steps / self.seconds if self.seconds > 0 else 0.0


class LlamaCppMetrics:
    def __init__(self, telemetry, replicas=None):
        """`replicas`: the router's ReplicaSet, for the requests running and waiting."""
        self.replicas = replicas
        self.prompt, self.predict = _Bucket(), _Bucket()  # since start
        # since the last scrape: the throughput gauges average over the window between two
        self.prompt_window, self.predict_window = _Bucket(), _Bucket()
        self.cached = self.tokens_max = 0
        self.drafts = self.draft_tokens = self.accepted = 0
        t = telemetry
        for name, read, description in (
            ("prompt_tokens", lambda: self.prompt.tokens, "Prompt tokens processed, not cached"),
            ("prompt_tokens_cached", lambda: self.cached, "Prompt tokens reused from the cache"),
            ("prompt_seconds", lambda: self.prompt.seconds, "Time spent processing prompts"),
            ("tokens_predicted", lambda: self.predict.tokens, "Generation tokens"),
            ("tokens_predicted_seconds", lambda: self.predict.seconds, "Time generating"),
            ("spec_decode_num_draft_tokens", lambda: self.draft_tokens, "Draft tokens"),
            ("spec_decode_num_accepted_tokens", lambda: self.accepted, "Draft tokens accepted"),
            ("spec_decode_num_drafts", lambda: self.drafts, "Speculative verification steps"),
        ):
            t.total(PREFIX + name, read, description)
        for name, read, description in (
            (
                "prompt_tokens_seconds",
                lambda: self._window_rate("prompt_window"),
                "Prompt throughput in tokens/s",
            ),
            (
                "predicted_tokens_seconds",
                lambda: self._window_rate("predict_window"),
                "Generation throughput, steps/s",
            ),
            ("requests_processing", self._processing, "Requests processing"),
            ("requests_deferred", self._deferred, "Requests waiting in a verifier's queue"),
            ("n_tokens_max", lambda: self.tokens_max, "Longest prompt + generation seen"),
        ):
            t.gauge(PREFIX + name, read, description)

    def finished(self, final, clock) -> None:
        """A finished request: `final` its last message, `clock` its RequestClock."""
        usage, spec = final.usage, final.speculation
        cached = usage.cached_prompt_tokens
        self.cached += cached
        self.tokens_max = max(self.tokens_max, usage.prompt_tokens + clock.tokens)
        self.drafts += spec.rounds
        self.draft_tokens += spec.drafted
        self.accepted += spec.accepted
        if clock.first is None:
            return
        processed = usage.prompt_tokens - cached
        for bucket in (self.prompt, self.prompt_window):
            bucket.add(processed, processed, clock.first - clock.started)
        # the first token came with the prompt; each later step made 1 + its accepted drafts
        steps = max(clock.tokens - 1 - spec.accepted, 0)
        for bucket in (self.predict, self.predict_window):
            bucket.add(clock.tokens, steps, clock.last - clock.first)

    def _window_rate(self, window: str) -> float:
        """A window's rate, the window started anew (a scrape reads each gauge once)."""
        rate = getattr(self, window).rate()
        setattr(self, window, _Bucket())
        return rate

    def _processing(self) -> int:
        return sum(len(r.serving) for r in self._replicas())

    def _deferred(self) -> int:
        return sum(r.report.waiting for r in self._replicas() if r.report is not None)

    def _replicas(self) -> list:
        return list(self.replicas.replicas.values()) if self.replicas is not None else []
