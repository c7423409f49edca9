"""Continuous batching with chunked prefill, prefix caching and preemption (torch-free).

The scheduler owns every request's state; what it sends to the ranks is a
`SchedulerOutput`: plain data, identical on every rank of a replica.
"""

from __future__ import annotations

from collections import deque

from cpllm.config import SchedulerConfig
from cpllm.engine.kv_blocks import BlockPool, extend_hashes
from cpllm.engine.request import Request, RequestStatus
from cpllm.step import ScheduledChunk, SchedulerOutput


class Scheduler:
    """Decides, step by step, which tokens of which requests are computed."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, tokens_per_block: int):
        self.config = config
        self.pool = pool
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

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
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
        self.pool.free(request.block_ids)
        request.block_ids = []

    def schedule(self) -> SchedulerOutput:
        chunks: list[ScheduledChunk] = []
        preempted: set[str] = set()
        budget = self._schedule_running(chunks, preempted)
        self._admit_waiting(chunks, budget, preempted)
        self._step_id += 1
        return SchedulerOutput(step_id=self._step_id, chunks=tuple(chunks))

    def _schedule_running(self, chunks: list[ScheduledChunk], preempted: set[str]) -> int:
        """Continue running requests first; returns the token budget left for waiting ones."""
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        for request in list(self.running):
            if budget == 0 or request not in self.running:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, num_new, scheduled, preempted):
                continue
            chunks.append(self._chunk(request, num_new))
            scheduled.add(request.request_id)
            budget -= num_new
        return budget

    def _admit_waiting(self, chunks: list[ScheduledChunk], budget: int, preempted: set[str]) -> None:
        """Start waiting requests in order while the budget, max_num_seqs and free blocks allow."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.request_id in preempted:
                # Its blocks were just taken for a running request: re-admitting it in
                # the same step would take them back. It waits, first in line.
                break
            num_hit_tokens = self._use_prefix_cache(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            blocks = self.pool.allocate(self._blocks_needed(request, num_new))
            if blocks is None:
                self._release(request)  # the prefix hits too: they are looked up again next step
                break
            request.block_ids += blocks
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(self._chunk(request, num_new))
            self.num_prefix_hit_tokens += num_hit_tokens
            if self.pool.enable_prefix_caching and not request.wants_prompt_logprobs:
                self.num_prefix_query_tokens += request.num_tokens
            budget -= num_new

    def on_step_done(self, output: SchedulerOutput) -> None:
        """Advance progress after the ranks computed a step; register newly full blocks."""
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None:
                continue
            request.num_computed_tokens = chunk.end_pos
            self._register_full_blocks(request)

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids[start:end]),
            start_pos=start,
            block_table=tuple(request.block_ids),
            sample=end == request.num_tokens,
            prompt_logits=request.wants_prompt_logprobs and start < request.num_prompt_tokens,
        )

    def _blocks_needed(self, request: Request, num_new: int) -> int:
        total = -(-(request.num_computed_tokens + num_new) // self.tokens_per_block)
        return max(0, total - len(request.block_ids))

    def _reserve(self, request: Request, num_new: int, scheduled: set[str], preempted: set[str]) -> bool:
        """Allocate blocks for a running request, preempting the newest unscheduled ones (added to
        `preempted`); False if the request itself was preempted."""
        needed = self._blocks_needed(request, num_new)
        while True:
            blocks = self.pool.allocate(needed)
            if blocks is not None:
                request.block_ids += blocks
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

    def _release(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0

    def _use_prefix_cache(self, request: Request) -> int:
        """Start a fresh request after its longest cached prefix of full blocks; returns the tokens skipped."""
        if request.num_computed_tokens or request.block_ids or request.wants_prompt_logprobs:
            return 0
        num_full = request.num_tokens // self.tokens_per_block
        extend_hashes(request.block_hashes, request.all_token_ids, self.tokens_per_block, num_full)
        hits = self.pool.lookup_prefix(request.block_hashes[:num_full])
        if hits and len(hits) * self.tokens_per_block == request.num_tokens:
            # At least one token must be computed to produce logits for sampling.
            self.pool.free(hits[-1:])
            hits = hits[:-1]
        request.block_ids = hits
        request.num_computed_tokens = len(hits) * self.tokens_per_block
        request.num_registered_blocks = len(hits)
        return request.num_computed_tokens

    def _register_full_blocks(self, request: Request) -> None:
        num_full = request.num_computed_tokens // self.tokens_per_block
        if num_full <= request.num_registered_blocks:
            return
        extend_hashes(request.block_hashes, request.all_token_ids, self.tokens_per_block, num_full)
        for i in range(request.num_registered_blocks, num_full):
            self.pool.register(request.block_ids[i], request.block_hashes[i])
        request.num_registered_blocks = num_full
