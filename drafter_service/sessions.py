"""The drafter's sessions: one per (verifier stream, sequence), opened, stepped and closed
by the verifier's commands. Validation of every command lives here, so the servicer only
moves messages: ids inside the vocabulary, k within bounds, a session to step, a
constraint that compiles and that the committed tokens keep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from protos.specd.v1 import drafter_pb2
from specd.config import check_proposer
from specd.grammar import GrammarState
from specd.proposal import DraftState
from specd.wire import constraint_from_proto, params_from_proto

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (stream, seq_id): two verifiers may use the same seq_id


@dataclass
class Session:
    state: DraftState  # the request as drafted; each step sets its k and grammar
    span: object = None  # "specd.drafter.session", child of the verifier's request span
    grammar: GrammarState | None = None  # a constrained request's, at the committed tokens

    def commit(self, tokens: list[int]) -> None:
        self.state.tokens.extend(tokens)
        if self.grammar is not None and not self.grammar.consume(tokens):
            log.warning("committed tokens outside the session's grammar; drafting unconstrained")
            self.grammar = None

    def step(self, k: int) -> DraftState:
        return replace(self.state, k=k, grammar=self.grammar)


@dataclass
class Step:
    """One sequence's part of a round: what to draft from, or why it cannot be drafted."""

    seq_id: int
    state: DraftState | None
    problem: str = ""


class Sessions:
    def __init__(
        self,
        vocab_size: int,
        max_draft_tokens: int,
        grammars=None,  # specd.grammar.Grammars; None: constraints are not followed here
        on_close: Callable[[Key], None] = lambda key: None,  # the proposer's cleanup
        start_span: Callable[[dict], object] = lambda trace_context: None,
    ):
        self.vocab_size = vocab_size
        self.max_draft_tokens = max_draft_tokens
        self.grammars = grammars
        self.on_close = on_close
        self.start_span = start_span
        self._open: dict[Key, Session] = {}

    def __len__(self) -> int:
        return len(self._open)

    def get(self, key: Key) -> Session | None:
        return self._open.get(key)

    def round(self, stream: int, commands) -> list[Step]:
        """Apply a round's commands in order; the steps to draft, in command order."""
        steps, errors = [], {}
        for cmd in commands:
            key = (stream, cmd.seq_id)
            which = cmd.WhichOneof("command")
            if which == "open":
                problem = self.open(key, cmd.open)
                if problem:
                    errors[cmd.seq_id] = problem
            elif which == "close":
                self.close(key)
            elif which == "step":
                steps.append(self._step(key, cmd.step, errors.get(cmd.seq_id, "")))
        return steps

    def open(self, key: Key, msg: drafter_pb2.Open) -> str:
        """Start (or restart) a session -> "" or what is wrong with the command."""
        problem = self._check_ids(msg.token_ids)
        try:
            check_proposer(msg.proposer)
            params = params_from_proto(msg.params)
            params.validate()
            grammar = self._grammar(msg)
        except ValueError as exc:
            problem = str(exc)
        if problem:
            return problem
        self.close(key)
        span = self.start_span(dict(msg.trace_context))
        state = DraftState(
            key,
            list(msg.token_ids),
            params,
            0,
            route=msg.route or "default",
            prompt_length=min(msg.prompt_length, len(msg.token_ids)),
            proposer=msg.proposer,
            suffix_private=msg.suffix_private,
            cache_salt=msg.cache_salt,
        )
        self._open[key] = Session(state, span, grammar)
        return ""

    def close(self, key: Key) -> None:
        session = self._open.pop(key, None)
        if session is not None:
            self.on_close(key)
            if session.span is not None:
                session.span.end()

    def close_stream(self, stream: int) -> None:
        for key in [k for k in self._open if k[0] == stream]:
            self.close(key)

    def _step(self, key: Key, msg: drafter_pb2.Step, problem: str) -> Step:
        session = self._open.get(key)
        problem = problem or self._check_ids(msg.committed_ids)
        if session is None and not problem:
            problem = f"no open session for seq_id {key[1]}"
        if not problem and not 0 < msg.k <= self.max_draft_tokens:
            problem = f"k must be in [1, {self.max_draft_tokens}], got {msg.k}"
        if problem:
            return Step(key[1], None, problem)
        session.commit(list(msg.committed_ids))
        return Step(key[1], session.step(msg.k))

    def _grammar(self, msg: drafter_pb2.Open) -> GrammarState | None:
        """The session's grammar at its committed tokens; None when unconstrained, or when
        this drafter has no tokenizer (it then drafts freely and the verifier cuts)."""
        constraint = constraint_from_proto(msg.constraint)
        if constraint is None or self.grammars is None:
            return None
        if msg.prompt_length > len(msg.token_ids):
            raise ValueError("prompt_length exceeds the tokens sent")
        grammar = self.grammars.start(constraint)
        if not grammar.consume(list(msg.token_ids[msg.prompt_length :])):
            raise ValueError("the committed tokens break the constraint")
        return grammar

    def _check_ids(self, ids) -> str:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        return f"token ids outside [0, {self.vocab_size}): {bad[:5]}" if bad else ""
