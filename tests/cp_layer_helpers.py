"""Rank side of tests/test_cp_attention_layer.py: PagedCPAttention in real gloo process groups.

Spawned processes (as many as the largest world) run every world in turn, largest first: for each, the ranks join
a fresh gloo process group (PCP x DCP ranks, TP = DCP so the DCP group exists, groups from ParallelGroups.build),
run every case of that world, send plain-data results through a queue and leave the group; the pytest process
judges the results. Each case is one step of the layer:

- every rank generates the whole K/V of every request and the queries of every new token from the same seed;
- it writes the cached context's K/V into its own pool only at the positions it owns (`KVLayout.slot`); every
  other slot holds NaN (block 0, which no request uses, holds finite garbage: padded decode rows read slot 0 under
  a -inf mask, and NaN * 0 is NaN);
- it builds q/k/v of its local rows from `StepBatch.token_ids` (each new token has a unique id) and runs the layer;
- it compares every local row, every head, with float64 causal attention over the request's whole sequence, and
  its pools with the exact expected content (context + the new tokens it owns; everything else unchanged).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch

from cpllm.config.engine import ParallelConfig
from cpllm.context_parallel import attention as attention_module
from cpllm.context_parallel.attention import PagedCPAttention
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.layers.gqa.backend import GQAPagedBackend
from cpllm.context_parallel.metadata import build_step_batch
from cpllm.layers.gqa.shared_keys import shared_key_view
from cpllm.context_parallel.sdpa import reference_attention
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.launch import init_distributed, shutdown_distributed
from cpllm.step import ScheduledChunk
from step_plans import eager_plan

HQ = 4
"""Query heads per TP rank (TP ranks of a DCP group hold different query heads)."""
HKV = 2
"""KV heads, the same on every rank of the CP group (replicated over the DCP group)."""
D = 8
BLOCK = 4
QK_GAIN = 4.0
"""q and k are this many unit normals: softmax is peaked, so a wrong key, position or mask moves the output by O(1)."""
SCALE = D**-0.5
TIMEOUT_S = 60.0
"""Bound of every collective (init_process_group and new_group); a broken step fails instead of hanging."""

STRATEGIES = ("allgather", "ring")
INTERLEAVES = (1, 2, 4)
SCENARIOS = ("mixed_shared", "mixed_padded", "decode_only", "short_decode", "fresh_only")


@dataclass(frozen=True, slots=True)
class Req:
    context: int
    """P: positions already cached."""
    new: int
    """T: new tokens in this step (1: a decode row)."""
    prefix: int = 0
    """Leading positions shared with the other requests that have a prefix (same blocks, same K/V)."""


def scenario(name: str, pcp: int, cp: int) -> list[Req]:
    """The requests of one step; sizes follow the layout so every edge case lands somewhere on every world."""
    vbs = BLOCK * cp  # tokens per virtual block
    if name == "mixed_shared":
        # Chunked-prefill continuations, a fresh prompt and three decodes over a common 2-virtual-block prefix
        # (contexts of different lengths, the first one starting a new block): the shared-key decode path.
        shared = 2 * vbs
        return [Req(shared, 1, shared), Req(vbs + 5, 7), Req(shared + 2, 1, shared), Req(0, 11),
                Req(shared + 1, 1, shared), Req(3, 5)]
    if name == "mixed_padded":
        # Unrelated decodes (padded path, one a 1-token prompt), a 2-token continuation (some PCP ranks hold none of
        # it), a fresh prompt, and a continuation whose last chunk is partial.
        return [Req(2, 2), Req(9, 1), Req(0, 13), Req(0, 1), Req(vbs + 6, 1), Req(2 * vbs + 3, 4 * pcp + 1)]
    if name == "decode_only":
        return [Req(5, 1), Req(0, 1), Req(vbs + 3, 1), Req(1, 1)]
    if name == "short_decode":
        # Decodes so short that most CP ranks hold no context for any of them (empty shards, lse = -inf).
        return [Req(1, 1), Req(0, 1)]
    if name == "ring_order":
        # Full head-tail chunks: every rank's tail chunk lies after every other rank's head chunk, so each rank
        # attends to every block that comes round the ring.
        return [Req(0, 6 * pcp)]
    if name == "fresh_only":
        # No cached context at all; the 3- and 2-token prompts leave some head-tail chunks empty.
        return [Req(0, 4 * pcp + 3), Req(0, 3), Req(0, 2)]
    raise ValueError(f"unknown scenario {name!r}")


def token_id(request: int, index: int) -> int:
    return 1 + request * 1000 + index  # 0 is the padding id


def block_tables(reqs: list[Req], cp: int) -> tuple[list[tuple[int, ...]], int]:
    """Virtual block tables (block 0 is left unused) and the number of blocks per rank's pool."""
    vbs = BLOCK * cp
    next_id, shared, tables = 1, None, []
    for req in reqs:
        needed = -(-(req.context + req.new) // vbs)
        table = []
        if req.prefix:
            assert req.prefix % vbs == 0
            if shared is None:
                shared = list(range(next_id, next_id + req.prefix // vbs))
                next_id += len(shared)
            table += shared
        private = needed - len(table)
        table += list(range(next_id, next_id + private))
        next_id += private
        tables.append(tuple(table))
    return tables, next_id


def make_data(reqs: list[Req], total_heads: int, seed: int):
    """Per request: K, V of every position [P + T, HKV, D] and queries of the new tokens [T, total_heads, D]."""
    g = torch.Generator().manual_seed(seed)
    prefix_len = max((r.prefix for r in reqs), default=0)
    k_prefix = torch.randn(prefix_len, HKV, D, generator=g) * QK_GAIN
    v_prefix = torch.randn(prefix_len, HKV, D, generator=g)
    data = []
    for req in reqs:
        length = req.context + req.new
        k = torch.randn(length, HKV, D, generator=g) * QK_GAIN
        v = torch.randn(length, HKV, D, generator=g)
        k[: req.prefix], v[: req.prefix] = k_prefix[: req.prefix], v_prefix[: req.prefix]
        q = torch.randn(req.new, total_heads, D, generator=g) * QK_GAIN
        data.append((q, k, v))
    return data


def reference_outputs(reqs, data, heads: slice) -> list[torch.Tensor]:
    """Float64 causal attention of each request's new tokens over its whole sequence: [T, HQ, D] each."""
    outs = []
    for req, (q, k, v) in zip(reqs, data):
        length = req.context + req.new
        q_pos = req.context + torch.arange(req.new)
        mask = torch.arange(length)[None, :] <= q_pos[:, None]  # [T, P + T], True keeps
        out, _ = reference_attention(q[:, heads].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], scale=SCALE, mask=mask)
        outs.append(out[0].transpose(0, 1))
    return outs


def _mismatched_slots(pool: torch.Tensor, expected: torch.Tensor) -> list[int]:
    same = (pool == expected) | (torch.isnan(pool) & torch.isnan(expected))
    return torch.nonzero(~same.flatten(1).all(dim=1)).flatten().tolist()


def run_case(groups: ParallelGroups, strategy: str, interleave: int, name: str, seed: int) -> dict:
    """One step of the layer on this rank; returns plain data for the pytest process to judge."""
    pcp, cp = groups.pcp_size, groups.cp_size
    layout = KVLayout(num_shards=cp, shard_rank=groups.cp_rank, interleave=interleave, block_size=BLOCK)
    comm = groups.context(prefill_strategy=strategy)
    reqs = scenario(name, pcp, cp)
    tables, num_blocks = block_tables(reqs, cp)
    data = make_data(reqs, groups.tp_size * HQ, seed)
    heads = slice(groups.tp_rank * HQ, (groups.tp_rank + 1) * HQ)
    chunks = [ScheduledChunk(request_id=str(i), token_ids=tuple(token_id(i, j) for j in range(r.new)),
                             start_pos=r.context, block_table=tables[i], sample=True, prompt_logits=False)
              for i, r in enumerate(reqs)]
    batch = build_step_batch(chunks, layout, pcp, groups.pcp_rank, lambda c: [len(c.token_ids) - 1],
                             plan=eager_plan(chunks, layout, pcp))
    meta = batch.attention

    # Pools: NaN everywhere, finite garbage in the unused block 0, the owned context positions filled in.
    g = torch.Generator().manual_seed(seed + 1)
    pools = []
    for _ in range(2):
        pool = torch.full((num_blocks * BLOCK, HKV, D), float("nan"))
        pool[:BLOCK] = torch.randn(BLOCK, HKV, D, generator=g) * 100
        pools.append(pool)
    k_pool, v_pool = pools
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    for i, (req, (_, k, v)) in enumerate(zip(reqs, data)):
        for pos in range(req.context + req.new):
            slot = layout.slot(pos, tables[i])
            if slot is None:
                continue
            expected_k[slot], expected_v[slot] = k[pos], v[pos]
            if pos < req.context:
                k_pool[slot], v_pool[slot] = k[pos], v[pos]

    # Local rows from the global tensors; padding rows hold NaN (no real row may read them).
    n = meta.num_rows
    q_loc = torch.full((n, HQ, D), float("nan"))
    k_loc, v_loc = torch.full((n, HKV, D), float("nan")), torch.full((n, HKV, D), float("nan"))
    held, problems = [], []
    for row in range(n):
        tid = int(batch.token_ids[row])
        if tid == 0:
            continue
        i, j = divmod(tid - 1, 1000)
        held.append(tid)
        if int(batch.positions[row]) != reqs[i].context + j:
            problems.append(f"row {row}: token {j} of request {i} at position {int(batch.positions[row])}, "
                            f"expected {reqs[i].context + j}")
        q, k, v = data[i]
        q_loc[row], k_loc[row], v_loc[row] = q[j, heads], k[reqs[i].context + j], v[reqs[i].context + j]

    out = PagedCPAttention(comm, scale=SCALE)(q_loc, k_loc, v_loc, k_pool, v_pool, meta)

    refs = reference_outputs(reqs, data, heads)
    max_err, worst, max_ref = 0.0, None, 0.0
    for row in range(n):
        tid = int(batch.token_ids[row])
        if tid == 0:
            continue
        i, j = divmod(tid - 1, 1000)
        err = (out[row].double() - refs[i][j]).abs()  # [HQ, D]
        max_ref = max(max_ref, refs[i][j].abs().max().item())
        value = float("inf") if torch.isnan(err).any() else err.max().item()
        if value > max_err or worst is None:
            head = int(torch.nan_to_num(err, nan=float("inf")).amax(dim=1).argmax())
            max_err = max(max_err, value)
            worst = f"request {i} (P={reqs[i].context}, T={reqs[i].new}) token {j} row {row} head {head}"
    for which, pool, expected in (("k", k_pool, expected_k), ("v", v_pool, expected_v)):
        bad = _mismatched_slots(pool, expected)
        if bad:
            problems.append(f"{which}_pool differs from context + owned new tokens at {len(bad)} slots, "
                            f"first {bad[:8]}")
    return {
        "max_err": max_err,
        "worst": worst,
        "max_ref": max_ref,
        "held": held,
        "problems": problems,
        "shared_keys": None if meta.decode is None else shared_key_view(meta.decode) is not None,
    }


class _LoggedTransfer:
    def __init__(self, transfer, step: int, events: list):
        self._transfer, self._step, self._events = transfer, step, events

    def wait(self):
        self._events.append(("wait", self._step))
        return self._transfer.wait()


def logged_ring(module, run) -> tuple[list, dict]:
    """Run `run()` with `module.ring_exchange` and the GQA backend's `attend` (every local attention call of the
    CP layer) logging post / wait / attend events."""
    events: list = []
    real_exchange, real_attend = module.ring_exchange, GQAPagedBackend.attend

    def exchange(tensor, group, **kwargs):
        step = sum(1 for e in events if e[0] == "post")
        events.append(("post", step))
        return _LoggedTransfer(real_exchange(tensor, group, **kwargs), step, events)

    def attend(*args, **kwargs):
        events.append(("attend",))
        return real_attend(*args, **kwargs)

    module.ring_exchange = exchange
    GQAPagedBackend.attend = staticmethod(attend)
    try:
        result = run()
    finally:
        module.ring_exchange = real_exchange
        GQAPagedBackend.attend = staticmethod(real_attend)
    return events, result


def ring_events(groups: ParallelGroups, seed: int) -> tuple[list, dict]:
    """A ring step of fresh prompts with ring_exchange and attend instrumented: the event order and the result."""
    return logged_ring(attention_module, lambda: run_case(groups, "ring", 1, "ring_order", seed))


def case_keys() -> list[tuple[str, int, str]]:
    return [(s, i, name) for s in STRATEGIES for i in INTERLEAVES for name in SCENARIOS]


def run_world(rank: int, world: int, port: int, pcp: int, dcp: int) -> dict:
    """Every case of one world on this rank, then the instrumented ring step; leaves the process group after."""
    parallel = ParallelConfig(tensor_parallel_size=dcp, prefill_context_parallel_size=pcp,
                              decode_context_parallel_size=dcp, distributed_timeout_s=TIMEOUT_S)
    groups = init_distributed(parallel, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                              timeout_s=TIMEOUT_S, backend="gloo")
    try:
        report = {"coords": (groups.pcp_rank, groups.tp_rank, groups.cp_rank), "cases": {}}
        for seed, key in enumerate(case_keys()):
            report["cases"][key] = run_case(groups, *key, seed=seed)
        report["ring"] = ring_events(groups, seed=1000)
        return report
    finally:
        shutdown_distributed()


def rank_main(rank: int, worlds: list[tuple[int, int, int]], results) -> None:
    """Entry point of one spawned process: global rank `rank` of every world `(pcp, dcp, port)` it belongs to.

    The worlds run one after the other (largest first) in the same processes, so the module starts only as many
    processes as its largest world. Puts `((pcp, dcp), rank, "ok", report)` per world, or
    `((pcp, dcp), rank, "error", traceback)` and stops.
    """
    torch.set_num_threads(1)
    for pcp, dcp, port in worlds:
        world = pcp * dcp
        if rank >= world:
            continue
        try:
            results.put(((pcp, dcp), rank, "ok", run_world(rank, world, port, pcp, dcp)))
        except BaseException:
            results.put(((pcp, dcp), rank, "error", traceback.format_exc()))
            return
