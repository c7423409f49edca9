"""The start-up log of a MoE model: how the experts are placed, and the expert bytes this rank holds."""

from __future__ import annotations

import torch

from cpllm.config.moe import describe_placement
from cpllm.model.formats.modes import FLOAT, quantization_mode
from cpllm.model.moe.sparse_block import expert_bytes, moe_blocks


def moe_summary_lines(model: torch.nn.Module) -> list[str]:
    """Nothing for a dense model; otherwise placement, bytes, and that experts are never quantized."""
    blocks = moe_blocks(model)
    if not blocks:
        return []
    config, shard = model.config, blocks[0].shard
    dtype = str(blocks[0].experts.dtype).removeprefix("torch.")
    lines = [describe_placement(config.moe, tp=shard.tp.size, pcp=shard.pcp_size,
                                expert_parallel=shard.expert_parallel)]
    lines.append(f"  expert weight bytes on this rank (MoE group rank {shard.rank} of {shard.size}): "
                 f"{expert_bytes(model) / 2**20:.2f} MiB over {len(blocks)} sparse layers")
    quantized_elsewhere = quantization_mode(config.quantization).quantizes
    if quantized_elsewhere and blocks[0].experts.method.weight_format == FLOAT:  # (GPT-OSS MXFP4 may not be)
        lines.append(f"  routed experts run in {dtype} (quantization={config.quantization} applies to the other "
                     "weights only)")
    return lines
