"""A draft model's runner (speculative decoding): one more ModelRunner, on the replica driver's device, alone.

The draft has a layout of its own: one rank (ParallelGroups.single(): TP = PCP = DCP = 1, no collective), whatever
the target's layout is, so its steps involve no other rank. Its KV pool holds as many tokens as the target's pool
(`tokens`), at the draft's own bytes per token. What the engine side learns of it is plain data (`info`), as of
the target's ranks.
"""

from __future__ import annotations

import dataclasses

import torch

from cpllm.config.engine import EngineConfig
from cpllm.distributed.groups import ParallelGroups
from cpllm.kv_groups import kv_groups
from cpllm.step import SchedulerOutput
from cpllm.worker.kv_cache import layer_bytes_per_block
from cpllm.worker.rank_stats import RankInfo
from cpllm.worker.runner import DTYPES, ModelRunner


def draft_kv_bytes(config: EngineConfig, tokens: int) -> int:
    """KV bytes of a one-rank pool of `config`'s model that holds `tokens` tokens in every layer."""
    dtype = DTYPES[config.dtype] if config.cache.kv_cache_dtype == "auto" else DTYPES[config.cache.kv_cache_dtype]
    group = kv_groups(config.model, config.scheduler.max_model_len)[0]
    per_block = layer_bytes_per_block(config, config.model.num_key_value_heads, dtype, group)  # TP = 1: every head
    blocks = -(-tokens // config.cache.block_size)
    return blocks * per_block * config.model.num_hidden_layers


class DraftRunner:
    """Runs draft steps (SchedulerOutputs of the draft's own block ids) on this process's device."""

    def __init__(self, config: EngineConfig, device: torch.device, tokens: int):
        """`config`: the draft's (parallel all ones; its cache's kv_cache_memory_bytes is set here from
        `tokens`)."""
        cache = dataclasses.replace(config.cache, kv_cache_memory_bytes=draft_kv_bytes(config, tokens))
        self.config = dataclasses.replace(config, cache=cache)
        self._runner = ModelRunner(self.config, ParallelGroups.single(), device)
        self.info: RankInfo = self._runner.info()
        """Its KV pools (blocks per KV group, bytes, dtype) and decode layers."""
        self.device = device

    def execute(self, step: SchedulerOutput) -> torch.Tensor | None:
        """Logits [rows, vocab] of the step's output rows (cpllm/step.py output_positions), None when it has
        none."""
        return self._runner.execute(step)
