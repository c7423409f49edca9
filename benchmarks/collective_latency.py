"""Latency of the collectives decode pays per layer and per step, over gloo and over shared memory.

    python benchmarks/collective_latency.py --ranks 2 --json benchmarks/results/collective_latency.json

Spawns `--ranks` processes (one thread each) that build the same gloo group twice: plain, and with the
shared-memory fast path (`cpllm.distributed.shm_group`). Each collective is timed over `--iters` calls after a
warm-up, alternating the two transports in rounds; the median round is reported. Payloads: a decode token's
hidden state (all-reduce, [1, 576] float32), the attention partials of 16 tokens ([16, 9, 65] float32 all-gather),
a decode step's K/V of 8 tokens for every layer (the replicated layout's sync, [8 * 30 * 2 * 3 * 64] float32
all-gather), and a step message (broadcast_object of a 16-request step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpllm.bench.common import machine_info
from cpllm.distributed import comm
from cpllm.distributed.launch import find_free_port
from cpllm.distributed.shm_group import open_shm_group
from cpllm.step import ScheduledChunk, SchedulerOutput

PAYLOADS = {
    "all_reduce [1, 576]": ("all_reduce", (1, 576)),
    "all_gather [16, 9, 65]": ("all_gather", (16, 9, 65)),
    "all_gather [92160] (K/V sync)": ("all_gather", (8 * 30 * 2 * 3 * 64,)),
    "broadcast_object (16-request step)": ("broadcast", None),
}


def _step() -> SchedulerOutput:
    chunks = tuple(ScheduledChunk(request_id=f"r{i}", token_ids=(i,), start_pos=2048, block_table=tuple(range(129)),
                                  sample=True, prompt_logits=False) for i in range(16))
    return SchedulerOutput(step_id=1, chunks=chunks)


def _call(kind: str, shape, group, rank: int):
    if kind == "all_reduce":
        return comm.all_reduce(torch.ones(shape), group)
    if kind == "all_gather":
        return comm.all_gather(torch.ones(shape), group)
    return comm.broadcast_object(_step() if rank == 0 else None, src=0, group=group)


def _rank(rank: int, world: int, port: int, iters: int, rounds: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    groups = {"gloo": dist.group.WORLD, "shared memory": open_shm_group(dist.group.WORLD, list(range(world)), rank,
                                                                          timeout_s=60)}
    results = {}
    for label, (kind, shape) in PAYLOADS.items():
        times = {name: [] for name in groups}
        for _ in range(rounds):
            for name, group in groups.items():
                for _ in range(max(3, iters // 10)):
                    _call(kind, shape, group, rank)
                begin = time.perf_counter()
                for _ in range(iters):
                    _call(kind, shape, group, rank)
                times[name].append((time.perf_counter() - begin) / iters)
        results[label] = {name: statistics.median(t) for name, t in times.items()}
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.iters, args.rounds, out))
             for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    results = out.get(timeout=600)
    for proc in procs:
        proc.join(60)
    rows = []
    for label, by_transport in results.items():
        gloo, shm = by_transport["gloo"], by_transport["shared memory"]
        rows.append({"collective": label, "ranks": args.ranks, "gloo_us": round(gloo * 1e6, 1),
                     "shared_memory_us": round(shm * 1e6, 1), "speedup": round(gloo / shm, 1)})
    for row in rows:
        print(row)
    if args.json:
        with open(args.json, "w") as f:
            machine = {**machine_info(), "load_average_start": load_at_start,
                       "load_average_end": [round(x, 2) for x in os.getloadavg()]}
            json.dump({"command": "collective_latency", "argv": ["python", *sys.argv], "machine": machine, "results": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
