"""Starting the verifier: the target model and its engine, the remote drafter's
handshake, the gRPC server and its drain on SIGTERM (`specd serve verifier`)."""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

from protos.specd.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.engine import Engine
from verifier_service.frontend import AsyncEngine
from verifier_service.server import VerifierServicer
from verifier_service.stats_log import StatsLog

log = logging.getLogger(__name__)


def build_engine(config, telemetry=None):
    """The target model, its engine and its drafts' source: a remote drafter, or a
    lookup of its own (`lookup`), if configured."""
    from specd.grammar import grammar_tokenizer
    from specd.models.loader import (
        eos_token_ids,
        load_config,
        load_model,
        resolve,
    )
    from verifier_service.drafter_client import RemoteProposer

    folder = resolve(config.model)
    model = load_model(
        folder,
        dtype=config.dtype,
        device=config.device or None,
        weights=config.weights,
        kv=config.kv_dtype,
    )
    proposer = None
    if config.lookup:
        from specd.lookup import NgramProposer

        proposer = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
        log.info(
            "drafts: a lookup of the request's last %d..%d tokens in its text",
            config.prompt_lookup_min,
            config.prompt_lookup_max,
        )
    elif config.drafter:
        proposer = RemoteProposer(
            config.drafter,
            config.drafter_timeout_ms,
            config.drafter_reconnect_ms,
            telemetry,
            tls_ca=config.tls_ca,
            prefetch=config.drafter_prefetch,
        )
    eos = eos_token_ids(folder, load_config(folder))
    load_tok = partial(grammar_tokenizer, folder)  # at the first constraint
    engine = Engine(model, config.engine, proposer, eos, telemetry, load_tokenizer=load_tok)
    return engine, folder.name


async def _wait_for_drafter(proposer, timeout_s: float) -> None:
    """Before serving, give a configured drafter time to answer the stream's handshake, so
    the first requests after readiness speculate. A drafter still missing after that is
    not fatal: requests run without drafts until it comes."""
    if proposer is None or not hasattr(proposer, "available"):
        return
    deadline = time.monotonic() + timeout_s
    while not proposer.available:
        if time.monotonic() >= deadline:
            log.warning("drafter %s not answering; serving without it", proposer.address)
            return
        await asyncio.sleep(0.1)


async def serve(config, ready=None, engine=None, model_name="") -> None:
    from specd.model_thread import on_model_thread
    from specd.serving import serve_servicer
    from specd.telemetry import setup

    telemetry = setup("verifier", config.metrics_port)
    if engine is None:
        # loaded on the thread that will step it (see specd/model_thread.py)
        engine, model_name = await on_model_thread("verifier", build_engine, config, telemetry)
    await _wait_for_drafter(engine.proposer, config.drafter_startup_wait_ms / 1000)
    servicer = VerifierServicer(AsyncEngine(engine), model_name, config.max_queue, telemetry)
    stats = None
    if config.log_stats_interval > 0:
        servicer.stats_log = StatsLog(engine, config.log_stats_interval)
        stats = asyncio.create_task(servicer.stats_log.run())
    await serve_servicer(
        config,
        "verifier",
        lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s),
        verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name,
        ready,
        servicer.draining,
    )
    if stats is not None:
        stats.cancel()
    await servicer.close()
