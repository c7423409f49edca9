"""Starting, merging and closing the engine requests behind one HTTP request, and its log line."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from cpllm.engine.outputs import RequestOutput
from cpllm.engine.sampling_params import SamplingParams
from cpllm.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from cpllm.server.errors import APIError
from cpllm.server.formatting import TokenTexts, engine_error, sse

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


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class Prompt:
    """One prompt of a request: its token ids and, when known, its text."""

    token_ids: list[int]
    text: str | None


async def start(ctx: ServerContext, base_id: str, prompts: list[Prompt], params: SamplingParams,
                arrival_time: float, max_tokens_param: str = "max_tokens") -> list[RequestStream]:
    """Adds every prompt to the engine; if one is refused, the others are aborted and a 400 is raised."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(await ctx.engine.add_request(request_id, prompt.token_ids, params, prompt=prompt.text,
                                                        arrival_time=arrival_time))
    except ValueError as exc:
        close(base_id, streams, log=False)
        raise engine_error(exc, max_tokens_param) from exc
    except EngineDeadError as exc:
        close(base_id, streams, log=False)
        raise APIError(503, str(exc)) from exc
    except BaseException:
        close(base_id, streams, log=False)
        raise
    return streams


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


async def sse_events(request_id: str, streams: list[RequestStream], chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Relay a streamed response's events; a failure after the status line is reported in-band, the request is
    closed however the stream ends (client gone included), and `[DONE]` ends a stream that ran out."""
    status = 200
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        status = exc.status
        yield sse(exc.body())
    except Exception as exc:  # noqa: BLE001 - the status line is gone; report in-band
        status = 500
        yield sse(APIError(500, f"generation failed: {exc}").body())
    finally:
        await chunks.aclose()
        close(request_id, streams, status=status)
    yield sse("[DONE]")


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
