"""The step contract between the replica driver and every rank of its replica (torch-free).

The driver's scheduler emits one `SchedulerOutput` per step; it is broadcast to
every rank, which computes it SPMD; `output_positions` says which rows of each
chunk come back to the driver as logits, so both sides agree on the order of
the rows without sending it. Both the engine and the workers import this module,
and nothing else of each other.
"""

from __future__ import annotations

from dataclasses import dataclass

FREED_BLOCK = -1
"""A block-table entry whose block a sliding-window group has freed: every position in it lies before the window of
the chunk's first query (cpllm/kv_groups.py), so no rank reads it."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ScheduledChunk:
    """The tokens of one request computed in this step."""

    request_id: str
    token_ids: tuple[int, ...]
    """New tokens, at positions start_pos .. start_pos + len - 1."""
    start_pos: int
    """Tokens already in the KV cache (earlier chunks, prefix-cache hits)."""
    block_table: tuple[int, ...]
    """Virtual block ids covering positions [0, start_pos + len(token_ids)): the table of KV group 0 (the
    full-attention layers when the model has any; cpllm/kv_groups.py)."""
    sample: bool
    """The chunk ends the known tokens: the driver samples the next one from its last position."""
    prompt_logits: bool
    """Return logits of every position in the chunk (prompt logprobs)."""
    num_draft_tokens: int = 0
    """Of token_ids, the last this many are drafts (speculative decoding): the chunk is a verify chunk, the
    request's last known token then its drafts, and every one of those rows comes back as logits."""
    state_slot: int = -1
    """The request's slot in the pools of layers that keep a fixed-size state per request (cpllm/layers/cache_spec.py
    STATE), given at admission and kept until it finishes or is preempted; -1: the model has no such layer."""
    state_restore: int = -1
    """A prefix hit of a model with state layers: before the forward, every state pool's slot `state_slot` is set
    from this snapshot slot (the states after the hit's last block, cpllm/engine/state_snapshots.py); -1: none."""
    state_save: int = -1
    """The chunk ends at a block boundary whose states are kept: after the forward, every state pool's slot
    `state_slot` is copied into this snapshot slot; -1: none."""
    block_tables: tuple[tuple[int, ...], ...] = ()
    """One table per KV group, in cpllm/kv_groups.py order (group 0's is `block_table`), all of the same length:
    entry i is virtual block i of that group's pool, or FREED_BLOCK where a windowed group has freed it (a prefix
    of the table). Empty: the model has one group, whose table is `block_table`."""

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)

    def group_table(self, group: int) -> tuple[int, ...]:
        """The block table of KV group `group`."""
        return self.block_tables[group] if self.block_tables else self.block_table


@dataclass(kw_only=True, frozen=True, slots=True)
class SchedulerOutput:
    """One step for every rank of a replica."""

    step_id: int
    chunks: tuple[ScheduledChunk, ...] = ()
    shutdown: bool = False
    """Tells the workers to leave their loop."""
    kv_pulls: tuple = ()
    """Prompt K/V every rank pulls from a prefill instance before the forward, one per request admitted with
    do_remote_prefill (plain data: cpllm/disagg/params.py `PullOp`)."""

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


def output_positions(chunk: ScheduledChunk) -> list[int]:
    """New-token indices whose hidden state the driver needs: all of them for prompt logprobs, the last known
    token and the drafts of a verify chunk, else the last."""
    if chunk.prompt_logits:
        return list(range(len(chunk.token_ids)))
    if chunk.num_draft_tokens:  # a verify chunk: the last known token and each draft predict the next token
        return list(range(len(chunk.token_ids) - chunk.num_draft_tokens - 1, len(chunk.token_ids)))
    return [len(chunk.token_ids) - 1] if chunk.sample else []
