"""What a rank tells its driver, the server and the tests: plain values, never a runner, a model or a tensor.

The executor hands these out (cpllm/worker/executor.py); nothing outside cpllm/worker/ sees the objects they
describe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCapacity:
    """One rank's paged KV cache. Every rank of a replica holds the same (the block count is agreed at start)."""

    num_blocks: int
    """Physical blocks in each pool of KV group 0 (the full-attention layers when the model has any)."""
    block_size: int
    """Tokens per block on one rank."""
    bytes: int
    """Bytes of K and V over every layer."""
    dtype: str
    """dtype the pools store, e.g. "bfloat16"."""
    group_blocks: tuple[int, ...] = ()
    """Blocks in the pools of each KV group (cpllm/kv_groups.py order; a sliding-window group holds only its
    requests' windows); () from a rank that predates groups: one group of num_blocks."""


@dataclass(frozen=True, slots=True)
class DecodeLayers:
    """Which implementation runs a rank's decode steps (fixed once the rank has started)."""

    fused: bool
    """Fused decode layers were built (one C call per decoder layer, cpllm/model/execution/fused_decode.py)."""
    fused_max_rows: int | None
    """Most rows the fused layers take in one step; None: as many as the batch (or the team's buffers) holds."""
    fused_tensor_parallel: bool
    """The fused layers hold TP weight shards and run only as a team of the TP ranks."""
    team: str | None
    """How the ranks of a decode team split a fused step (the start-up log's line); None: no team."""
    compiled: bool
    """Decode steps run through torch.compile (--compile-decode)."""


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What one rank built at start: where it runs, its KV cache and its decode layers."""

    rank: int
    """Global rank."""
    devices: frozenset[str]
    """Device types its runner, KV pools and weights are on (one, unless something was left behind)."""
    kv: KVCapacity
    """Its KV cache."""
    decode: DecodeLayers
    """Its decode-step implementation."""


@dataclass(frozen=True, slots=True)
class RankStats:
    """One rank's step counters since start."""

    strategy_counts: Mapping[str, int]
    """Prompt steps run with each PCP prefill strategy (every strategy listed, 0 until it runs)."""
    plan_counts: Mapping[str, int]
    """Steps run with each execution plan, by plan name."""
    fused_steps: int
    """Steps the fused decode layers ran."""
    compiled_steps: int
    """Steps the compiled decode graph ran."""
    graph_replays: int = 0
    """Decode steps replayed as a CUDA graph (cpllm/model/execution/cuda_graphs.py)."""
    kv_rows_pulled: int = 0
    """Disaggregated decode: (position, KV head) rows this rank pulled from prefill instances (cpllm/disagg)."""
    kv_messages_pulled: int = 0
    """The row messages they came in."""
    kv_messages_by_shm: int = 0
    """Of those, the ones read from /dev/shm (a prefill instance on this host; cpllm/disagg/shm_rows.py)."""
