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
    config, parallel = model.config, blocks[0].parallel
    dtype = str(blocks[0].experts.dtype).removeprefix("torch.")
    lines = [describe_placement(config.moe, tp=parallel.size("tp"), pcp=parallel.size("pcp"),
                                expert_parallel=parallel.dims.expert_parallel)]
    moe_rank, moe_size = parallel.rank("moe"), parallel.size("moe")
    lines.append(f"  expert weight bytes on this rank (MoE group rank {moe_rank} of {moe_size}): "
                 f"{expert_bytes(model) / 2**20:.2f} MiB over {len(blocks)} sparse layers")
    quantized_elsewhere = quantization_mode(config.quantization).quantizes
    if quantized_elsewhere and blocks[0].experts.method.weight_format == FLOAT:  # (GPT-OSS MXFP4 may not be)
        lines.append(f"  routed experts run in {dtype} (quantization={config.quantization} applies to the other "
                     "weights only)")
    return lines
