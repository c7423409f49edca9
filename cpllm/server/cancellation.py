"""Abandoned requests stop: a non-streamed request is cancelled the moment its client disconnects.

A streamed response notices a gone client when it next writes; a non-streamed one writes only at the end, so
without this a request whose client timed out would keep generating (and hold its KV blocks) to the last token.
The handler runs as a task beside a listener on the ASGI receive channel, as vLLM's `with_cancellation` does;
whichever ends first wins. Cancelling the handler reaches `RequestStream.close()` through its `finally`, which
aborts the engine request and frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

CLIENT_CLOSED = 499
"""The status logged and counted for a request whose client went away first (nginx's convention)."""


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, handler: Awaitable[Any]) -> Any:
    """`await handler`, cancelled if the client disconnects first (then a 499 nobody reads)."""
    work = asyncio.ensure_future(handler)
    listener = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        listener.cancel()
    if work.done():
        return work.result()
    work.cancel()
    try:
        await work
    except asyncio.CancelledError:
        pass
    return Response(status_code=CLIENT_CLOSED)
