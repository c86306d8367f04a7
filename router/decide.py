"""The router's speculation decision at arrival, from the route's policy, the client's
override and the chosen replica's load (the verifier decides every step after it,
verifier_service/speculation)."""

from __future__ import annotations

from dataclasses import dataclass

from router.policy import RoutePolicy


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


def decide(
    policy: RoutePolicy, client: str, temperature: float, load: Load, predicted: bool = False
) -> Decision:
    """client is the request's override: auto, on or off. The hard bounds (client, policy,
    drafter, temperature) are final; the soft ones (batch, KV) only name the arrival's
    state, since the verifier applies them every step (SpeculationBounds). `predicted`:
    the request brings a predicted output, which drafts without a drafter."""
    k = policy.num_draft_tokens
    if client == "off":
        return Decision(0, False, "off:client")
    if policy.speculation == "off" or k == 0:
        return Decision(0, False, "off:policy")
    if not load.drafter_available and not predicted:
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
