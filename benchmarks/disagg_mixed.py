"""Colocated against disaggregated serving under a mixed load: long prompts arriving while short chats decode.

    python benchmarks/disagg_mixed.py --long-tokens 7900 --longs 3 --long-interval-s 12 --chats 4 \
        --json benchmarks/results/disagg_mixed.json

SmolLM2 (the default GGUF, default weights), two ranks in all on each side, one thread per rank:
- colocated: one `cpllm serve` with PCP = 2: a long prompt's prefill is split over both ranks, and the chats decode
  in the same steps (chunked prefill at --max-num-batched-tokens);
- disaggregated: a prefill instance (one rank, kv_producer) and a decode instance (one rank, kv_consumer) behind
  `cpllm router`, which prefills every request on the first and decodes it on the second.
The same load on both: --chats clients each send streamed completions in a loop (a --chat-prompt-tokens prompt,
--chat-tokens tokens); --longs long prompts (random ids, 4 tokens out) arrive one every --long-interval-s, the first
after --warmup-s. Per chat request, TPOT = (last token - first token) / (tokens - 1); every gap between two streamed
tokens is kept too (the stall a long prefill puts into a chat). Per long prompt, TTFT. On the disaggregated side the
decode instance logs each pull (cpllm/disagg/rank_transfer.py): its milliseconds against its bytes, per 1K tokens.
The sides run one after the other (each on the whole machine); chats that finish while no long prompt is in flight
are counted apart from the ones that overlap one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx

from cpllm.bench.common import machine_info, random_prompt
from cpllm.server.process import ServerProcess, free_port

MODEL_NAME = "smollm2"
VOCAB = 49152
PULL_LINE = re.compile(r"kv transfer: rank (\d+) pulled (\d+) tokens of request \S+, (\d+) bytes in ([\d.]+) ms")


def free_ports(count: int) -> int:
    """A base port with `count` consecutive ports free a moment ago (a transfer's control port and one per rank)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count < 65000 and all(_is_free(port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def kv_flag(role: str, ranks: int) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "CpllmConnector", "kv_role": role,
                                                 "kv_ip": "127.0.0.1", "kv_port": free_ports(ranks + 1)})]


def serve_flags(args) -> list[str]:
    return ["--served-model-name", MODEL_NAME, "--threads-per-rank", "1", "--max-model-len", "8192",
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--no-enable-prefix-caching"]


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival time of every streamed token (the first is the TTFT's end)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
    return times


async def chat_loop(client, url: str, args, stop: asyncio.Event, index: int, out: list[dict]) -> None:
    seed = 1000 * index
    while not stop.is_set():
        seed += 1
        start = time.perf_counter()
        times = await stream_completion(client, url, random_prompt(args.chat_prompt_tokens, VOCAB, seed=seed),
                                        args.chat_tokens)
        out.append({"start": start, "times": times})


async def long_prompts(client, url: str, args, out: list[dict]) -> None:
    await asyncio.sleep(args.warmup_s)
    tasks = []
    for i in range(args.longs):
        tasks.append(asyncio.create_task(_one_long(client, url, args, i, out)))
        await asyncio.sleep(args.long_interval_s)
    await asyncio.gather(*tasks)


async def _one_long(client, url: str, args, i: int, out: list[dict]) -> None:
    start = time.perf_counter()
    times = await stream_completion(client, url, random_prompt(args.long_tokens, VOCAB, seed=-1 - i), 4)
    out.append({"start": start, "ttft_s": times[0] - start, "end": times[-1]})


async def run_load(url: str, args) -> dict:
    chats, longs, stop = [], [], asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as client:
        await stream_completion(client, url, random_prompt(64, VOCAB, seed=-999), 4)  # warm-up
        loops = [asyncio.create_task(chat_loop(client, url, args, stop, i, chats)) for i in range(args.chats)]
        await long_prompts(client, url, args, longs)
        await asyncio.sleep(args.cooldown_s)
        stop.set()
        await asyncio.gather(*loops)
    return summarize(chats, longs)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(chats: list[dict], longs: list[dict]) -> dict:
    busy = [(row["start"], row["end"]) for row in longs]
    overlapping = lambda c: any(s < c["times"][-1] and c["start"] < e for s, e in busy)  # noqa: E731
    summary = {"long_ttft_s": [round(row["ttft_s"], 3) for row in sorted(longs, key=lambda r: r["start"])]}
    for name, rows in (("all", chats), ("during_long", [c for c in chats if overlapping(c)]),
                       ("quiet", [c for c in chats if not overlapping(c)])):
        tpot = [(c["times"][-1] - c["times"][0]) / (len(c["times"]) - 1) * 1e3 for c in rows if len(c["times"]) > 1]
        gaps = [(b - a) * 1e3 for c in rows for a, b in zip(c["times"], c["times"][1:])]
        ttft = [(c["times"][0] - c["start"]) * 1e3 for c in rows if c["times"]]
        summary[f"chats_{name}"] = {
            "requests": len(rows), "tpot_ms_p50": round(percentile(tpot, 0.5), 1),
            "tpot_ms_p99": round(percentile(tpot, 0.99), 1), "token_gap_ms_p99": round(percentile(gaps, 0.99), 1),
            "token_gap_ms_max": round(max(gaps), 1) if gaps else None, "ttft_ms_p50": round(percentile(ttft, 0.5), 1)}
    return summary


def pulls_from(log: str, min_tokens: int) -> dict:
    """The decode instance's pulls of at least `min_tokens` (the long prompts, less the token the decode side
    computes itself): ms and bytes per 1K tokens."""
    rows = [(int(t), int(b), float(ms)) for _, t, b, ms in PULL_LINE.findall(log) if int(t) >= min_tokens]
    if not rows:
        return {"pulls": 0}
    tokens, nbytes, ms = (sum(r[i] for r in rows) for i in range(3))
    return {"pulls": len(rows), "tokens": tokens, "bytes": nbytes, "ms": round(ms, 1),
            "ms_per_1k_tokens": round(ms / tokens * 1000, 2), "mib_per_1k_tokens": round(nbytes / tokens * 1000 / 2**20, 3),
            "gb_per_s": round(nbytes / (ms / 1e3) / 1e9, 2)}


def colocated(args) -> dict:
    with ServerProcess.running(["-pcp", "2", *serve_flags(args)], timeout_s=600) as server:
        return {"layout": "colocated: one instance, PCP=2", **asyncio.run(run_load(server.url, args))}


def disaggregated(args) -> dict:
    prefill = ServerProcess([*serve_flags(args), *kv_flag("kv_producer", 1)])
    decode = ServerProcess([*serve_flags(args), *kv_flag("kv_consumer", 1)])
    router = None
    try:
        prefill.wait_ready(600)
        decode.wait_ready(600)
        port = free_port()
        router = subprocess.Popen([sys.executable, "-m", "cpllm", "router", "--prefill", prefill.url,
                                   "--decode", decode.url, "--port", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        _wait_health(url)
        result = asyncio.run(run_load(url, args))
        return {"layout": "disaggregated: prefill 1 rank -> decode 1 rank (router)", **result,
                "transfer": pulls_from(decode.log(), args.long_tokens // 2)}
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        prefill.close()
        decode.close()


def _wait_health(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url}/health did not answer 200 within 60 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long-tokens", type=int, default=7900)
    parser.add_argument("--longs", type=int, default=3)
    parser.add_argument("--long-interval-s", type=float, default=12.0)
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--chat-prompt-tokens", type=int, default=96)
    parser.add_argument("--chat-tokens", type=int, default=48)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--warmup-s", type=float, default=4.0, help="chats alone before the first long prompt")
    parser.add_argument("--cooldown-s", type=float, default=4.0, help="chats alone after the last long prompt")
    parser.add_argument("--sides", default="colocated,disaggregated")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    sides = {"colocated": colocated, "disaggregated": disaggregated}
    results = []
    for name in args.sides.split(","):
        results.append(sides[name](args))
        print(json.dumps(results[-1]), flush=True)
    payload = {"command": "disagg_mixed", "argv": sys.argv, "machine": {**machine_info(),
               "load_average_start": load_start}, "options": vars(args), "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
