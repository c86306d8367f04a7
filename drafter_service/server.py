"""The drafter's gRPC servicer: one bidirectional `Draft` stream per verifier connection.

Sessions are keyed by (stream, seq_id), so several verifiers can connect at once; all of a
stream's sessions close when it ends. The proposer runs on a worker thread, one round at a
time (a lock), so the event loop keeps answering health checks; a proposer that runs no
model (a lookup) runs on the event loop, where its rounds take microseconds.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from functools import partial

from drafter_service.sessions import Sessions
from protos.specd.v1 import drafter_pb2, drafter_pb2_grpc
from specd.grammar import Grammars
from specd.model_thread import on_model_thread
from specd.proposal import Proposer
from specd.telemetry import DRAFTER_ROUNDS, DRAFTER_SESSIONS, extract_metadata
from specd.wire_proposals import proposal_to_proto

log = logging.getLogger(__name__)

# how many rounds past the last one answered the drafter drafts ahead: each assumes the one
# before it accepted whole, and the first request to arrive stops them
AHEAD_ROUNDS = 4


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(
        self,
        proposer: Proposer,
        vocab_size: int,
        max_draft_tokens: int = 16,
        telemetry=None,
        draft_ahead: bool = False,
        name: str = "",
        load_tokenizer=None,
        eos_ids: set[int] | None = None,
    ):
        self.proposer = proposer
        # drafting under a request's constraint needs the tokenizer (specd/grammar.py),
        # loaded at the first one
        self.grammars = (
            None if load_tokenizer is None else Grammars(load_tokenizer, vocab_size, eos_ids)
        )
        self.name = name  # told to each verifier in the handshake
        # between rounds, let the proposer continue as if all drafts were accepted (always
        # where that costs no model forward), and push that work to verifiers that ask
        self.lookup_only = bool(getattr(proposer, "lookup_only", False))
        self.draft_ahead = (draft_ahead or self.lookup_only) and hasattr(proposer, "draft_ahead")
        self.vocab_size = vocab_size
        self.max_draft_tokens = max_draft_tokens
        self.sessions = Sessions(
            vocab_size, max_draft_tokens, self.grammars, proposer.close, self._session_span
        )
        self._streams = itertools.count()
        self._lock = threading.Lock()
        self.telemetry = telemetry
        self.tracer = telemetry.tracer if telemetry is not None and telemetry.tracing else None
        if telemetry is not None:
            self._rounds = telemetry.counter(DRAFTER_ROUNDS, "Draft rounds served")
            telemetry.gauge(DRAFTER_SESSIONS, lambda: len(self.sessions), "Open draft sessions")

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    async def Draft(self, request_iterator, context):
        stream = next(self._streams)
        stop, ahead, push = threading.Event(), None, False
        try:
            # answered with context.write, so that a push can go out between two answers
            async for request in request_iterator:
                if ahead is not None:  # a round is waiting: the work ahead stops at once
                    stop.set()
                    await ahead
                    stop.clear()
                push = push or (request.round == 0 and request.push_ahead)
                # a lookup's round runs on the event loop unless it opens a grammar to compile
                loop = self.lookup_only and not any(map(_opens_constraint, request.commands))
                await context.write(await self._call(self._round, stream, request, loop=loop))
                if self.draft_ahead:
                    ahead = asyncio.ensure_future(
                        self._ahead(stream, request.round, stop, context if push else None)
                    )
        finally:
            if ahead is not None:
                stop.set()
                await asyncio.gather(ahead, return_exceptions=True)
            await self._call(self._close_stream, stream)

    async def _call(self, fn, *args, loop: bool = True):
        """fn(*args) on the model thread; on the event loop instead where the proposer runs
        no model, `loop` (nothing that may take long, such as compiling a grammar) and no
        other work holds the sessions: a lookup's round takes less than the hop to the
        thread and back."""
        if loop and self.lookup_only and not self._lock.locked():
            return fn(*args)
        return await on_model_thread("drafter", fn, *args)

    async def _ahead(self, stream: int, after: int, stop: threading.Event, context) -> None:
        """Draft ahead until the next request: one round, or for a verifier that asked for
        pushes (`context`) up to AHEAD_ROUNDS rounds deep (each as if the one before is
        accepted whole), each pushed as it is made unless that request came first (it then
        asks anyway)."""
        try:
            for _ in range(AHEAD_ROUNDS if context is not None else 1):
                made = await self._call(self._made_ahead, stream, after, stop.is_set)
                if not made.proposals or stop.is_set():
                    return
                if context is not None:
                    await context.write(made)
        except Exception:  # noqa: BLE001 - work ahead is spare: the next round drafts anew
            log.exception("drafting ahead failed")

    def _made_ahead(self, stream: int, after: int, stop) -> drafter_pb2.DraftResponse:
        made = self.proposer.draft_ahead(stop)
        out = drafter_pb2.DraftResponse(round=after, ahead=True)
        with self._lock:
            for state, p in made:
                session = self.sessions.get(state.seq_id)
                if state.seq_id[0] != stream or session is None or not p.tokens:
                    continue  # another stream's sequence, or one closed since
                sent = len(session.state.tokens)  # what the verifier sent; the rest assumed
                msg = out.proposals.add(seq_id=state.seq_id[1], follows=len(state.tokens))
                msg.assumed.extend(state.tokens[sent:])
                proposal_to_proto(p, msg)
        return out

    def _round(self, stream: int, request: drafter_pb2.DraftRequest) -> drafter_pb2.DraftResponse:
        with self._lock:
            if request.reset_prefix_cache:
                self.proposer.forget_cached()
                log.info("prefix cache reset (verifier stream %d)", stream)
            steps = self.sessions.round(stream, request.commands)
            states = [s.state for s in steps if s.state is not None]
            if states and self.telemetry is not None:
                self._rounds.inc()
            proposals = iter(self.proposer.propose(states) if states else [])
            out = drafter_pb2.DraftResponse(round=request.round)
            if request.round == 0:
                out.drafter = self.name
                out.lookup_only = self.lookup_only
                out.context_window = getattr(self.proposer, "context_window", 0)
                out.combined_lookup = getattr(self.proposer, "combined_lookup", False)
            for step in steps:
                msg = out.proposals.add(seq_id=step.seq_id, error=step.problem)
                if step.state is None:
                    continue
                p = next(proposals)
                proposal_to_proto(p, msg)
                span = self.sessions.get(step.state.seq_id).span
                if span is not None:
                    span.add_event("draft.round", {"k": step.state.k, "proposed": len(p.tokens)})
            return out

    def _session_span(self, trace_context: dict):
        if self.tracer is None or not trace_context:
            return None
        parent = extract_metadata(list(trace_context.items()))
        return self.tracer.start_span("specd.drafter.session", context=parent)

    def _close_stream(self, stream: int) -> None:
        with self._lock:
            self.sessions.close_stream(stream)


def _opens_constraint(cmd) -> bool:
    return cmd.WhichOneof("command") == "open" and cmd.open.HasField("constraint")


def build_proposer(config):
    """The proposer the config names, the vocabulary size it checks ids against, and what
    it tells verifiers it is."""
    from drafter_service.combined import CombinedProposer
    from drafter_service.draft_model import DraftModelProposer, load_draft_model
    from specd.config import context_window, prefix_cache_on
    from specd.lookup import NgramProposer
    from specd.models.loader import load_config, resolve
    from specd.models.paged_kv import PagedKV

    folder = resolve(config.model)
    if config.proposer == "ngram":
        lookup = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
        return lookup, load_config(folder).vocab_size, "ngram"
    model = load_draft_model(
        folder, config.dtype, config.device or None, config.weights, config.vocab, config.kv_dtype
    )
    blocks = PagedKV.blocks_for_budget(model, config.kv_cache_bytes)
    proposer = DraftModelProposer(
        model,
        blocks,
        top_m=config.top_m,
        alternatives=config.alternatives,
        prefix_cache=prefix_cache_on(config.prefix_cache, model),
        p_min=config.p_min,
        context_window=context_window(config.context_window, model.device.type),
        graphs=not config.enforce_eager,
    )
    name = folder.name
    if config.proposer == "combined":
        proposer, name = CombinedProposer(proposer), f"combined:{name}"
    elif config.proposer == "suffix":
        from drafter_service.suffix import SuffixProposer

        proposer = SuffixProposer(
            proposer,
            max_tokens=config.suffix_memory_tokens,
            shared=config.suffix_shared,
            alternatives=config.alternatives,
        )
        name = f"suffix:{name}"
    return proposer, model.args.vocab_size, name


async def serve(config, ready=None, built=None) -> None:
    """Load the drafter's model (or n-gram), serve until a signal. `built`: a proposer
    built already, as (proposer, vocab size, name), served without a tokenizer (the GPU
    benchmark's, on random weights)."""
    from specd.grammar import grammar_tokenizer
    from specd.models.loader import eos_token_ids, load_config, resolve
    from specd.serving import serve_servicer
    from specd.telemetry import setup

    load_tok, eos = None, None
    if built is None:
        # built on the thread that will run it (see specd/model_thread.py)
        built = await on_model_thread("drafter", build_proposer, config)
        folder = resolve(config.model)
        load_tok = partial(grammar_tokenizer, folder)  # at the first constraint
        eos = eos_token_ids(folder, load_config(folder))
    proposer, vocab, name = built
    telemetry = setup("drafter", config.metrics_port)
    servicer = DrafterServicer(
        proposer,
        vocab,
        config.max_draft_tokens,
        telemetry,
        draft_ahead=config.draft_ahead,
        name=name,
        load_tokenizer=load_tok,
        eos_ids=eos,
    )
    log.info("drafter proposer: %s", config.proposer)
    await serve_servicer(
        config,
        "drafter",
        lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s),
        drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name,
        ready,
    )
