"""Acceptance by draft position per route, decayed with wall-clock time so an old burst
stops counting (the speculation controller's estimates: a route that
accepted badly once is not off for good)."""

from __future__ import annotations

import time

from verifier_service.acceptance import PositionAcceptance


class RouteAcceptance:
    """Per route, acceptance by position, decayed with wall-clock time (half-life
    `half_life_s`) so an old burst stops counting and the estimate returns to the prior, and
    never worth more than `max_rounds` rounds, so new rounds move it within a request or
    two."""

    def __init__(self, half_life_s: float = 30.0, max_rounds: float = 16.0, clock=time.monotonic):
        self.half_life_s = half_life_s
        self.max_rounds = max_rounds
        self.clock = clock
        self._routes: dict[str, PositionAcceptance] = {}
        self._stamp: dict[str, float] = {}
        self._overall: dict[str, list[float]] = {}  # decayed [drafted, accepted]

    def _aged(self, route: str) -> PositionAcceptance:
        now = self.clock()
        acc = self._routes.setdefault(route, PositionAcceptance())
        last = self._stamp.get(route, now)
        if now > last:
            factor = 0.5 ** ((now - last) / self.half_life_s)
            acc.decay(factor)
            self._overall[route] = [x * factor for x in self._overall.get(route, [0.0, 0.0])]
        self._stamp[route] = now
        return acc

    def record(self, route: str, k: int, accepted: int) -> None:
        if k <= 0:
            return
        acc = self._aged(route)
        acc.record(k, accepted)
        acc.limit(self.max_rounds)
        d, a = self._overall.get(route, [0.0, 0.0])
        self._overall[route] = [d + k, a + accepted]

    def positions(self, route: str) -> PositionAcceptance:
        return self._aged(route)

    def rates(self) -> dict[str, float]:
        """accepted / drafted per route with rounds in memory (for load reports)."""
        out = {}
        for route in list(self._routes):
            self._aged(route)
            d, a = self._overall.get(route, [0.0, 0.0])
            if d > 1e-3:
                out[route] = a / d
        return out
