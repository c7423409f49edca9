"""vLLM's server load (--enable-server-load-tracking): the generation requests in flight, served at GET /load."""

from __future__ import annotations

GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch",
                               "/v1/responses", "/invocations"})
"""The routes whose requests count (as vLLM's load-aware routes)."""


class ServerLoad:
    """ASGI middleware counting requests to GENERATION_ROUTES from their arrival until their response has been
    sent (a stream: until its last event), however they end."""

    def __init__(self, app, counter: "LoadCounter"):
        self.app = app
        self.counter = counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _route_path(scope) not in GENERATION_ROUTES:
            return await self.app(scope, receive, send)
        self.counter.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.in_flight -= 1


class LoadCounter:
    """The count GET /load reports (touched by the event loop only)."""

    def __init__(self):
        self.in_flight = 0
        """Generation requests arrived and not yet fully answered."""


def _route_path(scope) -> str:
    """The path without the --root-path prefix, when it has one (both forms are served)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path
