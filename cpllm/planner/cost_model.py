"""Predicted time of prefill and decode for a model, a device and a TP x PCP x DCP layout (the `ParallelDims` of
one replica: its DP size plays no part).

Per layer and per rank (T new tokens, P cached, N = PCP, C = KV shard group, local heads Hq_l = Hq / TP and
Hkv_l = max(1, Hkv / TP), head width D, element size e):

- linear FLOPs  2 * W_layer * T / (TP * N)                     at gemm_rate: the weight format's peak (FP8 when
                the weights are FP8) x gemm_utilization
- attention     4 * D * Hq * (T * P + T (T + 1) / 2 + T * o) / (TP * N) at attention_rate: the 16-bit peak x
                attention_utilization (head-tail chunks balance it; o = the spec's attention_row_overhead, the
                diagonal blocks' extra work, measured on CPUs), plus, on GPUs (attention_row_traffic), each query
                row's memory traffic per kernel call at memory_bw: Hq_l (D e + 4 D + 4) bytes per call, and
                2 Hq_l (4 D + 4) more per ring step past the first (the merge of the running output); with a ring
                of N steps a row is attended in N calls of T / N keys, so short blocks reach less of peak
- elementwise   (T / (TP * N)) * elementwise_bytes_per_token at the spec's elementwise_bw (when it has one)
- TP            two all-reduces of (T / N) * hidden * e bytes: inside a node over NVLink, across nodes on 1/g of
                the data per NIC (reduce-scatter, all-reduce across nodes, all-gather)
- PCP, by strategy (a ring step's transfer hides behind the attention of the block in hand; what does not fit
                is exposed, and collectives outside a ring block the layer):
    allgather   all-gather of the new K/V, (N - 1) * (T / N) * 2 Hkv_l D e, blocking
    ring        N - 1 ring steps of the new K/V block (T / N) * 2 Hkv_l D e over the new-token attention;
                with P > 0 also cpllm's query gather and partial all-to-all for the cached part, blocking
    pass-kv     the paper's pass-KV: K/V of (T + P) / N tokens per step round the ring, over all the attention
    pass-q      R - 1 ring steps of the query block (T / N) * Hq_l D e (R = C with cached context, else N) over
                the attention, then one blocking all-to-all of the float32 partials (R - 1)(T / N) Hq_l (D + 1) 4
                plus the new K/V rows their owners store

- MoE under PCP  per sparse layer an all-gather of the rank's (T / N) x hidden rows over PCP and a reduce-scatter
                of the partials back, blocking (docs/context_parallel.md "Mixture of experts under PCP"); the
                routed experts are stored split over the TP x PCP group, the rest over TP

W_layer counts what a token passes through (shapes.py: a MoE layer's top-k and shared experts, MLA's latent
projections), and with MLA the attention's 4 D per pair is 2 (D_qk + D_v) and a ring's K/V row is one latent row.

Every transfer runs at the link bandwidth x collective_utilization; its latency is counted apart and never hidden:
a ring step costs max(compute, transfer) + latency, a blocking all-gather or all-to-all its bytes plus latency.
Latency is the spec's base cost per collective call plus one hop per peer (an all-reduce: 2 (g - 1) NVLink hops
and 2 (nodes - 1) network hops), on the built-in GPUs NCCL's own figures (hardware.py, NCCL_LATENCY). Fixed
costs: each kernel of a prefill step costs the spec's kernel_launch_s (CUDA's launch cost on the built-in GPUs):
LAYER_KERNELS per layer, RING_STEP_KERNELS per ring step past the first, STEP_KERNELS for the step itself.

On layouts of more than one device the compute terms also divide by the device's `busy_node_fraction` (measured
on CPUs, 1 on GPUs). Decode reads every local weight once per step and the local KV shard once per request, at
memory bandwidth, plus the collectives' latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cpllm.config.engine import ModelConfig
from cpllm.distributed.parallel_dims import ParallelDims, kv_heads_per_rank
from cpllm.kv_groups import full_cache_spec
from cpllm.layers.registry import state_layer_specs
from cpllm.planner.hardware import HardwareSpec
from cpllm.planner.shapes import attention_flops_per_pair, linear_params, routed_expert_params

WEIGHT_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
PARTIAL_BYTES = 4
"""cpllm returns attention partials in float32 (docs/context_parallel.md "Exact merge")."""
USABLE_MEMORY = 0.9
"""Share of device memory for weights and KV (the rest: activations, workspace, fragmentation)."""
STRATEGIES = ("allgather", "ring", "pass-kv", "pass-q")
LAYER_KERNELS = 12
"""Kernels one decoder layer launches in a prefill step: two norms, the packed q|k|v projection, rope, the K/V
store, one attention call, the output projection, two residual adds, the packed gate|up projection, the
activation and the down projection (the TP all-reduces are counted as collectives)."""
RING_STEP_KERNELS = 2
"""Kernels each ring step past the first adds: the attention call on the block received and the merge into the
running output."""
STEP_KERNELS = 4
"""Kernels of the step outside the layers: the embedding, the final norm, the LM head and the sampler."""


@dataclass(kw_only=True, frozen=True, slots=True)
class LinkTime:
    """One message or collective: its bytes on the wire and its fixed cost (seconds)."""

    transfer_s: float
    latency_s: float

    @property
    def total_s(self) -> float:
        return self.transfer_s + self.latency_s

    def __add__(self, other: "LinkTime") -> "LinkTime":
        return LinkTime(transfer_s=self.transfer_s + other.transfer_s, latency_s=self.latency_s + other.latency_s)


@dataclass(kw_only=True, frozen=True, slots=True)
class RingStep:
    """One ring step: compute of the block in hand against the transfer of the next block (seconds)."""

    compute_s: float
    exposed_s: float
    """What of the transfer the compute does not hide: max(0, transfer - compute)."""
    latency_s: float
    """The message's fixed cost, never hidden."""

    @property
    def total_s(self) -> float:
        """max(compute, transfer) + latency."""
        return self.compute_s + self.exposed_s + self.latency_s


@dataclass(kw_only=True, frozen=True, slots=True)
class LayerComm:
    """One layer's PCP communication beyond its compute (seconds), and the kernels its ring steps add."""

    exposed_s: float = 0.0
    blocking_s: float = 0.0
    latency_s: float = 0.0
    extra_kernels: int = 0


@dataclass(kw_only=True, frozen=True, slots=True)
class Precision:
    """Number formats of the run."""

    weight_format: str = "bf16"
    """"fp8", "bf16", "fp16" or "fp32": bytes per weight and which peak the linear layers run at."""
    activation_bytes: int = 2
    """Bytes per activation element (q, k, v, hidden states)."""
    kv_bytes: int = 2
    """Bytes per cached K or V element."""

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_BYTES:
            raise ValueError(f"weight_format={self.weight_format!r}; choose one of {tuple(WEIGHT_BYTES)}")

    @property
    def weight_bytes(self) -> int:
        return WEIGHT_BYTES[self.weight_format]


@dataclass(kw_only=True, frozen=True, slots=True)
class PrefillCost:
    """Predicted prefill time of one step, whole model, and where it goes (seconds)."""

    strategy: str
    linear_s: float
    attention_s: float
    tp_comm_s: float
    elementwise_s: float = 0.0
    """Norms, rope, activation, residual adds and layout copies at the spec's elementwise bandwidth (0 when the
    spec does not model them)."""
    cp_exposed_s: float
    """Ring transfers not hidden behind attention."""
    cp_blocking_s: float
    """Collectives outside the ring (all-gathers, all-to-alls): their bytes on the wire."""
    latency_s: float = 0.0
    """Every message's fixed cost: each collective's base latency and hops, each ring step's (a ring step costs
    max(compute, transfer) + latency, so its latency is never hidden)."""
    launch_s: float = 0.0
    """Kernel launches: each layer's kernels, each ring step's attention call and merge, the step's own."""

    @property
    def compute_s(self) -> float:
        return self.linear_s + self.attention_s + self.elementwise_s

    @property
    def exposed_transfer_s(self) -> float:
        """Bytes on the wire that no compute hides: TP all-reduces, ring excess, blocking collectives."""
        return self.tp_comm_s + self.cp_exposed_s + self.cp_blocking_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_transfer_s + self.latency_s + self.launch_s


@dataclass(kw_only=True, frozen=True, slots=True)
class MemoryCost:
    """Per-device memory of a layout."""

    weights_bytes: float
    kv_bytes_per_token: float
    """KV bytes one device stores per token it holds (all layers, its heads)."""
    kv_capacity_tokens: int
    """Tokens of one request the KV shard group can hold with the memory left after the weights (and the states of
    the batch's requests)."""
    fits_weights: bool = field(default=True)
    state_bytes_per_request: float = 0.0
    """Bytes of one request's recurrent states on one device (all state layers, its heads; 0 without such layers):
    held by every PCP and DCP rank alike, whatever the request's length."""


class CostModel:
    """Predictions for one model on one kind of device."""

    def __init__(self, model: ModelConfig, hardware: HardwareSpec, precision: Precision | None = None):
        self.model, self.hw = model, hardware
        self.precision = precision if precision is not None else Precision()

    # ---- work ---------------------------------------------------------------------------------------------

    def linear_params_per_layer(self) -> float:
        """Matmul weights one token passes through per layer, averaged over the layers (shapes.py: a MoE
        layer's top-k and shared experts, MLA's latent projections)."""
        return linear_params(self.model, active=True) / self.model.num_hidden_layers

    def linear_flops(self, tokens: float) -> float:
        """All layers' projections and MLP for `tokens` rows (the LM head runs on one row: negligible)."""
        return 2.0 * self.linear_params_per_layer() * tokens * self.model.num_hidden_layers

    def attention_flops(self, new: float, cached: float, row_overhead: float = 0.0) -> float:
        """QK^T and PV of `new` queries over `cached` earlier keys plus themselves, causally, all layers; with
        `row_overhead` the work the kernel does on the causal diagonal's blocks beyond the pairs it keeps."""
        m = self.model
        pairs = new * cached + new * (new + 1) / 2 + new * row_overhead
        return float(attention_flops_per_pair(m)) * pairs * m.num_hidden_layers

    def elementwise_bytes_per_token(self, tp: int = 1) -> float:
        """Bytes one token moves per layer outside the matmuls and the attention kernel: two norms and two
        residual adds over the hidden state, rope on q and k, q/k/v and the output copied to and from the
        kernel's head-major layout, the gated activation (with its temporary), and the K/V store."""
        m = self.model
        hq, hkv = self.local_heads(tp)
        d, h, inter = m.head_dim, m.hidden_size, m.intermediate_size / tp
        elements = 10 * h + 2 * (hq + hkv) * d + 2 * (hq + 2 * hkv) * d + 2 * hq * d + 5 * inter + 4 * hkv * d
        return elements * self.precision.activation_bytes

    def attention_row_bytes(self, tp: int, calls: int) -> float:
        """HBM bytes one query row's attention moves on one TP rank over `calls` kernel calls: per call its Q read,
        its float32 partial and log-sum-exp written; past the first call, the merge's read and write of the running
        output and log-sum-exp."""
        hq, _ = self.local_heads(tp)
        d, e = self.model.head_dim, self.precision.activation_bytes
        per_call = hq * (d * e + 4 * d + 4)
        merge = 2 * hq * (4 * d + 4)
        return calls * per_call + (calls - 1) * merge

    def kv_row_bytes(self, tp: int) -> float:
        """Bytes of one token's K and V in one layer on a TP rank, as a ring moves them (activation precision):
        2 Hkv_l D e for grouped-query attention, one latent row (kv_lora_rank + qk_rope_head_dim) for MLA."""
        _, hkv = self.local_heads(tp)
        return full_cache_spec(self.model, hkv, self.precision.activation_bytes).bytes_per_token

    def local_heads(self, tp: int) -> tuple[int, int]:
        """(query heads, KV heads) one TP rank holds; KV heads are replicated when fewer than TP."""
        m = self.model
        return m.num_attention_heads // tp, kv_heads_per_rank(m.num_key_value_heads, tp)

    # ---- links --------------------------------------------------------------------------------------------

    def _crosses_nodes(self, group_size: int, stride: int) -> bool:
        return group_size > 1 and group_size * stride > self.hw.devices_per_node

    def _hop_latency(self, inter: bool) -> float:
        return self.hw.inter_node_latency_s if inter else self.hw.intra_node_latency_s

    def _wire_time(self, nbytes: float, inter: bool) -> float:
        hw = self.hw
        return nbytes / ((hw.inter_node_bw if inter else hw.intra_node_bw) * hw.collective_utilization)

    def p2p_link(self, nbytes: float, *, inter: bool) -> LinkTime:
        """One message to a neighbour: its bytes at the link's rate; one call and one hop of latency."""
        return LinkTime(transfer_s=self._wire_time(nbytes, inter),
                        latency_s=self.hw.collective_base_latency_s + self._hop_latency(inter))

    def ring_step(self, compute_s: float, nbytes: float, *, inter: bool) -> RingStep:
        """One ring step: the block in hand is computed while the next block travels, so the step takes
        max(compute, transfer) + latency (the message's fixed cost starts the transfer and is never hidden)."""
        link = self.p2p_link(nbytes, inter=inter)
        return RingStep(compute_s=compute_s, exposed_s=max(0.0, link.transfer_s - compute_s),
                        latency_s=link.latency_s)

    def all_reduce_link(self, nbytes: float, ranks: int) -> LinkTime:
        """Ring all-reduce over consecutive devices: inside each node, then across nodes on 1/g of the data; one
        call, 2 (g - 1) NVLink hops and 2 (nodes - 1) network hops of latency (NCCL's ring model)."""
        if ranks <= 1:
            return LinkTime(transfer_s=0.0, latency_s=0.0)
        hw = self.hw
        g = min(ranks, hw.devices_per_node)
        nodes = math.ceil(ranks / g)
        transfer = 2 * (g - 1) / g * self._wire_time(nbytes, False)
        latency = hw.collective_base_latency_s + 2 * (g - 1) * hw.intra_node_latency_s
        if nodes > 1:
            transfer += 2 * (nodes - 1) / nodes * self._wire_time(nbytes / g, True)
            latency += 2 * (nodes - 1) * hw.inter_node_latency_s
        return LinkTime(transfer_s=transfer, latency_s=latency)

    def all_reduce_time(self, nbytes: float, ranks: int) -> float:
        return self.all_reduce_link(nbytes, ranks).total_s

    def exchange_link(self, nbytes_per_peer: float, peers: int, *, inter: bool) -> LinkTime:
        """An all-gather or all-to-all where each rank sends `nbytes_per_peer` to each of `peers` others: it
        blocks, so it costs its bytes plus one call and one hop per peer of latency."""
        if peers <= 0:
            return LinkTime(transfer_s=0.0, latency_s=0.0)
        if not inter and self.hw.shared_memory_bw is not None:  # one host's collectives through shared memory
            return LinkTime(transfer_s=nbytes_per_peer * peers / self.hw.shared_memory_bw,
                            latency_s=self.hw.collective_base_latency_s + peers * self._hop_latency(inter))
        return LinkTime(transfer_s=self._wire_time(nbytes_per_peer * peers, inter),
                        latency_s=self.hw.collective_base_latency_s + peers * self._hop_latency(inter))

    def exchange_time(self, nbytes_per_peer: float, peers: int, *, inter: bool) -> float:
        return self.exchange_link(nbytes_per_peer, peers, inter=inter).total_s

    # ---- prefill ------------------------------------------------------------------------------------------

    def prefill(self, layout: ParallelDims, new: int, cached: int = 0, strategy: str = "ring") -> PrefillCost:
        """Time of one prefill step of `new` tokens after `cached` ones, whole model."""
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r}; the cost model knows {STRATEGIES}")
        m, hw, prec = self.model, self.hw, self.precision
        layers, tp, n = m.num_hidden_layers, layout.tp, layout.pcp
        ranks = tp * n
        busy = hw.busy_node_fraction if ranks > 1 else 1.0  # other devices of the node compute too
        linear_s = self.linear_flops(new) / ranks / (hw.gemm_rate(prec.weight_format) * busy)
        attention_flops = self.attention_flops(new, cached, hw.attention_row_overhead)
        attention_s = attention_flops / ranks / (hw.attention_rate() * busy)
        if hw.attention_row_traffic:
            calls = 1 if n == 1 or strategy == "allgather" else n  # ring steps each attend a row once more
            attention_s += layers * (new / n) * self.attention_row_bytes(tp, calls) / hw.memory_bw  # rows of a PCP rank
        elementwise_s = 0.0
        if hw.elementwise_bw is not None:
            elementwise_s = layers * new / ranks * self.elementwise_bytes_per_token(tp) / (hw.elementwise_bw * busy)
        rows = new / n  # tokens per PCP rank
        tp_link = self.all_reduce_link(rows * m.hidden_size * prec.activation_bytes, tp)
        comm = LayerComm()
        if n > 1:
            comm = self._cp_per_layer(layout, new, cached, strategy, attention_s / layers)
        moe = self._moe_pcp_link(layout, rows)
        kernels = layers * (LAYER_KERNELS + comm.extra_kernels) + STEP_KERNELS
        return PrefillCost(strategy=strategy, linear_s=linear_s, attention_s=attention_s, elementwise_s=elementwise_s,
                           tp_comm_s=2 * layers * tp_link.transfer_s,
                           cp_exposed_s=comm.exposed_s * layers,
                           cp_blocking_s=comm.blocking_s * layers + moe.transfer_s,
                           latency_s=layers * (2 * tp_link.latency_s + comm.latency_s) + moe.latency_s,
                           launch_s=kernels * hw.kernel_launch_s)

    def _moe_pcp_link(self, layout: ParallelDims, rows: float) -> LinkTime:
        """cpllm's sparse layers under PCP, whole model (docs/context_parallel.md "Mixture of experts under PCP"):
        each all-gathers its `rows` x hidden over PCP and reduce-scatters the partial of all PCP x rows back,
        both blocking (the TP all-reduce after them is the layer's usual one)."""
        m = self.model
        if m.moe is None or layout.pcp == 1:
            return LinkTime(transfer_s=0.0, latency_s=0.0)
        sparse = sum(m.moe.is_sparse(i) for i in range(m.num_hidden_layers))
        block = rows * m.hidden_size * self.precision.activation_bytes
        one = self.exchange_link(block, layout.pcp - 1, inter=self._crosses_nodes(layout.pcp, layout.tp))
        return LinkTime(transfer_s=2 * sparse * one.transfer_s, latency_s=2 * sparse * one.latency_s)

    def _ring(self, steps: int, compute_s: float, nbytes: float, inter: bool,
              blocking: LinkTime | None = None) -> LayerComm:
        """`steps` ring steps of `nbytes` each behind `compute_s` of compute each, then a blocking collective."""
        step = self.ring_step(compute_s, nbytes, inter=inter)
        after = blocking if blocking is not None else LinkTime(transfer_s=0.0, latency_s=0.0)
        return LayerComm(exposed_s=steps * step.exposed_s, blocking_s=after.transfer_s,
                         latency_s=steps * step.latency_s + after.latency_s, extra_kernels=steps * RING_STEP_KERNELS)

    def _cp_per_layer(self, layout: ParallelDims, new: int, cached: int, strategy: str,
                      attention_layer_s: float) -> LayerComm:
        """One layer's PCP communication under `strategy`."""
        m, prec = self.model, self.precision
        n, tp = layout.pcp, layout.tp
        cp = layout.cp_size
        hq, _ = self.local_heads(tp)
        d, e = m.head_dim, prec.activation_bytes
        rows = new / n
        inter = self._crosses_nodes(n, tp)
        kv_block = rows * self.kv_row_bytes(tp)
        q_block = rows * hq * d * e
        partial = rows * hq * (d + 1) * PARTIAL_BYTES
        new_share = self.attention_flops(new, 0) / max(self.attention_flops(new, cached), 1.0)
        if strategy == "allgather":
            gather = self.exchange_link(kv_block, n - 1, inter=inter)
            gather += self._context_gather(cached, cp, q_block, partial, inter)
            return LayerComm(blocking_s=gather.transfer_s, latency_s=gather.latency_s)
        if strategy == "ring":
            step_attention = attention_layer_s * new_share / n  # the new-token part of one block
            return self._ring(n - 1, step_attention, kv_block, inter,
                              self._context_gather(cached, cp, q_block, partial, inter))
        if strategy == "pass-kv":
            block = (new + cached) / n * self.kv_row_bytes(tp)
            return self._ring(n - 1, attention_layer_s / n, block, inter)
        ring = cp if cached > 0 else n
        kv_to_owners = kv_block / cp * PARTIAL_BYTES / e  # per peer: the 1/C of my rows it owns, sent as float32
        return self._ring(ring - 1, attention_layer_s / ring, q_block, inter,
                          self.exchange_link(partial + kv_to_owners, ring - 1, inter=inter))

    def _context_gather(self, cached: int, cp: int, q_block: float, partial: float, inter: bool) -> LinkTime:
        """cpllm's cached-context path of allgather and ring: gather queries over CP, return partials."""
        if cached <= 0 or cp <= 1:
            return LinkTime(transfer_s=0.0, latency_s=0.0)
        return self.exchange_link(q_block, cp - 1, inter=inter) + self.exchange_link(partial, cp - 1, inter=inter)

    # ---- decode -------------------------------------------------------------------------------------------

    def weight_bytes(self) -> float:
        """All weights of the model (embedding and LM head included)."""
        m = self.model
        linear = linear_params(m, active=False)  # every expert is stored
        embedding = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
        return (linear + embedding) * self.precision.weight_bytes

    def weights_per_device(self, layout: ParallelDims) -> float:
        """Weight bytes one device holds: the routed experts split over the TP x PCP MoE group, the rest over TP
        (replicated over PCP)."""
        experts = routed_expert_params(self.model) * self.precision.weight_bytes
        return (self.weight_bytes() - experts) / layout.tp + experts / (layout.tp * layout.pcp)

    def kv_bytes_per_token(self, tp: int) -> float:
        """KV bytes per token on one device (its KV heads, the layers that cache rows), from the layers' cache
        spec; a state layer caches none."""
        _, hkv = self.local_heads(tp)
        spec = full_cache_spec(self.model, hkv, self.precision.kv_bytes)
        return (self.model.num_hidden_layers - len(state_layer_specs(self.model, tp))) * spec.bytes_per_token

    def state_bytes_per_request(self, tp: int) -> float:
        """Bytes of one request's states on one device (every state layer's spec on a rank of TP = `tp`)."""
        return float(sum(spec.bytes_per_request for spec in state_layer_specs(self.model, tp).values()))

    def decode_step(self, layout: ParallelDims, context: int, batch: int = 1) -> float:
        """Seconds of one decode step of `batch` requests of `context` tokens each (the time per output token)."""
        m, hw = self.model, self.hw
        tp, n = layout.tp, layout.pcp
        hq, _ = self.local_heads(tp)
        local_batch = math.ceil(batch / n) if layout.kv_replicated else batch
        weights = self.weights_per_device(layout) / hw.memory_bw
        kv = local_batch * context / layout.kv_shard_size * self.kv_bytes_per_token(tp) / hw.memory_bw
        kv += 2 * batch * self.state_bytes_per_request(tp) / hw.memory_bw  # every PCP rank reads and writes each state
        hidden = local_batch * m.hidden_size * self.precision.activation_bytes
        per_layer = 2 * self.all_reduce_time(hidden, tp)
        shard_group = layout.kv_shard_size
        if shard_group > 1:  # partials of every query over the KV shard group (one collective per layer)
            inter = self._crosses_nodes(n, tp) and not layout.kv_replicated
            per_layer += self.exchange_time(local_batch * hq * (m.head_dim + 1) * PARTIAL_BYTES, shard_group - 1,
                                            inter=inter)
        return weights + kv + per_layer * m.num_hidden_layers

    # ---- memory -------------------------------------------------------------------------------------------

    def memory(self, layout: ParallelDims, requests: int = 1) -> MemoryCost:
        """Weights, KV bytes and the KV capacity of one device, the states of `requests` requests set aside first
        (the runner allocates the state slots out of the KV budget)."""
        weights = self.weights_per_device(layout)
        per_token = self.kv_bytes_per_token(layout.tp)
        states = self.state_bytes_per_request(layout.tp)
        free = self.hw.memory_bytes * USABLE_MEMORY - weights
        tokens = int(max(free - requests * states, 0) // per_token) * layout.kv_shard_size
        return MemoryCost(weights_bytes=weights, kv_bytes_per_token=per_token, kv_capacity_tokens=tokens,
                          fits_weights=free > 0, state_bytes_per_request=states)
