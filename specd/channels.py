"""Client channels to specd's gRPC services (TLS when given a CA) and the grpc.health.v1
check that `specd health`, the supervisor and the tests use."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 16 << 20


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def open_channel(address: str, tls_ca: str = "", aio: bool = False, options=None):
    """A client channel: TLS verified against `tls_ca` (a PEM file) when given."""
    grpc_mod = grpc.aio if aio else grpc
    if tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=read_file(tls_ca))
        return grpc_mod.secure_channel(address, creds, options=options)
    return grpc_mod.insecure_channel(address, options=options)


def health_status(address: str, timeout: float = 2.0, service: str = "", tls_ca: str = "") -> str:
    """What `address` answers grpc.health.v1 for `service` (SERVING, NOT_SERVING, ...), or
    where it gives no answer, the call's status and details (e.g. "UNAVAILABLE: failed to
    connect ...", "NOT_FOUND: ..." for a service it does not know)."""
    with open_channel(address, tls_ca) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def check_health(address: str, timeout: float = 2.0, service: str = "", tls_ca: str = "") -> bool:
    """True when `address` answers grpc.health.v1 with SERVING."""
    return health_status(address, timeout, service, tls_ca) == "SERVING"
