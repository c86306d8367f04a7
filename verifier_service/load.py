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
