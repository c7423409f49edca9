"""The engine's side of `--cp-prefill-strategy auto`: the heuristic's constants for this rank's device, and the
per-step choice (strategy.py) with a count of how often each strategy ran."""

from __future__ import annotations

import dataclasses
import logging

import torch

from cpllm.config import ModelConfig, ParallelConfig
from cpllm.planner.hardware import HardwareSpec, builtin_hardware
from cpllm.planner.strategy import PASS_KV, HeuristicInputs, choose, step_sizes

logger = logging.getLogger(__name__)

COUNTED_STRATEGIES = ("allgather", "ring", "pass-q")


def device_hardware(device: torch.device, threads: int) -> HardwareSpec:
    """The built-in spec of this rank's device: a known GPU by name, else the CPU figures scaled by threads."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for key in ("h200", "h100", "a100"):
            if key in name:
                return builtin_hardware(key)
        logger.warning("auto strategy: no built-in figures for GPU %r; using the H100's", name)
        return builtin_hardware("h100")
    cpu = builtin_hardware("cpu")
    return dataclasses.replace(cpu, peak_flops=cpu.peak_flops * max(threads, 1))


def heuristic_inputs(parallel: ParallelConfig, model: ModelConfig, element_bytes: int,
                     hardware: HardwareSpec) -> HeuristicInputs:
    tp, pcp = parallel.tensor_parallel_size, parallel.prefill_context_parallel_size
    crosses = pcp * tp > hardware.devices_per_node
    return HeuristicInputs(
        pcp=pcp, flops=hardware.attention_peak(),
        bandwidth=hardware.inter_node_bw if crosses else hardware.intra_node_bw,
        kv_heads=max(1, model.num_key_value_heads // tp), query_heads=model.num_attention_heads // tp,
        element_bytes=element_bytes,
    )


class StepStrategy:
    """Which prefill strategy each step runs; `counts` says how many prompt steps ran with each (the engine's
    metrics read it)."""

    def __init__(self, parallel: ParallelConfig, inputs: HeuristicInputs):
        self.configured = parallel.cp_prefill_strategy
        self.replicated = parallel.cp_kv_cache_layout == "replicated"
        self.inputs = inputs
        self.counts: dict[str, int] = {name: 0 for name in COUNTED_STRATEGIES}

    def __call__(self, step_id: int, chunks) -> str | None:
        """The step's strategy, or None when it has no prompt chunk or there is no PCP (nothing to choose)."""
        if self.inputs.pcp == 1:
            return None
        sizes = step_sizes(chunks)
        if sizes.new == 0:
            return None
        if self.configured != "auto":
            strategy = self.configured
        elif self.replicated:
            strategy = PASS_KV  # every PCP rank stores every new token: the K/V must travel anyway
        else:
            strategy = choose(sizes, self.inputs)
        self.counts[strategy] += 1
        if self.configured == "auto":
            logger.debug("step %d: T=%d P=%d (T/(T+P)=%.3f; pass-KV from T>=%.0f or %.3f) -> %s", step_id,
                         sizes.new, sizes.cached, sizes.new / (sizes.new + sizes.cached),
                         self.inputs.overlap_threshold, self.inputs.miss_rate_threshold, strategy)
        return strategy
