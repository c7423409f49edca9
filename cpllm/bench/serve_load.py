"""A load of concurrent streamed completions against a running OpenAI-compatible server.

Per request: TTFT (send to first streamed token), TPOT ((last token - first token) / (tokens - 1)).
Over the run: request and output-token throughput, TTFT and TPOT p50 / p99.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from cpllm.bench.common import random_prompt


@dataclass(kw_only=True, frozen=True, slots=True)
class RequestTiming:
    """One streamed request as the client saw it."""

    ttft_s: float
    total_s: float
    output_tokens: int

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.total_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(kw_only=True, frozen=True, slots=True)
class ServeResult:
    """A whole load run."""

    num_requests: int
    concurrency: int
    prompt_tokens: int
    max_tokens: int
    wall_s: float
    timings: list[RequestTiming]

    def summary(self) -> dict[str, Any]:
        ttft = [t.ttft_s for t in self.timings]
        tpot = [t.tpot_s for t in self.timings if t.tpot_s is not None]
        output = sum(t.output_tokens for t in self.timings)

        def ms(value: float | None) -> float | None:
            return None if value is None else round(1000 * value, 2)

        return {
            "num_requests": self.num_requests, "concurrency": self.concurrency,
            "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens, "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(self.num_requests / self.wall_s, 3),
            "output_tokens_per_s": round(output / self.wall_s, 2),
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "tpot_p50_ms": ms(percentile(tpot, 50)), "tpot_p99_ms": ms(percentile(tpot, 99)),
            "ttft_mean_ms": ms(statistics.fmean(ttft)) if ttft else None,
        }


async def _served_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _one_request(client: httpx.AsyncClient, body: dict[str, Any]) -> RequestTiming:
    """Stream one completion; count tokens from the final usage chunk (one SSE chunk may hold several)."""
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"server answered {response.status_code}: {detail[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("choices"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first if first is not None else end
    return RequestTiming(ttft_s=first - start, total_s=end - start, output_tokens=tokens or chunks)


async def _run_load(url: str, *, num_requests: int, concurrency: int, prompt_tokens: int, max_tokens: int,
                    vocab_size: int, api_key: str | None, timeout_s: float,
                    progress: Callable[[], None] | None) -> ServeResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s,
                                 limits=limits) as client:
        model = await _served_model(client)
        gate = asyncio.Semaphore(concurrency)

        async def worker(index: int) -> RequestTiming:
            body = {"model": model, "prompt": random_prompt(prompt_tokens, vocab_size, seed=index),
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with gate:
                timing = await _one_request(client, body)
            if progress:
                progress()
            return timing

        begin = time.perf_counter()
        timings = await asyncio.gather(*(worker(i) for i in range(num_requests)))
        wall = time.perf_counter() - begin
    return ServeResult(num_requests=num_requests, concurrency=concurrency, prompt_tokens=prompt_tokens,
                       max_tokens=max_tokens, wall_s=wall, timings=list(timings))


def run_serve_bench(
    url: str,
    *,
    num_requests: int,
    concurrency: int,
    prompt_tokens: int = 128,
    max_tokens: int = 64,
    vocab_size: int = 256,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    progress: Callable[[], None] | None = None,
) -> ServeResult:
    """Send `num_requests` streamed completions (random token-id prompts), at most `concurrency` at once.

    `vocab_size` bounds the random prompt ids; keep it at or below the served model's vocabulary.
    """
    if num_requests < 1 or concurrency < 1:
        raise ValueError(f"num_requests ({num_requests}) and concurrency ({concurrency}) must be at least 1")
    return asyncio.run(_run_load(url, num_requests=num_requests, concurrency=concurrency,
                                 prompt_tokens=prompt_tokens, max_tokens=max_tokens, vocab_size=vocab_size,
                                 api_key=api_key, timeout_s=timeout_s, progress=progress))
