"""The ranks of one replica agree on where their int4 layers switch from the integer kernel to the dequantized GEMMs.

Each process measures that row count at start-up (cpllm/kernels/int4_choice.py), and one noisy probe can land a
step apart from another's (64 rows on one rank, 128 on the next). Ranks that took different thresholds would round
the same row count differently: a TP shard's columns, or a PCP rank's rows, through bf16 GEMMs on one rank and the
integer kernel on another. So once the weights are loaded every rank of the replica takes the highest threshold any
of them measured (the integer kernel's rounding kept the longest), and the lowest row count below which any of them
runs the bf16 GEMMs on the kernels fed from the int4 records (int4_records.py, whose accumulation order oneDNN's GEMM
does not share at every count); one all-reduce of two integers, on every rank alike whether or not its model has such
layers.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from cpllm.config.int4_threshold import NEVER
from cpllm.distributed.comm import all_reduce
from cpllm.kernels.int4_gemm import INTEGER_KERNELS
from cpllm.model.formats.group_kernels import Int4Linear

logger = logging.getLogger(__name__)


def agree_gemm_threshold(model: torch.nn.Module, group, device: torch.device) -> int | None:
    """Give every int4 layer of `model` the highest `gemm_from_rows` and the lowest `records_below` measured on any
    rank of `group` (the replica's ranks; every one of them calls this once, after loading); the threshold taken,
    or None where this rank has no such layer."""
    # the layers whose integer kernel hands over to GEMMs at a row count (aten's have no threshold)
    layers = [m for m in model.modules() if isinstance(m, Int4Linear) and m.backend in INTEGER_KERNELS]
    own = max((layer.gemm_from_rows for layer in layers), default=0)
    own_bound = min((layer.records_below for layer in layers), default=NEVER)
    highest = torch.tensor([own, -own_bound], dtype=torch.long, device=device)  # the lowest bound as a maximum
    all_reduce(highest, group, op=dist.ReduceOp.MAX)
    if not layers:
        return None
    agreed, bound = int(highest[0].item()), -int(highest[1].item())
    for layer in layers:
        layer.gemm_from_rows, layer.records_below = agreed, bound
    if (agreed, bound) != (own, own_bound):
        logger.info("int4 GEMMs from %d rows, fed from the records below %d: the highest threshold and lowest bound "
                    "the replica's ranks measured (this one: %d and %d)", agreed, bound, own, own_bound)
    return agreed
