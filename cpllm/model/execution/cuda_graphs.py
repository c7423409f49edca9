"""Decode steps as CUDA graph replays: one graph per batch-size bucket, captured at start-up, the step's inputs
written into static buffers before each replay.

A decode step of a small model on a GPU is launch-bound: every layer is tens of kernels, each a Python call and a
launch. Captured once per batch size in `capture_sizes` (vLLM's `cudagraph_capture_sizes` idea: 1, 2, 4, then
every 8 up to max_num_seqs), the whole decoder stack replays as one launch. The graphs read only static tensors:
token ids, positions, the K/V write slots, the slot table [S, W] and the lengths of the decode rows (W: the
longest local context the engine allows). A step of B rows takes the smallest bucket S >= B; its rows fill the
first B rows of the buffers and rows B..S-1 repeat row B-1 (the same token at the same position: the same K/V
written to the same slot, the same attention, outputs dropped), so no padding row touches another request's
slots. The attention kernel reads each row's length from device memory (cpllm/kernels/triton_attention.py), so one
graph serves every context length up to W.

What is decided here without a GPU (and tested on the CPU, tests/test_cuda_graphs.py): the buckets, the static
buffers and their fill, and every reason a step or a model runs eager instead (`model_reason`, `step_reason`),
each logged once. Which bucket a step replays is its plan's (`StepPlan.graph_bucket`, chosen by plan.py from the
captured sizes and width, which the rank's capabilities carry). Capture and replay (`DecodeGraphs`) run on CUDA
only and are checked by scripts/gpu_check.sh (graphs on and off, same outputs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cpllm.context_parallel.metadata import AttentionMetadata, DecodeBatch, StepBatch
from cpllm.context_parallel.plan import StepPath, StepPlan, bucket_for
from cpllm.layers.registry import GRAPH_CAPTURABLE

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
"""Largest bucket (vLLM's default bound): bigger decode batches are compute-bound and gain little from a graph."""
STATIC_SLOT_BYTES = 256 << 20
"""Bytes the static slot table may take (int32, S x W): buckets beyond it are not captured (logged)."""


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """The batch sizes to capture for a scheduler of `max_num_seqs` rows: 1, 2, 4, then multiples of 8, up to
    min(max_num_seqs, limit), that bound itself included (so every decode batch the scheduler forms fits one)."""
    top = max(1, min(max_num_seqs, limit))
    sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    return tuple(sorted(sizes))


def sizes_within_memory(sizes: tuple[int, ...], width: int, budget: int = STATIC_SLOT_BYTES) -> tuple[int, ...]:
    """The buckets whose static slot table (int32, size x width) fits `budget` bytes."""
    return tuple(s for s in sizes if s * width * 4 <= budget)


class FallbackLog:
    """Why steps ran eager: each reason logged once (INFO), every occurrence counted."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def note(self, reason: str) -> None:
        if reason not in self.counts:
            logger.info("decode step: eager, not a CUDA graph replay (%s); logged once", reason)
        self.counts[reason] = self.counts.get(reason, 0) + 1


def model_reason(*, device: torch.device, enforce_eager: bool, backend_name: str, replica_ranks: int,
                 scored_layers: bool, moe: bool) -> str | None:
    """Why this rank captures no graph at all (None: it captures). Kept to what was checked on a device: one rank
    per replica (NCCL collectives inside a graph are left for a run that can test them), the Triton backend (the
    SDPA path reads masks on the host), layers without windows, soft-caps or sinks (their decode view is built on
    the host) and dense MLPs (routing has data-dependent shapes)."""
    if device.type != "cuda":
        return f"device {device.type}: CUDA graphs need a CUDA device"
    if enforce_eager:
        return "enforce_eager=True"
    if backend_name not in GRAPH_CAPTURABLE:
        return (f"attention backend {backend_name!r}: graphs need the Triton kernels ({', '.join(GRAPH_CAPTURABLE)}; "
                "is triton installed?)")
    if replica_ranks > 1:
        return f"a replica of {replica_ranks} ranks: collectives inside graphs are not captured yet"
    if scored_layers:
        return "layers with a sliding window, soft-cap or sinks"
    if moe:
        return "mixture-of-experts layers (data-dependent expert shapes)"
    return None


def step_reason(batch: StepBatch, sizes: tuple[int, ...], width: int) -> str | None:
    """Why this step runs eager although graphs exist (None: it replays a bucket). Read from shapes and plain
    fields only: no device tensor is read back."""
    meta = batch.attention
    if meta.plan.path is not StepPath.ONE_SHARD:
        return f"plan {meta.plan.value}"
    decode = meta.decode
    if decode is None or meta.plan.replica_sync:
        return "no decode rows on this rank"
    rows = batch.token_ids.shape[0]
    if decode.slots.shape[0] != rows or decode.lengths is None or decode.shared_keys:
        return "decode rows are not every row of the step"
    if meta.write_slots.shape[0] != rows:
        return "a decode row whose K/V another rank stores"
    if bucket_for(sizes, rows) is None:
        return f"batch of {rows} rows over the largest captured size {sizes[-1] if sizes else 0}"
    if decode.slots.shape[1] > width:
        return f"context of {decode.slots.shape[1]} slots over the captured width {width}"
    return None


@dataclass(frozen=True, slots=True)
class StaticDecodeInputs:
    """The tensors every captured graph reads (bucket S uses rows [:S] of each), on the rank's device."""

    token_ids: torch.Tensor
    """[S_max] long."""
    positions: torch.Tensor
    """[S_max] long."""
    write_slots: torch.Tensor
    """[S_max] long: pool slot of each row's new K/V."""
    rows: torch.Tensor
    """[S_max] long, 0..S_max-1: row r is decode row r and writes its own K/V (never changes)."""
    slots: torch.Tensor
    """[S_max, W] int32: each row's context slots (past its length: stale, never read)."""
    lengths: torch.Tensor
    """[S_max] int32: each row's context length (itself included)."""

    @classmethod
    def allocate(cls, max_size: int, width: int, device: torch.device | str) -> "StaticDecodeInputs":
        """Zeros: row r writes slot 0 and reads none until the first fill (what warm-up and capture see)."""
        zeros = dict(dtype=torch.long, device=device)
        return cls(token_ids=torch.zeros(max_size, **zeros), positions=torch.zeros(max_size, **zeros),
                   write_slots=torch.zeros(max_size, **zeros), rows=torch.arange(max_size, **zeros),
                   slots=torch.zeros(max_size, width, dtype=torch.int32, device=device),
                   lengths=torch.zeros(max_size, dtype=torch.int32, device=device))

    @property
    def width(self) -> int:
        return self.slots.shape[1]

    def fill(self, batch: StepBatch, size: int) -> None:
        """Copy a decode step of B <= size rows into rows [:size] (device-side copies, no host sync): rows [:B] are
        the step's, rows [B:size] repeat row B-1."""
        meta, decode = batch.attention, batch.attention.decode
        rows, width = batch.token_ids.shape[0], decode.slots.shape[1]
        pad = size - rows
        self.token_ids[:rows].copy_(batch.token_ids)
        self.positions[:rows].copy_(batch.positions)
        self.write_slots[:rows].index_copy_(0, meta.write_rows, meta.write_slots)
        self.slots[:rows, :width].copy_(decode.slots)
        self.lengths[:rows].copy_(decode.lengths)
        if pad:
            last = slice(rows - 1, rows)
            for buffer in (self.token_ids, self.positions, self.write_slots, self.lengths):
                buffer[rows:size].copy_(buffer[last].expand(pad))
            self.slots[rows:size, :width].copy_(self.slots[last, :width].expand(pad, width))

    def metadata(self, size: int, layout) -> AttentionMetadata:
        """The step metadata a bucket's graph is captured with: views of rows [:size] of the buffers."""
        rows = self.rows[:size]
        decode = DecodeBatch(requests=tuple(range(size)), slots=self.slots[:size], key_mask=None,
                             rows=rows.unsqueeze(0), max_local_context=self.width, lengths=self.lengths[:size])
        return AttentionMetadata(num_rows=size, requests=(), write_rows=rows, write_slots=self.write_slots[:size],
                                 has_context=True, has_new=False, decode=decode, rows_same_over_pcp=True,
                                 plan=StepPlan(path=StepPath.ONE_SHARD), kv_layout=layout)


class DecodeGraphs:
    """The captured decode graphs of one CUDA rank and their static buffers (see the module). Built by
    `decode_graphs_for`, which checks `model_reason` first; `run` replays a step or returns None (eager)."""

    def __init__(self, model, kv_caches, layout, sizes: tuple[int, ...], width: int, device: torch.device):
        self.model, self.kv_caches, self.layout = model, kv_caches, layout
        self.sizes, self.device = sizes, device
        self.static = StaticDecodeInputs.allocate(max(sizes), width, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        """Each bucket's hidden states [S, hidden] (the graph's output tensor, rewritten by every replay)."""
        self.fallbacks = FallbackLog()
        self.replays = 0
        """Steps run as a replay (for the stats and tests)."""

    def _forward(self, size: int) -> torch.Tensor:
        s = self.static
        return self.model(s.token_ids[:size], s.positions[:size], self.kv_caches, s.metadata(size, self.layout))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, into one memory pool. The warm-up runs write K/V to
        slot 0 (the zeroed buffers'), which is zeroed again afterwards: no request holds a slot yet."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in sorted(self.sizes, reverse=True):
                for _ in range(2):  # the first compiles the Triton kernels and sets up cuBLAS
                    self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for size in sorted(self.sizes, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.zero_scratch()

    def zero_scratch(self) -> None:
        """Slot 0 of every pool back to zeros (the pools' invariant, cpllm/worker/kv_cache.py `zeroed_pool`)."""
        with torch.no_grad():
            for k_pool, v_pool in self.kv_caches:
                k_pool[0].zero_()
                v_pool[0].zero_()

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """Hidden states [B, hidden] of a decode step by one replay of the bucket its plan chose
        (`StepPlan.graph_bucket`: cpllm/context_parallel/plan.py), or None where the step is not in the form the
        graphs read (the caller runs it eager; the reason is logged once)."""
        reason = step_reason(batch, self.sizes, self.static.width)
        if reason is not None:
            self.fallbacks.note(reason)
            return None
        size, rows = batch.attention.plan.graph_bucket, batch.token_ids.shape[0]
        if size not in self.graphs or size < rows:
            raise ValueError(f"graph bucket {size!r} for {rows} rows: the step was planned for no captured size "
                             f"that holds it ({self.sizes})")
        self.static.fill(batch, size)
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][:rows]


    def note_eager(self, batch: StepBatch) -> None:
        """Count (and log once) why a decode step the plan gave no bucket runs eager."""
        self.fallbacks.note(step_reason(batch, self.sizes, self.static.width) or "several KV groups")


def _has_scored_layers(model) -> bool:
    from cpllm.context_parallel.attention import PagedCPAttention
    return any(isinstance(m, PagedCPAttention) and m.mods is not None for m in model.modules()) \
        or getattr(model.config, "attention_sinks", False)


def _has_moe(model) -> bool:
    return any("moe" in type(m).__name__.lower() for m in model.modules())


def decode_graphs_for(model, kv_caches, layout, *, device: torch.device, enforce_eager: bool, replica_ranks: int,
                      max_num_seqs: int, max_local_context: int) -> DecodeGraphs | None:
    """This rank's captured decode graphs, or None with the reason logged (INFO). A capture that fails is logged
    as a WARNING with its error, and the rank runs eager: graphs are an optimisation, never a requirement."""
    reason = model_reason(device=device, enforce_eager=enforce_eager,
                          backend_name=getattr(model.attention_backend, "name", "?"), replica_ranks=replica_ranks,
                          scored_layers=_has_scored_layers(model), moe=_has_moe(model))
    if reason is not None:
        logger.info("decode steps: no CUDA graphs (%s)", reason)
        return None
    width = -(-max_local_context // layout.block_size) * layout.block_size
    wanted = capture_sizes(max_num_seqs)
    sizes = sizes_within_memory(wanted, width)
    if not sizes:
        logger.info("decode steps: no CUDA graphs (a static slot table of %d slots does not fit %d MiB even for "
                    "one row)", width, STATIC_SLOT_BYTES >> 20)
        return None
    if sizes != wanted:
        logger.info("decode steps: CUDA graphs up to batch %d (larger buckets' slot tables over %d MiB)", sizes[-1],
                    STATIC_SLOT_BYTES >> 20)
    graphs = DecodeGraphs(model, kv_caches, layout, sizes, width, device)
    try:
        graphs.capture()
    except Exception as exc:  # noqa: BLE001 - any capture failure leaves the rank eager, loudly
        graphs.zero_scratch()
        logger.warning("decode steps: CUDA graph capture failed, running eager: %s: %s", type(exc).__name__, exc)
        return None
    logger.info("decode steps: CUDA graphs captured for batch sizes %s (context up to %d slots)",
                ",".join(map(str, sizes)), width)
    return graphs
