"""A bounded soak of `cpllm serve` on loopback: mixed traffic for a few minutes, then the books must balance.

Traffic (concurrent clients, each picking at random): completions and chat, streamed and not, n > 1, stop
strings, JSON-schema outputs, clients that disconnect mid-stream, and bad requests. Afterwards:

- every request was answered exactly once: the client's count of responses by status equals the server's
  cpllm_http_requests_total, every finished stream ended with one [DONE] after exactly one finish_reason per
  choice, and no response id repeats;
- no 5xx, and no in-band error event in a stream;
- the server is idle: KV cache usage 0 on every rank, no running or waiting sequence;
- the server's memory (RSS of it and its rank processes) grew by less than --rss-bound-mib.

    python benchmarks/soak.py                   # SmolLM2, 180 s, 12 clients
    python benchmarks/soak.py --duration 60 --clients 6 -- -pcp 2   # extra flags go to `cpllm serve`
    python benchmarks/soak.py --faults 20 -- -dp 2 --distributed-timeout 10   # kill / stop a replica's rank every 20 s

With --faults (soak_faults.py) the books change: a request whose replica failed after it had sent tokens ends with
an error naming the replica (an in-band event, or a 503), which counts as "errored", not as a problem; one that
neither completed nor errored is "lost" (the target: 0). RSS and log checks are off (restarts reload the model).

Prints a JSON summary (requests, errors by kind, p50/p99 latency, RSS before/after); exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx
import psutil

from cpllm.server.process import ServerProcess
from soak_faults import FaultSchedule

SERVER_FLAGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", "96MiB", "--max-num-seqs", "8",
                "--max-queued-requests", "8", "--max-n", "4"]
PROMPTS = ["The three primary colours are", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The capital of France is", "List three fruits:", "Water boils at"]
CHATS = ["Name three animals.", "What is 2 + 2?", "Write a haiku about rain.", "Give me a JSON object for a cat."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 30}},
          "required": ["name", "age"]}
BAD = [  # (path, body): each must get a 4xx
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "x", "temperature": 9}),
    ("/v1/completions", {"prompt": "x", "n": 99}),
    ("/v1/completions", {"prompt": "x", "guided_regex": "("}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
    ("/v1/completions", {"prompt": "x", "model": "not-this-one"}),
    ("/v1/completions", "{broken json"),
]


@dataclass
class Books:
    """What the clients saw."""

    statuses: collections.Counter = field(default_factory=collections.Counter)
    """HTTP status -> responses received (disconnected streams count with their status line)."""
    kinds: collections.Counter = field(default_factory=collections.Counter)
    """What happened, by kind (ok_stream, ok_whole, disconnect, bad_request, busy_429, ...)."""
    latencies: list[float] = field(default_factory=list)
    """Seconds from sending to the last byte, for completed generation requests."""
    ids: collections.Counter = field(default_factory=collections.Counter)
    """Response id -> times seen."""
    problems: list[str] = field(default_factory=list)
    """Broken invariants, with what was seen."""
    faults: bool = False
    """Faults are injected: errors naming a failed replica are expected."""
    errored: int = 0
    """Requests ended with an error naming a failed replica (streams: in-band; whole: 503)."""
    lost: int = 0
    """Requests that neither completed nor ended with an error (a broken connection, a stream cut short)."""
    completions: list[tuple[float, int]] = field(default_factory=list)
    """(time.monotonic() at the end, output tokens) of each completed generation request."""


def _replica_error(books: Books, message: str) -> bool:
    """An error the fault schedule causes: its replica failed (the messages name it)."""
    return books.faults and "replica " in message


def _body(rng: random.Random) -> tuple[str, dict]:
    """A random valid generation request."""
    n = rng.choice([1, 1, 1, 2, 3])
    common = {"max_tokens": rng.randint(4, 40), "n": n, "temperature": rng.choice([0, 0.7, 1.0]),
              "seed": rng.randint(0, 10**6)}
    if rng.random() < 0.3:
        common["stop"] = rng.choice([["\n"], [".", ","], ["the"]])
    if rng.random() < 0.5:
        return "/v1/completions", {"prompt": rng.choice(PROMPTS), **common}
    body = {"messages": [{"role": "user", "content": rng.choice(CHATS)}], **common}
    if rng.random() < 0.25:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "cat", "schema": SCHEMA}}
        body["max_tokens"] = 48
    return "/v1/chat/completions", body


async def _stream(client: httpx.AsyncClient, path: str, body: dict, books: Books, disconnect_after: int | None):
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    async with client.stream("POST", path, json=body) as response:
        books.statuses[response.status_code] += 1
        if response.status_code != 200:
            await response.aread()
            books.kinds[f"status_{response.status_code}"] += 1
            return
        events, finishes, done, response_id, errored, tokens = 0, collections.Counter(), 0, None, False, 0
        async for line in response.aiter_lines():
            if not line:
                continue
            events += 1
            if disconnect_after is not None and events >= disconnect_after:
                books.kinds["disconnect"] += 1
                return  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                done += 1
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                if _replica_error(books, chunk["error"]["message"]):
                    errored = True
                else:
                    books.problems.append(f"in-band error: {chunk}")
                continue
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            if done:
                books.problems.append(f"event after [DONE]: {line[:200]}")
            response_id = chunk["id"]
            for choice in chunk["choices"]:
                if choice.get("finish_reason"):
                    finishes[choice["index"]] += 1
        if errored and done == 1:
            books.errored += 1
            books.kinds["errored_stream"] += 1
            return
        if done != 1 or sorted(finishes) != list(range(body["n"])) or any(v != 1 for v in finishes.values()):
            books.lost += 1
            books.problems.append(f"stream ended with done={done} finishes={dict(finishes)} for n={body['n']}")
        books.ids[response_id] += 1
    books.latencies.append(time.monotonic() - start)
    books.completions.append((time.monotonic(), tokens))
    books.kinds["ok_stream"] += 1


async def _whole(client: httpx.AsyncClient, path: str, body: dict, books: Books) -> None:
    start = time.monotonic()
    response = await client.post(path, json=body)
    books.statuses[response.status_code] += 1
    if response.status_code == 503 and _replica_error(books, response.text):
        books.errored += 1
        books.kinds["errored_whole"] += 1
        return
    if response.status_code != 200:
        books.kinds[f"status_{response.status_code}"] += 1
        return
    data = response.json()
    books.ids[data["id"]] += 1
    indexes = sorted(c["index"] for c in data["choices"])
    if indexes != list(range(body["n"])) or any(c["finish_reason"] is None for c in data["choices"]):
        books.problems.append(f"response choices {indexes} for n={body['n']}: {str(data)[:300]}")
    books.latencies.append(time.monotonic() - start)
    books.completions.append((time.monotonic(), data["usage"]["completion_tokens"]))
    books.kinds["ok_whole"] += 1


async def _bad(client: httpx.AsyncClient, rng: random.Random, books: Books) -> None:
    path, body = rng.choice(BAD)
    response = await (client.post(path, content=body, headers={"content-type": "application/json"})
                      if isinstance(body, str) else client.post(path, json=body))
    books.statuses[response.status_code] += 1
    books.kinds["bad_request"] += 1
    if not 400 <= response.status_code < 500:
        books.problems.append(f"bad request {body!r} answered {response.status_code}")


async def _client(url: str, seed: int, deadline: float, books: Books) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            try:
                if roll < 0.12:
                    await _bad(client, rng, books)
                    continue
                path, body = _body(rng)
                busy = books.statuses[429]
                if roll < 0.55:
                    await _whole(client, path, body, books)
                else:
                    disconnect = rng.randint(2, 6) if roll > 0.88 else None
                    await _stream(client, path, body, books, disconnect)
                if books.statuses[429] > busy:
                    await asyncio.sleep(rng.uniform(0.1, 0.5))  # backs off after a 429, as Retry-After asks
            except httpx.HTTPError as exc:
                books.lost += 1
                books.kinds[f"client_error_{type(exc).__name__}"] += 1
                books.problems.append(f"client error: {exc!r}")


def _metrics(url: str) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = collections.defaultdict(list)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        match = re.match(r"^(\w+)(\{[^}]*\})? (\S+)$", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            out[match.group(1)].append((labels, float(match.group(3))))
    return out


def _rss_mib(pid: int) -> float:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def soak(args: argparse.Namespace) -> dict:
    server = ServerProcess([*([args.model] if args.model else []), *SERVER_FLAGS, *args.serve_args])
    try:
        server.wait_ready(timeout_s=300)
        warm = Books()
        asyncio.run(_run(server.url, args.clients, 15.0, args.seed + 1000, warm))  # first allocations, caches
        rss_before = _rss_mib(server.process.pid)
        before = _metrics(server.url)
        books = Books(faults=args.faults is not None)
        schedule = FaultSchedule(server.url, server.process.pid, args.faults, args.seed) if args.faults else None
        started = time.monotonic()
        if schedule is not None:
            schedule.start()
        asyncio.run(_run(server.url, args.clients, args.duration, args.seed, books))
        elapsed = time.monotonic() - started
        faults = None
        if schedule is not None:
            schedule.stop()  # returns once the last fault's replica serves again
            _wait_healthy(server.url)
            faults = schedule.summary(books.completions, started, started + elapsed)
        idle = _wait_idle(server.url)
        after = _metrics(server.url)
        rss_after = _rss_mib(server.process.pid)
        healthy = httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        log = server.log()
    finally:
        server.close()
    return _summary(args, books, before, after, idle, healthy, rss_before, rss_after, elapsed, log, faults)


def _wait_healthy(url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


async def _run(url: str, clients: int, duration: float, seed: int, books: Books) -> None:
    deadline = time.monotonic() + duration
    await asyncio.gather(*(_client(url, seed + i, deadline, books) for i in range(clients)))


def _wait_idle(url: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(url)
        state = {"kv_usage_max": max((v for _, v in m["cpllm_kv_cache_usage_perc"]), default=0.0),
                 "running": sum(v for _, v in m["cpllm_num_requests_running"]),
                 "waiting": sum(v for _, v in m["cpllm_num_requests_waiting"])}
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def _http_counts(before: dict, after: dict) -> collections.Counter:
    """Server-side responses by status on the two generation routes, during the soak."""
    def counts(m):
        c = collections.Counter()
        for labels, value in m["cpllm_http_requests_total"]:
            if labels.get("route") in ("/v1/completions", "/v1/chat/completions"):
                c[int(labels["status"])] += int(value)
        return c
    diff = counts(after)
    diff.subtract(counts(before))
    return +diff


def _summary(args, books: Books, before, after, idle, healthy, rss_before, rss_after, elapsed, log,
             faults: dict | None = None) -> dict:
    server_counts = _http_counts(before, after)
    problems = list(books.problems)
    if server_counts != +books.statuses:
        problems.append(f"server counted {dict(server_counts)}, clients saw {dict(books.statuses)}")
    repeated = [i for i, n in books.ids.items() if n != 1]
    if repeated:
        problems.append(f"{len(repeated)} response ids seen more than once, e.g. {repeated[:3]}")
    unexplained_5xx = sum(n for s, n in books.statuses.items() if s >= 500) - books.kinds["errored_whole"]
    if unexplained_5xx:
        problems.append(f"5xx responses: {dict(books.statuses)}")
    if any(idle.values()):
        problems.append(f"not idle after the soak: {idle}")
    if not healthy:
        problems.append("/health is not 200 after the soak")
    if faults is None and rss_after - rss_before > args.rss_bound_mib:
        problems.append(f"RSS grew {rss_after - rss_before:.0f} MiB > {args.rss_bound_mib} MiB")
    if faults is None and "Traceback" in log:
        problems.append("a traceback in the server log")
    if books.lost:
        problems.append(f"{books.lost} request(s) lost (neither completed nor ended with an error)")
    if faults is not None:
        requeued = sum(v for _, v in after.get("cpllm_requests_requeued_total", [])) - \
            sum(v for _, v in before.get("cpllm_requests_requeued_total", []))
        faults = {**faults, "served": len(books.completions), "failed_over": int(requeued),
                  "errored": books.errored, "lost": books.lost}
        if faults["undetected"] or faults["unrecovered"]:
            problems.append(f"faults not detected or not recovered: {faults['injected']}")
    total = sum(books.statuses.values())
    return {
        "duration_s": round(elapsed, 1), "clients": args.clients, "requests": total,
        "requests_per_s": round(total / elapsed, 2),
        "by_status": dict(sorted(books.statuses.items())), "by_kind": dict(sorted(books.kinds.items())),
        "output_tokens_per_s": round(sum(n for _, n in books.completions) / elapsed, 1),
        "latency_s": {"p50": round(_percentile(books.latencies, 50), 3),
                      "p99": round(_percentile(books.latencies, 99), 3), "completed": len(books.latencies)},
        "idle_after": idle, "rss_mib": {"before": round(rss_before, 1), "after": round(rss_after, 1),
                                        "bound_growth": args.rss_bound_mib},
        "faults": faults, "problems": problems, "ok": not problems,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model for `cpllm serve` (default: SmolLM2)")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of traffic (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=12, help="concurrent clients (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-bound-mib", type=float, default=64.0,
                        help="largest RSS growth accepted over the soak (default: %(default)s)")
    parser.add_argument("--faults", type=float, default=None, metavar="SECONDS",
                        help="kill or stop a rank of the next DP replica every SECONDS (serve with -dp 2)")
    parser.add_argument("--json", default=None, help="also write the summary to this file")
    parser.add_argument("serve_args", nargs="*", help="extra `cpllm serve` flags (after --)")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.duration > 1800:
        parser.error(f"--duration must be in (0, 1800] seconds, got {args.duration}")
    summary = {**soak(args), "argv": ["python", "benchmarks/soak.py", *(argv if argv is not None else sys.argv[1:])]}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
