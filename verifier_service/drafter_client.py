"""The verifier's side of the `Draft` stream, as a Proposer the engine calls each step.

Runs on the engine's worker thread (synchronous gRPC). Each round sends one batched
request (opens for new sequences, steps with the tokens committed since the last step,
pending closes) and waits for its response up to a per-round deadline. A slow, failed or
absent drafter yields empty proposals (k = 0 for that round, never a failed request); a
broken stream is dropped and reconnected after a back-off, re-opening every session.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import NamedTuple

from opentelemetry import trace

from protos.specd.v1 import drafter_pb2
from specd.lookup import COMBINED_MAX_N, COMBINED_MIN_MATCH, Lookups, lookup
from specd.proposal import DraftState, Proposal
from specd.telemetry import (
    DRAFTER_FALLBACKS,
    DRAFTER_LOOKED_UP,
    DRAFTER_PREFETCHED,
    DRAFTER_PUSHED,
    DRAFTER_RTT,
    inject_metadata,
)
from specd.wire import constraint_to_proto, params_to_proto
from specd.wire_proposals import proposal_from_proto
from verifier_service.drafter_stream import DraftStream

log = logging.getLogger(__name__)


class Sent(NamedTuple):
    """A round sent on the stream, its answer not yet read."""

    stream: DraftStream
    round: int
    waiter: list  # DraftStream.start's
    at: float  # perf_counter when it went (the round trip's histogram)


class RemoteProposer:
    def __init__(
        self,
        address: str,
        timeout_ms: int = 3000,
        reconnect_ms: int = 1000,
        telemetry=None,
        tls_ca: str = "",
        prefetch: bool = True,
    ):
        self.address = address
        self.prefetching = prefetch  # `prefetch` asks (else it does nothing)
        self.tls_ca = tls_ca
        self.timeout_s = timeout_ms / 1000
        self.reconnect_s = reconnect_ms / 1000
        self._stream: DraftStream | None = None
        self._next_try = 0.0
        self._up = False  # a stream answered the handshake, and none was lost since
        self._down_said = False  # that no stream is up was logged (once an outage)
        self._sent: dict[int, int] = {}  # seq_id -> committed tokens the drafter has
        self._asked: dict[int, int] = {}  # seq_id -> k of its last round asked
        # seq_id -> {tokens they follow: drafts the drafter pushed ahead (a SeqProposal)}:
        # set on the stream's reader thread, taken on the engine's
        self._ahead: dict[int, dict[int, drafter_pb2.SeqProposal]] = {}
        self.ahead_taken = 0  # sequences' rounds drafted from a push, with no round trip
        # seq_id -> (its tokens, k, the round `_send` sent) of a round asked as its step ended
        self._fetching: dict[int, tuple[int, int, Sent]] = {}
        self.prefetched = 0  # sequences' rounds drafted from a round asked so (`prefetch`)
        self._rounds = itertools.count(1)
        # each open sequence's `combined` lookup, where the drafter drafts so (`_look_first`)
        self.lookups = Lookups(COMBINED_MAX_N, COMBINED_MIN_MATCH)
        self.looked_up = 0  # sequences' rounds drafted by that lookup here, with no round trip
        self.fallbacks = 0  # rounds that decoded with k = 0 because of the drafter
        self._lock = threading.RLock()  # the engine thread and load reports both connect
        self._rtt = self._fallback_counter = self._pushed_counter = self._prefetched = None
        self._looked_up = None
        if telemetry is not None:
            self._rtt = telemetry.histogram(DRAFTER_RTT, "Draft round trip")
            self._fallback_counter = telemetry.counter(
                DRAFTER_FALLBACKS, "Rounds decoded without drafts because of the drafter"
            )
            self._pushed_counter = telemetry.counter(
                DRAFTER_PUSHED, "Sequences' rounds drafted from the drafter's pushes, unasked"
            )
            self._prefetched = telemetry.counter(
                DRAFTER_PREFETCHED, "Sequences' rounds drafted from a round asked the step before"
            )
            self._looked_up = telemetry.counter(
                DRAFTER_LOOKED_UP, "Sequences' rounds drafted by the verifier's own lookup"
            )

    @property
    def drafter(self) -> str:
        """What the connected drafter drafts with ("" while none is connected)."""
        stream = self._stream
        return stream.drafter if stream is not None and stream.alive else ""

    @property
    def context_window(self) -> int:
        """The connected draft model's context window (0: none, or none connected)."""
        stream = self._stream
        return stream.context_window if stream is not None and stream.alive else 0

    @property
    def available(self) -> bool:
        """Whether a drafter stream is up (opening one if it is time to try again)."""
        stream = self._connect()
        return stream is not None and stream.alive and stream.ready

    def _connect(self) -> DraftStream | None:
        with self._lock:
            if self._stream is not None and not self._stream.alive:
                self._drop()
            if self._stream is None and time.monotonic() >= self._next_try:
                try:
                    self._stream = DraftStream(self.address, self.tls_ca, self._pushed)
                except Exception:  # noqa: BLE001 - any failure means: no drafter this round
                    log.exception("cannot open a drafter stream to %s", self.address)
                    self._next_try = time.monotonic() + self.reconnect_s
            stream = self._stream
            if stream is not None and stream.ready and not self._up:
                log.info("drafter %s connected: %s", self.address, stream.drafter)
                self._up, self._down_said = True, False
            return stream

    def _drop(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._said_ended(self._stream)
                self._stream.close()
            self._stream = None
            self._sent.clear()  # a new stream starts with no sessions
            self._asked.clear()
            self._ahead.clear()
            self._fetching.clear()
            self._next_try = time.monotonic() + self.reconnect_s

    def _said_ended(self, stream: DraftStream) -> None:
        """A drafter that was connected and is lost is a warning, each time; one that
        cannot be reached (starting, or gone) is said once, not at every retry."""
        if stream.ready:
            log.warning(
                "drafter %s lost (%s): decoding without drafts until it is back",
                self.address,
                stream.ended or "its stream broke",
            )
        elif not self._down_said:
            log.info(
                "drafter %s not reachable (%s): decoding without drafts, retrying every %.1f s",
                self.address,
                stream.ended or "no answer",
                self.reconnect_s,
            )
        self._up, self._down_said = False, True

    def propose(self, states: list[DraftState]) -> list[Proposal]:
        """Each state's drafts: looked up here where the drafter would look them up first
        (`_look_first`: no round trip), else pushed ahead where the drafter guessed its
        tokens, else the answer to the round `prefetch` asked for them, else asked for in
        one round."""
        taken = {}
        for s in states:
            if (p := self._look_first(s) or self._take_ahead(s)) is not None:
                taken[s.seq_id] = p
        taken |= self._take_fetched([s for s in states if s.seq_id not in taken])
        asked = iter(self._ask([s for s in states if s.seq_id not in taken]))
        return [taken[s.seq_id] if s.seq_id in taken else next(asked) for s in states]

    def _look_first(self, s: DraftState) -> Proposal | None:
        """`s`'s drafts by `combined`'s lookup in its own text, where the drafter's
        handshake says it drafts so (it would find the same in the same tokens); None
        elsewhere, or where the lookup finds nothing (the drafter's model drafts then,
        catching up on the tokens it did not see). Pushes made for its tokens or fewer
        are dropped: never used."""
        stream = self._stream
        if stream is None or not (stream.alive and stream.combined_lookup):
            return None
        found = lookup(s, self.lookups.follow(s))
        if found is None:
            return None
        self.looked_up += 1
        if self._looked_up is not None:
            self._looked_up.inc()
        self._drop_pushes(s.seq_id, len(s.tokens) + 1)
        return found

    @property
    def prefetches(self) -> bool:
        """Whether `prefetch` asks: it is on, and a lookup-only drafter's stream is up."""
        stream = self._stream
        up = stream is not None and stream.alive and stream.ready
        return self.prefetching and up and stream.lookup_only

    def prefetch(self, states: list[DraftState]) -> None:
        """Ask now, without waiting, for these sequences' next rounds (their tokens just
        committed, k as this step's): the round trip runs while the engine ends its step
        and plans the next, and `propose` takes the answer where the plan asks no more
        drafts of the same tokens. For rounds that cost the drafter no model forward (a
        lookup, as the drafter's handshake says): an answer the plan does not take wasted
        nothing, where a draft model's would hold the next round up behind it. A sequence
        whose push already holds its tokens is not asked."""
        if not self.prefetches:
            return
        states = [s for s in states if not self._has_push(s)]
        sent = self._send(states) if states else None
        if sent is not None:
            for s in states:
                self._fetching[s.seq_id] = (len(s.tokens), s.k, sent)

    def _take_fetched(self, states: list[DraftState]) -> dict[int, Proposal]:
        """The prefetched answers for `states` that follow their tokens and hold as many
        drafts as asked (every sequence's prefetch is spent: stale ones are dropped)."""
        out, answers = {}, {}
        for s in states:
            fetched = self._fetching.pop(s.seq_id, None)
            if fetched is None:
                continue
            follows, k, sent = fetched
            if follows != len(s.tokens) or k < s.k:
                continue
            if sent.round not in answers:
                answers[sent.round] = self._answer(sent, timed=False)
            out[s.seq_id] = proposal_from_proto(answers[sent.round].get(s.seq_id), s.k)
            self.prefetched += 1
            if self._prefetched is not None:
                self._prefetched.inc()
        return out

    def _ask(self, states: list[DraftState]) -> list[Proposal]:
        if not states:
            return []
        sent = self._send(states)
        by_seq = {} if sent is None else self._answer(sent)
        return [proposal_from_proto(by_seq.get(s.seq_id), s.k) for s in states]

    def _send(self, states: list[DraftState]) -> Sent | None:
        """One round for `states`, sent; None (a fallback) where no stream is up."""
        stream = self._connect()
        if stream is None:
            self._fell_back()
            return None
        request = drafter_pb2.DraftRequest(round=next(self._rounds))
        for s in states:
            self._add_commands(request, s)
        try:
            waiter = stream.start(request)
        except ConnectionError:
            self._drop()
            self._fell_back()
            return None
        return Sent(stream, request.round, waiter, time.perf_counter())

    def _answer(self, sent: Sent, timed: bool = True) -> dict:
        """A sent round's proposals by sequence ({} where it failed: no drafts); `timed`:
        its round trip observed (a prefetched one's also spans the engine's work)."""
        try:
            response = sent.stream.wait(sent.round, sent.waiter, self.timeout_s)
        except TimeoutError as exc:
            log.warning("%s; decoding without drafts this round", exc)
            self._fell_back()
            return {}
        except ConnectionError:
            if self._stream is sent.stream:  # not one opened since
                self._drop()
            self._fell_back()
            return {}
        if timed and self._rtt is not None:
            self._rtt.observe(time.perf_counter() - sent.at)
        return {p.seq_id: p for p in response.proposals}

    def _pushed(self, response) -> None:
        """Drafts the drafter made ahead (on the stream's reader thread), kept by the
        tokens they follow for a sequence still open."""
        for p in response.proposals:
            if p.seq_id in self._sent:
                self._ahead.setdefault(p.seq_id, {})[p.follows] = p
                if p.seq_id not in self._sent:  # closed meanwhile (close pops this second)
                    self._ahead.pop(p.seq_id, None)

    def _has_push(self, s: DraftState) -> bool:
        """Whether a push follows exactly `s`'s tokens (`_take_ahead` would look at it)."""
        return _follows(self._ahead.get(s.seq_id, {}).get(len(s.tokens)), s.tokens)

    def _take_ahead(self, s: DraftState) -> Proposal | None:
        """The drafts pushed for `s` if they follow exactly its tokens (the drafter's
        guess of the last round held) and are the k asked, or all the drafter had when
        asked for as many; else None. Pushes for fewer tokens are dropped: never used."""
        pushed, n = self._ahead.get(s.seq_id), len(s.tokens)
        if not pushed:
            return None
        msg = pushed.pop(n, None)
        self._drop_pushes(s.seq_id, n)
        if not _follows(msg, s.tokens):
            return None
        if len(msg.tokens) < s.k and self._asked.get(s.seq_id, 0) < s.k:
            return None
        self.ahead_taken += 1
        if self._pushed_counter is not None:
            self._pushed_counter.inc()
        return proposal_from_proto(msg, s.k)

    def _drop_pushes(self, seq_id, before: int) -> None:
        """A sequence's pushes for fewer than `before` tokens: it is past them, never used."""
        pushed = self._ahead.get(seq_id, {})
        for follows in list(pushed):  # (a copy: the reader thread adds to it)
            if follows < before:
                pushed.pop(follows, None)

    def _add_commands(self, request, s: DraftState) -> None:
        """A round's commands for one sequence: open its session (the first time on this
        stream: its tokens, params, constraint, trace context), then step it with the
        tokens committed since the last round."""
        sent = self._sent.get(s.seq_id)
        step = s.tokens[sent:] if sent is not None else []
        if sent is None:
            cmd = request.commands.add(seq_id=s.seq_id)
            cmd.open.token_ids.extend(s.tokens)
            cmd.open.params.CopyFrom(params_to_proto(s.params))
            cmd.open.route, cmd.open.proposer = s.route, s.proposer
            cmd.open.prompt_length = s.prompt_length
            cmd.open.suffix_private = s.suffix_private
            cmd.open.cache_salt = s.cache_salt
            if s.grammar is not None:  # the drafter drafts under the same constraint
                cmd.open.constraint.CopyFrom(constraint_to_proto(s.grammar.constraint))
                cmd.open.prompt_length = len(s.tokens) - s.grammar.consumed
            if s.span is not None:
                ctx = trace.set_span_in_context(s.span)
                cmd.open.trace_context.update(dict(inject_metadata(ctx)))
        cmd = request.commands.add(seq_id=s.seq_id)
        cmd.step.committed_ids.extend(step)
        cmd.step.k = s.k
        self._sent[s.seq_id] = len(s.tokens)
        self._asked[s.seq_id] = s.k

    def _fell_back(self, happened: bool = True) -> None:
        if happened:
            self.fallbacks += 1
            if self._fallback_counter is not None:
                self._fallback_counter.inc()

    def close(self, seq_id) -> None:
        self.lookups.close(seq_id)
        sent = self._sent.pop(seq_id, None)
        self._asked.pop(seq_id, None)
        self._fetching.pop(seq_id, None)
        self._ahead.pop(seq_id, None)  # after `_sent`: see `_pushed`
        if sent is None or not self.available:
            return
        request = drafter_pb2.DraftRequest(round=next(self._rounds))
        request.commands.add(seq_id=seq_id).close.SetInParent()
        self._stream.send(request)  # fire and forget: the response pairs with no waiter

    def forget_cached(self) -> None:
        """Ask the drafter to forget its cached prefixes, fire and forget (a drafter not
        reached now: one that restarts comes back empty)."""
        if self.available:
            request = drafter_pb2.DraftRequest(round=next(self._rounds), reset_prefix_cache=True)
            self._stream.send(request)

    def shutdown(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def _follows(msg: drafter_pb2.SeqProposal | None, tokens: list[int]) -> bool:
    """Whether a push was made for exactly these tokens (the ones it assumed end them)."""
    return msg is not None and bool(msg.assumed) and tokens[-len(msg.assumed) :] == msg.assumed
