"""Rows of a rank's K/V pools by position and KV head: read on a producer rank, written on a consumer rank.

A layer's cache is its pools (`worker/kv_cache.py`: K and V, or one latent pool read as both), each
[slots, local KV heads, width]; position `pos` of a request sits at slot block_table[i // block_size] * block_size
+ i % block_size with i its local index on its owner (context_parallel.md "KV layout")."""

from __future__ import annotations

import torch

from cpllm.disagg.reshard import CacheLayout

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layer_pools(caches: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    """Every distinct pool of every layer, in layer order (a shared latent pool once)."""
    out = []
    for cache in caches:
        out += list({id(t): t for t in cache}.values())
    return out


def positions_of(ranges) -> torch.Tensor:
    """The positions of [start, end) runs, ascending. [n] long."""
    return torch.cat([torch.arange(a, b, dtype=torch.long) for a, b in ranges]) if ranges else \
        torch.empty(0, dtype=torch.long)


def slots_of(layout: CacheLayout, block_table, positions: torch.Tensor) -> torch.Tensor:
    """Owner's pool slots of `positions` under `layout` with this request's block table. [n] long."""
    c, i, bs = layout.shards, layout.interleave, layout.block_size
    local = torch.div(positions, c * i, rounding_mode="floor") * i + positions % i
    table = torch.tensor(block_table, dtype=torch.long)
    needed = int(local.max()) // bs + 1 if len(local) else 0
    if needed > len(table):
        raise ValueError(f"the rows need block-table entry {needed - 1}; the table has {len(table)}")
    return table[torch.div(local, bs, rounding_mode="floor")] * bs + local % bs


def read_rows(pools: list[torch.Tensor], slots: torch.Tensor, heads: slice) -> list[torch.Tensor]:
    """Each pool's rows at `slots`, local heads `heads`, contiguous on the CPU. [n, h, width] per pool."""
    return [_gather(pool, slots.to(pool.device), heads).cpu() for pool in pools]


def _gather(pool: torch.Tensor, slots: torch.Tensor, heads: slice) -> torch.Tensor:
    # every head of the slots: one index_select (advanced indexing with a slice runs several times slower)
    if heads.start == 0 and heads.stop == pool.shape[1]:
        return pool.index_select(0, slots)
    return pool[slots, heads].contiguous()


def write_rows(pools: list[torch.Tensor], slots: torch.Tensor, heads: slice, rows: list[torch.Tensor]) -> None:
    """Store `rows` (one [n, h, width] per pool, any float dtype) at `slots`, local heads `heads`, in the pools'
    own dtype."""
    if len(rows) != len(pools):
        raise ValueError(f"{len(rows)} pools of rows arrived; this rank has {len(pools)} (another model?)")
    for pool, part in zip(pools, rows):
        want = (len(slots), heads.stop - heads.start, pool.shape[-1])
        if tuple(part.shape) != want:
            raise ValueError(f"rows of shape {tuple(part.shape)} for pool rows {want}: the instances' models differ")
        part = part.to(device=pool.device, dtype=pool.dtype)
        if heads.start == 0 and heads.stop == pool.shape[1]:  # every head: one index_copy_
            pool.index_copy_(0, slots.to(pool.device), part)
        else:
            pool[slots.to(pool.device), heads] = part


def to_frames(rows: list[torch.Tensor]) -> tuple[list[list[int]], list[memoryview]]:
    """Shapes and raw bytes of `rows` for the wire."""
    return [list(r.shape) for r in rows], [memoryview(r.view(torch.uint8).numpy()) if r.numel() else b""
                                           for r in (t.reshape(-1) for t in rows)]


def from_frames(shapes: list[list[int]], frames: list, dtype: str) -> list[torch.Tensor]:
    """`to_frames` inverted (a copy: the frames' buffers are read-only)."""
    kind = WIRE_DTYPES[dtype]
    out = []
    for shape, frame in zip(shapes, frames, strict=True):
        data = bytearray(frame)
        t = torch.frombuffer(data, dtype=kind) if data else torch.empty(0, dtype=kind)
        out.append(t.view(shape))
    return out
