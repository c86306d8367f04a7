"""How many drafts each decoding sequence may have this step, and why.

None past its route's batch or KV bound; `auto` sequences as the controller plans from
measured costs and acceptance (verifier_service/controller.py); the others as asked.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from specd.config import EngineConfig
from verifier_service.acceptance import expected_tokens
from verifier_service.controller import Controller
from verifier_service.sequence import Sequence
from verifier_service.step_shape import Candidate, Fixed, deepest, reach


class Decision(NamedTuple):
    k: int  # drafts allowed this step
    reason: str  # "on", "probe", "off:batch", "off:kv", "off:request", "off:cost", ...
    gain: float  # the controller's predicted speed-up (1.0 when it did not plan)


class DraftDecisions:
    def __init__(self, controller: Controller, config: EngineConfig, clock=time.monotonic):
        self.controller = controller
        self.config = config
        self.clock = clock
        self._batch_history: deque[tuple[float, int]] = deque()

    def decide(self, ready: list[Sequence], batch: int, kv_used: float) -> list[Decision]:
        """`batch`: sequences running + waiting; `kv_used`: the KV pool's utilization."""
        recent = self._recent_batch(batch)
        fixed: dict[int, Decision] = {}
        candidates, auto, reaches, rows, tokens, most = [], [], [], 0.0, 0.0, 0
        route_rates: dict[str, list[float]] = {}
        goes_on: dict[str, list[float]] = {}
        for i, seq in enumerate(ready):
            bounds = seq.speculation
            remaining = seq.max_new_tokens - seq.num_generated
            k = max(0, min(seq.num_draft, self.config.max_draft_tokens, remaining - 1))
            if bounds.route not in route_rates:
                route_rates[bounds.route] = self.controller.route_rates(bounds.route)
                goes_on[bounds.route] = self.controller.goes_on(bounds.route)
            accept = self.controller.accept_rates(route_rates[bounds.route], seq.positions)
            reason = "on" if k else "off:request"
            if k and bounds.draft_below_batch and recent >= bounds.draft_below_batch:
                k, reason = 0, "off:batch"
            elif k and kv_used > bounds.max_kv_utilization:
                k, reason = 0, "off:kv"
            elif k and bounds.auto:
                probe = seq.off_steps + 1 >= self.controller.config.probe_every
                candidates.append(
                    Candidate(
                        k,
                        accept,
                        probe,
                        bounds.min_acceptance,
                        seq.drafter_behind,
                        remaining,
                        goes_on[bounds.route],
                    )
                )
                auto.append(i)
                continue
            fixed[i] = Decision(k, reason, 1.0)
            reaches.append(reach(goes_on[bounds.route], k))
            rows, most = rows + 1 + sum(reaches[-1]), max(most, k)
            tokens += expected_tokens(accept, k)
        # fewer ready than the batch had a moment ago (or than run and wait now): a dip
        dip = recent > len(ready)
        rest = Fixed(len(fixed), rows, tokens, most, tuple(deepest(reaches)))
        plan = self.controller.plan(candidates, rest, dip)
        for i, k, reason in zip(auto, plan.ks, plan.reasons, strict=True):
            fixed[i] = Decision(k, reason, plan.gain)
        return [fixed[i] for i in range(len(ready))]

    def _recent_batch(self, size: int) -> int:
        """The largest batch over the last `draft_gate_memory_s`: a one-step dip (a
        request finished, the next not yet admitted) must not switch the whole batch to
        drafting, whose catch-up forward costs more than that step gains."""
        now, history = self.clock(), self._batch_history
        history.append((now, size))
        while history[0][0] < now - self.config.draft_gate_memory_s:
            history.popleft()
        return max(n for _, n in history)
