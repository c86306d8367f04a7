"""Find verifier replicas by DNS (a Kubernetes headless Service answers with every ready
pod) and keep the replica set in step as pods come and go."""

from __future__ import annotations

import asyncio
import logging
import socket

from router.replicas import ReplicaSet

log = logging.getLogger(__name__)


async def resolve_dns(name: str) -> list[str]:
    """ "host:port" -> ["ip:port", ...] for every address the name resolves to."""
    host, _, port = name.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    out = []
    for family, *_rest, sockaddr in infos:
        ip = sockaddr[0]
        out.append(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(set(out))


class DnsDiscovery:
    def __init__(
        self,
        replicas: ReplicaSet,
        names: list[str],
        static: list[str] = (),
        interval_s: float = 5.0,
        resolve=resolve_dns,
    ):
        self.replicas = replicas
        self.names = list(names)
        self.static = list(static)
        self.interval_s = interval_s
        self.resolve = resolve

    async def refresh(self) -> list[str]:
        found = list(self.static)
        for name in self.names:
            try:
                found += await self.resolve(name)
            except OSError as exc:  # NXDOMAIN while no pod is ready: keep the others
                log.warning("cannot resolve %s: %s", name, exc)
        await self.replicas.sync(found)
        return found

    async def run(self) -> None:
        """Refresh every interval until cancelled (the router's task group runs it)."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)
