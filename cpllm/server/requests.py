"""Starting, merging and closing the engine requests behind one HTTP request, and its log line."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from cpllm.engine.outputs import RequestOutput
from cpllm.engine.sampling_params import SamplingParams
from cpllm.server.admission import Admission
from cpllm.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from cpllm.server.cancellation import CLIENT_CLOSED
from cpllm.server.errors import APIError, bad_request
from cpllm.server.formatting import TokenTexts, engine_error, sse
from cpllm.server.options import ServeOptions
from cpllm.server.structured_fields import Constraint

logger = logging.getLogger("cpllm.server.requests")


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class ServerContext:
    """What every route needs."""

    engine: AsyncEngine
    """The engine behind the server."""
    model_name: str
    """The name clients pass as `model`."""
    texts: TokenTexts
    """Token id -> text, for logprobs."""
    options: ServeOptions
    """Limits and tool-calling settings."""
    admission: Admission
    """The bound on sequences in flight."""


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class Prompt:
    """One prompt of a request: its token ids and, when known, its text."""

    token_ids: list[int]
    text: str | None


async def start(ctx: ServerContext, base_id: str, prompts: list[Prompt], params: SamplingParams,
                arrival_time: float, max_tokens_param: str = "max_tokens") -> list[RequestStream]:
    """Adds every prompt to the engine; if one is refused, the others are aborted and a 400 is raised.
    429 when the server's queue cannot take the request's sequences (they are released when the streams close)."""
    if ctx.options.enable_log_requests:
        logger.info("received request %s: %d prompt(s) of %s tokens, params=%r", base_id, len(prompts),
                    ",".join(str(len(p.token_ids)) for p in prompts), params)
    ticket = ctx.admission.admit(len(prompts) * params.n)
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(await ctx.engine.add_request(request_id, prompt.token_ids, params, prompt=prompt.text,
                                                        arrival_time=arrival_time))
            streams[-1].on_close(ticket.release)
    except ValueError as exc:
        close(base_id, streams, log=False)
        raise engine_error(exc, max_tokens_param) from exc
    except EngineDeadError as exc:
        close(base_id, streams, log=False)
        raise APIError(503, str(exc)) from exc
    except BaseException:
        close(base_id, streams, log=False)
        raise
    finally:
        if len(streams) < len(prompts):  # refused part-way: nothing of this request stays in flight
            ticket.release()
    return streams


async def compile_constraint(ctx: ServerContext, constraint: Constraint | None) -> None:
    """Checks (and caches) the grammar off the event loop; an invalid one is a 400 naming its field."""
    if constraint is None:
        return
    try:
        await ctx.engine.compile_constraint(constraint.params)
    except ValueError as exc:
        raise bad_request(f"{constraint.param}: {exc}", constraint.param) from exc


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            await queue.put(exc)
        await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


class EventStream:
    """A streamed response's server-sent events. A failure after the status line is reported in-band, `[DONE]` ends
    a stream that ran out, and the request is closed exactly once however the response ends: finished, failed, the
    client gone mid-stream, or gone before the first event was even asked for (`aclose()` covers that case)."""

    def __init__(self, request_id: str, streams: list[RequestStream], chunks: AsyncIterator[str]):
        self._request_id = request_id
        self._streams = streams
        self._chunks = chunks
        self._closed = False

    def __aiter__(self) -> AsyncIterator[str]:
        return self._events()

    async def _events(self) -> AsyncIterator[str]:
        status = CLIENT_CLOSED  # until the chunks run out: a client that leaves closes (or cancels) us mid-way
        try:
            async for chunk in self._chunks:
                yield chunk
            status = 200
        except APIError as exc:
            status = exc.status
            yield sse(exc.body())
        except EngineDeadError as exc:  # the engine failed, or the shutdown deadline ended this stream
            status = 503
            yield sse(APIError(503, str(exc)).body())
        except Exception as exc:  # noqa: BLE001 - the status line is gone; report in-band
            status = 500
            yield sse(APIError(500, f"generation failed: {exc}").body())
        finally:
            await self.aclose(status)
        yield sse("[DONE]")

    async def aclose(self, status: int = 200) -> None:
        if self._closed:
            return
        self._closed = True
        await self._chunks.aclose()
        close(self._request_id, self._streams, status=status)


def sse_events(request_id: str, streams: list[RequestStream], chunks: AsyncIterator[str]) -> EventStream:
    return EventStream(request_id, streams, chunks)


async def finished(request_id: str, streams: list[RequestStream]) -> list[RequestOutput]:
    """Every stream's finished output, for a response sent whole; the request is closed and logged however the wait
    ends: 499 when the client left (the wait is cancelled, cancellation.py), 503 when the engine failed or stopped."""
    status = 500
    try:
        outputs = await results(streams)
        status = 200
        return outputs
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    except EngineDeadError:
        status = 503
        raise
    finally:
        close(request_id, streams, status=status)


async def results(streams: list[RequestStream]) -> list[RequestOutput]:
    """Every stream's finished output (they run side by side in the engine)."""
    return list(await asyncio.gather(*(s.result() for s in streams)))


def close(request_id: str, streams: list[RequestStream], *, status: int = 200, log: bool = True) -> None:
    """Aborts what did not finish, records metrics, and writes the request's one log line."""
    for stream in streams:
        stream.close()
    if log:
        log_request(request_id, [s.last for s in streams if s.last is not None], status)


def log_request(request_id: str, outputs: list[RequestOutput], status: int) -> None:
    now = time.monotonic()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    firsts = [o.metrics.first_token_time for o in outputs if o.metrics.first_token_time is not None]
    arrival = min((o.metrics.arrival_time for o in outputs), default=now)
    reasons = sorted({c.finish_reason or "abort" for o in outputs for c in o.outputs})
    ttft = f"{min(firsts) - arrival:.3f}s" if firsts else "-"
    logger.info("request %s status=%d prompt_tokens=%d output_tokens=%d ttft=%s latency=%.3fs finish=%s",
                request_id, status, prompt_tokens, output_tokens, ttft, now - arrival, ",".join(reasons) or "-")
