"""Bytes each prefill strategy moves per layer: the formula, and a count of what the collectives carry.

Formula (one request of T new tokens, no cached context, PCP = p, per rank):
  n = the largest rank's token count under the head-tail partition (every rank pads to it);
  each rank receives the other p - 1 ranks' K and V blocks of n rows:
      bytes_received = 2 * (p - 1) * n * kv_heads_per_rank * head_dim * dtype_bytes
  for `ring` (p - 1 pass-KV steps of a [2, n, heads, dim] block) and for `allgather` over gloo (one all-gather of
  K and one of V). Where the ranks share a host, `allgather` gathers the request's K and V straight into position
  order in shared memory (comm.all_gather_rows): a rank then reads the other ranks' tokens only, no padding,
      bytes_received = 2 * (T - t_r) * kv_heads_per_rank * head_dim * dtype_bytes   (t_r: this rank's tokens).

Measured: the collectives imported from cpllm.distributed.comm are wrapped, in this process only
(global rank 0), for the duration of one prefill; each call records the bytes this rank received.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from cpllm.context_parallel.partition import rank_num_tokens
from cpllm.distributed import comm
from cpllm.distributed.parallel_dims import kv_heads_per_rank as _kv_heads_per_rank

WRAPPED = ("all_gather", "all_gather_rows", "all_reduce", "reduce_scatter", "all_to_all", "ring_exchange")


def kv_heads_per_rank(config: Any, tp: int) -> int:
    """KV heads one TP rank holds (the engine's placement rule: parallel_dims.kv_heads_per_rank)."""
    return _kv_heads_per_rank(config.num_key_value_heads, tp)


def formula_bytes_per_layer(config: Any, tokens: int, pcp: int, tp: int = 1, dtype_bytes: int = 4,
                            in_order_rank: int | None = None) -> int:
    """Bytes of new K/V one rank receives per layer in a prefill of `tokens`: the padded blocks of the ring or a gloo
    all-gather, or, with `in_order_rank`, the other ranks' tokens that rank reads from a gather in position order."""
    if pcp == 1:
        return 0
    if in_order_rank is not None:
        rows = tokens - rank_num_tokens(tokens, pcp, in_order_rank)
        return 2 * rows * kv_heads_per_rank(config, tp) * config.head_dim * dtype_bytes
    rows = max(rank_num_tokens(tokens, pcp, r) for r in range(pcp))
    return 2 * (pcp - 1) * rows * kv_heads_per_rank(config, tp) * config.head_dim * dtype_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _received(name: str, args: tuple, kwargs: dict, result: Any) -> int:
    """Bytes this rank received in one call (0 for a group of one)."""
    group = args[3] if name == "all_gather_rows" else args[1] if len(args) > 1 else kwargs.get("group")
    world = comm.group_size(group)
    if world == 1:
        return 0
    tensor = args[0]
    if name == "all_gather_rows":  # args: tensors, placements, total rows, group; None: not this path
        if result is None:
            return 0
        own = sum(length for _, _, length in args[1])
        return sum((args[2] - own) * _nbytes(t) // max(t.shape[0], 1) for t in tensor)
    if name == "all_gather":
        return _nbytes(tensor) * (world - 1)
    if name in ("all_reduce", "reduce_scatter"):
        return _nbytes(tensor) * (world - 1) // world  # a ring all-reduce: (w-1)/w of it in each phase
    if name == "ring_exchange":
        return _nbytes(tensor)
    if name == "all_to_all":
        splits = kwargs.get("output_split_sizes")
        me = comm.group_rank(group)
        rows = result.shape[0]
        own = splits[me] if splits is not None else rows // world
        return (rows - own) * (_nbytes(result) // max(rows, 1))
    return 0


@dataclass(slots=True)
class CommCounter:
    """Calls and bytes received, keyed by (calling module, collective)."""

    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    """Wall time inside the call (for ring_exchange only the start: its transfer is waited on later)."""

    def record(self, module: str, name: str, received: int, seconds: float) -> None:
        self.calls[(module, name)] += 1
        self.bytes[(module, name)] += received
        self.seconds[(module, name)] += seconds

    def rows(self) -> list[dict[str, Any]]:
        return [{"module": m, "op": op, "calls": self.calls[(m, op)], "bytes": self.bytes[(m, op)],
                 "seconds": round(self.seconds[(m, op)], 4)} for m, op in sorted(self.calls)]


@contextlib.contextmanager
def count_collectives() -> Iterator[CommCounter]:
    """Wrap every cpllm module's reference to a comm collective; undone on exit."""
    counter = CommCounter()
    originals = {name: getattr(comm, name) for name in WRAPPED}
    patched: list[tuple[Any, str, Any]] = []

    def wrap(module_name: str, name: str, fn):
        def counted(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            seconds = time.perf_counter() - start
            out = result.received if name == "ring_exchange" else result
            counter.record(module_name, name, _received(name, args, kwargs, out), seconds)
            return result
        return counted

    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("cpllm.") or module_name.startswith("cpllm.bench") or module is comm:
            continue
        for name, fn in originals.items():
            if getattr(module, name, None) is fn:
                patched.append((module, name, fn))
                setattr(module, name, wrap(module_name, name, fn))
    try:
        yield counter
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)


def measure_prefill_comm(llm, prompt: list[int]) -> CommCounter:
    """Count rank 0's collectives during one prefill (max_tokens=1) of `prompt`."""
    from cpllm.bench.prefill import time_prefill

    with count_collectives() as counter:
        time_prefill(llm, prompt)
    return counter


def attention_bytes_per_layer(counter: CommCounter, num_layers: int) -> int:
    """Bytes received by the context-parallel attention module, per layer."""
    total = sum(b for (module, _), b in counter.bytes.items() if module.startswith("cpllm.context_parallel"))
    return total // num_layers


def run_comm_bench(
    model: str | None,
    *,
    lengths: list[int],
    pcp: int,
    tp: int = 1,
    strategies: list[str],
    threads_per_rank: int | None = 1,
) -> list[dict[str, Any]]:
    """Per strategy and length: measured attention bytes per layer on rank 0 vs the formula."""
    from cpllm.bench.common import BenchLayout, random_prompt
    from cpllm.bench.engines import build_llm, model_config_of

    config = model_config_of(model)
    rows = []
    for strategy in strategies:
        llm, _ = build_llm(model, BenchLayout.of(tp=tp, pcp=pcp, dcp=1), strategy=strategy,
                           threads_per_rank=threads_per_rank, context_tokens=max(lengths) + 16,
                           batch_tokens=max(lengths) + 16)
        try:
            for length in lengths:
                counter = measure_prefill_comm(llm, random_prompt(length, config.vocab_size, seed=length))
                measured = attention_bytes_per_layer(counter, config.num_hidden_layers)
                in_order = any(op == "all_gather_rows" and counter.bytes[(m, op)] for m, op in counter.calls)
                formula = formula_bytes_per_layer(config, length, pcp, tp, in_order_rank=0 if in_order else None)
                rows.append({"strategy": strategy, "pcp": pcp, "tp": tp, "prompt_tokens": length,
                             "measured_bytes_per_layer": measured, "formula_bytes_per_layer": formula,
                             "gathered_in_order": in_order,
                             "ratio": round(measured / formula, 4) if formula else None,
                             "collective_s": round(sum(counter.seconds.values()), 3),
                             "calls": {f"{m}.{op}": n for (m, op), n in counter.calls.items()}})
        finally:
            llm.shutdown()
    return rows
