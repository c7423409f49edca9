"""The calibration steps that need two processes of this machine: gloo point-to-point bandwidth and latency,
and the share of the projections' rate a process keeps while both compute at once.

The share is measured in rounds: rank 0 alone (rank 1 waits in a barrier), then both at once, and the share is
the median over rounds of (slower rank's rate together) / (rate alone). A shared host's speed drifts by a
quarter within seconds, so a rate alone taken at another moment than the rate together would put that drift
into the share; taken back to back, both sides see the same moment."""

from __future__ import annotations

import statistics
import time

import torch

BANDWIDTH_BYTES = 8 * 2**20
REPEATS = 5
BUSY_ROUNDS = 5


def _p2p(rank: int) -> dict[str, float]:
    import torch.distributed as dist

    out = {}
    for name, nbytes in (("latency", 4), ("bandwidth", BANDWIDTH_BYTES)):
        send, recv = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        best = float("inf")
        for _ in range(REPEATS + 1):
            dist.barrier()
            start = time.perf_counter()
            ops = [dist.P2POp(dist.isend, send, 1 - rank), dist.P2POp(dist.irecv, recv, 1 - rank)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            best = min(best, time.perf_counter() - start)
        out[name] = best
    return out


def _pair_rank(rank: int, port: int, threads: int, shapes, linear_gflops, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out = _p2p(rank)
        out["alone_gflops"], out["busy_gflops"] = [], []
        for _ in range(BUSY_ROUNDS):
            dist.barrier()
            if rank == 0:
                out["alone_gflops"].append(linear_gflops(threads, shapes))
            dist.barrier()  # both start computing together
            out["busy_gflops"].append(linear_gflops(threads, shapes))
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def pair_figures(threads: int, shapes, linear_gflops) -> tuple[float, float, float]:
    """(point-to-point bytes/s, latency s, the share of its projections' rate a process keeps with both busy);
    `linear_gflops` (threads, shapes) -> GFLOP/s is the caller's measurement of the projections (a module-level
    function: it travels to the spawned pair by reference)."""
    import torch.multiprocessing as mp

    from cpllm.distributed.launch import find_free_port

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), find_free_port()
    procs = [ctx.Process(target=_pair_rank, args=(rank, port, threads, shapes, linear_gflops, results), daemon=True)
             for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        outs = dict(_collect(results, procs, timeout_s=180))
    finally:
        for proc in procs:
            proc.join(30)
    latency = outs[0]["latency"]
    together = [min(pair) for pair in zip(outs[0]["busy_gflops"], outs[1]["busy_gflops"])]  # the slower rank
    share = statistics.median(t / a for t, a in zip(together, outs[0]["alone_gflops"]))  # sets a PCP step's pace
    return BANDWIDTH_BYTES / max(outs[0]["bandwidth"] - latency, 1e-9), latency, min(1.0, share)


def _collect(results, procs, timeout_s: float) -> list:
    """One result per process; a process that dies first is an error at once, not a timeout."""
    import queue

    deadline, got = time.monotonic() + timeout_s, []
    while len(got) < len(procs):
        try:
            got.append(results.get(timeout=0.5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"calibration processes failed (exit codes {[p.exitcode for p in procs]})")
    return got
