"""Per-route speculation policy (YAML) and the decision at arrival (DESIGN.md section 6).

    default:  {speculation: auto, num_draft_tokens: 4, max_batch_size: 8,
               max_kv_utilization: 0.85, max_temperature: 1.0, min_acceptance: 0.5}
    routes:
      code:   {num_draft_tokens: 6}
      batch:  {speculation: off}

A route's entry overrides the default's fields. Unknown routes fall back to `default` with
a warning in the response (not an error: a typo should not take a client down).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields, replace

import yaml

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")

# The policy of a router started without --policy-file. deploy/policy.yaml is the same
# policy as a file (a test keeps the two equal). k per route from the sweeps in
# BENCHMARKS.md: code drafts well at 6; editing repeats its source, so n-gram or combined
# drafting runs long at 8; chat drafts poorly past 3 and only pays at small batches.
BUILTIN_POLICY = {
    "default": {"speculation": "auto", "num_draft_tokens": 4, "max_batch_size": 8},
    "routes": {
        "code": {"num_draft_tokens": 6},
        "edit": {"num_draft_tokens": 8},
        "chat": {"num_draft_tokens": 3, "max_batch_size": 4},
        "batch": {"speculation": "off"},
    },
}


@dataclass(frozen=True)
class RoutePolicy:
    speculation: str = "auto"
    num_draft_tokens: int = 4
    max_batch_size: int = 8
    max_kv_utilization: float = 0.85
    max_temperature: float = 1.0
    min_acceptance: float = 0.5

    def __post_init__(self):
        if self.speculation not in MODES:
            raise ValueError(f"speculation must be one of {MODES}, got {self.speculation!r}")
        if self.num_draft_tokens < 0 or self.max_batch_size < 0:
            raise ValueError("num_draft_tokens and max_batch_size must be >= 0")
        if not 0 <= self.max_kv_utilization <= 1 or not 0 <= self.min_acceptance <= 1:
            raise ValueError("max_kv_utilization and min_acceptance must be in [0, 1]")


@dataclass(frozen=True)
class Policy:
    default: RoutePolicy
    routes: dict[str, RoutePolicy]

    @classmethod
    def from_dict(cls, data: dict | None) -> Policy:
        data = data or {}
        unknown = set(data) - {"default", "routes"}
        if unknown:
            raise ValueError(f"unknown policy keys: {sorted(unknown)}")
        default = _route(RoutePolicy(), data.get("default") or {}, "default")
        routes = {
            name: _route(default, body or {}, name)
            for name, body in (data.get("routes") or {}).items()
        }
        return cls(default, routes)

    @classmethod
    def builtin(cls) -> Policy:
        return cls.from_dict(BUILTIN_POLICY)

    @classmethod
    def from_yaml(cls, text: str) -> Policy:
        return cls.from_dict(yaml.safe_load(text))

    @classmethod
    def load(cls, path: str) -> Policy:
        with open(path) as f:
            return cls.from_yaml(f.read())

    def for_route(self, name: str) -> tuple[str, RoutePolicy, str | None]:
        """-> (route applied, its policy, warning or None)."""
        if name in ("", "default"):
            return "default", self.default, None
        if name in self.routes:
            return name, self.routes[name], None
        return "default", self.default, f"unknown route {name!r}; used 'default'"


class PolicyFile:
    """A policy YAML (a mounted ConfigMap in Kubernetes) reloaded when it changes: every
    request stats the file, so a new policy applies from the next request on. A file that
    does not parse is logged and the previous policy stays."""

    def __init__(self, path: str):
        self.path = path
        self._stamp = None
        self.policy = Policy.load(path)
        self._stamp = self._stat()

    def _stat(self):
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def current(self) -> Policy:
        try:
            stamp = self._stat()
            if stamp != self._stamp:
                self._stamp = stamp
                self.policy = Policy.load(self.path)
                log.info("reloaded policy from %s", self.path)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            log.error("keeping the previous policy: %s", exc)
        return self.policy


def _route(base: RoutePolicy, body: dict, name: str) -> RoutePolicy:
    known = {f.name for f in fields(RoutePolicy)}
    bad = set(body) - known
    if bad:
        raise ValueError(f"route {name!r}: unknown fields {sorted(bad)}")
    return replace(base, **body)


@dataclass(frozen=True)
class Load:
    """What the arrival decision reads from the chosen replica's last load report."""

    running: int = 0
    kv_utilization: float = 0.0
    drafter_available: bool = True


@dataclass(frozen=True)
class Decision:
    """What the router sends: the most drafts per round (0: never), whether the verifier's
    controller decides per step (`auto`), and the reason at arrival (reported beside the
    verifier's own, which is the truth: the batch, KV and acceptance change while a
    request runs)."""

    k: int
    auto: bool
    reason: str


def decide(policy: RoutePolicy, client: str, temperature: float, load: Load) -> Decision:
    """client is the request's override: auto, on or off. The hard bounds (client, policy,
    drafter, temperature) are final; the soft ones (batch, KV) only name the arrival's
    state, since the verifier applies them every step (SpeculationBounds)."""
    k = policy.num_draft_tokens
    if client == "off":
        return Decision(0, False, "off:client")
    if policy.speculation == "off" or k == 0:
        return Decision(0, False, "off:policy")
    if not load.drafter_available:
        return Decision(0, False, "off:drafter-unavailable")
    if client == "on" or policy.speculation == "on":
        return Decision(k, False, "on")
    if temperature > policy.max_temperature:
        return Decision(0, False, "off:temperature")
    if policy.max_batch_size <= 0:  # the route speculates at no batch size
        return Decision(0, False, "off:batch")
    if load.running >= policy.max_batch_size:
        return Decision(k, True, "off:batch")
    if load.kv_utilization >= policy.max_kv_utilization:
        return Decision(k, True, "off:kv")
    return Decision(k, True, "auto")
