"""Device-path check: the engine and the CP attention layer on CUDA (or, with --cpu, on the CPU).

Run through scripts/gpu_check.sh, or directly:

    python scripts/gpu_check.py [--cpu] [--dump FILE] [--compare FILE]

Prints one line per check, "PASS name detail" or "FAIL name detail", and exits
non-zero when any check fails. Checks, on the chosen device:

- metadata: a step's metadata built with `device=` has every tensor on it;
- sdpa_*: `attention_with_lse` (fp32, bf16; GQA, causal, masks with fully
  masked rows) against the float64 reference, and that no call fell back to
  the matmul path (the fallback WARNING of cpllm.context_parallel.sdpa);
- cp_*: `PagedCPAttention` with several ranks simulated in one process (one
  thread per CP rank; the collectives of attention.py are swapped for in-process
  exchanges, so the layer's own code runs unchanged on the device): PCP 2/4,
  all-gather and ring, DCP 2, prefill chunks with context plus decodes, against
  a float64 reference over each request's whole sequence; also the KV writes;
- engine_*: the single-rank engine (`LLM`) in fp32 and bf16 on a tiny random
  Llama (tests/tiny_models.py) and a tiny random Qwen3-MoE (tests/tiny_moe_models.py) against transformers, teacher-forced: each
  greedy token is within a tolerance of the best token under transformers,
  its logprob and the prompt logprobs agree within it;
- with --compare FILE (written by a --cpu --dump FILE run): the same engine
  outputs against the CPU engine's.

On CUDA also (issue 28):
- triton_*: the Triton kernels (cpllm/kernels/triton_attention.py, triton_prefill.py) on the GPU against float64
  attention through torch: decode over the slot table with split-K (head sizes 64/128/256, GQA, long contexts),
  prefill of a chunk against its context in place; and one line timing the decode kernel against the SDPA path
  (gather + efficient attention) at batch 1, 32K keys;
- cp_triton_*: the CP layer's layouts with the gqa-triton backend (the engine's choice on CUDA);
- the engine checks twice: with CUDA graphs (the default on CUDA; the llama run must replay graphs) and with
  enforce_eager=True (`*_eager`), both against transformers (and, with --compare, the CPU engine).

The single-rank engine picks its device itself (cpllm.worker.worker.device_for:
cuda:0 when CUDA is visible); --cpu hides CUDA (CUDA_VISIBLE_DEVICES="") before
torch is imported, so the same code runs on the CPU. Without --cpu the check
fails at once when CUDA is not available.
"""

from __future__ import annotations

import os
import sys

CPU_ONLY = "--cpu" in sys.argv
if CPU_ONLY:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: the engine's device_for then picks the CPU

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402

from cpllm.context_parallel import attention as attention_module  # noqa: E402
from cpllm.context_parallel.attention import PagedCPAttention  # noqa: E402
from cpllm.distributed.parallel_context import ParallelContext  # noqa: E402
from cpllm.layers.registry import attention_backend  # noqa: E402
from cpllm.context_parallel.kv_layout import KVLayout  # noqa: E402
from cpllm.context_parallel.metadata import build_step_batch, iter_tensors  # noqa: E402
from cpllm.context_parallel.plan import RankCapabilities, plan_step  # noqa: E402
from cpllm.context_parallel.sdpa import attention_with_lse, reference_attention  # noqa: E402
from cpllm.distributed.parallel_dims import ParallelDims  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}

ENGINE_MODELS = {"llama": "", "qwen3_moe": "qwen3_moe_"}
"""Tiny random models the engine checks run on (tests/tiny_models.py, tests/tiny_moe_models.py), with the prefix of
their check names: a dense Llama, and Qwen3-MoE (per-head q/k norms, routed experts, one dense layer)."""

SDPA_TOL = {"fp32": 2e-5, "bf16": 2e-2}
"""Max |out - float64 reference| of one attention call (values of order 1; bf16 keeps 8 bits)."""
CP_TOL = {"fp32": 5e-5, "bf16": 2e-2}
"""Max |out - float64 reference| of the CP layer: partials merged in float32, one rounding to bf16 at the end."""
ENGINE_TOL = {"fp32": 2e-3, "bf16": 0.1}
"""Logprob agreement with transformers (fp32 model, float64 log-softmax), and the greedy margin
(measured on the CPU: fp32 ~5e-7, bf16 ~1e-2; a wrong attention is off by more than 1)."""
CROSS_TOL = {"fp32": 2e-3, "bf16": 0.1}
"""Logprob agreement between the CUDA engine and the CPU engine (--compare)."""

# --- reporting --------------------------------------------------------------------------------------------------


class Report:
    def __init__(self, prefix: str):
        self.prefix, self.failed, self.count = prefix, 0, 0

    def line(self, ok: bool, name: str, detail: str) -> None:
        self.count += 1
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {self.prefix}/{name} {detail}", flush=True)

    def run(self, name: str, fn, *args, **kwargs) -> None:
        """Run a check that returns (ok, detail); an exception is a FAIL with its last line."""
        start = time.monotonic()
        try:
            ok, detail = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every error is a reported failure
            traceback.print_exc(file=sys.stderr)
            ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self.line(ok, name, f"{detail} ({time.monotonic() - start:.1f}s)")


class CaptureWarnings(logging.Handler):
    """Collects WARNING records of cpllm.context_parallel.sdpa (the matmul-fallback notice)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# --- metadata ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """What build_step_batch reads of a scheduled chunk."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool = True
    prompt_logits: bool = False
    state_slot: int = -1  # a recurrent-state kind's slot (-1: the request keeps no state)
    num_draft_tokens: int = 0  # of the new tokens, the last this many are speculative drafts

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


def make_chunks(requests, layout: KVLayout) -> list[Chunk]:
    """requests: (context_len, num_new); each gets its own virtual blocks."""
    chunks, next_block = [], 1  # block 0 left for padding reads
    for i, (ctx, new) in enumerate(requests):
        blocks = layout.num_virtual_blocks(ctx + new)
        chunks.append(Chunk(request_id=str(i), token_ids=tuple([3] * new), start_pos=ctx,
                            block_table=tuple(range(next_block, next_block + blocks))))
        next_block += blocks
    return chunks


def check_metadata(device: torch.device):
    layout = KVLayout(num_shards=2, shard_rank=1, interleave=1, block_size=4)
    # prefill chunks with context, padded decodes; then decodes sharing a prefix (the shared-key batch)
    steps = [[(0, 9), (6, 5), (10, 1), (3, 1)], [(17, 1), (17, 1), (18, 1)]]
    moved = 0
    for requests in steps:
        chunks = make_chunks(requests, layout)
        plan = plan_step(chunks, RankCapabilities(pcp_size=2, pcp_rank=1, kv_shards=2))
        batch = build_step_batch(chunks, layout, 2, 1, lambda c: [len(c.token_ids) - 1], plan=plan, device=device,
                                 non_blocking=True)
        for path, tensor in iter_tensors(batch):
            if tensor.device.type != device.type:
                return False, f"{path} is on {tensor.device}"
            moved += 1
    return True, f"{moved} tensors on {device}"


# --- sdpa -------------------------------------------------------------------------------------------------------


def check_sdpa(device: torch.device, dtype_name: str):
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(0)
    worst, cases = 0.0, 0

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    for hq, hkv, q_len, k_len, causal, masked in [(4, 4, 7, 7, True, False), (8, 2, 5, 37, False, False),
                                                   (4, 2, 1, 70, False, True), (4, 1, 6, 33, False, True),
                                                   (4, 2, 9, 9, True, True)]:
        q, k, v = rand(2, hq, q_len, 16), rand(2, hkv, k_len, 16), rand(2, hkv, k_len, 16)
        mask = None
        if masked:
            keep = torch.rand(2, 1, q_len, k_len, generator=g) < 0.6
            keep[0, 0, 0] = False  # one fully masked row: out 0, lse -inf
            mask = keep.to(device)
        out, lse = attention_with_lse(q, k, v, scale=0.25, mask=mask, causal=causal)
        ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), scale=0.25,
                                               mask=None if mask is None else mask.cpu(), causal=causal)
        if out.device != q.device or out.dtype != dtype or lse.dtype != torch.float32:
            return False, f"out on {out.device} {out.dtype}, lse {lse.dtype}"
        if not torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse)):
            return False, "fully masked rows differ from the reference (lse = -inf)"
        finite = ~torch.isneginf(ref_lse)
        lse_err = (lse.cpu().double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
        worst = max(worst, (out.cpu().double() - ref_out).abs().max().item(), lse_err)
        cases += 1
    return worst <= SDPA_TOL[dtype_name], f"{cases} cases max_err={worst:.2e} tol={SDPA_TOL[dtype_name]:.0e}"


# --- CP attention, several ranks simulated in one process -------------------------------------------------------

_local = threading.local()


class SimGroup:
    """A process group of CP ranks that are threads of this process (members: cp ranks, in group-rank order)."""

    def __init__(self, members: list[int]):
        self.members, self.size = members, len(members)
        self.barrier = threading.Barrier(self.size, timeout=120)
        self.slots: list = [None] * self.size

    def rank(self) -> int:
        return self.members.index(_local.cp_rank)

    def exchange(self, value) -> list:
        """Every member's `value`, in group-rank order (an all-gather of Python objects)."""
        self.slots[self.rank()] = value
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return got


def _sim_all_gather(tensor, group, *, dim=0):
    return tensor if group is None else torch.cat(group.exchange(tensor), dim=dim)


def _sim_all_to_all(tensor, group, *, output_split_sizes=None, input_split_sizes=None):
    if group is None:
        return tensor
    if output_split_sizes is not None or input_split_sizes is not None:
        raise NotImplementedError("uneven all_to_all is not simulated")
    pieces = group.exchange(list(tensor.chunk(group.size)))
    return torch.cat([pieces[src][group.rank()] for src in range(group.size)])


class _Done:
    def __init__(self, tensor):
        self.tensor = tensor

    def wait(self):
        return self.tensor


def _sim_ring_exchange(tensor, group, *, recv_buffer=None):
    if group is None:
        return _Done(tensor)
    got = group.exchange(tensor.clone())
    return _Done(got[(group.rank() - 1) % group.size])


@contextmanager
def simulated_collectives():
    names = ("all_gather", "all_to_all", "ring_exchange")
    saved = {n: getattr(attention_module, n) for n in names}
    attention_module.all_gather = _sim_all_gather
    attention_module.all_to_all = _sim_all_to_all
    attention_module.ring_exchange = _sim_ring_exchange
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(attention_module, n, fn)


def run_cp_layer(requests, *, pcp: int, dcp: int, strategy: str, interleave: int, dtype: torch.dtype,
                 device: torch.device, block_size: int = 4, hq_total: int = 4, hkv: int = 2, head_dim: int = 16,
                 seed: int = 0, backend: str = "gqa"):
    """PagedCPAttention on pcp x dcp simulated CP ranks.

    Returns (max abs error vs float64, KV writes ok, {(out dtype, device type)})."""
    cp = pcp * dcp
    hq = hq_total // dcp  # each DCP rank holds its own query heads and the same (replicated) KV heads
    g = torch.Generator().manual_seed(seed)
    scale = head_dim**-0.5

    def rand(*shape):  # rounded to the model dtype once; the reference sees exactly these values
        return torch.randn(*shape, generator=g).to(dtype)

    layout0 = KVLayout(num_shards=cp, shard_rank=0, interleave=interleave, block_size=block_size)
    chunks = make_chunks(requests, layout0)
    num_slots = (max(b for c in chunks for b in c.block_table) + 1) * block_size
    ctx_k = [rand(ctx, hkv, head_dim) for ctx, _ in requests]
    ctx_v = [rand(ctx, hkv, head_dim) for ctx, _ in requests]
    new_q = [rand(new, hq_total, head_dim) for _, new in requests]
    new_k = [rand(new, hkv, head_dim) for _, new in requests]
    new_v = [rand(new, hkv, head_dim) for _, new in requests]
    pcp_groups = [SimGroup([p * dcp + d for p in range(pcp)]) if pcp > 1 else None for d in range(dcp)]
    cp_group = SimGroup(list(range(cp))) if cp > 1 else None
    ranks = []
    for c in range(cp):
        p, d = divmod(c, dcp)
        layout = KVLayout(num_shards=cp, shard_rank=c, interleave=interleave, block_size=block_size)
        k_pool, v_pool = rand(num_slots, hkv, head_dim), rand(num_slots, hkv, head_dim)  # garbage where unused
        for chunk, ck, cv in zip(chunks, ctx_k, ctx_v):
            for pos in range(chunk.start_pos):
                if layout.owner(pos) == c:
                    slot = layout.slot(pos, chunk.block_table)
                    k_pool[slot], v_pool[slot] = ck[pos], cv[pos]
        plan = plan_step(chunks, RankCapabilities(pcp_size=pcp, pcp_rank=p, kv_shards=cp))
        batch = build_step_batch(chunks, layout, pcp, p, lambda ch: [], plan=plan, device=device)
        meta = batch.attention
        n = meta.num_rows
        q = torch.zeros(n, hq, head_dim, dtype=dtype)
        k, v = torch.zeros(n, hkv, head_dim, dtype=dtype), torch.zeros(n, hkv, head_dim, dtype=dtype)
        for i, request in enumerate(meta.requests):
            for run in request.local_chunks:
                rows, toks = slice(run.row, run.row + run.length), slice(run.new_start, run.new_start + run.length)
                q[rows] = new_q[i][toks, d * hq : (d + 1) * hq]
                k[rows], v[rows] = new_k[i][toks], new_v[i][toks]
        comm = ParallelContext.at(ParallelDims(tp=dcp, pcp=pcp, dcp=dcp), pcp_rank=p, tp_rank=d,
                                  groups={"pcp": pcp_groups[d], "cp": cp_group, "kv_shard": cp_group},
                                  prefill_strategy=strategy)
        ranks.append(dict(layout=layout, meta=meta, comm=comm, d=d, q=q.to(device), k=k.to(device),
                          v=v.to(device), k_pool=k_pool.to(device), v_pool=v_pool.to(device)))

    results: list = [None] * cp
    errors: list = []

    def work(c: int) -> None:
        _local.cp_rank = c
        r = ranks[c]
        try:
            layer = PagedCPAttention(r["comm"], scale=scale, backend=attention_backend(backend))
            results[c] = layer(r["q"], r["k"], r["v"], r["k_pool"], r["v_pool"], r["meta"])
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
            for group in [*pcp_groups, cp_group]:
                if group is not None:
                    group.barrier.abort()  # release the other ranks at once

    with simulated_collectives():
        threads = [threading.Thread(target=work, args=(c,)) for c in range(cp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)] or errors
        raise real[0]

    worst, writes_ok, dtypes = 0.0, True, set()
    for c, r in enumerate(ranks):
        out, meta, d = results[c], r["meta"], r["d"]
        dtypes.add((out.dtype, out.device.type))
        for i, (request, chunk) in enumerate(zip(meta.requests, chunks)):
            ctx, new = requests[i]
            keys = torch.cat((ctx_k[i], new_k[i])).double()
            values = torch.cat((ctx_v[i], new_v[i])).double()
            for run in request.local_chunks:
                toks = torch.arange(run.new_start, run.new_start + run.length)
                q_ref = new_q[i][toks][:, d * hq : (d + 1) * hq].double()  # [L, hq, D]
                mask = torch.arange(ctx + new)[None, :] <= (ctx + toks)[:, None]  # causal by position
                want, _ = reference_attention(q_ref.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                              values.transpose(0, 1)[None], scale=scale, mask=mask)
                got = out[run.row : run.row + run.length].cpu().double()
                worst = max(worst, (got - want[0].transpose(0, 1)).abs().max().item())
            for pos in range(ctx, ctx + new):  # this rank stored exactly the new tokens it owns
                if r["layout"].owner(pos) == c:
                    slot = r["layout"].slot(pos, chunk.block_table)
                    writes_ok &= torch.equal(r["k_pool"][slot].cpu(), new_k[i][pos - ctx])
                    writes_ok &= torch.equal(r["v_pool"][slot].cpu(), new_v[i][pos - ctx])
    return worst, writes_ok, dtypes


CP_LAYOUTS = {  # name -> (pcp, dcp, strategy, interleave)
    "single": (1, 1, "allgather", 1),
    "pcp2_allgather": (2, 1, "allgather", 1),
    "pcp2_ring": (2, 1, "ring", 4),
    "pcp4_ring": (4, 1, "ring", 1),
    "dcp2": (1, 2, "allgather", 1),
    "pcp2_dcp2": (2, 2, "allgather", 2),
}
CP_STEPS = {
    # prefill chunks with and without context, plus decodes with padded context
    "mixed": [(0, 13), (9, 7), (22, 1), (5, 1), (0, 1), (30, 1)],
    # decodes only, sharing a 24-token prefix (the shared-key batch)
    "decodes": [(27, 1), (26, 1), (29, 1), (25, 1)],
}


def check_cp(device: torch.device, dtype_name: str, layout_name: str, step_name: str, backend: str = "gqa"):
    pcp, dcp, strategy, interleave = CP_LAYOUTS[layout_name]
    dtype = DTYPES[dtype_name]
    worst, writes_ok, dtypes = run_cp_layer(CP_STEPS[step_name], pcp=pcp, dcp=dcp, strategy=strategy,
                                            interleave=interleave, dtype=dtype, device=device, backend=backend)
    ok = worst <= CP_TOL[dtype_name] and writes_ok and dtypes == {(dtype, device.type)}
    detail = f"max_err={worst:.2e} tol={CP_TOL[dtype_name]:.0e} kv_writes={'ok' if writes_ok else 'WRONG'}"
    if dtypes != {(dtype, device.type)}:
        detail += f" out={sorted(str(x) for x in dtypes)}"
    return ok, detail


# --- Triton kernels on the GPU ---------------------------------------------------------------------------------

TRITON_TOL = {"fp32": 2e-5, "bf16": 3e-2, "fp16": 4e-3}
"""Max |kernel - float64| on values of order 1: float32 products (IEEE) for fp32; bf16/fp16 tensor-core products
with float32 accumulation, the probabilities rounded to the dtype before P @ V (FlashAttention's habit)."""
TRITON_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _ref_attention(q, k, v, scale, keep=None):
    """float64 attention of q [L, Hq, D] over k/v [S, Hkv, D] with an optional keep-mask [L, S] -> (out, lse)."""
    out, lse = reference_attention(q.double().cpu().transpose(0, 1)[None], k.double().cpu().transpose(0, 1)[None],
                                   v.double().cpu().transpose(0, 1)[None], scale=scale,
                                   mask=None if keep is None else keep.cpu())
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def check_triton_decode(device: torch.device, dtype_name: str):
    from cpllm.kernels.triton_attention import paged_decode_attention

    dtype, g, worst = TRITON_DTYPES[dtype_name], torch.Generator().manual_seed(1), 0.0
    for hq, hkv, d, lengths, splits in [(32, 8, 64, [4100, 0, 77], None), (16, 2, 128, [2048, 1], 5),
                                        (8, 1, 256, [900, 513], None), (4, 4, 128, [33], 1)]:
        pool_size = sum(lengths) + 100
        k_pool = torch.randn(pool_size, hkv, d, generator=g).to(dtype).to(device)
        v_pool = torch.randn(pool_size, hkv, d, generator=g).to(dtype).to(device)
        q = torch.randn(len(lengths), hq, d, generator=g).to(dtype).to(device)
        slots = torch.zeros(len(lengths), max(lengths) + 5, dtype=torch.long)
        for b, n in enumerate(lengths):
            slots[b, :n] = torch.randperm(pool_size, generator=g)[:n]
        out, lse = paged_decode_attention(q, k_pool, v_pool, slots.to(device), torch.tensor(lengths).to(device),
                                          d**-0.5, splits=splits)
        for b, n in enumerate(lengths):
            rows = slots[b, :n].to(device)
            ref_out, ref_lse = _ref_attention(q[b : b + 1], k_pool[rows], v_pool[rows], d**-0.5)
            if n == 0:
                if not (torch.isneginf(lse[b]).all() and (out[b] == 0).all()):
                    return False, "a row of length 0 is not (0, -inf)"
                continue
            worst = max(worst, (out[b].cpu().double() - ref_out[0]).abs().max().item(),
                        (lse[b].cpu().double() - ref_lse[0]).abs().max().item())
    return worst <= TRITON_TOL[dtype_name], f"max_err={worst:.2e} tol={TRITON_TOL[dtype_name]:.0e}"


def check_triton_prefill(device: torch.device, dtype_name: str):
    from cpllm.kernels.triton_prefill import prefill_attention

    dtype, g, worst = TRITON_DTYPES[dtype_name], torch.Generator().manual_seed(2), 0.0
    for hq, hkv, d, num_q, ctx in [(32, 8, 64, 300, 700), (16, 4, 128, 129, 0), (8, 2, 256, 70, 250)]:
        pool = [torch.randn(ctx + 64, hkv, d, generator=g).to(dtype).to(device) for _ in range(2)]
        q = torch.randn(num_q, hq, d, generator=g).to(dtype).to(device)
        new = [torch.randn(num_q, hkv, d, generator=g).to(dtype).to(device) for _ in range(2)]
        slots = torch.randperm(ctx + 64, generator=g)[:ctx].to(device)
        out, lse = prefill_attention(q, pool[0], pool[1], d**-0.5, slots=slots, new_k=new[0], new_v=new[1])
        keep = torch.ones(num_q, ctx + num_q, dtype=torch.bool)
        keep[:, ctx:] = torch.ones(num_q, num_q, dtype=torch.bool).tril()
        ref_out, ref_lse = _ref_attention(q, torch.cat((pool[0][slots], new[0])), torch.cat((pool[1][slots], new[1])),
                                          d**-0.5, keep)
        worst = max(worst, (out.cpu().double() - ref_out).abs().max().item(),
                    (lse.cpu().double() - ref_lse).abs().max().item())
    return worst <= TRITON_TOL[dtype_name], f"max_err={worst:.2e} tol={TRITON_TOL[dtype_name]:.0e}"


def time_triton_decode(device: torch.device):
    """Batch 1, 32K keys of Llama-3.2-1B's heads (32 / 8, 64), bf16: the kernel against the SDPA path."""
    from cpllm.layers.gqa import local_attention
    from cpllm.context_parallel.metadata import DecodeBatch
    from cpllm.kernels.triton_attention import paged_decode_attention

    n, pool_size = 32768, 40000
    k_pool, v_pool = (torch.randn(pool_size, 8, 64, dtype=torch.bfloat16, device=device) for _ in range(2))
    q = torch.randn(1, 32, 64, dtype=torch.bfloat16, device=device)
    slots = torch.randperm(pool_size, device=device)[:n].unsqueeze(0)
    lengths = torch.tensor([n], device=device)
    decode = DecodeBatch(requests=(0,), slots=slots, key_mask=None, rows=torch.zeros(1, 1, dtype=torch.long),
                         max_local_context=n, lengths=lengths)
    timings = {}
    for name, fn in [("triton", lambda: paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)),
                     ("sdpa", lambda: local_attention.attend_decode(q, k_pool, v_pool, decode, 0.125))]:
        fn()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize(device)
        timings[name] = (time.perf_counter() - start) / 20 * 1e6
    read = 2 * n * 8 * 64 * 2 / (timings["triton"] * 1e-6) / 1e9
    return True, (f"decode attention b1 32K keys bf16: triton {timings['triton']:.0f} us ({read:.0f} GB/s of K/V), "
                  f"sdpa path {timings['sdpa']:.0f} us")


# --- engine -----------------------------------------------------------------------------------------------------

ENGINE_MAX_TOKENS = 10


def engine_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab_size) for _ in range(20)]
    return [[rng.randrange(3, vocab_size)],
            [rng.randrange(3, vocab_size) for _ in range(9)],
            shared + [rng.randrange(3, vocab_size) for _ in range(6)],
            shared + [rng.randrange(3, vocab_size) for _ in range(3)]]


@torch.no_grad()
def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float64 log-probabilities of the next token after each position."""
    logits = hf_model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def _value(entry) -> float:
    return entry.logprob if hasattr(entry, "logprob") else float(entry)


def run_engine(folder: str, dtype_name: str, prompts: list[list[int]], enforce_eager: bool = False):
    """Two rounds of the same prompts: with prompt logprobs (which skip the prefix cache), then without (prefix-cache
    hits, decodes over cached context). Returns (results, device types of runner/KV/weights, prefix-hit tokens, CUDA
    graph replays of the driver rank)."""
    from cpllm import LLM, SamplingParams

    rounds = [SamplingParams(temperature=0, max_tokens=ENGINE_MAX_TOKENS, ignore_eos=True, logprobs=1,
                             prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=ENGINE_MAX_TOKENS, ignore_eos=True, logprobs=1)]
    results = []
    with LLM(folder, dtype=ENGINE_DTYPES[dtype_name], max_model_len=128, block_size=4, max_num_seqs=8,
             max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 22, enforce_eager=enforce_eager) as llm:
        device_types = set(llm.engine.executor.rank_info.devices)
        for params in rounds:
            for output in llm.generate([{"prompt_token_ids": p} for p in prompts], params):
                completion = output.outputs[0]
                ids = output.prompt_token_ids
                results.append(dict(
                    prompt=list(ids),
                    tokens=list(completion.token_ids),
                    logprobs=[_value(step[tok]) for step, tok in zip(completion.logprobs, completion.token_ids)],
                    prompt_logprobs=([] if output.prompt_logprobs is None else
                                     [_value(output.prompt_logprobs[i][ids[i]]) for i in range(1, len(ids))]),
                ))
        hits = llm.engine.scheduler.num_prefix_hit_tokens
        replays = llm.engine.executor.rank_stats().graph_replays
    return results, device_types, hits, replays


def compare_with_hf(results, hf_model, tol: float):
    """Teacher-forced on the engine's own sequences: (max logprob diff, worst greedy margin)."""
    worst_diff, worst_margin = 0.0, 0.0
    for r in results:
        seq = r["prompt"] + r["tokens"]
        lp = hf_logprobs(hf_model, seq)
        n = len(r["prompt"])
        for j, tok in enumerate(r["tokens"]):
            row = lp[n - 1 + j]
            worst_margin = max(worst_margin, (row.max() - row[tok]).item())  # 0 when the engine chose HF's argmax
            worst_diff = max(worst_diff, abs(row[tok].item() - r["logprobs"][j]))
        for i, value in enumerate(r["prompt_logprobs"]):
            worst_diff = max(worst_diff, abs(lp[i, seq[i + 1]].item() - value))
    return worst_diff, worst_margin


def check_engine(device: torch.device, dtype_name: str, folder: str, hf_model, prompts, store: dict, key: str,
                 enforce_eager: bool = False, want_replays: bool = False):
    results, device_types, hits, replays = run_engine(folder, dtype_name, prompts, enforce_eager)
    store[key] = results
    if want_replays and not replays:
        return False, "no decode step replayed a CUDA graph (see the 'no CUDA graphs' / 'eager' log lines)"
    if enforce_eager and replays:
        return False, f"{replays} graph replays under enforce_eager=True"
    if device_types != {device.type}:
        return False, f"runner, KV cache or weights on {sorted(device_types)}, expected {device.type}"
    tol = ENGINE_TOL[dtype_name]
    diff, margin = compare_with_hf(results, hf_model, tol)
    repeat_ok = all(a["tokens"] == b["tokens"] for a, b in zip(results[: len(prompts)], results[len(prompts):]))
    ok = diff <= tol and margin <= tol and hits > 0 and (repeat_ok or dtype_name != "fp32")
    return ok, (f"vs transformers: logprob_diff={diff:.2e} greedy_margin={margin:.2e} tol={tol:g} "
                f"prefix_hit_tokens={hits} repeat_same={repeat_ok} graph_replays={replays}")


def check_cross(dtype_name: str, mine: list, theirs: list):
    """This device's engine against the CPU engine's outputs (same prompts, same order)."""
    tol = CROSS_TOL[dtype_name]
    worst, same_tokens = 0.0, 0
    for a, b in zip(mine, theirs):
        worst = max(worst, max((abs(x - y) for x, y in zip(a["prompt_logprobs"], b["prompt_logprobs"])), default=0))
        n = 0
        while n < min(len(a["tokens"]), len(b["tokens"])) and a["tokens"][n] == b["tokens"][n]:
            n += 1
        worst = max(worst, max((abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n])), default=0))
        same_tokens += n == len(a["tokens"]) == len(b["tokens"])
    ok = worst <= tol and (same_tokens == len(mine) or dtype_name != "fp32") and len(mine) == len(theirs)
    return ok, f"logprob_diff={worst:.2e} tol={tol:g} identical_completions={same_tokens}/{len(mine)}"


# --- main -------------------------------------------------------------------------------------------------------


def _ensure_gguf_importable() -> None:
    """tests/tiny_models.py imports gguf at the top, for GGUF writers this check never calls. A machine without
    gguf (and without a registry to fetch it from) gets an inert stand-in, announced on stderr."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        def missing(*args, **kwargs):
            raise ImportError("gguf is not installed (stand-in module from scripts/gpu_check.py)")

        stub, quants = types.ModuleType("gguf"), types.ModuleType("gguf.quants")
        stub.GGMLQuantizationType = types.SimpleNamespace()
        stub.GGUFWriter = quants.dequantize = quants.quantize = missing
        stub.quants = quants
        sys.modules["gguf"], sys.modules["gguf.quants"] = stub, quants
        print("note: gguf is not installed; tests/tiny_models.py gets an inert stand-in (GGUF is not used here)",
              file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run every check on the CPU (CUDA hidden)")
    parser.add_argument("--dump", help="write the engine outputs to this JSON file (for --compare)")
    parser.add_argument("--compare", help="also compare the engine outputs with this JSON file of a --cpu run")
    parser.add_argument("--skip-engine", action="store_true", help="only the kernel and CP layer checks")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    fallback = CaptureWarnings()
    logging.getLogger("cpllm.context_parallel.sdpa").addHandler(fallback)
    torch.manual_seed(0)
    if not args.cpu and not torch.cuda.is_available():
        print("FAIL cuda/available torch.cuda.is_available() is False (use --cpu for the CPU variant)")
        return 1
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    name = "cpu" if args.cpu else f"cuda ({torch.cuda.get_device_name(0)})"
    print(f"# device {name}, torch {torch.__version__}", flush=True)
    report = Report(device.type)

    report.run("metadata_on_device", check_metadata, device)
    for dtype_name in DTYPES:
        report.run(f"sdpa_{dtype_name}", check_sdpa, device, dtype_name)
    for dtype_name in DTYPES:
        for layout_name in CP_LAYOUTS:
            for step_name in CP_STEPS:
                report.run(f"cp_{dtype_name}_{layout_name}_{step_name}", check_cp, device, dtype_name,
                           layout_name, step_name)
    if device.type == "cuda":  # the Triton kernels and the backend the engine picks on CUDA
        for dtype_name in TRITON_DTYPES:
            report.run(f"triton_decode_{dtype_name}", check_triton_decode, device, dtype_name)
            report.run(f"triton_prefill_{dtype_name}", check_triton_prefill, device, dtype_name)
        report.run("triton_decode_timing", time_triton_decode, device)
        for dtype_name in DTYPES:
            for layout_name in CP_LAYOUTS:
                for step_name in CP_STEPS:
                    report.run(f"cp_triton_{dtype_name}_{layout_name}_{step_name}", check_cp, device, dtype_name,
                               layout_name, step_name, "gqa-triton")

    if not args.skip_engine:
        _ensure_gguf_importable()
        from tiny_models import make_tiny_hf_model, save_tiny_hf_model
        from tiny_moe_models import make_tiny_moe_model, save_tiny_moe_model

        store: dict = {}
        with tempfile.TemporaryDirectory() as tmp:
            for model_name, prefix in ENGINE_MODELS.items():
                if model_name == "llama":
                    folder = save_tiny_hf_model(os.path.join(tmp, model_name), "llama", seed=1)
                    hf_model = make_tiny_hf_model("llama", seed=1)
                else:
                    folder = save_tiny_moe_model(os.path.join(tmp, model_name), model_name, seed=1)
                    hf_model = make_tiny_moe_model(model_name, seed=1)
                prompts = engine_prompts(hf_model.config.vocab_size)
                for dtype_name in DTYPES:
                    report.run(f"engine_{prefix}{dtype_name}", check_engine, device, dtype_name, folder, hf_model,
                               prompts, store, f"{prefix}{dtype_name}",
                               want_replays=device.type == "cuda" and model_name == "llama")
                    if device.type == "cuda":  # graphs off: the same checks on the eager steps
                        report.run(f"engine_{prefix}{dtype_name}_eager", check_engine, device, dtype_name, folder,
                                   hf_model, prompts, store, f"{prefix}{dtype_name}_eager", enforce_eager=True)
        if args.dump:
            with open(args.dump, "w") as f:
                json.dump(store, f)
        if args.compare:
            try:
                with open(args.compare) as f:
                    theirs = json.load(f)
            except (OSError, ValueError) as exc:
                theirs = {}
                report.line(False, "cpu_engine_outputs", f"cannot read {args.compare}: {exc}")
            for prefix in ENGINE_MODELS.values():
                for dtype_name in DTYPES:
                    key = f"{prefix}{dtype_name}"
                    for mine in (key, f"{key}_eager"):
                        report.run(f"engine_{mine}_vs_cpu_engine", check_cross, dtype_name, store.get(mine, []),
                                   theirs.get(key, []))

    # A fused kernel must have served every call: the matmul path is announced by a WARNING (logged once per reason).
    report.line(not fallback.messages, "no_matmul_fallback",
                "none" if not fallback.messages else " | ".join(fallback.messages)[:500])
    print(f"# {report.count - report.failed} passed, {report.failed} failed", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
