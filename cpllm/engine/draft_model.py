"""Drafting with a draft model (speculative decoding): a small model of the target's vocabulary guesses each
request's next k tokens, on the replica's driver rank.

The draft runs as a second model runner (cpllm/worker/draft_runner.py) with a layout of its own (one rank) and a KV
pool of its own, whose blocks this module hands out from its own free list: per request a block table and the
number of positions whose draft K/V are valid. Drafting for a batch of requests is a few steps on that runner:
one catch-up chunk per request over the tokens its draft cache lacks (the whole prompt the first time, afterwards
the tokens the last verify step emitted), whose last row gives draft 1, then k - 1 single-token steps for all the
requests together, each feeding the draft just drawn. The K/V of drafts the verify step rejects are not removed:
the next drafting sets the request's valid length back to the tokens its draft cache shares with the request's
tokens, and the catch-up chunk writes over them.

q: a greedy request's draft is the draft model's argmax (q is a point mass; the verify step takes the target's
argmax anyway). A sampled request draws each draft from the draft model's distribution at the request's
temperature, top-k, top-p and min-p, with a generator of its own seeded from the request's (so seeded runs
repeat), and keeps those rows: rejection sampling accepts with min(1, p/q) and draws a rejected row from
max(p - q, 0) normalised, so the tokens keep the target's distribution whatever q is.

A request the draft pool cannot hold gets no drafts that step (it decodes one token as without speculation); its
blocks go back when it finishes or is preempted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cpllm.config.engine import CacheConfig, EngineConfig, ParallelConfig
from cpllm.engine.kv_blocks import BlockPool
from cpllm.engine.request import Request, RequestStatus
from cpllm.engine.sampler import make_generator, restricted_probs
from cpllm.layers.registry import state_layer_indices
from cpllm.model.loaders.loader import open_weights
from cpllm.step import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:  # the engine is handed its executor (cpllm/engine/engine.py)
    from cpllm.worker.executor import Executor

DRAFT_SEED_SALT = 0x9E37_79B9_7F4A_7C15
"""Mixed into a request's seed for its draft generator, so the drafts' stream is not the verify step's."""


def draft_engine_config(target: EngineConfig) -> EngineConfig:
    """The draft model's config: the target's block size, max_model_len, batching limits and dtypes, one rank,
    eager (no compiled step, no CUDA graphs), no prefix cache; its KV bytes are set by its runner."""
    path = target.speculative_config.model
    model = open_weights(path).config
    if state_layer_indices(model):  # its chunks carry no state slot: its runner would read another request's
        raise ValueError(f"speculative_config model={path!r} keeps a state per request ({model.architecture}): a "
                         "draft model with state layers is not built; draft with a model of K/V layers only")
    return EngineConfig(
        model_path=path, model=model, dtype=target.dtype, seed=target.seed,
        parallel=ParallelConfig(distributed_timeout_s=target.parallel.distributed_timeout_s),
        cache=CacheConfig(block_size=target.cache.block_size, enable_prefix_caching=False,
                          kv_cache_dtype=target.cache.kv_cache_dtype),
        scheduler=target.scheduler, compile_decode=False, enforce_eager=True)


@dataclass(eq=False)
class _DraftState:
    """One request's place in the draft cache."""

    request: Request
    generator: torch.Generator | None
    """Draws a sampled request's drafts; None for greedy requests."""
    blocks: list[int] = field(default_factory=list)
    """Draft pool blocks covering positions [0, len(blocks) * block_size)."""
    computed: int = 0
    """Positions [0, computed) hold valid draft K/V: of the request's tokens below `tail_start`, then `tail`."""
    tail_start: int = 0
    tail: list[int] = field(default_factory=list)
    """Drafts fed back at positions tail_start.. in the last drafting (they may since have been rejected)."""
    drafts: list[int] = field(default_factory=list)
    """The drafts proposed last, and for a sampled request the q row each was drawn from (None: a point mass)."""
    probs: list[torch.Tensor | None] = field(default_factory=list)


class DraftModel:
    """Proposes drafts for a batch of requests with the draft model; one per engine."""

    def __init__(self, target: EngineConfig, executor: Executor, capacity_tokens: int):
        """`capacity_tokens`: what the target's KV pool holds; the draft pool holds as many."""
        self.k = target.speculative_config.num_speculative_tokens
        self.draft_length = target.speculative_config.draft_length
        self.config = draft_engine_config(target)
        self.draft_executor = executor.draft_runner(self.config, capacity_tokens)
        """The draft's own one-rank executor (cpllm/worker/draft_runner.py): steps in, logits and plain data out."""
        kv = self.draft_executor.info.kv
        self.block_size = kv.block_size
        self.pool = BlockPool(min(kv.group_blocks or (kv.num_blocks,)), enable_prefix_caching=False)
        """The draft pool's block ids (every KV group of the draft uses the same table)."""
        self.kv_bytes = kv.bytes
        self.budget = target.scheduler.max_num_batched_tokens
        """Most catch-up tokens in one draft step."""
        self.num_pool_short = 0
        """Times (requests x steps) a request got no drafts because the draft pool could not hold them."""
        self._states: dict[str, _DraftState] = {}
        self._step_id = 0

    def describe(self) -> str:
        """What drafts and how, for the start-up log."""
        model, kv = self.config.model, self.draft_executor.info.kv
        return (f"draft model {self.config.model_path} ({model.architecture}, {model.num_hidden_layers} layers, "
                f"hidden {model.hidden_size}) on the replica's driver rank alone (TP = PCP = DCP = 1, "
                f"{self.draft_executor.device.type}), its own KV pool of {self.pool.num_blocks} blocks x "
                f"{self.block_size} tokens = {self.pool.num_blocks * self.block_size} tokens "
                f"({kv.bytes / 2**20:.1f} MiB, {kv.dtype}); up to {self.k} drafts per request and step "
                f"({self.draft_length}: one catch-up chunk, then up to {self.k - 1} single-token steps), verified "
                "in one step of k + 1 rows: greedy requests take the draft's argmax, sampled ones "
                "draw from it at their temperature and are verified by rejection sampling against its distribution")

    # ---- requests -------------------------------------------------------------------------------------

    def release(self, request_id: str) -> None:
        """Give back a request's draft blocks (finished, aborted or preempted)."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self.pool.free(state.blocks)

    def draft_probs(self, request_id: str) -> list[torch.Tensor | None] | None:
        """The q row of each draft proposed last for a sampled request (None: greedy, or no drafts)."""
        state = self._states.get(request_id)
        return state.probs if state is not None and state.probs else None

    def _sweep(self) -> None:
        """Requests no longer running (finished, or preempted: their target K/V are gone too) give back their
        draft blocks."""
        for request_id, state in list(self._states.items()):
            if state.request.status is not RequestStatus.RUNNING:
                self.release(request_id)

    def _state(self, request: Request, generator: torch.Generator | None) -> _DraftState:
        state = self._states.get(request.request_id)
        if state is None or state.request is not request:
            self.release(request.request_id)
            draws = None if generator is None else make_generator(generator.initial_seed() ^ DRAFT_SEED_SALT,
                                                                  generator.device)
            state = self._states[request.request_id] = _DraftState(request=request, generator=draws)
        return state

    # ---- drafting -------------------------------------------------------------------------------------

    def propose(self, items: list[tuple[Request, torch.Generator | None, int]]) -> None:
        """Set `draft_token_ids` of each (request, its generator, most drafts it may take) for its next step."""
        self._sweep()
        active: list[tuple[_DraftState, list[int], int]] = []  # (state, the request's tokens, drafts wanted)
        for request, generator, room in items:
            state = self._state(request, generator)
            state.drafts, state.probs = [], []
            request.draft_token_ids = []
            count = min(self.k, room)
            tokens = request.all_token_ids
            if count <= 0:
                continue
            if not self._reserve(state, len(tokens) + count - 1):
                self.num_pool_short += 1  # the draft pool is full: no drafts this step
                continue
            self._rewind(state, tokens)
            active.append((state, tokens, count))
        if not active:
            return
        rows = self._catch_up(active)  # [len(active), vocab]: each request's last known token
        live = list(range(len(active)))
        for j in range(max(count for _, _, count in active)):
            best = rows.argmax(dim=-1).tolist()  # one transfer for the step's greedy drafts
            for slot, i in enumerate(live):
                self._draw(active[i][0], rows[slot], best[slot])
            live = [i for i in live if active[i][2] > j + 1]
            if not live:
                break
            chunks = [self._chunk(active[i][0], [active[i][0].drafts[-1]], len(active[i][1]) + j, True)
                      for i in live]
            rows = self._run(chunks)
        for state, tokens, count in active:
            state.request.draft_token_ids = list(state.drafts)
            state.computed, state.tail_start, state.tail = len(tokens) + count - 1, len(tokens), state.drafts[:-1]

    def _reserve(self, state: _DraftState, positions: int) -> bool:
        """Blocks for positions [0, positions); False (nothing taken) when the pool is short."""
        missing = -(-positions // self.block_size) - len(state.blocks)
        if missing <= 0:
            return True
        ids = self.pool.allocate(missing)
        if ids is None:
            return False
        state.blocks += ids
        return True

    @staticmethod
    def _rewind(state: _DraftState, tokens: list[int]) -> None:
        """Valid draft K/V: the positions whose tokens are still the request's (the drafts fed back that the
        verify step accepted), at most all but the last token, whose row gives the first draft."""
        shared = state.tail_start
        for i, token in enumerate(state.tail):
            if state.tail_start + i >= len(tokens) or tokens[state.tail_start + i] != token:
                break
            shared += 1
        state.computed = min(state.computed, shared, len(tokens) - 1)

    def _catch_up(self, active) -> torch.Tensor:
        """Each request's tokens from its valid draft length to its end, at most `budget` tokens per draft step;
        returns the logits of each request's last token, in `active` order ([len(active), vocab])."""
        starts = [state.computed for state, _, _ in active]
        rows: list[torch.Tensor | None] = [None] * len(active)
        while any(start < len(tokens) for start, (_, tokens, _) in zip(starts, active)):
            budget, chunks, owners = self.budget, [], []
            for i, (state, tokens, _) in enumerate(active):
                take = min(len(tokens) - starts[i], budget)
                if take <= 0:
                    continue
                end = starts[i] + take
                chunks.append(self._chunk(state, tokens[starts[i] : end], starts[i], end == len(tokens)))
                if end == len(tokens):
                    owners.append(i)
                starts[i], budget = end, budget - take
            logits = self._run(chunks)
            for row, i in enumerate(owners):
                rows[i] = logits[row]
        return torch.stack(rows)

    def _chunk(self, state: _DraftState, token_ids: list[int], start: int, sample: bool) -> ScheduledChunk:
        return ScheduledChunk(request_id=state.request.request_id, token_ids=tuple(token_ids), start_pos=start,
                              block_table=tuple(state.blocks), sample=sample, prompt_logits=False)

    def _run(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """One draft step; logits of its sampled chunks, in order."""
        self._step_id += 1
        return self.draft_executor.execute(SchedulerOutput(step_id=self._step_id, chunks=tuple(chunks)))

    @staticmethod
    def _draw(state: _DraftState, logits: torch.Tensor, argmax: int) -> None:
        """The next draft from one row of draft logits ([vocab]; `argmax` its best token): the argmax for a greedy
        request, else a draw from the request's restricted distribution, whose row is kept as q."""
        params = state.request.sampling_params
        if state.generator is None:
            state.drafts.append(argmax)
            return
        logits = logits.float().to(state.generator.device)
        probs = restricted_probs(logits, params)
        if not torch.isfinite(probs).all() or not probs.sum() > 0:
            state.drafts.append(argmax)  # nothing to draw from: a point mass on the argmax
            state.probs.append(None)
            return
        state.drafts.append(int(torch.multinomial(probs, 1, generator=state.generator)))
        state.probs.append(probs)
