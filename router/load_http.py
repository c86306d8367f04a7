"""vLLM's `GET /load` on the HTTP door: `{"server_load": N}`, the requests this router has
sent to its replicas and not yet seen end (vLLM counts its API server's requests in
flight, with `--enable-server-load-tracking`; specd counts always). Unguarded, as vLLM's
and as /health: it tells a balancer in front how busy this door is, and nothing else."""

from __future__ import annotations

from aiohttp import web


class LoadRoutes:
    def __init__(self, router):
        """`router`: the door's router.generation.Router."""
        self.router = router

    def routes(self) -> list:
        return [web.get("/load", self.load)]

    async def load(self, request):
        inflight = sum(replica.inflight for replica in self.router.replicas.replicas.values())
        return web.json_response({"server_load": inflight})
