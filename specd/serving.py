"""What every specd gRPC server shares: an aio server with health and reflection, and its
drain on SIGTERM (clients' channels and health checks: specd/channels.py).

(The core runs no service; this one generic bootstrap lives here so the three services do
not each carry a copy. It knows no service.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.channels import MAX_MESSAGE_BYTES, read_file
from specd.request_decoding import strict_decoding

log = logging.getLogger(__name__)


class ListenError(OSError):
    """A listener that cannot take its address (in use, or not this machine's)."""


async def start_server(
    host: str,
    port: int,
    register,
    service_names: list[str],
    interceptors=(),
    tls_cert: str = "",
    tls_key: str = "",
) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Start an aio server; `register(server)` adds the servicers. Returns the bound port
    (port 0 picks a free one) and the health servicer (already SERVING). With a certificate
    and key (PEM files) the port speaks TLS only."""
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options, interceptors=list(interceptors))
    register(strict_decoding(server))  # undecodable bytes: INVALID_ARGUMENT
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [
        *service_names,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    ]
    reflection.enable_server_reflection(names, server)
    try:
        if tls_cert or tls_key:
            creds = grpc.ssl_server_credentials([(read_file(tls_key), read_file(tls_cert))])
            bound = server.add_secure_port(f"{host}:{port}", creds)
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises where it once returned 0
        bound = 0
    if bound == 0:
        raise ListenError(f"cannot listen on {host}:{port}: in use, or not this machine's")
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


async def serve_until_signal(
    server: grpc.aio.Server,
    health: health.aio.HealthServicer,
    grace: float,
    draining: asyncio.Event | None = None,
    also_stop=(),
) -> None:
    """Run until SIGINT/SIGTERM, then drain: health answers NOT_SERVING (readiness probes
    and peers stop sending), `draining` is set (long-lived streams end), new calls are
    refused (the router retries them elsewhere) and calls in flight get `grace` seconds.
    `also_stop`: coroutine functions that drain other listeners, awaited alongside."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if draining is not None:
        draining.set()
    await health.enter_graceful_shutdown()
    await asyncio.gather(server.stop(grace), *(stop_other() for stop_other in also_stop))
    waiter.cancel()
    stopper.cancel()


async def serve_servicer(config, role: str, register, service_name: str, ready=None, draining=None):
    """A service's whole life on its config's host, port and certificate: start the server
    with `register(server)`, log, report the bound port to `ready`, drain on a signal."""
    server, port, health = await start_server(
        config.host,
        config.port,
        register,
        [service_name],
        tls_cert=config.tls_cert,
        tls_key=config.tls_key,
    )
    log.info("%s serving on %s:%d", role, config.host, port)
    if ready is not None:
        ready(port)
    await serve_until_signal(server, health, config.drain_seconds, draining)
