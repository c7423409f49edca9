"""The engine's side of `--cp-prefill-strategy auto`: the cost model of this rank's device and layout, and the
per-step choice (strategy.py) with a count of how often each strategy ran."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from cpllm.config.engine import ModelConfig, ParallelConfig
from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.planner.cost_model import CostModel, Precision
from cpllm.planner.hardware import HardwareSpec, builtin_hardware
from cpllm.planner.strategy import PASS_KV, choose, step_sizes

logger = logging.getLogger(__name__)

COUNTED_STRATEGIES = ("allgather", "ring", "pass-q")


def device_hardware(device: torch.device, threads: int, shared_memory: bool = True) -> HardwareSpec:
    """The built-in spec of this rank's device: a known GPU by name, else the CPU figures scaled by threads, their
    same-host collectives through shared memory unless `shared_memory` is False (`--collective-transport gloo`)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for key in ("h200", "h100", "h800", "a100"):
            if key in name:
                return builtin_hardware(key)
        logger.warning("auto strategy: no built-in figures for GPU %r; using the H100's", name)
        return builtin_hardware("h100")
    cpu = builtin_hardware("cpu")
    return dataclasses.replace(cpu, peak_flops=cpu.peak_flops * max(threads, 1),
                               shared_memory_bw=cpu.shared_memory_bw if shared_memory else None)


@dataclass(kw_only=True, frozen=True, slots=True)
class EngineCost:
    """The cost model `auto` consults and the engine's layout in its terms."""

    cost: CostModel
    layout: ParallelDims


def engine_cost(parallel: ParallelConfig, model: ModelConfig, element_bytes: int,
                hardware: HardwareSpec) -> EngineCost:
    """Only the strategies' communication and overlap differ between candidates, so the weight format (it
    scales the linear layers, the same under every strategy) does not move the choice."""
    precision = Precision(weight_format="fp32" if element_bytes == 4 else "bf16",
                          activation_bytes=element_bytes, kv_bytes=element_bytes)
    return EngineCost(cost=CostModel(model, hardware, precision), layout=parallel.dims)


class StepStrategy:
    """Which prefill strategy each step runs; `counts` says how many prompt steps ran with each (the server's
    metrics export it)."""

    def __init__(self, parallel: ParallelConfig, engine: EngineCost):
        self.configured = parallel.cp_prefill_strategy
        self.replicated = parallel.dims.kv_replicated
        self.engine = engine
        self.counts: dict[str, int] = {name: 0 for name in COUNTED_STRATEGIES}

    def __call__(self, step_id: int, chunks) -> str | None:
        """The step's strategy, or None when it has no prompt chunk or there is no PCP (nothing to choose)."""
        if self.engine.layout.pcp == 1:
            return None
        sizes = step_sizes(chunks)
        if sizes.new == 0:
            return None
        if self.configured != "auto":
            strategy = self.configured
        elif self.replicated:
            strategy = PASS_KV  # every PCP rank stores every new token: the K/V must travel anyway
        else:
            choice = choose(self.engine.cost, self.engine.layout, sizes)
            strategy = choice.strategy
            logger.debug("step %d: T=%d P=%d predicted %s -> %s", step_id, sizes.new, sizes.cached,
                         " ".join(f"{k}={v * 1e3:.2f}ms" for k, v in choice.predicted_s.items()), strategy)
        self.counts[strategy] += 1
        return strategy
