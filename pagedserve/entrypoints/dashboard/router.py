"""The dashboard's routes: the page at / and /dashboard and its static files (public:
the page asks for the API key itself), and its event stream (behind the key, like
every API route).  Built by a function rather than at import, because the hub comes
from the server that includes the router, which this package does not import."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagedserve.entrypoints.dashboard import EVENTS_PATH, PAGE_PATHS, STATIC_PREFIX, DashboardHub

_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                  ".css": "text/css; charset=utf-8", ".txt": "text/plain; charset=utf-8"}


_STATIC = resources.files(__package__).joinpath("static")
# The files there, listed once: a request's name is looked up in this set and never
# reaches the file system (a 300-character name raised ENAMETOOLONG: a 500).
_STATIC_NAMES = frozenset(f.name for f in _STATIC.iterdir()
                          if f.is_file() and "." in f.name and "." + f.name.rsplit(".", 1)[-1] in _CONTENT_TYPES)


# The page is never shown inside another site's frame (the playground holds an API key
# and sends on a click: a framing page could steer the click), nor sniffed as another type.
PAGE_HEADERS = {"Cache-Control": "no-cache", "X-Frame-Options": "DENY",
                "Content-Security-Policy": "frame-ancestors 'none'", "X-Content-Type-Options": "nosniff"}


def _static_file(name: str) -> Response:
    """A file of static/, or a 404."""
    if name not in _STATIC_NAMES:
        return Response(status_code=404)
    suffix = "." + name.rsplit(".", 1)[-1]
    return Response(_STATIC.joinpath(name).read_bytes(), media_type=_CONTENT_TYPES[suffix], headers=PAGE_HEADERS)


def dashboard_router(hub_of: Callable[..., Awaitable[DashboardHub]],
                     sse_response: Callable[[AsyncIterator[str]], Response]) -> APIRouter:
    """`hub_of`: a FastAPI dependency giving the hub once the engine has loaded (raising
    a 503 before); `sse_response` wraps an async iterator of SSE strings in a streaming
    response."""
    router = APIRouter()

    async def page() -> Response:
        return _static_file("index.html")

    for path in PAGE_PATHS:
        # (HEAD too: Ollama's clients check that a server is up with HEAD /)
        router.add_api_route(path, page, methods=["GET", "HEAD"], include_in_schema=False)

    @router.api_route(STATIC_PREFIX + "{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def static(name: str) -> Response:
        return _static_file(name)

    @router.get(EVENTS_PATH, include_in_schema=False)
    async def events(request: Request, hub: DashboardHub = Depends(hub_of)) -> Response:
        address = request.client.host if request.client is not None else ""
        hub.check_room(address)
        return sse_response(hub.events(address))

    return router
