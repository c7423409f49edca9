"""Continuous batching with chunked prefill, prefix caching and preemption (torch-free).

The scheduler owns every request's state; what it sends to the ranks is a
`SchedulerOutput`: plain data, identical on every rank of a replica.

A model's layers fall into KV groups (cpllm/kv_groups.py): full attention, and one group per sliding window. Each
group has its own block pool and, per request, its own block table, all indexed by the same virtual block. A
windowed group gives back the blocks that slid out of the window of the request's next query (their entries become
FREED_BLOCK), so a request holds there at most its window plus one block between steps and in decode steps, plus
the step's new tokens in a prompt chunk (kv_groups.window_blocks).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

from cpllm.config.engine import SchedulerConfig
from cpllm.disagg.params import PullOp
from cpllm.engine.kv_blocks import BlockPool, extend_hashes
from cpllm.engine.request import Request, RequestStatus
from cpllm.engine.state_snapshots import StateSnapshots
from cpllm.kv_groups import FREED_BLOCK, KVGroupSpec, first_key, first_kept_block, max_chunk
from cpllm.step import ScheduledChunk, SchedulerOutput

FULL_ATTENTION = (KVGroupSpec(window=None, layers=()),)
"""The groups of a scheduler built without any: one full-attention group."""


class Scheduler:
    """Decides, step by step, which tokens of which requests are computed."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool | Sequence[BlockPool], tokens_per_block: int,
                 groups: tuple[KVGroupSpec, ...] | None = None, state_slots: int = 0, state_snapshots: int = 0,
                 held_state_slots: int = 0):
        """`pool`: the block pool, or one per KV group in `groups` order (None: one full-attention group).
        `state_slots`: slots of the per-request state pools (layers that keep a state per request, not rows per
        position; 0: the model has none): a request takes one at admission and gives it back when it finishes or
        is preempted (it is then recomputed from position 0, whose chunk starts from a zero state).
        `state_snapshots`: snapshot slots after the live ones (prefix caching with state layers:
        cpllm/engine/state_snapshots.py); without them a model with states gets no prefix hit.
        `held_state_slots`: slots after the snapshots where a disaggregated producer keeps a prefilled prompt's
        states after all but its last token (the point a consumer resumes from) until the consumer pulls them."""
        self.config = config
        self.pools: tuple[BlockPool, ...] = (pool,) if isinstance(pool, BlockPool) else tuple(pool)
        self.groups = groups if groups is not None else FULL_ATTENTION
        if len(self.groups) != len(self.pools):
            raise ValueError(f"{len(self.groups)} KV groups but {len(self.pools)} block pools")
        self.pool = self.pools[0]
        """Group 0's pool (the full-attention layers when the model has any)."""
        self.tokens_per_block = tokens_per_block  # virtual block: block_size * cp_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._step_id = 0
        self.num_preemptions = 0
        """Running requests sent back to the queue to free blocks, since start."""
        self.num_prefix_hit_tokens = 0
        """Tokens of admitted requests found in the prefix cache (not computed), since start."""
        self.num_prefix_query_tokens = 0
        """Tokens of admitted requests looked up in the prefix cache, since start (vLLM's prefix-cache queries)."""
        self.free_state_slots: list[int] = list(range(state_slots - 1, -1, -1))
        """State slots no request holds (the lowest taken first)."""
        self.state_slot_of: dict[str, int] = {}
        """Request id -> its state slot, while it runs."""
        self.uses_state = state_slots > 0
        self.snapshots = StateSnapshots(state_slots, state_snapshots) if state_snapshots else None
        """The states kept at block boundaries for prefix hits (None: no prefix hit for a model with states)."""
        self._restore: dict[str, int] = {}
        """Request id -> the snapshot slot its next chunk starts from (a prefix hit found at admission)."""
        self._branch: dict[str, int] = {}
        """Request id -> the position where its cached K/V blocks go on past the last snapshot: a chunk ends there
        and keeps the states, so the next request sharing that prefix resumes from it."""
        self.peak_request_blocks = [0] * len(self.groups)
        """Most blocks one request held at once in each group's pool, since start (counted when a step's blocks
        are reserved, so a prompt chunk's new tokens are included)."""
        self.held: dict[str, list[list[int]]] = {}
        """Finished prefill-only requests (Request.kv_hold) -> the block tables a decode instance pulls, until
        `release_held` (cpllm/disagg)."""
        self._pulls: list[PullOp] = []
        first_held = state_slots + state_snapshots
        self.free_held_slots: list[int] = list(range(first_held + held_state_slots - 1, first_held - 1, -1))
        """Held state slots no request uses (a producer's; the lowest taken first)."""
        self._held_slot_of: dict[str, int] = {}
        """A running producer request (kv_hold, states, a prompt of > 1 token) -> the held slot its states at
        num_prompt_tokens - 1 are saved into."""
        self._unfilled: dict[str, dict[int, int]] = {}
        """A pulled request -> group -> the one block of a windowed group whose positions before the window were
        not pulled: never registered for prefix hits (a later request could read those positions)."""
        self.held_states: dict[str, int] = {}
        """A held request (`held`) -> the held slot of its states, until `release_held`."""

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if not request.block_tables:
            request.block_tables = [[] for _ in self.groups]
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stopped, length, aborted) and release its blocks."""
        request.status = status
        self.requests.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        held_slot = self._held_slot_of.pop(request.request_id, None)
        if request.kv_hold and status is not RequestStatus.FINISHED_ABORTED and request.block_ids:
            self.held[request.request_id] = request.block_tables
            request.block_tables = [[] for _ in self.groups]
            if held_slot is not None:
                self.held_states[request.request_id], held_slot = held_slot, None
        if held_slot is not None:
            self.free_held_slots.append(held_slot)
        self._free_tables(request)

    def release_held(self, request_id: str) -> None:
        """Free a held request's blocks (its consumer pulled them, or nobody did in time)."""
        for pool, table in zip(self.pools, self.held.pop(request_id, [])):
            pool.free(table)
        if request_id in self.held_states:
            self.free_held_slots.append(self.held_states.pop(request_id))

    def request_blocks(self, request_id: str) -> tuple[int, ...]:
        """Blocks the request holds now in each group's pool (freed entries not counted)."""
        request = self.requests[request_id]
        return tuple(len(table) - _num_freed(table) for table in request.block_tables)

    def schedule(self) -> SchedulerOutput:
        chunks: list[ScheduledChunk] = []
        preempted: set[str] = set()
        budget = self._schedule_running(chunks, preempted)
        self._admit_waiting(chunks, budget, preempted)
        self._step_id += 1
        pulls, self._pulls = tuple(self._pulls), []
        return SchedulerOutput(step_id=self._step_id, chunks=tuple(chunks), kv_pulls=pulls)

    def _schedule_running(self, chunks: list[ScheduledChunk], preempted: set[str]) -> int:
        """Continue running requests first; returns the token budget left for waiting ones."""
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        for request in list(self.running):
            if budget == 0 or request not in self.running:
                continue
            cap = self._chunk_cap(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget, cap)
            drafts = self._drafts(request, num_new, min(budget, cap))
            if not self._reserve(request, num_new + len(drafts), scheduled, preempted):
                continue
            chunks.append(self._chunk(request, num_new, drafts))
            scheduled.add(request.request_id)
            budget -= num_new + len(drafts)
        return budget

    def _admit_waiting(self, chunks: list[ScheduledChunk], budget: int, preempted: set[str]) -> None:
        """Start waiting requests in order while the budget, max_num_seqs and free blocks allow."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.request_id in preempted:
                # Its blocks were just taken for a running request: re-admitting it in
                # the same step would take them back. It waits, first in line.
                break
            if self.uses_state and not self.free_state_slots:
                break  # every state slot is held (max_num_seqs bounds it first when slots = max_num_seqs)
            if self._needs_held_slot(request) and not self.free_held_slots:
                break  # prefilled prompts wait for their consumers in every held slot
            num_hit_tokens = self._use_prefix_cache(request)  # a pulled prompt pulls what comes after its hit
            pulled = self._use_remote_prefill(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget, self._chunk_cap(request))
            if not self._allocate(request, self._blocks_needed(request, num_new)):
                self._release(request)  # the prefix hits too: they are looked up again next step
                break
            self.waiting.popleft()
            if self.uses_state:
                self.state_slot_of[request.request_id] = self.free_state_slots.pop()
            if self._needs_held_slot(request):
                self._held_slot_of[request.request_id] = self.free_held_slots.pop()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(self._chunk(request, num_new))
            if pulled is not None:
                self._pulls.append(PullOp(remote=request.kv_pull, request_id=request.request_id,
                                          num_tokens=pulled, block_tables=tuple(map(tuple, request.block_tables)),
                                          first_token=num_hit_tokens,
                                          state_slot=self.state_slot_of.get(request.request_id, -1)))
                request.kv_pull = None
            self.num_prefix_hit_tokens += num_hit_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit_tokens
            if self.pool.enable_prefix_caching and not request.wants_prompt_logprobs:
                self.num_prefix_query_tokens += request.num_tokens
            budget -= num_new

    def on_step_done(self, output: SchedulerOutput) -> None:
        """Advance progress after the ranks computed a step; register newly full blocks, then give back the
        blocks that left the windows of the next query."""
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None:
                continue
            # a verify chunk's drafts count once accepted (accept_drafts); their K/V past that are never read
            request.num_computed_tokens = chunk.end_pos - chunk.num_draft_tokens
            self._register_full_blocks(request)
            self._slide(request)
            if chunk.state_save >= 0 and chunk.state_save != self._held_slot_of.get(request.request_id):
                # the ranks wrote the snapshot after the forward: it can be found now (a held slot is no snapshot)
                last_block = chunk.end_pos // self.tokens_per_block - 1
                self.snapshots.register(chunk.state_save, request.block_hashes[last_block])
            if chunk.state_restore >= 0:
                self.snapshots.num_restored += 1

    def accept_drafts(self, request_id: str, num_accepted: int) -> None:
        """During a verify chunk: `num_accepted` more of its drafts became output tokens, so their K/V (computed in
        the step) count; the blocks they fill are registered, as a decode step would have registered them."""
        request = self.requests.get(request_id)
        if request is None:  # finished during verification: its blocks are already back
            return
        if self.uses_state:  # the states absorbed no draft: the next chunk computes the accepted ones again
            return
        request.num_computed_tokens += num_accepted
        self._register_full_blocks(request)

    def drop_rejected(self, request_id: str) -> None:
        """After a verify chunk: give back the blocks past the computed tokens, which only rejected drafts wrote.
        The request then holds what it would hold without speculation, and no prefix hash names a rejected
        token's K/V (slots past the computed tokens in a kept block are written again before any query reads
        them: queries read positions below their own)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        keep = -(-request.num_computed_tokens // self.tokens_per_block)
        for pool, table in zip(self.pools, request.block_tables):
            pool.free(table[keep:])
            del table[keep:]
        self._slide(request)

    def _drafts(self, request: Request, num_new: int, room: int) -> tuple[int, ...]:
        """The request's drafts that fit its step (speculative decoding): only in a decode step (its one known
        token left to compute), within the step's budget and chunk cap (`room` rows in all). With state layers a
        verify chunk's states go only through its known tokens (a state cannot be rolled back past a rejected
        draft), so the drafts accepted last step are computed again before the new drafts: every known token
        after the prompt, then the drafts (docs/context_parallel.md, "Speculative decoding on hybrids")."""
        if not request.draft_token_ids or num_new != request.num_tokens - request.num_computed_tokens:
            return ()
        if num_new != 1 and not (self.uses_state and request.num_computed_tokens >= request.num_prompt_tokens):
            return ()
        return tuple(request.draft_token_ids[: max(0, room - num_new)])

    def _chunk(self, request: Request, num_new: int, drafts: tuple[int, ...] = ()) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new
        tables = tuple(tuple(table) for table in request.block_tables)
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids[start:end]) + drafts,
            num_draft_tokens=len(drafts),
            start_pos=start,
            block_table=tables[0],
            sample=end == request.num_tokens,
            prompt_logits=request.wants_prompt_logprobs and start < request.num_prompt_tokens,
            block_tables=tables if len(tables) > 1 else (),
            state_slot=self.state_slot_of.get(request.request_id, -1),
            state_restore=self._restore.pop(request.request_id, -1),
            state_save=self._save_slot(request, end),
        )

    def _chunk_cap(self, request: Request) -> int:
        """Most new tokens the request can compute in one step with every group's whole pool: a windowed group
        holds the window of the chunk's first query plus the chunk (at least 1: the engine checks at start
        that every pool holds one request's window and the full groups its max_model_len)."""
        start, v = request.num_computed_tokens, self.tokens_per_block
        cap = min(max_chunk(g.window, start, pool.num_blocks, v) for g, pool in zip(self.groups, self.pools))
        point = self._snapshot_point(request)
        if point is not None:  # the chunk ends where the states are kept
            cap = min(cap, point - start)
        held_point = request.num_prompt_tokens - 1
        if self._keeps_states(request) and start < held_point:  # a producer keeps the states there
            cap = min(cap, held_point - start)
        return max(cap, 1)

    def _keeps_states(self, request: Request) -> bool:
        """A producer's request whose states a consumer resumes from, after all but the last prompt token (a
        one-token prompt resumes from a zero state)."""
        return self.uses_state and request.kv_hold and request.num_prompt_tokens > 1

    def _needs_held_slot(self, request: Request) -> bool:
        """One that holds no held slot yet (a preempted one keeps its)."""
        return self._keeps_states(request) and request.request_id not in self._held_slot_of

    def _save_slot(self, request: Request, end: int) -> int:
        """The slot a chunk ending at `end` saves its states into: a producer's held slot where the chunk ends just
        before the prompt's last token, else a prefix snapshot's (-1: none)."""
        held = self._held_slot_of.get(request.request_id)
        if held is not None and end == request.num_prompt_tokens - 1:
            return held
        return self._snapshot_slot(request, end)

    def _snapshot_point(self, request: Request) -> int | None:
        """The next block boundary of the request's prompt whose states are kept (None: none left): where its
        cached blocks outrun the snapshots (`_branch`), then the prompt's last boundary before its last token (the
        longest hit a later request of the same prompt can take); one that a snapshot already holds is skipped."""
        if self.snapshots is None:
            return None
        v, start = self.tokens_per_block, request.num_computed_tokens
        last = (request.num_prompt_tokens - 1) // v * v
        for point in sorted({self._branch.get(request.request_id, 0), last}):
            if point <= start:
                continue
            extend_hashes(request.block_hashes, request.all_token_ids, v, point // v)
            if not self.snapshots.holds(request.block_hashes[point // v - 1]):
                return point
        return None

    def _snapshot_slot(self, request: Request, end: int) -> int:
        """The snapshot slot a chunk ending at `end` saves its states into (-1: it ends at no snapshot point)."""
        point = self._snapshot_point(request)
        if point is None or end != point:
            return -1
        if self._branch.get(request.request_id, 0) <= end:
            self._branch.pop(request.request_id, None)
        return self.snapshots.take()

    def _blocks_needed(self, request: Request, num_new: int) -> tuple[int, ...]:
        """New blocks for the step in each group: the tables share their indices, so each grows to the step's last
        virtual block (the same count in every group, but after a remote prefill, whose windowed tables start with
        freed entries)."""
        total = -(-(request.num_computed_tokens + num_new) // self.tokens_per_block)
        return tuple(max(0, total - len(table)) for table in request.block_tables)

    def _allocate(self, request: Request, counts: tuple[int, ...]) -> bool:
        """`counts[g]` fresh blocks in each group's pool, or none at all (False) when one of them is short."""
        taken: list[list[int]] = []
        for pool, count in zip(self.pools, counts):
            ids = pool.allocate(count)
            if ids is None:
                for got_pool, got in zip(self.pools, taken):
                    got_pool.free(got)
                return False
            taken.append(ids)
        for table, ids in zip(request.block_tables, taken):
            table += ids
        for g, table in enumerate(request.block_tables):
            self.peak_request_blocks[g] = max(self.peak_request_blocks[g], len(table) - _num_freed(table))
        return True

    def _reserve(self, request: Request, num_new: int, scheduled: set[str], preempted: set[str]) -> bool:
        """Allocate blocks for a running request, preempting the newest unscheduled ones (added to
        `preempted`); False if the request itself was preempted."""
        self._slide(request)
        needed = self._blocks_needed(request, num_new)
        while True:
            if self._allocate(request, needed):
                return True
            victim = next((r for r in reversed(self.running) if r.request_id not in scheduled), None)
            if victim is None:
                return False
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return False

    def _preempt(self, request: Request) -> None:
        """Recompute later: drop the KV blocks and put the request first in line."""
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _free_tables(self, request: Request) -> None:
        for pool, table in zip(self.pools, request.block_tables):
            pool.free(table)
        request.block_tables = [[] for _ in self.groups]
        slot = self.state_slot_of.pop(request.request_id, None)
        if slot is not None:
            self.free_state_slots.append(slot)
        self._restore.pop(request.request_id, None)
        self._branch.pop(request.request_id, None)
        self._unfilled.pop(request.request_id, None)

    def _release(self, request: Request) -> None:
        self._free_tables(request)
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0

    def _slide(self, request: Request) -> None:
        """Give back each windowed group's blocks that lie wholly before the window of the next query (at
        position num_computed_tokens): the same block ids on every rank, each of which frees there its own share
        of the block's positions (docs/context_parallel.md, "Windowed KV groups"). A producer's request (kv_hold)
        keeps the window of the query before: its consumer computes the last prompt token again."""
        query = request.num_computed_tokens - (1 if request.kv_hold else 0)
        for group, pool, table in zip(self.groups, self.pools, request.block_tables):
            if group.window is None:
                continue
            first = min(first_kept_block(group.window, max(query, 0), self.tokens_per_block), len(table))
            dead = []
            for i in range(first - 1, -1, -1):  # freed entries are a prefix: stop at the first one
                if table[i] == FREED_BLOCK:
                    break
                dead.append(table[i])
                table[i] = FREED_BLOCK
            pool.free(dead)  # in ascending order: the latest block is evicted last

    def _use_remote_prefill(self, request: Request) -> int:
        """A request whose prompt a prefill instance computed starts after all of it but its last token, which
        this step computes (so the first token is sampled here); the ranks pull those positions' K/V, past the
        request's own prefix-cache hit, before the step's forward. Returns the end of the positions pulled (a
        one-token prompt: 0, the pull then only releases the producer's blocks), None for a request computed
        here."""
        if request.kv_pull is None:
            return None
        hit, query = request.num_computed_tokens, request.num_prompt_tokens - 1
        request.num_computed_tokens = query
        self._restore.pop(request.request_id, None)  # the pulled states cover the prompt: no snapshot to restore
        self._branch.pop(request.request_id, None)
        self._slide(request)  # a windowed group's hit blocks that lie before the window of the step's query
        v = self.tokens_per_block
        for g, (group, table) in enumerate(zip(self.groups, request.block_tables)):
            table += [FREED_BLOCK] * max(0, first_kept_block(group.window, query, v) - len(table))  # never held
            pulled_from = first_key(group.window, query)  # a windowed group pulls only the window (rank_transfer)
            if pulled_from > hit and pulled_from % v:  # its first block misses the positions before the window
                self._unfilled.setdefault(request.request_id, {})[g] = pulled_from // v
        return query

    def _use_prefix_cache(self, request: Request) -> int:
        """Start a fresh request after its longest cached prefix of full blocks; returns the tokens skipped."""
        if request.num_computed_tokens or request.block_ids or request.wants_prompt_logprobs:
            return 0
        if not self.pool.enable_prefix_caching or (self.uses_state and self.snapshots is None):
            return 0
        v = self.tokens_per_block
        num_full = request.num_tokens // v
        extend_hashes(request.block_hashes, request.all_token_ids, v, num_full)
        hashes = request.block_hashes[:num_full]
        hit = self._longest_hit(hashes, request.num_tokens)
        if self.snapshots is not None:
            hit = self._state_hit(request, hashes, hit)
        if hit == 0:
            return 0
        tables = []
        for group, pool in zip(self.groups, self.pools):
            first = first_kept_block(group.window, hit * v, v)
            ids = [pool.cached(h) for h in hashes[first:hit]]
            pool.acquire(ids)
            tables.append([FREED_BLOCK] * first + ids)
        request.block_tables = tables
        request.num_computed_tokens = hit * v
        request.num_registered_blocks = hit
        return request.num_computed_tokens

    def _state_hit(self, request: Request, hashes: list[bytes], hit: int) -> int:
        """The longest of the `hit` cached blocks after which a snapshot holds the states (the request starts from
        it: `_restore`); where the blocks go on past it, the request's first chunk ends there to keep the states."""
        kept = next((i for i in range(hit, 0, -1) if self.snapshots.holds(hashes[i - 1])), 0)
        if kept < hit:
            self._branch[request.request_id] = hit * self.tokens_per_block
        if kept:
            self._restore[request.request_id] = self.snapshots.find(hashes[kept - 1])
        return kept

    def _longest_hit(self, hashes: list[bytes], num_tokens: int) -> int:
        """Most leading blocks a request can skip: every full group holds all of them, every windowed group the
        ones in the window of the first position after them (blocks before it may be gone), and at least one
        token is left to compute, so there is a position to sample from."""
        hit = min(len(hashes), (num_tokens - 1) // self.tokens_per_block)
        for group, pool in zip(self.groups, self.pools):
            if group.window is None:
                run = next((i for i, h in enumerate(hashes[:hit]) if pool.cached(h) is None), hit)
                hit = min(hit, run)
        while hit > 0:
            missing = -1
            for group, pool in zip(self.groups, self.pools):
                if group.window is None:
                    continue
                first = first_kept_block(group.window, hit * self.tokens_per_block, self.tokens_per_block)
                gone = [i for i in range(first, hit) if pool.cached(hashes[i]) is None]
                if gone:
                    missing = max(missing, gone[-1])
            if missing < 0:
                return hit
            hit = missing  # any longer hit has `missing` inside its window too
        return 0

    def _register_full_blocks(self, request: Request) -> None:
        num_full = request.num_computed_tokens // self.tokens_per_block
        if num_full <= request.num_registered_blocks:
            return
        extend_hashes(request.block_hashes, request.all_token_ids, self.tokens_per_block, num_full)
        unfilled = self._unfilled.get(request.request_id, {})
        for g, (pool, table) in enumerate(zip(self.pools, request.block_tables)):
            for i in range(request.num_registered_blocks, num_full):
                if table[i] != FREED_BLOCK and unfilled.get(g) != i:
                    pool.register(table[i], request.block_hashes[i])
        request.num_registered_blocks = num_full


def _num_freed(table: list[int]) -> int:
    """Leading FREED_BLOCK entries of a block table (they form a prefix)."""
    return bisect.bisect_left(range(len(table)), True, key=lambda i: table[i] != FREED_BLOCK)
