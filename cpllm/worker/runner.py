"""ModelRunner: one rank's model, KV pools and per-step forward (SPMD on every rank of a replica)."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from cpllm.config.engine import EngineConfig
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import StepBatch, build_step_batch
from cpllm.context_parallel.plan import RankCapabilities, StepPath, StepPlan, plan_step
from cpllm.context_parallel.replica_sync import sync_replicas
from cpllm.distributed.comm import all_reduce
from cpllm.distributed.groups import ParallelGroups
from cpllm.disagg.rank_transfer import rank_transfer
from cpllm.model.execution.decode_graph import CompiledDecode
from cpllm.model.execution.decode_team import DecodeTeam
from cpllm.model.loaders.loader import open_weights
from cpllm.model.registry import model_class
from cpllm.kv_groups import kv_groups, layer_groups
from cpllm.planner.runtime import StepStrategy, device_hardware, engine_cost
from cpllm.step import SchedulerOutput, output_positions
from cpllm.model.execution.cuda_graphs import decode_graphs_for
from cpllm.layers.registry import state_layer_specs
from cpllm.state_slots import engine_state_slots
from cpllm.worker.int4_agreement import agree_gemm_threshold
from cpllm.worker.kv_cache import (allocate_kv_cache, allocate_states, copy_state_slots, group_block_counts,
                                   layer_bytes_per_block, layer_cache_spec, state_bytes)
from cpllm.worker.rank_capabilities import rank_capabilities
from cpllm.worker.rank_stats import DecodeLayers, KVCapacity, RankInfo, RankStats

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Loads this rank's shard, owns its KV pools, and runs steps; the replica driver gets the logits."""

    def __init__(self, config: EngineConfig, groups: ParallelGroups, device: torch.device):
        self.config, self.groups, self.device = config, groups, device
        self.dtype = DTYPES[config.dtype]
        self.kv_dtype = self.dtype if config.cache.kv_cache_dtype == "auto" else DTYPES[config.cache.kv_cache_dtype]
        self.parallel = groups.context(prefill_strategy=config.parallel.cp_prefill_strategy)
        """What the model's layers receive: the dims, this rank and its groups (distributed/parallel_context.py)."""
        self.replicated = groups.dims.kv_replicated
        # Replicated: every PCP rank keeps a whole copy, divided over the DCP group only.
        self.layout = KVLayout(num_shards=groups.dims.kv_shard_size, shard_rank=groups.kv_shard_rank,
                               interleave=config.parallel.cp_kv_cache_interleave_size,
                               block_size=config.cache.block_size)
        with torch.device(device):
            self.model = model_class(config.model.architecture)(config.model, self.parallel, self.dtype,
                                                                config.scheduler.max_model_len)
        self.model.load_weights(open_weights(config.model_path))
        agree_gemm_threshold(self.model, groups.moe_group, device)  # one rounding per row count on every rank
        _, self.num_kv_heads = self.parallel.kv_heads(config.model.num_key_value_heads)
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        self.step_strategy = StepStrategy(config.parallel, engine_cost(
            config.parallel, config.model, element_bytes,
            device_hardware(device, torch.get_num_threads(), config.parallel.collective_transport == "auto")))
        self.kv_groups = kv_groups(config.model, config.scheduler.max_model_len)
        """The layers' KV groups (cpllm/kv_groups.py): each has its own pools' size and block tables."""
        self.layer_group = layer_groups(self.kv_groups, config.model.num_hidden_layers)
        """Layer index -> its group's index (a layer keeping a state per request: 0, for its rows)."""
        self.state_specs = state_layer_specs(config.model, groups.tp_size)
        """Layer index -> the spec of its per-request state (cpllm/layers/cache_spec.py STATE), for such layers."""
        state_slots = sum(engine_state_slots(config))  # the scheduler's live, snapshot and held slots alike
        self.group_blocks = self._count_blocks(state_bytes(list(self.state_specs.values()), state_slots))
        self.num_blocks = self.group_blocks[0]
        group_specs = [layer_cache_spec(config, self.num_kv_heads, self.kv_dtype, g) for g in self.kv_groups]
        row_layers = [i for i in range(config.model.num_hidden_layers) if i not in self.state_specs]
        caches = dict(zip(row_layers, allocate_kv_cache(
            [self.group_blocks[self.layer_group[i]] for i in row_layers], config.cache.block_size,
            [group_specs[self.layer_group[i]] for i in row_layers], self.kv_dtype, device)))
        caches.update(zip(self.state_specs, allocate_states(list(self.state_specs.values()), state_slots, device)))
        self.kv_caches = [caches[i] for i in range(config.model.num_hidden_layers)]
        """Each layer's cache: its K/V pools, or its state pools indexed by state slot."""
        if self.model.fused_decode is not None and not self.model.fused_decode.fits_pools(self.kv_caches):
            logger.info("decode steps: eager layers (K/V pools the fused layers do not read)")
            self.model.fused_decode = None
        self._form_decode_team()
        self.compiled_decode = CompiledDecode(self.model, device) if config.compile_decode else None
        self._last_layer_local = self.model.last_layer_rows_local()
        """The last layer's rows past attention meet in no PCP collective: each PCP rank may keep its own."""
        self.plan_counts: dict[str, int] = {}
        """Steps run with each plan since start (by path: `StepPath` values), counted once per step."""
        if self.model.fused_decode is None and self.compiled_decode is None:
            self.model.pack_weights()
        self.decode_graphs = decode_graphs_for(
            self.model, self.kv_caches, self.layout, device=device, enforce_eager=config.enforce_eager,
            replica_ranks=groups.dims.replica_size, max_num_seqs=config.scheduler.max_num_seqs,
            max_local_context=config.scheduler.max_model_len)
        """Decode steps captured as CUDA graphs per batch bucket (None: eager, the reason logged at start)."""
        self.capabilities: RankCapabilities = rank_capabilities(
            groups, self.model, kv_groups=len(self.kv_groups), compiled=self.compiled_decode is not None,
            decode_graphs=self.decode_graphs, states=bool(self.state_specs))
        """What this rank can run, fixed from here on: every step's plan is made from it and the step alone."""
        self.kv_transfer = rank_transfer(config, groups.dims, groups.rank, self.kv_caches)
        """Disaggregated prefill/decode (cpllm/disagg): serves and pulls this rank's K/V rows; None when off."""

    def _form_decode_team(self) -> None:
        """The PCP ranks (or, with TP and PCP = 1, the TP ranks) of one host run fused decode steps as one team
        (cpllm/model/execution/decode_team.py); every rank of the group calls this alike. Without a team, a sharded layout's
        decode steps and tensor-parallel ones run eager."""
        fused = self.model.fused_decode
        if fused is None or fused.team_size < 2:
            return
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", self.groups.world_size))  # torchrun's, else one host
        group = self.groups.tp_group if fused.tensor_parallel else self.groups.pcp_group
        fused.team = DecodeTeam.open(group, fused.shapes, self.config.scheduler.max_num_seqs,
                                     split_context=self.replicated and not fused.tensor_parallel,  # PCP copies only
                                     busy_threads=ranks_here * torch.get_num_threads(),
                                     tensor_parallel=fused.tensor_parallel, dcp=fused.dcp)
        if fused.team is not None:
            logger.info("decode steps: %s", fused.team.describe())
        elif fused.needs_team:
            kind = "TP" if fused.tensor_parallel else "PCP"
            logger.info("decode steps: eager layers (sharded weights or K/V fuse only as a team of %s ranks, which "
                        "needs the shared-memory transport and a core for every thread of the ranks on this host)",
                        kind)
            self.model.fused_decode = None

    def _count_blocks(self, reserved_bytes: int = 0) -> tuple[int, ...]:
        """Blocks per rank of each KV group, the same on every rank of the replica (block ids are shared across the
        CP group), from the budget left after `reserved_bytes` (the state pools)."""
        per_block = layer_bytes_per_block(self.config, self.num_kv_heads, self.kv_dtype, self.kv_groups[0])
        count = torch.tensor(group_block_counts(self.config, self.device, self.kv_groups, per_block, reserved_bytes),
                             dtype=torch.long, device=self.device)
        # the replica's ranks on the default backend, bounded by --distributed-timeout (the control group is not)
        all_reduce(count, self.groups.moe_group, op=dist.ReduceOp.MIN)
        return tuple(int(c) for c in count.tolist())

    @property
    def kv_bytes(self) -> int:
        """KV bytes allocated on this rank."""
        # a pool read as both K and V counts once
        return sum(t.numel() * t.element_size() for cache in self.kv_caches for t in {id(t): t for t in cache}.values())

    @property
    def strategy_counts(self) -> dict[str, int]:
        """Prompt steps run with each prefill strategy since start (for a per-strategy metrics counter)."""
        return dict(self.step_strategy.counts)

    @property
    def is_driver(self) -> bool:
        return self.groups.is_replica_driver

    def execute(self, step: SchedulerOutput) -> torch.Tensor | None:
        """Run one step; returns logits [num_output_rows, vocab] on the replica driver, None elsewhere."""
        if step.kv_pulls:  # a prefill instance's K/V for this step's chunks, into this rank's pools first
            self.kv_transfer.pull(step.kv_pulls, self.groups.moe_group if self.groups.replica_size > 1 else None)
        if not step.chunks:
            return None
        # a prefix hit's states from their snapshot, before any layer reads them (cpllm/engine/state_snapshots.py)
        copy_state_slots(self.kv_caches, self.state_specs,
                         [(c.state_restore, c.state_slot) for c in step.chunks if c.state_restore >= 0])
        chunks = self._verify_rows(step.chunks)
        strategy = self.step_strategy(step.step_id, chunks)  # the same choice on every rank
        plan = plan_step(chunks, self.capabilities, strategy)  # every later stage follows it
        self.plan_counts[plan.value] = self.plan_counts.get(plan.value, 0) + 1
        logger.debug("step %d: plan %s", step.step_id, plan.value)
        batches = self._group_batches(chunks, plan)
        batch = batches[0]  # token ids, positions and output rows are every group's; the metadata is group 0's
        forward = self.compiled_decode if plan.path is StepPath.COMPILED else self.model
        keep = self._rows_kept(batch) if forward is self.model else None
        args = (batch.token_ids, batch.positions, self.kv_caches, batch.attention)
        # each layer reads its own group's metadata (its block tables' slots); one group: batch.attention
        layers = {} if len(batches) == 1 else {"layer_meta": tuple(batches[g].attention for g in self.layer_group)}
        hidden = self._replay(batch, plan)
        if hidden is not None:
            keep = None  # the graph returns every row; the sampled ones are picked below
        else:
            hidden = forward(*args, **layers) if keep is None else forward(*args, keep, **layers)  # keep: sampled rows
        copy_state_slots(self.kv_caches, self.state_specs,  # states kept at a block boundary the chunk ends at
                         [(c.state_slot, c.state_save) for c in step.chunks if c.state_save >= 0])
        if plan.replica_sync:  # decode K/V computed on one PCP rank reach the other copies
            for group, group_batch in zip(self.kv_groups, batches):
                caches = self.kv_caches if len(batches) == 1 else [self.kv_caches[i] for i in group.layers]
                sync_replicas(caches, group_batch.replica_sync, self.groups.pcp_group, self.groups.pcp_rank)
        if not batch.output_rows:
            return None
        rows = self._gather_output_rows(hidden, batch, kept=keep is not None)
        if self.groups.pcp_rank != 0 and not plan.lm_head_split:
            return None  # the LM head runs on PCP rank 0's TP group only
        logits = self.model.logits(rows)  # split over PCP: every PCP rank computes a share of the vocabulary
        return logits if self.is_driver else None

    def _replay(self, batch: StepBatch, plan: StepPlan) -> torch.Tensor | None:
        """Hidden states of every row by one replay of the CUDA graph the plan chose (model/execution/cuda_graphs.py), or
        None: the step runs eager."""
        if plan.graph_bucket is not None:
            return self.decode_graphs.run(batch)
        if self.decode_graphs is not None and plan.path is StepPath.ONE_SHARD:
            self.decode_graphs.note_eager(batch)  # why the plan chose no bucket for it (each reason logged once)
        return None

    def _group_batches(self, chunks, plan: StepPlan) -> list[StepBatch]:
        """The step laid out once per KV group, each with that group's block tables (a windowed group's freed
        entries are never read: its layers attend only in-window keys). Every tensor of the step (token ids,
        positions, all attention metadata) on this rank's device."""
        batches = []
        for g in range(len(self.kv_groups)):
            group_chunks = chunks if g == 0 else tuple(
                dataclasses.replace(chunk, block_table=chunk.group_table(g)) for chunk in chunks)
            batches.append(build_step_batch(group_chunks, self.layout, self.groups.pcp_size, self.groups.pcp_rank,
                                            output_positions, plan=plan, device=self.device, non_blocking=True))
        return batches

    def _verify_rows(self, chunks):
        """Verify chunks (a request's last token and its drafts) as that many single-token rows at consecutive
        positions, the rows of one chunk next to each other: row i is a decode row whose context is every position
        up to its own, and on every decode path (the fused layers, alone or as a team, and the eager decode plans)
        every layer stores the step's K/V before any row attends, so row i sees rows < i as the causal chunk would,
        merged over the KV shards by the same log-sum-exp as decode. The step can then take the decode plans. On
        one rank with one KV shard always; under PCP or a sharded KV cache only in a step without a prompt chunk
        (which is a prefill step anyway: the verify chunks then run as prefill chunks, as they do with it). Under
        the replicated layout a chunk's rows stay on one PCP copy (plan.py `single_token_homes`). The rows come
        back in the chunk's order."""
        if not any(c.num_draft_tokens for c in chunks) or self.state_specs:
            return chunks  # a state layer takes a chunk's rows in order, from its one state (not as decode rows)
        whole = [bool(c.num_draft_tokens) and len(c.token_ids) == c.num_draft_tokens + 1 for c in chunks]
        spread = self.groups.pcp_size > 1 or self.layout.num_shards > 1
        if spread and any(len(c.token_ids) > 1 and not w for c, w in zip(chunks, whole)):
            return chunks
        rows = []
        for chunk, split in zip(chunks, whole):
            if not split:
                rows.append(chunk)
                continue
            rows += [dataclasses.replace(chunk, token_ids=(token,), start_pos=chunk.start_pos + i, num_draft_tokens=0)
                     for i, token in enumerate(chunk.token_ids)]
        return tuple(rows)

    def _rows_kept(self, batch: StepBatch) -> torch.Tensor | None:
        """This rank's rows the driver samples from, where the last layer can skip the others (past its attention:
        every row's K/V is still stored and attended), or None: every row. Under PCP each rank keeps its own
        sampled rows, none where it holds none, unless the last layer's rows meet in a collective after attention
        (a decode team, where every rank holds every row; split MLPs; a MoE block, which gathers as many rows from
        every rank). A 4,096-token prompt under PCP=2 then runs one o_proj and MLP row on one rank where it ran
        2,048 on each."""
        if self.groups.pcp_size == 1:
            rows = [row for _, row in batch.output_rows]
        else:
            plan = batch.attention.plan
            if plan.team or plan.mlp_split or not self._last_layer_local:
                return None
            rows = [row for rank, row in batch.output_rows if rank == self.groups.pcp_rank]
        if len(rows) == batch.token_ids.shape[0]:
            return None
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _gather_output_rows(self, hidden: torch.Tensor, batch: StepBatch, kept: bool) -> torch.Tensor:
        """Hidden states of the rows the driver samples from, collected on every PCP rank in driver order; `kept`:
        `hidden` holds this rank's sampled rows only (`_rows_kept`), in their order."""
        me = self.groups.pcp_rank
        if self.groups.pcp_size == 1 or batch.attention.plan.team:  # a team's ranks all hold every row's state
            return hidden if kept else hidden[torch.tensor([row for _, row in batch.output_rows], device=hidden.device)]
        out = torch.zeros(len(batch.output_rows), hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
        mine = [(i, row) for i, (p, row) in enumerate(batch.output_rows) if p == me]
        if mine:
            idx = torch.tensor([i for i, _ in mine], device=hidden.device)
            out[idx] = hidden if kept else hidden[torch.tensor([row for _, row in mine], device=hidden.device)]
        # Each row is non-zero on exactly one rank, so the sum is exact.
        return all_reduce(out, self.groups.pcp_group)

    def info(self) -> RankInfo:
        """What this rank built, as plain data (what the driver, the server and the tests may know of it)."""
        fused = self.model.fused_decode
        team = fused.team if fused is not None else None
        decode = DecodeLayers(fused=fused is not None, fused_max_rows=fused.max_rows if fused is not None else None,
                              fused_tensor_parallel=fused is not None and fused.tensor_parallel,
                              team=team.describe() if team is not None else None,
                              compiled=self.compiled_decode is not None)
        kv = KVCapacity(num_blocks=self.num_blocks, block_size=self.config.cache.block_size, bytes=self.kv_bytes,
                        dtype=str(self.kv_dtype).removeprefix("torch."), group_blocks=self.group_blocks)
        devices = {self.device.type, *(cache[0].device.type for cache in self.kv_caches),
                   *(p.device.type for p in self.model.parameters())}
        return RankInfo(rank=self.groups.rank, devices=frozenset(devices), kv=kv, decode=decode)

    def stats(self) -> RankStats:
        """This rank's step counters, as plain data."""
        fused, compiled = self.model.fused_decode, self.compiled_decode
        return RankStats(strategy_counts=self.strategy_counts, plan_counts=dict(self.plan_counts),
                         fused_steps=fused.steps if fused is not None else 0,
                         compiled_steps=compiled.steps if compiled is not None else 0,
                         graph_replays=self.decode_graphs.replays if self.decode_graphs is not None else 0,
                         kv_rows_pulled=self.kv_transfer.rows_pulled if self.kv_transfer is not None else 0,
                         kv_messages_pulled=self.kv_transfer.messages_pulled if self.kv_transfer is not None else 0,
                         kv_messages_by_shm=self.kv_transfer.messages_by_shm if self.kv_transfer is not None else 0)
