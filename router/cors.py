"""Cross-origin requests (CORS) on the HTTP door, so that a page served from elsewhere (a
chat UI in a browser) may call it. vLLM's flags say who may (`--allowed-origins`,
`--allowed-methods`, `--allowed-headers`, `--allow-credentials`), and by default any page
may, as vLLM, SGLang and llama-server let it. aiohttp-cors answers the preflights and
marks the answers."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp_cors
from aiohttp import web

from specd.config import string_list

PREFLIGHT_MAX_AGE_S = 600  # how long a browser may keep a preflight's answer (Starlette's)


@dataclass(frozen=True)
class CrossOrigin:
    """Who may call from another origin: `origins` (scheme://host[:port], or "*" for
    any; none: no page may), the methods and request headers it may use ("*": any), and
    whether with the browser's credentials (cookies, HTTP authentication)."""

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


ANY_ORIGIN = CrossOrigin()


def cross_origin(config) -> CrossOrigin:
    """Who may call, as the router's config (`specd.config.RouterConfig`) says."""
    return CrossOrigin(
        string_list(config.allowed_origins, "allowed_origins"),
        string_list(config.allowed_methods, "allowed_methods"),
        string_list(config.allowed_headers, "allowed_headers"),
        config.allow_credentials,
    )


def allow_cross_origin(app: web.Application, allowed: CrossOrigin) -> None:
    """Answer `allowed`'s preflights (OPTIONS) on every path of `app`, and mark its
    answers to those origins, errors included, as theirs to read (every header exposed).
    Call it once the routes are added."""
    if not allowed.origins:
        return
    options = aiohttp_cors.ResourceOptions(
        allow_credentials=allowed.credentials,
        expose_headers="*",
        allow_headers="*" if "*" in allowed.headers else allowed.headers,
        allow_methods="*" if "*" in allowed.methods else [m.upper() for m in allowed.methods],
        max_age=PREFLIGHT_MAX_AGE_S,
    )
    cors = aiohttp_cors.setup(app, defaults=dict.fromkeys(allowed.origins, options))
    for resource in list(app.router.resources()):
        cors.add(resource)  # a resource, not its routes: then --allowed-methods holds
    app.on_response_prepare.append(_vary_by_origin)  # after aiohttp-cors's, which it reads


async def _vary_by_origin(request: web.Request, response: web.StreamResponse) -> None:
    """An answer that names the origin it was for says so to caches (`Vary: Origin`), so
    that a proxy does not hand one site's answer to another site's page."""
    if "Access-Control-Allow-Origin" in response.headers:
        vary = response.headers.get("Vary")
        response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"


def is_preflight(request: web.Request) -> bool:
    """A browser asking whether it may (which carries no credentials to check)."""
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
