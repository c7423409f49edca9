"""Per-step inputs of one rank: which tokens it computes and what each attention layer reads and writes.

Built identically (up to the rank) on every rank from the same SchedulerOutput, so
every rank of a CP group knows every other rank's batch layout and all of them
issue the same collectives in the same order.

The index tensors are built on the CPU (small Python-driven work) and then moved
to the rank's device once per step by `to_device` (`build_step_batch(..., device=)`):
every tensor field, however deeply nested, travels, in one copy per dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, TypeVar

import torch

from cpllm.context_parallel.kv_layout import KVLayout, local_context_slots
from cpllm.context_parallel.partition import rank_token_ranges
from cpllm.context_parallel.pass_q_plan import PassQPlan, build_pass_q_plan
from cpllm.context_parallel.plan import StepPath, StepPlan
from cpllm.context_parallel.replica_sync import ReplicaSync, build_replica_sync


@dataclass(kw_only=True, frozen=True, slots=True)
class LocalChunk:
    """A contiguous run of one request's new tokens held by this rank."""

    row: int
    """First row of the run in this rank's batch."""
    new_start: int
    """Index of the run's first token among the request's new tokens."""
    length: int


@dataclass(kw_only=True, frozen=True, slots=True)
class RequestAttention:
    """What attention needs to know about one request in this step."""

    num_new: int
    """New tokens of the request in this step (all ranks together)."""
    start_pos: int
    """Absolute position of its first new token (new token t sits at start_pos + t): with the layout, what a
    sliding window reads its positions from (cpllm/layers/window/)."""
    context_len: int
    """Cached positions the queries read from the KV shards (P, or P + 1 for an unsplit single token)."""
    local_chunks: tuple[LocalChunk, ...]
    """This rank's runs of new tokens; attention among new tokens covers these (only when num_new > 1)."""
    new_kv_rows: torch.Tensor | None
    """[num_new] rows of the PCP-gathered new K/V buffer, in token order (None when num_new == 1)."""
    new_kv_first: int | None = None
    """Where `new_kv_rows` is one ascending run (one rank, or the whole request on one PCP rank): its first row, so
    that the new keys are read as a slice of the buffer in place; None otherwise."""
    context_slots: torch.Tensor
    """[num_local_context] this rank's pool slots of positions < context_len, in local order."""
    pcp_rows: tuple[tuple[int, int], ...]
    """Rows [start, end) of this request in each PCP rank's batch (index = pcp rank)."""
    source_rank_rows: tuple[tuple[tuple[int, int, int], ...], ...]
    """Per PCP rank: (row, new_start, length) runs of this request's new tokens on that rank."""
    state_slot: int = -1
    """The request's slot in the per-request state pools (ScheduledChunk.state_slot; -1: none)."""
    num_draft_tokens: int = 0
    """Of the new tokens, the last this many are drafts (ScheduledChunk.num_draft_tokens): a state layer keeps
    its state through the tokens before them only, since a rejected draft's update could not be taken back."""


@dataclass(kw_only=True, frozen=True, slots=True)
class DecodeBatch:
    """Single-token requests batched into one padded attention call against this rank's KV shard."""

    requests: tuple[int, ...]
    """Indices (into AttentionMetadata.requests) of the requests in the batch."""
    slots: torch.Tensor
    """[B, max_local_context] pool slots of each request's local context, padded with slot 0."""
    key_mask: torch.Tensor | None
    """[B, 1, 1, max_local_context] additive mask hiding the padding (None when nothing is padded)."""
    rows: torch.Tensor
    """[pcp_size, B] row of each request in each PCP rank's batch."""
    max_local_context: int
    """Longest local context among them (0: this rank's shard is empty for all)."""
    shared_keys: bool = False
    """slots is [1, U], the union of their slots, and key_mask [1, 1, B, U] says which keys each query sees: only
    in the shared-key view of a batch (cpllm/layers/gqa/shared_keys.py), never in a step's metadata, which always carries each
    request's own slots."""
    window: tuple[int, int] | None = None
    """(first slot, count) when slots is [1, count] and those slots are consecutive in the pool: attention then
    reads a view of the pools instead of a gathered copy (one request, or shared keys, in adjacent blocks)."""
    lengths: torch.Tensor | None = None
    """[B] long: how many of each request's slots are its context (slots[b, :lengths[b]]); the decode attention
    kernel reads them in place (cpllm/kernels/decode_attention.py). None with shared keys."""
    shared_prefix: "SharedPrefix | None" = None
    """Set where two or more of the requests start from the same cached block (a shared prefix; found from the
    block tables at build time, no tensor read): a backend that reads keys once per query block may ask for the
    batch's shared-key view (the GQA kind's `shared_key_view`, cpllm/layers/gqa/shared_keys.py). None: no request
    shares a key with another."""
    views: "StepViews | None" = None
    """The cache of the views layer kinds build of this batch once per step (cpllm/layers/window/decode_view.py:
    one per window and device), shared by the CPU batch and its device copy; None in a view itself or a batch
    built by hand."""


@dataclass(kw_only=True, frozen=True, slots=True)
class AttentionMetadata:
    """Everything the attention layers of one step need; shared by all layers."""

    num_rows: int
    """Rows of every rank's batch, padding at the end included (equal on all PCP ranks)."""
    requests: tuple[RequestAttention, ...]
    write_rows: torch.Tensor
    """[num_writes] rows of the gathered new K/V that this rank owns and stores."""
    write_slots: torch.Tensor
    """[num_writes] pool slots for those rows."""
    has_context: bool
    """Some request reads cached context (same value on every rank)."""
    has_new: bool
    """Some request has more than one new token (same value on every rank)."""
    decode: DecodeBatch | None
    """The single-token requests, attended to the context in one call (None when there are none)."""
    strategy: str | None = None
    """How this step's prefill moves data over PCP ("allgather", "ring", "pass-q"), chosen per step by the
    runner; None: the layer's configured strategy."""
    pass_q: PassQPlan | None = None
    """Where the new K/V are stored under pass-Q (only in pass-Q steps with a split prompt chunk)."""
    rows_same_over_pcp: bool = False
    """Every PCP rank holds the same rows in the same order (one PCP rank, or a step of single tokens that are
    not split over PCP): MoE layers then skip gathering tokens over PCP (cpllm/model/moe/sparse_block.py)."""
    plan: StepPlan
    """The step's plan (cpllm/context_parallel/plan.py), made once by the runner: its path, prefill strategy, graph
    bucket, MLP and LM-head splits and replica sync; every layer reads it and none re-decides it. A decode team's
    plan keeps every row on every member and each request's own context slots (no shared keys)."""
    kv_layout: KVLayout | None = None
    """The layout the slots were laid out with (which positions this rank holds: local context index l is
    position (l // I) * C * I + rank * I + l % I): how a sliding window finds the positions of a shard's keys
    (cpllm/layers/window/). Plain ints, no tensor."""

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> "AttentionMetadata":
        """A copy with every tensor on `device` (see `to_device`)."""
        return to_device(self, device, non_blocking=non_blocking)


@dataclass(kw_only=True, frozen=True, slots=True)
class StepBatch:
    """This rank's model inputs for one step."""

    token_ids: torch.Tensor
    """[num_rows] long, padded with 0 at the end."""
    positions: torch.Tensor
    """[num_rows] long, absolute positions (padding: 0)."""
    attention: AttentionMetadata
    output_rows: tuple[tuple[int, int], ...]
    """(pcp rank, row) of each hidden state the driver needs, in the order the driver expects."""
    replica_sync: ReplicaSync | None = None
    """The single tokens' K/V to copy between PCP ranks after the forward, where the plan says so
    (`StepPlan.replica_sync`: replicated KV layout, decode-only step; each was computed, and stored, by one PCP
    rank only)."""

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> "StepBatch":
        """A copy with the token ids, positions and every metadata tensor on `device` (see `to_device`)."""
        return to_device(self, device, non_blocking=non_blocking)


T = TypeVar("T")


def iter_tensors(obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from `obj` through dataclass fields, tuples and lists, with its path."""
    yield from _walk(obj, "")


def _walk(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _walk(item, f"{path}[{i}]")


def to_device(obj: T, device: torch.device | str, *, non_blocking: bool = False) -> T:
    """A copy of `obj` (metadata dataclasses, tuples, tensors) with every tensor on `device`.

    The tensors not yet there travel together, one host-to-device copy per dtype
    (from pinned memory, asynchronously, when `non_blocking` and the target is
    CUDA); each comes back as a view of its dtype's buffer. Returns `obj` itself
    when nothing needs to move.
    """
    device = torch.device(device)
    tensors = [t for _, t in iter_tensors(obj)]
    if all(_on(t, device) for t in tensors):
        return obj
    moved = iter(_move_all(tensors, device, non_blocking))
    return _rebuild(obj, moved)


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    if tensor.device.type != device.type:
        return False
    return device.index is None or tensor.device.index == device.index


def _move_all(tensors: list[torch.Tensor], device: torch.device, non_blocking: bool) -> list[torch.Tensor]:
    out: list[torch.Tensor | None] = [t if _on(t, device) else None for t in tensors]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if out[i] is None:
            by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1).cpu() for i in indices])
        pin = non_blocking and device.type == "cuda" and torch.cuda.is_available()
        buffer = (flat.pin_memory() if pin else flat).to(device, non_blocking=pin)
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            out[i] = buffer[offset : offset + n].view(tensors[i].shape)
            offset += n
    return out  # type: ignore[return-value]


def _rebuild(obj: Any, moved: Iterator[torch.Tensor]) -> Any:
    # Visits exactly the tensors `_walk` yields, in the same order.
    if isinstance(obj, torch.Tensor):
        return next(moved)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _rebuild(getattr(obj, f.name), moved) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, tuple):
        return tuple(_rebuild(item, moved) for item in obj)
    if isinstance(obj, list):
        return [_rebuild(item, moved) for item in obj]
    return obj


def _rank_runs(num_new: int, pcp_size: int, row_offsets: list[int],
               split_single: bool = False, stay: int | None = None) -> list[list[tuple[int, int, int]]]:
    """Per PCP rank, (row, new_start, length) runs of one request, advancing each rank's row offset.

    With `split_single`, a single new token goes to one PCP rank only, the one with the fewest rows so far
    (lowest rank on ties), so PCP ranks share the decode batch instead of each computing all of it; or rank `stay`
    where given (the previous token's rank: a verify chunk's rows, plan.py `single_token_homes`)."""
    if split_single and num_new == 1:
        home = stay if stay is not None else min(range(pcp_size), key=lambda p: (row_offsets[p], p))
        runs = [[] for _ in range(pcp_size)]
        runs[home].append((row_offsets[home], 0, 1))
        row_offsets[home] += 1
        return runs
    runs = []
    for p in range(pcp_size):
        rank_runs = []
        for start, end in rank_token_ranges(num_new, pcp_size, p):
            rank_runs.append((row_offsets[p], start, end - start))
            row_offsets[p] += end - start
        runs.append(rank_runs)
    return runs


def _chunk_runs(chunks, pcp_size: int, row_offsets: list[int], split_single: bool) -> list:
    """`_rank_runs` of every chunk in order; split single tokens of the same request as the chunk before (the rows
    of one verify chunk) stay on that chunk's rank (plan.py `single_token_homes`)."""
    runs_per_chunk, previous = [], None
    for chunk in chunks:
        stay = None
        if split_single and previous is not None and previous[0] == chunk.request_id and len(chunk.token_ids) == 1:
            stay = previous[1]
        runs = _rank_runs(len(chunk.token_ids), pcp_size, row_offsets, split_single, stay)
        single = split_single and len(chunk.token_ids) == 1
        previous = (chunk.request_id, next(p for p in range(pcp_size) if runs[p])) if single else None
        runs_per_chunk.append(runs)
    return runs_per_chunk


def build_step_batch(chunks, layout: KVLayout, pcp_size: int, pcp_rank: int, output_plan, *, plan: StepPlan,
                     device: torch.device | str | None = None, non_blocking: bool = False) -> StepBatch:
    """Lay out one step for this rank as `plan` (the runner's, cpllm/context_parallel/plan.py `plan_step`) says;
    `output_plan(chunk) -> new-token indices whose hidden state is needed`.

    The plan's `strategy` is the step's prefill strategy (None: the layer's own); "pass-q" adds the plan of its
    K/V stores. Its `split_single_tokens` (replicated KV layout outside a team) computes each single-token chunk on
    one PCP rank instead of all, and its `replica_sync` adds what to copy between the copies after the step; a
    team's plan keeps every row on every PCP rank. The decode rows always carry each request's own context slots
    (the form the C kernel and the fused layers read), whatever kernels exist; where requests share a prefix the
    batch says so (`DecodeBatch.shared_prefix`) and a backend that wants the union of their keys builds it once
    per step (cpllm/layers/gqa/shared_keys.py). With `device`, every tensor of the result (token ids, positions, all metadata)
    is on it."""
    if not isinstance(plan, StepPlan):
        raise TypeError(f"plan {plan!r}: build_step_batch needs the step's StepPlan record (plan.py `plan_step`)")
    has_new = any(len(c.token_ids) > 1 for c in chunks)
    if has_new and plan.path is not StepPath.PREFILL:
        raise ValueError(f"plan {plan.value!r} is for steps of single tokens; this step has a prompt chunk")
    strategy, split_single_tokens = plan.strategy, plan.split_single_tokens
    row_offsets = [0] * pcp_size
    runs_per_chunk = _chunk_runs(chunks, pcp_size, row_offsets, split_single_tokens)
    # Without a prompt chunk nothing is gathered: each rank stores what it holds, from its own rows.
    local_writes = None if has_new else pcp_rank
    num_rows = max(row_offsets) if chunks else 0
    token_ids = torch.zeros(num_rows, dtype=torch.long)
    positions = torch.zeros(num_rows, dtype=torch.long)
    requests, write_rows, write_slots, output_rows = [], [], [], []
    for chunk, runs in zip(chunks, runs_per_chunk):
        for row, new_start, length in runs[pcp_rank]:
            token_ids[row : row + length] = torch.tensor(chunk.token_ids[new_start : new_start + length])
            positions[row : row + length] = torch.arange(length) + chunk.start_pos + new_start
        requests.append(_request_attention(chunk, runs, layout, pcp_rank, num_rows))
        homes = _token_homes(runs)
        _plan_writes(chunk, homes, layout, num_rows, write_rows, write_slots, runs, local_writes)
        output_rows += [homes[i] for i in output_plan(chunk)]
    pass_q = None
    if strategy == "pass-q" and has_new and pcp_size > 1:
        single_rows = [runs[pcp_rank][0][0] if r.num_new == 1 else None for r, runs in zip(requests, runs_per_chunk)]
        pass_q = build_pass_q_plan(chunks, [r.new_kv_rows for r in requests], single_rows, layout, pcp_size,
                                   pcp_rank, num_rows)
    attention = AttentionMetadata(
        num_rows=num_rows,
        requests=tuple(requests),
        write_rows=torch.tensor(write_rows, dtype=torch.long),
        write_slots=torch.tensor(write_slots, dtype=torch.long),
        has_context=any(r.context_len > 0 for r in requests),
        has_new=has_new,
        decode=_decode_batch(requests, chunks),
        strategy=strategy,
        pass_q=pass_q,
        rows_same_over_pcp=pcp_size == 1 or not (has_new or split_single_tokens),
        plan=plan,
        kv_layout=layout,
    )
    replica_sync = None
    if plan.replica_sync:
        replica_sync = build_replica_sync(chunks, runs_per_chunk, layout, pcp_size)
    batch = StepBatch(token_ids=token_ids, positions=positions, attention=attention, output_rows=tuple(output_rows),
                      replica_sync=replica_sync)
    if device is None or torch.device(device).type == "cpu":  # built on the CPU: nothing to move (or walk)
        return batch
    return to_device(batch, device, non_blocking=non_blocking)


def _one_run(pieces: list[tuple[int, int, int]]) -> int | None:
    """The first gathered row where (new_start, gathered row, length) pieces, in token order, follow each other
    in the buffer as one run; else None."""
    for (start, row, length), (next_start, next_row, _) in zip(pieces, pieces[1:]):
        if next_row - row != length or next_start - start != length:
            return None
    return pieces[0][1] if pieces else None


def _request_attention(chunk, runs, layout: KVLayout, pcp_rank: int, num_rows: int) -> RequestAttention:
    num_new = len(chunk.token_ids)
    # A single new token is not split: every PCP rank holds it, its owner stores it first, and it then
    # attends to the cached context including itself (docs/context_parallel.md, "Decode").
    context_len = chunk.start_pos + (1 if num_new == 1 else 0)
    block_table = torch.tensor(chunk.block_table, dtype=torch.long)
    new_kv_rows, new_kv_first = None, None
    if num_new > 1:
        new_kv_rows = torch.empty(num_new, dtype=torch.long)
        pieces = []
        for p, rank_runs in enumerate(runs):
            for row, new_start, length in rank_runs:
                new_kv_rows[new_start : new_start + length] = torch.arange(length) + p * num_rows + row
                pieces.append((new_start, p * num_rows + row, length))
        new_kv_first = _one_run(sorted(pieces))
    return RequestAttention(
        num_new=num_new,
        start_pos=chunk.start_pos,
        context_len=context_len,
        local_chunks=tuple(LocalChunk(row=r, new_start=s, length=n) for r, s, n in runs[pcp_rank]),
        new_kv_rows=new_kv_rows,
        new_kv_first=new_kv_first,
        context_slots=local_context_slots(context_len, block_table, layout),
        pcp_rows=tuple((rr[0][0], rr[-1][0] + rr[-1][2]) if rr else (0, 0) for rr in runs),
        source_rank_rows=tuple(tuple(rr) for rr in runs),
        state_slot=chunk.state_slot,
        num_draft_tokens=chunk.num_draft_tokens,
    )


def _token_homes(runs) -> dict[int, tuple[int, int]]:
    """New-token index -> (pcp rank, row) holding it; the lowest rank when several hold it (a single token)."""
    homes: dict[int, tuple[int, int]] = {}
    for p, rank_runs in enumerate(runs):
        for row, new_start, length in rank_runs:
            for i in range(length):
                homes.setdefault(new_start + i, (p, row + i))
    return homes


def _plan_writes(chunk, homes, layout: KVLayout, num_rows: int, write_rows: list, write_slots: list, runs,
                 local_rank: int | None) -> None:
    """This rank stores exactly the new tokens it owns, reading them from the gathered buffer, or, with
    `local_rank` (a step without prompt chunks), from its own rows; a token it does not hold is then skipped
    (under the replicated layout the rank that computed it sends it after the step: replica_sync.py)."""
    local = None
    if local_rank is not None:
        local = {start + i: row + i for row, start, length in runs[local_rank] for i in range(length)}
    for pos in layout.owned_positions(chunk.start_pos, chunk.end_pos):
        if local is None:
            p, row = homes[pos - chunk.start_pos]
            write_rows.append(p * num_rows + row)
        elif pos - chunk.start_pos in local:
            write_rows.append(local[pos - chunk.start_pos])
        else:
            continue
        write_slots.append(layout.slot(pos, chunk.block_table))


def _decode_batch(requests: list[RequestAttention], chunks) -> DecodeBatch | None:
    members = [i for i, r in enumerate(requests) if r.num_new == 1 and r.local_chunks]  # the ones held here
    if not members:
        return None
    lengths = [requests[i].context_slots.numel() for i in members]
    width = max(max(lengths), 1)
    slots = torch.zeros(len(members), width, dtype=torch.long)
    for b, i in enumerate(members):
        slots[b, : lengths[b]] = requests[i].context_slots
    key_mask = None
    if min(lengths) < width:
        valid = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)  # [B, width]
        key_mask = torch.zeros(len(members), 1, 1, width).masked_fill(~valid[:, None, None, :], float("-inf"))
    # A shared prefix starts at position 0: requests sharing keys share their first block (plain ints, no tensor)
    first_blocks = {chunks[i].block_table[0] for i in members}
    shared = SharedPrefix() if len(first_blocks) < len(members) else None
    batch = DecodeBatch(requests=tuple(members), slots=slots, key_mask=key_mask, rows=_rows(requests, members),
                        max_local_context=max(lengths), window=consecutive_window(slots) if lengths[0] else None,
                        lengths=torch.tensor(lengths, dtype=torch.long), shared_prefix=shared, views=StepViews())
    if shared is not None:
        shared.batch = batch
    return batch


class SharedPrefix:
    """Marks a decode batch whose requests share keys, and holds the host-side batch (this rank's CPU slots of each
    request, never moved to a device) its shared-key view is built from (the GQA kind's `shared_key_view`,
    cpllm/layers/gqa/shared_keys.py). Not a dataclass: the step's moves (`to_device`) pass it along as is."""

    __slots__ = ("batch",)

    def __init__(self):
        self.batch: DecodeBatch | None = None
        """The host-side batch (set once it is built)."""


def consecutive_window(slots: torch.Tensor) -> tuple[int, int] | None:
    """(first, count) when slots [1, count] are first, first + 1, ... (blocks allocated one after another)."""
    if slots.shape[0] != 1 or slots.shape[1] == 0:
        return None
    first, count = int(slots[0, 0]), slots.shape[1]
    if int(slots[0, -1]) - first != count - 1 or not bool((slots[0, 1:] - slots[0, :-1] == 1).all()):
        return None
    return first, count


def _rows(requests: list[RequestAttention], members: list[int]) -> torch.Tensor:
    return torch.tensor([[requests[i].pcp_rows[p][0] for i in members] for p in range(len(requests[0].pcp_rows))],
                        dtype=torch.long)


class StepViews:
    """Per-step views of a decode batch that a layer kind builds on first use and keeps for every later layer of the
    step (a window's in-window batch, keyed by the kind as it likes). Not a dataclass: `to_device` passes it along
    as is, so the CPU batch and its device copy share one cache."""

    __slots__ = ("views",)

    def __init__(self):
        self.views: dict = {}
