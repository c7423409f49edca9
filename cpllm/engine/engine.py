"""LLMEngine: the driver's loop of schedule -> run on every rank -> sample -> update."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import TYPE_CHECKING

import torch

from cpllm.config.engine import EngineConfig
from cpllm.config.deepseek import latent_cache_line
from cpllm.disagg.engine_transfer import IDLE_RELEASE_S, engine_transfer, request_marks
from cpllm.engine.detokenizer import IncrementalDetokenizer
from cpllm.engine.draft_model import DraftModel
from cpllm.engine.kv_blocks import BlockPool
from cpllm.engine.outputs import RequestOutput
from cpllm.engine.request import Request, RequestStatus
from cpllm.engine.sampler import Sampler, SamplingRow, make_generator, prompt_logprobs
from cpllm.engine.sampling_params import SamplingParams
from cpllm.engine.scheduler import Scheduler
from cpllm.engine.sequence import RequestState, Sequence, finish_status
from cpllm.engine.spec_decode import SpecDecodeTotals, SpeculativeDecoding
from cpllm.kv_groups import kv_groups, length_capacity, window_blocks
from cpllm.engine.state_snapshots import snapshot_line
from cpllm.layers.registry import state_layer_indices, state_layer_specs
from cpllm.state_slots import engine_state_slots
from cpllm.model.tokenization.tokenizer import Tokenizer
from cpllm.structured.manager import StructuredOutputManager
from cpllm.step import SchedulerOutput, output_positions

if TYPE_CHECKING:  # the engine is handed its executor; only cpllm.launch_ranks imports both sides
    from cpllm.worker.executor import Executor

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerTotals:
    """Counters one replica's scheduler keeps from start, read by the server's metrics after every step."""

    preemptions: int = 0
    """Running requests sent back to the queue (their KV dropped) to free blocks."""
    prefix_query_tokens: int = 0
    """Prompt tokens of admitted requests that were looked up in the prefix cache."""
    prefix_hit_tokens: int = 0
    """Of those, the tokens found cached (not computed again)."""
    peak_request_blocks: tuple[int, ...] = ()
    """Most blocks one request held at once in each KV group's pool (cpllm/kv_groups.py order); a sliding-window
    group's stays within its window plus one block plus a prompt chunk's tokens (kv_groups.window_blocks)."""
    spec_drafts: int = 0
    """Verify chunks run (speculative decoding: a request's drafts scored in one step)."""
    spec_draft_tokens: int = 0
    """Draft tokens scored."""
    spec_accepted_tokens: int = 0
    """Draft tokens accepted (each the token the request would have produced anyway)."""


class LLMEngine:
    """Owns the scheduler and the executor of one replica; `step()` advances every running request."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, executor: Executor):
        self.config, self.tokenizer = config, tokenizer
        self.executor = executor
        # A virtual block spans the ranks one request's KV is divided over (PCP x DCP, or DCP when replicated).
        self.tokens_per_block = config.cache.block_size * config.parallel.dims.kv_shard_size
        num_blocks = self.executor.num_blocks
        # The layers' KV groups (full attention, each sliding window), as the ranks built their pools.
        self.kv_groups = kv_groups(config.model, config.scheduler.max_model_len)
        group_blocks = self.executor.rank_info.kv.group_blocks or (num_blocks,)
        self._check_windows(group_blocks)
        # Only full-attention layers keep a request's every position: they alone bound its length.
        capacity = length_capacity(self.kv_groups, group_blocks, self.tokens_per_block)
        self.kv_capacity_tokens = capacity if capacity is not None else min(group_blocks) * self.tokens_per_block
        self._capacity_bounds_length = capacity is not None
        self.max_model_len = config.scheduler.max_model_len
        if capacity is not None:
            self.max_model_len = min(self.max_model_len, capacity)
        self._log_layout(num_blocks)
        if self.max_model_len < config.scheduler.max_model_len:
            logger.warning("max_model_len lowered from %d to %d: the KV cache of the CP group holds only %d tokens",
                           config.scheduler.max_model_len, self.max_model_len, self.kv_capacity_tokens)
        scheduler_config = dataclasses.replace(config.scheduler, max_model_len=self.max_model_len)
        self.pools = tuple(BlockPool(n, config.cache.enable_prefix_caching) for n in group_blocks)
        """One block pool per KV group (self.kv_groups order)."""
        self.pool = self.pools[0]
        # a state slot per running request where layers keep a state per request, and with prefix caching as many
        # snapshot slots (cpllm/state_slots.py: the ranks' pools hold both)
        state_slots, snapshots, held = engine_state_slots(config)
        self.scheduler = Scheduler(scheduler_config, self.pools, self.tokens_per_block, self.kv_groups, state_slots,
                                   snapshots, held)
        if snapshots:
            per_request = sum(spec.bytes_per_request for spec in
                              state_layer_specs(config.model, config.parallel.tensor_parallel_size).values())
            logger.info("%s", snapshot_line(snapshots, per_request))
        self.sampler = Sampler()
        spec = config.speculative_config
        draft = DraftModel(config, executor, self.kv_capacity_tokens) if spec and spec.method == "draft_model" else None
        self.spec = SpeculativeDecoding(spec, self.max_model_len, draft) if spec is not None else None
        """Drafting and verification (cpllm/engine/spec_decode.py); None without speculative_config."""
        if self.spec is not None:
            logger.info("speculative decoding: %s", self.spec.describe())
        self.eos_token_ids = tuple(config.model.eos_token_ids) or tuple(tokenizer.eos_token_ids)
        self.structured = StructuredOutputManager(tokenizer, config.model.vocab_size, self.eos_token_ids)
        self._seed_stream = random.Random(config.seed)
        self._states: dict[str, RequestState] = {}
        self._sequences: dict[str, tuple[RequestState, Sequence]] = {}
        self.kv_transfer = engine_transfer(config)
        """Disaggregated prefill/decode (cpllm/disagg/engine_transfer.py); None when kv_transfer_config is unset."""
        if self.kv_transfer is not None and self.kv_transfer.config.produces:
            # held blocks are freed at a step: the server steps an idle producer this often, so that its blocks
            # go back at the abort timeout (or the release) without waiting for the next request
            self.idle_tick_s = IDLE_RELEASE_S
        self.collect_failures = False
        """True (the server): requests whose K/V pull failed wait in take_failures(); False (LLM): step raises."""
        self._failures: list[tuple[str, str]] = []

    def _check_windows(self, group_blocks: tuple[int, ...]) -> None:
        """Every sliding-window group's pools hold at least one request's window plus a block (a decode step's
        keys); fewer and no request could ever run."""
        if len(group_blocks) != len(self.kv_groups):
            raise ValueError(f"the ranks built {len(group_blocks)} KV groups; the model has {len(self.kv_groups)}")
        for group, blocks in zip(self.kv_groups, group_blocks):
            if group.window is None:
                continue
            need = window_blocks(group.window, self.tokens_per_block)
            if blocks < need:
                raise ValueError(
                    f"the KV cache of the {group.describe()} holds {blocks} blocks of {self.tokens_per_block} "
                    f"tokens; one request's window of {group.window} tokens needs {need} (the window and a block): "
                    "raise kv_cache_memory_bytes")
        if len(self.kv_groups) > 1 or self.kv_groups[0].window is not None:
            logger.info("KV groups: %s", "; ".join(f"{group.describe()}: {blocks} blocks per rank"
                                                   for group, blocks in zip(self.kv_groups, group_blocks)))

    def _log_layout(self, num_blocks: int) -> None:
        p, dims = self.config.parallel, self.config.parallel.dims
        kv = self.executor.rank_info.kv
        logger.info(
            "layout: world=%d dp=%d pcp=%d tp=%d dcp=%d cp_size=%d interleave=%d prefill_strategy=%s "
            "kv_cache_layout=%s",
            dims.world_size, p.data_parallel_size, p.prefill_context_parallel_size, p.tensor_parallel_size,
            p.decode_context_parallel_size, dims.cp_size, p.cp_kv_cache_interleave_size, p.cp_prefill_strategy,
            p.cp_kv_cache_layout,
        )
        logger.info(
            "KV cache: %d blocks x %d tokens per rank (%.1f MiB per rank, %s); the %s layout divides each request "
            "over %d ranks, so the replica holds %d tokens",
            num_blocks, self.config.cache.block_size, kv.bytes / 2**20, kv.dtype,
            p.cp_kv_cache_layout, dims.kv_shard_size, self.kv_capacity_tokens,
        )
        if self.config.model.mla is not None:  # MLA: replicated over TP unless DCP shards it
            model = self.config.model
            states = state_layer_specs(model, p.tensor_parallel_size)  # Kimi Linear: its KDA layers hold no latents
            slots = sum(engine_state_slots(self.config))
            latent_bytes = kv.bytes - slots * sum(spec.bytes_per_request for spec in states.values())
            logger.info("%s", latent_cache_line(model.mla, model.num_hidden_layers - len(states), latent_bytes,
                                                num_blocks * self.config.cache.block_size, dims.kv_shard_size,
                                                self.kv_capacity_tokens, indexer=model.indexer))
        if p.prefill_context_parallel_size > 1:
            per_rank = num_blocks * self.config.cache.block_size
            logger.info("KV capacity by layout with these blocks: sharded %d tokens (over PCP x DCP = %d ranks), "
                        "replicated %d tokens (a copy per PCP rank, over DCP = %d ranks)",
                        per_rank * dims.cp_size, dims.cp_size, per_rank * p.decode_context_parallel_size,
                        p.decode_context_parallel_size)

    # ---- requests -------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, prompt: str | None = None, arrival_time: float | None = None) -> None:
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids, params)
        kv_marks = request_marks(self.kv_transfer, params)  # disaggregated prefill/decode (cpllm/disagg)
        state = RequestState(request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
                             sequences=[])
        state.metrics.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        for index in range(params.n):
            child_params = params if index == 0 else dataclasses.replace(params, prompt_logprobs=None)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = Request(request_id=child_id, prompt_token_ids=list(prompt_token_ids),
                              sampling_params=child_params, arrival_time=state.metrics.arrival_time)
            seq = Sequence(index=index, request=request,
                           detokenizer=IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), params),
                           generator=self._generator(params, index),
                           logprobs=[] if params.logprobs is not None else None)
            state.sequences.append(seq)
            self._sequences[child_id] = (state, seq)
            request.kv_pull, request.kv_hold = kv_marks
            self.structured.add(child_id, params.structured_outputs)
        self._states[request_id] = state
        for seq in state.sequences:
            self.scheduler.add_request(seq.request)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        base = params.seed if params.seed is not None else self._seed_stream.getrandbits(63)
        return None if params.greedy else make_generator(base + index)

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; at least one token is needed")
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        bad = [t for t in params.logit_bias or {} if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
        self.structured.check(params.structured_outputs)  # compiles (cached); an invalid grammar is refused here
        needed = len(prompt_token_ids) + (params.max_tokens or 1)
        if needed > self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens + max_tokens={params.max_tokens} = {needed} tokens "
                f"exceeds max_model_len={self.max_model_len}"
                + (f" (the KV cache of the CP group holds {self.kv_capacity_tokens} tokens)"
                   if self._capacity_bounds_length and self.max_model_len == self.kv_capacity_tokens else "")
            )

    def abort_request(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is None:
            return
        for seq in state.sequences:
            self._sequences.pop(seq.request.request_id, None)
            self.structured.remove(seq.request.request_id)
            if not seq.finished:
                self.scheduler.finish(seq.request, RequestStatus.FINISHED_ABORTED)
                seq.detokenizer.finish()
            if self.spec is not None:
                self.spec.release(seq.request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def prompt_progress(self) -> dict[str, int]:
        """Prompt tokens with their K/V cached, per unfinished request (its first sample's; prefix-cache hits
        included), known after each step: a long prompt's grows chunk by chunk (engine/progress.py draws it)."""
        return {request_id: min(state.sequences[0].request.num_computed_tokens, len(state.prompt_token_ids))
                for request_id, state in self._states.items()}

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV memory in use: every rank's (block ids are shared over the replica's ranks), each KV
        group's blocks weighted by its layers."""
        layers = [len(group.layers) for group in self.kv_groups]
        total = sum(pool.num_blocks * n for pool, n in zip(self.pools, layers))
        return sum(pool.num_used * n for pool, n in zip(self.pools, layers)) / total

    @property
    def scheduler_totals(self) -> "SchedulerTotals":
        """The scheduler's running totals since start (the server exports their increments)."""
        s, spec = self.scheduler, self.spec_decode_totals
        return SchedulerTotals(preemptions=s.num_preemptions, prefix_query_tokens=s.num_prefix_query_tokens,
                               prefix_hit_tokens=s.num_prefix_hit_tokens,
                               peak_request_blocks=tuple(s.peak_request_blocks), spec_drafts=spec.num_drafts,
                               spec_draft_tokens=spec.num_draft_tokens, spec_accepted_tokens=spec.num_accepted_tokens)

    @property
    def spec_decode_totals(self) -> SpecDecodeTotals:
        """Drafted and accepted tokens since start (all zero without speculative decoding)."""
        return self.spec.totals if self.spec is not None else SpecDecodeTotals()

    # ---- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the state of every request that advanced or finished."""
        if self.kv_transfer is not None:  # blocks a consumer pulled (or nobody did in time) go back first
            for request_id in self.kv_transfer.due():
                self.scheduler.release_held(request_id)
        step = self.scheduler.schedule()
        if not step.chunks:
            return []
        now = time.monotonic()
        for chunk in step.chunks:
            state, _ = self._sequences[chunk.request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
        logits = self.executor.execute(step)
        failed = self._end_failed_pulls(step) if step.kv_pulls else {}
        self.scheduler.on_step_done(step)
        touched = self._process_logits(step, logits, skip=failed)
        outputs = []
        for state in touched:
            state.mark_finished_if_done()
            outputs.append(state.output())
            if state.finished and self.kv_transfer is not None:
                outputs[-1].kv_transfer_params = self.kv_transfer.answer(
                    state.request_id, self.scheduler.held.get(state.request_id),
                    self.scheduler.held_states.get(state.request_id, -1))
            if state.finished:
                self._forget(state)
        return outputs

    def _end_failed_pulls(self, step: SchedulerOutput) -> dict[str, str]:
        """Requests whose K/V pull failed on some rank end here, before their blocks could be registered as a
        prompt's (aborted: their blocks go back unhashed); the others' producers may free their blocks."""
        failed = self.executor.failed_pulls()
        self.kv_transfer.pulled(tuple(op for op in step.kv_pulls if op.request_id not in failed))
        for request_id, why in failed.items():
            state, _ = self._sequences[request_id]
            self.abort_request(state.request_id)
            self._failures.append((state.request_id, f"the prompt's K/V could not be pulled from the prefill "
                                   f"instance: {why}"))
        if self._failures and not self.collect_failures:
            request_id, message = self._failures.pop(0)
            raise RuntimeError(f"request {request_id}: {message}")
        return failed

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, message) of each request ended by a failed K/V pull since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def _forget(self, state: RequestState) -> None:
        self._states.pop(state.request_id, None)
        for seq in state.sequences:
            self._sequences.pop(seq.request.request_id, None)
            self.structured.remove(seq.request.request_id)

    def _process_logits(self, step: SchedulerOutput, logits: torch.Tensor | None,
                        skip: dict | frozenset = frozenset()) -> list[RequestState]:
        """`skip`: chunks of requests ended in this step (their rows are passed over)."""
        row, rows, to_sample, to_verify, touched = 0, [], [], [], {}
        for chunk in step.chunks:
            if chunk.request_id in skip:
                row += len(output_positions(chunk))
                continue
            state, seq = self._sequences[chunk.request_id]
            num_rows = len(output_positions(chunk))
            if chunk.prompt_logits:
                self._add_prompt_logprobs(state, seq, chunk, logits[row : row + num_rows])
            if chunk.sample and chunk.num_draft_tokens:  # a verify chunk: its last k + 1 rows, in order
                first = row + num_rows - chunk.num_draft_tokens - 1
                to_verify.append((state, seq, chunk, logits[first : row + num_rows]))
            elif chunk.sample:
                rows.append(row + num_rows - 1)
                to_sample.append((state, seq))
            row += num_rows
        if to_sample:
            sample_rows = [
                SamplingRow(params=seq.request.sampling_params, prompt_token_ids=seq.request.prompt_token_ids,
                            output_token_ids=seq.request.output_token_ids, generator=seq.generator,
                            eos_token_ids=self.eos_token_ids)
                for _, seq in to_sample
            ]
            bitmask = self.structured.bitmask([seq.request.request_id for _, seq in to_sample])
            sampled = self.sampler(logits[rows], sample_rows, bitmask)
            for (state, seq), token in zip(to_sample, sampled):
                self._append_token(state, seq, token)
                touched[state.request_id] = state
        for state, seq, chunk, chunk_logits in to_verify:
            self._verify(state, seq, chunk, chunk_logits)
            touched[state.request_id] = state
        if self.spec is not None:  # the next step's drafts follow every token just emitted
            advanced = [seq for _, seq in to_sample] + [seq for _, seq, _, _ in to_verify]
            for seq in advanced:
                seq.request.draft_token_ids = []
            self.spec.propose_all([(seq.request, seq.generator) for seq in advanced if not seq.finished])
        return list(touched.values())

    def _verify(self, state: RequestState, seq: Sequence, chunk, chunk_logits: torch.Tensor) -> None:
        """Emit the tokens of a verify chunk (chunk_logits: [k + 1, vocab]) one row at a time, each sampled as a
        decode step would sample it; the scheduler counts each accepted draft's K/V as it goes (so a request that
        ends inside the chunk registers the blocks a decode-only run would), then gives back the blocks that only
        rejected drafts wrote."""
        request = seq.request
        row = SamplingRow(params=request.sampling_params, prompt_token_ids=request.prompt_token_ids,
                          output_token_ids=request.output_token_ids, generator=seq.generator,
                          eos_token_ids=self.eos_token_ids)  # output_token_ids: the list the tokens join

        def emit(row_logits: torch.Tensor, draft: int | None, q: torch.Tensor | None) -> tuple[bool, bool]:
            bitmask = self.structured.bitmask([request.request_id])  # the grammar after the accepted drafts
            token, accepted = self.sampler.against_draft(row_logits, row, bitmask, draft, q)
            self._append_token(state, seq, token)
            return accepted, seq.finished

        self.spec.verify(chunk_logits, chunk.token_ids[-chunk.num_draft_tokens :], emit,
                         lambda: self.scheduler.accept_drafts(request.request_id, 1),
                         self.spec.draft_probs(request.request_id),  # q of a draft model's sampled drafts
                         request)
        self.scheduler.drop_rejected(request.request_id)

    def _add_prompt_logprobs(self, state: RequestState, seq: Sequence, chunk, chunk_logits: torch.Tensor) -> None:
        """Row i predicts position start + i + 1; fill the prompt positions not filled before (recompute)."""
        prompt = seq.request.prompt_token_ids
        first = len(state.prompt_logprobs) - 1  # logits row position whose target is the next unfilled position
        last = min(chunk.end_pos, len(prompt) - 1)
        if last <= first or first < chunk.start_pos:
            return
        rows = chunk_logits[first - chunk.start_pos : last - chunk.start_pos]
        state.prompt_logprobs += prompt_logprobs(rows, prompt[first + 1 : last + 1],
                                                 seq.request.sampling_params.prompt_logprobs)

    def _append_token(self, state: RequestState, seq: Sequence, token) -> None:
        request = seq.request
        request.output_token_ids.append(token.token_id)
        state.mark_first_token()
        if seq.logprobs is not None:
            seq.logprobs.append(token.logprobs)
        status = finish_status(seq, token.token_id, self.eos_token_ids, self.max_model_len)
        if self.structured.accept(request.request_id, token.token_id) and status is None:
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing more may follow
        if status is not None:
            self.scheduler.finish(request, status)
            seq.detokenizer.finish()

    def shutdown(self) -> None:
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        self.executor.shutdown()
