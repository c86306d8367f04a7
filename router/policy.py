"""Per-route speculation policy (YAML; the decision at arrival is router/decide.py, the
verifier's every step verifier_service/speculation).

    default:  {speculation: auto, num_draft_tokens: 4, max_batch_size: 8,
               max_kv_utilization: 0.85, max_temperature: 1.0, min_acceptance: 0.5}
    routes:
      code:   {num_draft_tokens: 6}
      batch:  {speculation: off}

A route's entry overrides the default's fields. The file is parsed into typed models
(pydantic, strict: `'6'` or `6.5` is not an integer, NaN is not a number, unknown keys are
refused) and an error names the field, e.g. `routes.code.num_draft_tokens: Input should be
a valid integer`. YAML reads a bare `off`/`on` as a boolean; both spellings mean the mode.
Unknown routes fall back to `default` with a warning in the response (not an error: a typo
should not take a client down).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from specd.config import PROPOSERS

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")

# The policy of a router started without --policy-file. deploy/policy.yaml is the same
# policy as a file (a test keeps the two equal). k per route from the sweeps in
# docs/benchmarks-log.md: code drafts well at 6; editing repeats its source, so n-gram or combined
# drafting runs long at 8; chat drafts poorly past 3. Below the default's batch bound the
# verifier prices whether drafting pays (a tighter bound on chat lost at c = 4: section 115).
BUILTIN_POLICY = {
    "default": {"speculation": "auto", "num_draft_tokens": 4, "max_batch_size": 8},
    "routes": {
        "code": {"num_draft_tokens": 6},
        "edit": {"num_draft_tokens": 8},
        "chat": {"num_draft_tokens": 3},
        "batch": {"speculation": "off"},
    },
}


class PolicyError(ValueError):
    """A policy that does not validate; the message names each bad field."""


def _mode(value):
    """YAML 1.1 reads `off`/`on` as booleans: take them as the modes users meant."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value


Mode = Annotated[Literal["auto", "on", "off"], BeforeValidator(_mode)]
Count = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class RoutePolicy(BaseModel):
    """One route's bounds (the defaults of a policy without a `default` entry)."""

    model_config = _STRICT
    speculation: Mode = "auto"
    num_draft_tokens: Count = 4
    max_batch_size: Count = 8
    max_kv_utilization: Fraction = 0.85
    max_temperature: Temperature = 1.0
    min_acceptance: Fraction = 0.5
    # how the drafter drafts for the route (a drafter started with `--proposer suffix`
    # serves each): draft, ngram, combined or suffix; "" = the drafter's own
    proposer: Literal[("", *PROPOSERS)] = ""
    # suffix: whether the route's responses become drafts for its later requests (false:
    # each request drafts from its own text only, and nothing it says is kept)
    suffix_shared: bool = True


class _PolicyFile(BaseModel):
    """The file's shape; each entry is then a RoutePolicy over the default's fields."""

    model_config = ConfigDict(extra="forbid", strict=True)
    default: dict[str, Any] | None = None
    routes: dict[str, dict[str, Any] | None] | None = None  # `code:` alone: the default


def _explain(exc: ValidationError, where: str = "") -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(([where] if where else []) + [str(x) for x in err["loc"]]) or "policy"
        parts.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


def _entry(base: RoutePolicy, body: dict | None, where: str) -> RoutePolicy:
    """`body`'s fields over `base`'s, validated; errors are located at `where`."""
    try:
        return RoutePolicy.model_validate({**base.model_dump(), **(body or {})})
    except ValidationError as exc:
        raise PolicyError(_explain(exc, where)) from None


@dataclass(frozen=True)
class Policy:
    default: RoutePolicy
    routes: dict[str, RoutePolicy]

    @classmethod
    def from_dict(cls, data) -> Policy:
        try:
            spec = _PolicyFile.model_validate({} if data is None else data)
        except ValidationError as exc:
            raise PolicyError(_explain(exc)) from None
        default = _entry(RoutePolicy(), spec.default, "default")
        routes = spec.routes or {}
        return cls(default, {n: _entry(default, b, f"routes.{n}") for n, b in routes.items()})

    @classmethod
    def builtin(cls) -> Policy:
        return cls.from_dict(BUILTIN_POLICY)

    @classmethod
    def from_yaml(cls, text: str) -> Policy:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PolicyError(f"not YAML: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str) -> Policy:
        try:
            with open(path) as f:
                return cls.from_yaml(f.read())
        except (OSError, PolicyError) as exc:
            raise PolicyError(f"policy file {path}: {exc}") from None

    def for_route(self, name: str) -> tuple[str, RoutePolicy, str | None]:
        """-> (route applied, its policy, warning or None)."""
        if name in ("", "default"):
            return "default", self.default, None
        if name in self.routes:
            return name, self.routes[name], None
        shown = name if len(name) <= 64 else name[:64] + "..."  # a warning, not an echo
        return "default", self.default, f"unknown route {shown!r}; used 'default'"


class PolicyFile:
    """A policy YAML (a mounted ConfigMap in Kubernetes) reloaded when it changes: every
    request stats the file, so a new policy applies from the next request on. A version of
    the file that does not load is logged once, naming the field, and the previous policy
    stays; a bad file at start is a startup error (PolicyError)."""

    def __init__(self, path: str):
        self.path = path
        self.policy = Policy.load(path)
        self._stamp = self._stat()

    def _stat(self):
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def current(self) -> Policy:
        try:
            stamp = self._stat()
            if stamp != self._stamp:
                self._stamp = stamp  # one log line per version of the file, not per request
                self.policy = Policy.load(self.path)
                log.info("reloaded policy from %s", self.path)
        except (OSError, PolicyError) as exc:
            log.error("keeping the previous policy: %s", exc)
        return self.policy


def routing_policy(policy_file: str, text: str) -> Policy | PolicyFile:
    """The router's policy: its file (reloaded as it changes), else `--policy`'s YAML text,
    else the built-in one (PolicyError names the file or the flag)."""
    if policy_file:
        return PolicyFile(policy_file)
    if not text:
        return Policy.builtin()
    try:
        return Policy.from_yaml(text)
    except PolicyError as exc:
        raise PolicyError(f"--policy: {exc}") from None
