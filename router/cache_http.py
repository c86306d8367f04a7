"""The prefix caches' endpoint on the HTTP door, as the servers benchmarks run against
spell it (sglang.bench_serving's --flush-cache calls the one of its backend):

    POST /reset_prefix_cache            vLLM's: 200, empty
    GET|POST /flush_cache               SGLang's: 200, "Cache flushed."; the mean
                                        accepted length /server_info tells starts
                                        over, as SGLang's does

Every replica forgets its cached prefixes (verifier.proto's ResetPrefixCache; running
requests keep their blocks), and the router where it sent them. 503 where a replica could
not be reached. The door's bearer token guards them, as an admin's."""

from __future__ import annotations

import grpc
from aiohttp import web

from router.openai_errors import error_response

PATHS = ("/reset_prefix_cache", "/flush_cache")


class CacheRoutes:
    def __init__(self, router):
        """`router`: the door's router.generation.Router."""
        self.router = router

    def routes(self) -> list:
        return [
            web.post("/reset_prefix_cache", self.reset),
            web.get("/flush_cache", self.flush),
            web.post("/flush_cache", self.flush),
        ]

    async def reset(self, request):
        failed = await self._forget()
        return failed or web.Response(status=200)

    async def flush(self, request):
        failed = await self._forget()
        if failed is None and self.router.metrics is not None:
            self.router.metrics.restart_accept_length()
        return failed or web.Response(text="Cache flushed.\n")

    async def _forget(self) -> web.Response | None:
        try:
            await self.router.replicas.reset_prefix_caches()
        except grpc.aio.AioRpcError as exc:
            return error_response(503, f"a replica's cache was not reset: {exc.details()}")
        return None
