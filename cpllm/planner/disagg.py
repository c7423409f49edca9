"""`cpllm plan --disaggregated`: the time to the first token and per output token of a prefill instance and a
decode instance, each in its own layout (docs/disaggregated.md "Planning a disaggregated deployment").

TTFT = the prompt's prefill on the prefill instance (cost_model.py, the strategy `auto` would pick) + the K/V
transfer + the decode instance's first step. The transfer moves the rows reshard.py's plan moves: every producer
rank sends each consumer rank the (position, KV head) rows that rank owns, one message per move, every rank on
its own NIC (the two instances are on different nodes). All messages run at once, so the transfer takes what the
busiest NIC carries, sent or received, at the network rate x collective_utilization, plus the base latency of one
call and one network hop per message that NIC handles. TPOT is the decode instance's step (cost_model.py
`decode_step`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.disagg.reshard import CacheLayout, plan_reshard
from cpllm.kv_groups import full_cache_spec
from cpllm.layers.registry import state_layer_specs
from cpllm.planner.cost_model import CostModel, LinkTime
from cpllm.planner.plan import PlanRequest, auto_strategy

_LABEL = re.compile(r"^\s*(\d+)x(\d+)x(\d+)(-repl)?\s*$")


def parse_layout(text: str) -> ParallelDims:
    """'TPxPCPxDCP' (ParallelDims.label, '-repl' for the replicated KV layout) -> its ParallelDims."""
    match = _LABEL.match(text)
    if not match:
        raise ValueError(f"not a layout: {text!r} (TPxPCPxDCP, e.g. 1x8x1 or 8x1x8, '-repl' for the replicated "
                         "KV layout)")
    tp, pcp, dcp = (int(match.group(i)) for i in (1, 2, 3))
    return ParallelDims(tp=tp, pcp=pcp, dcp=dcp, kv_replicated=match.group(4) is not None)


@dataclass(kw_only=True, frozen=True, slots=True)
class KVTransfer:
    """The prompt's K/V on its way from the prefill instance to the decode instance."""

    total_bytes: float
    """Bytes of every row that moves (each consumer owner receives its rows once)."""
    busiest_nic_bytes: float
    """Bytes the busiest NIC carries, sent or received."""
    busiest_nic_messages: int
    """Messages (moves of the re-shard plan) that NIC sends or receives."""
    link: LinkTime
    """Its transfer and latency (seconds)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class DisaggPrediction:
    """What the cost model expects of one prefill layout feeding one decode layout."""

    prefill_layout: ParallelDims
    decode_layout: ParallelDims
    strategy: str
    """Prefill strategy `auto` picks on the prefill instance ("-" without PCP)."""
    prefill_compute_s: float
    prefill_transfer_s: float
    """The prefill's own exposed transfers (TP all-reduces, ring excess, blocking collectives)."""
    prefill_latency_s: float
    """The prefill's message latencies and kernel launches."""
    kv: KVTransfer
    first_decode_s: float
    tpot_s: float
    prefill_fits: bool
    decode_fits: bool

    @property
    def prefill_s(self) -> float:
        return self.prefill_compute_s + self.prefill_transfer_s + self.prefill_latency_s

    @property
    def ttft_s(self) -> float:
        return self.prefill_s + self.kv.link.total_s + self.first_decode_s

    def explain(self) -> dict:
        """TTFT split into compute, transfer and latency (seconds): the decode's first step counts as compute
        (it is memory-bound reading weights and the shard), the K/V transfer apart from the prefill's own."""
        return {"prefill_compute_s": self.prefill_compute_s, "prefill_transfer_s": self.prefill_transfer_s,
                "prefill_latency_s": self.prefill_latency_s, "kv_transfer_s": self.kv.link.transfer_s,
                "kv_latency_s": self.kv.link.latency_s, "first_decode_s": self.first_decode_s,
                "compute_s": self.prefill_compute_s + self.first_decode_s,
                "transfer_s": self.prefill_transfer_s + self.kv.link.transfer_s,
                "latency_s": self.prefill_latency_s + self.kv.link.latency_s, "ttft_s": self.ttft_s}

    def row(self) -> dict:
        return {"prefill_layout": self.prefill_layout.label(), "decode_layout": self.decode_layout.label(),
                "prefill_devices": self.prefill_layout.replica_size, "decode_devices": self.decode_layout.replica_size,
                "strategy": self.strategy, "prefill_s": round(self.prefill_s, 4),
                "kv_bytes": int(self.kv.total_bytes), "kv_busiest_nic_bytes": int(self.kv.busiest_nic_bytes),
                "kv_transfer_s": round(self.kv.link.total_s, 5), "first_decode_s": round(self.first_decode_s, 5),
                "ttft_s": round(self.ttft_s, 4), "tpot_ms": round(self.tpot_s * 1e3, 3),
                "prefill_fits": self.prefill_fits, "decode_fits": self.decode_fits}


def check_layout(cost: CostModel, layout: ParallelDims, role: str) -> None:
    """Refuse a layout the engine would refuse for this model, naming the role."""
    if layout.dp != 1:
        raise ValueError(f"{role} layout {layout.label()}: a disaggregated instance is one replica")
    try:
        layout.validate(cost.model)
    except ValueError as error:
        raise ValueError(f"{role} layout {layout.label()}: {error}") from None
    if state_layer_specs(cost.model, layout.tp):
        raise ValueError(f"{role} layout {layout.label()}: models keeping a per-request state are refused by the "
                         "disaggregated connector (docs/disaggregated.md, Configuration)")


def kv_bytes_per_head_token(cost: CostModel) -> float:
    """Bytes of one token's cached row of one KV head, all layers (the cache spec at the KV precision; one latent
    row per layer for MLA)."""
    spec = full_cache_spec(cost.model, 1, cost.precision.kv_bytes)
    return cost.model.num_hidden_layers * spec.bytes_per_token


def kv_transfer(cost: CostModel, src: ParallelDims, dst: ParallelDims, tokens: int) -> KVTransfer:
    """The re-shard plan's moves of a `tokens`-token prompt, as bytes on each NIC: the plan of one period of both
    ownership patterns (interleave 1), scaled to the prompt (exact for whole periods)."""
    source = CacheLayout(dims=src, interleave=1, block_size=16)
    target = CacheLayout(dims=dst, interleave=1, block_size=16)
    period = math.lcm(source.shards, target.shards)
    heads = cost.model.num_key_value_heads
    moves = plan_reshard(source, target, heads, min(period, tokens)).moves
    scale = tokens / min(period, tokens)
    row = kv_bytes_per_head_token(cost)
    load: dict[tuple[str, int], float] = {}
    messages: dict[tuple[str, int], int] = {}
    for move in moves:
        nbytes = move.num_positions * len(move.heads) * row * scale
        for end in (("send", move.src_rank), ("recv", move.dst_rank)):
            load[end] = load.get(end, 0.0) + nbytes
            messages[end] = messages.get(end, 0) + 1
    busiest = max(load, key=load.get) if load else None
    nbytes = load.get(busiest, 0.0) if busiest else 0.0
    count = messages.get(busiest, 0) if busiest else 0
    hw = cost.hw
    link = LinkTime(transfer_s=nbytes / (hw.inter_node_bw * hw.collective_utilization),
                    latency_s=(hw.collective_base_latency_s + hw.inter_node_latency_s) * count)
    total = sum(m.num_positions * len(m.heads) for m in moves) * row * scale
    return KVTransfer(total_bytes=total, busiest_nic_bytes=nbytes, busiest_nic_messages=count, link=link)


def predict_disaggregated(cost: CostModel, prefill_layout: ParallelDims, decode_layout: ParallelDims,
                          request: PlanRequest) -> DisaggPrediction:
    """The prediction of one (prefill layout, decode layout) pair for `request` (both on `cost`'s device)."""
    check_layout(cost, prefill_layout, "prefill")
    check_layout(cost, decode_layout, "decode")
    strategy = auto_strategy(cost, prefill_layout, request)
    parts = cost.prefill(prefill_layout, request.new, request.cached, "ring" if strategy == "-" else strategy)
    prefill_memory, decode_memory = cost.memory(prefill_layout), cost.memory(decode_layout, request.batch)
    return DisaggPrediction(
        prefill_layout=prefill_layout, decode_layout=decode_layout, strategy=strategy,
        prefill_compute_s=parts.compute_s, prefill_transfer_s=parts.exposed_transfer_s,
        prefill_latency_s=parts.latency_s + parts.launch_s,
        kv=kv_transfer(cost, prefill_layout, decode_layout, request.context),
        first_decode_s=cost.decode_step(decode_layout, request.context, 1),
        tpot_s=cost.decode_step(decode_layout, request.context, request.batch),
        prefill_fits=prefill_memory.fits_weights and request.context <= prefill_memory.kv_capacity_tokens,
        decode_fits=decode_memory.fits_weights and request.context * request.batch <= decode_memory.kv_capacity_tokens)
