"""Rank side of tests/test_cp_window.py: PagedCPAttention with a sliding window, soft-capping and sinks in real gloo
process groups, against float64 attention computed directly from positions.

The harness is tests/cp_layer_helpers.py's (the same block tables, data, pools full of NaN but for the context this
rank owns, local rows rebuilt from token ids); what differs is the reference (window mask, tanh soft-cap, sink in
the denominator), the layouts (sharded and replicated), and a backend that counts its attend calls, which the
pytest process compares with a brute-force count of the pieces the window leaves non-empty.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch

import cp_layer_helpers as base
from cpllm.config.engine import ParallelConfig
from cpllm.context_parallel.attention import PagedCPAttention
from cpllm.layers.gqa.backend import GQAPagedBackend
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import build_step_batch
from cpllm.context_parallel.sdpa import reference_attention
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.launch import init_distributed, shutdown_distributed
from cpllm.layers.window.modifier import score_mods
from cpllm.step import FREED_BLOCK, ScheduledChunk
from step_plans import eager_plan

Req = base.Req
HQ, HKV, D, BLOCK, SCALE = base.HQ, base.HKV, base.D, base.BLOCK, base.SCALE
INTERLEAVES = (1, BLOCK)


@dataclass(frozen=True, slots=True)
class Mods:
    """One layer's score modifiers in a case."""

    window: int | None
    softcap: float | None
    sinks: bool

    @property
    def name(self) -> str:
        return f"w{self.window}-c{self.softcap}-s{int(self.sinks)}"


MODS = (Mods(8, None, False), Mods(13, None, False), Mods(None, 10.0, True), Mods(8, 10.0, True))
"""Windows of 8 and 13 tokens alone, soft-capping with sinks and no window, all three together. With a soft-cap of
10 every score lies in [-10, 10] and the sinks are drawn in [6, 11]: each sink moves the outputs by O(0.1-1), so a
sink counted once per shard (or per piece) is off by far more than the tolerance."""
SCENARIOS = ("chunked_mixed", "fresh_long", "decode_only", "one_decode")


def scenario(name: str, window: int) -> list[Req]:
    """Prompts and contexts 3-6x the window (8 when the case has none: the same shapes)."""
    w = window
    if name == "chunked_mixed":
        # A chunked-prefill continuation on a long context, a fresh prompt, a continuation shorter than the
        # window, and decodes: one far past the window, one inside it, one at its edge.
        return [Req(3 * w + 2, 2 * w + 3), Req(0, 4 * w + 1), Req(5 * w, 1), Req(w - 3, 1), Req(4 * w + 5, 3),
                Req(2 * w, 1)]
    if name == "fresh_long":
        return [Req(0, 6 * w), Req(0, 3 * w + 1)]
    if name == "decode_only":
        return [Req(4 * w, 1), Req(3, 1), Req(6 * w + 2, 1), Req(w, 1)]
    if name == "one_decode":
        return [Req(6 * w + 5, 1)]
    raise ValueError(name)


def freed_table(table: tuple[int, ...], req: Req, cp: int, window: int) -> tuple[int, ...]:
    """The table as a windowed KV group holds it: FREED_BLOCK for each virtual block wholly before the window of
    the request's first query of the step: a slot computed from the -1 entry is negative, so reading one raises
    and fails the case (the layer must read in-window slots only)."""
    first_kept = max(req.context - window + 1, 0) // (BLOCK * cp)
    return tuple(FREED_BLOCK if b < first_kept else block for b, block in enumerate(table))


def case_window(mods: Mods) -> int:
    return mods.window if mods.window is not None else 8


class CountingBackend(GQAPagedBackend):
    """The GQA backend counting the local attention calls of the CP layer."""

    def __init__(self):
        self.calls = {"attend": 0, "attend_scored": 0, "attend_decode": 0, "attend_decode_whole": 0,
                      "attend_gathered_decode": 0}

    def _count(self, name, method, *args, **kwargs):
        self.calls[name] += 1
        return method(*args, **kwargs)

    def attend(self, *a, **k):
        return self._count("attend", GQAPagedBackend.attend, *a, **k)

    def attend_decode(self, *a, **k):
        return self._count("attend_decode", GQAPagedBackend.attend_decode, *a, **k)

    def attend_decode_whole(self, *a, **k):
        return self._count("attend_decode_whole", GQAPagedBackend.attend_decode_whole, *a, **k)

    def attend_gathered_decode(self, *a, **k):
        return self._count("attend_gathered_decode", GQAPagedBackend.attend_gathered_decode, *a, **k)


class CountingMods:
    """A layer's score modifier counting, into a CountingBackend's `calls`, the pieces it attends with its own math
    (masked or soft-capped: "attend_scored"); the plain ones reach the backend's `attend` and count there."""

    def __init__(self, mods, calls: dict):
        self._mods, self._calls = mods, calls

    def __getattr__(self, name):
        return getattr(self._mods, name)

    def attend(self, backend, scale, q, k, v, piece):
        if piece.mask is not None or self._mods.softcap is not None:
            self._calls["attend_scored"] += 1
        return self._mods.attend(backend, scale, q, k, v, piece)


def reference_outputs(reqs, data, heads: slice, mods: Mods, sinks: torch.Tensor | None):
    """Float64 attention of each request's new tokens over its whole sequence with the window mask, the tanh
    soft-cap and the sink in each head's denominator, computed directly: [T, HQ, D] each, and the same without
    the sinks (how much they move the outputs)."""
    outs, plain = [], []
    for req, (q, k, v) in zip(reqs, data):
        length = req.context + req.new
        q_pos = req.context + torch.arange(req.new)
        k_pos = torch.arange(length)
        keep = k_pos[None, :] <= q_pos[:, None]  # [T, P + T]
        if mods.window is not None:
            keep &= k_pos[None, :] > q_pos[:, None] - mods.window
        qd, kd, vd = (x.double() for x in (q[:, heads], k, v))
        groups = qd.shape[1] // kd.shape[1]
        scores = torch.einsum("thd,shd->ths", qd, kd.repeat_interleave(groups, dim=1)) * SCALE  # [T, HQ, S]
        if mods.softcap is not None:
            scores = mods.softcap * torch.tanh(scores / mods.softcap)
        scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("ths,shd->thd", probs, vd.repeat_interleave(groups, dim=1))
        plain.append(out)
        if sinks is not None:
            denominator = torch.exp(scores).sum(-1) + torch.exp(sinks.double())  # [T, HQ]
            out = torch.einsum("ths,shd->thd", torch.exp(scores) / denominator[..., None],
                               vd.repeat_interleave(groups, dim=1))
        outs.append(out)
    return outs, plain


def run_case(groups: ParallelGroups, strategy: str, interleave: int, name: str, mods: Mods, seed: int) -> dict:
    """One step of the windowed layer on this rank: errors against the reference, pool check, call counts."""
    replicated = groups.dims.kv_replicated
    pcp, cp = groups.pcp_size, groups.dims.kv_shard_size
    layout = KVLayout(num_shards=cp, shard_rank=groups.kv_shard_rank, interleave=interleave, block_size=BLOCK)
    comm = groups.context(prefill_strategy=strategy)
    reqs = scenario(name, case_window(mods))
    tables, num_blocks = base.block_tables(reqs, cp)
    if mods.window is not None:
        tables = [freed_table(t, r, cp, mods.window) for t, r in zip(tables, reqs)]
    data = base.make_data(reqs, groups.tp_size * HQ, seed)
    heads = slice(groups.tp_rank * HQ, (groups.tp_rank + 1) * HQ)
    g = torch.Generator().manual_seed(seed + 7)
    all_sinks = torch.rand(groups.tp_size * HQ, generator=g) * 5 + 6  # [6, 11]: comparable to the capped lse
    sinks = all_sinks[heads].float() if mods.sinks else None
    chunks = [ScheduledChunk(request_id=str(i), token_ids=tuple(base.token_id(i, j) for j in range(r.new)),
                             start_pos=r.context, block_table=tables[i], sample=True, prompt_logits=False)
              for i, r in enumerate(reqs)]
    batch = build_step_batch(chunks, layout, pcp, groups.pcp_rank, lambda c: [len(c.token_ids) - 1],
                             plan=eager_plan(chunks, layout, pcp, replicated=replicated, strategy=strategy))
    meta = batch.attention

    pools = []
    for _ in range(2):
        pool = torch.full((num_blocks * BLOCK, HKV, D), float("nan"))
        pool[:BLOCK] = torch.randn(BLOCK, HKV, D, generator=g) * 100
        pools.append(pool)
    k_pool, v_pool = pools
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    held_ids = {int(t) for t in batch.token_ids.tolist() if t}
    for i, (req, (_, k, v)) in enumerate(zip(reqs, data)):
        for pos in range(req.context + req.new):
            if tables[i][pos // (BLOCK * cp)] == FREED_BLOCK:
                continue  # slid out of the window: the scheduler gave the block back
            slot = layout.slot(pos, tables[i])
            if slot is None:
                continue
            if pos < req.context:
                k_pool[slot], v_pool[slot] = k[pos], v[pos]
            elif req.new == 1 and not meta.has_new and base.token_id(i, 0) not in held_ids:
                continue  # replicated layout, decode-only step: another PCP rank computes and stores it
            expected_k[slot], expected_v[slot] = k[pos], v[pos]

    n = meta.num_rows
    q_loc = torch.full((n, HQ, D), float("nan"))
    k_loc, v_loc = torch.full((n, HKV, D), float("nan")), torch.full((n, HKV, D), float("nan"))
    rows = []
    for row in range(n):
        tid = int(batch.token_ids[row])
        if tid == 0:
            continue
        i, j = divmod(tid - 1, 1000)
        rows.append((row, i, j))
        q, k, v = data[i]
        q_loc[row], k_loc[row], v_loc[row] = q[j, heads], k[reqs[i].context + j], v[reqs[i].context + j]

    backend = CountingBackend()
    layer_mods = score_mods(window=mods.window, softcap=mods.softcap)
    layer_mods = None if layer_mods is None else CountingMods(layer_mods, backend.calls)
    layer = PagedCPAttention(comm, SCALE, backend, mods=layer_mods)
    out = layer(q_loc, k_loc, v_loc, k_pool, v_pool, meta, sinks=sinks)

    refs, plain = reference_outputs(reqs, data, heads, mods, sinks)
    max_err, worst, sink_effect = 0.0, None, 0.0
    for row, i, j in rows:
        err = (out[row].double() - refs[i][j]).abs()
        value = float("inf") if torch.isnan(err).any() else err.max().item()
        sink_effect = max(sink_effect, (refs[i][j] - plain[i][j]).abs().max().item())
        if value > max_err or worst is None:
            max_err, worst = max(max_err, value), f"request {i} (P={reqs[i].context}, T={reqs[i].new}) token {j}"
    problems = []
    for which, pool, expected in (("k", k_pool, expected_k), ("v", v_pool, expected_v)):
        bad = base._mismatched_slots(pool, expected)
        if bad:
            problems.append(f"{which}_pool differs at {len(bad)} slots, first {bad[:8]}")
    return {"max_err": max_err, "worst": worst, "problems": problems, "sink_effect": sink_effect,
            "calls": dict(backend.calls), "plan": meta.plan.value, "held": sorted(held_ids)}


def world_strategies(pcp: int, replicated: bool) -> tuple[str, ...]:
    if pcp == 1:
        return ("allgather",)  # one PCP rank: every strategy is the same local attention
    return ("allgather", "ring") if replicated else ("allgather", "ring", "pass-q")


def case_keys(pcp: int, replicated: bool) -> list[tuple[str, int, str, Mods]]:
    return [(s, i, name, mods) for s in world_strategies(pcp, replicated) for i in INTERLEAVES
            for name in SCENARIOS for mods in MODS]


def run_world(rank: int, port: int, pcp: int, dcp: int, replicated: bool) -> dict:
    parallel = ParallelConfig(tensor_parallel_size=dcp, prefill_context_parallel_size=pcp,
                              decode_context_parallel_size=dcp, distributed_timeout_s=base.TIMEOUT_S,
                              cp_kv_cache_layout="replicated" if replicated else "sharded")
    groups = init_distributed(parallel, rank=rank, world_size=pcp * dcp, master_addr="127.0.0.1",
                              master_port=port, timeout_s=base.TIMEOUT_S, backend="gloo")
    try:
        report = {"coords": (groups.pcp_rank, groups.tp_rank, groups.cp_rank, groups.kv_shard_rank), "cases": {}}
        for seed, key in enumerate(case_keys(pcp, replicated)):
            report["cases"][key] = run_case(groups, *key, seed=seed)
        return report
    finally:
        shutdown_distributed()


def rank_main(rank: int, worlds: list[tuple[int, int, bool, int]], results) -> None:
    """Global rank `rank` of every world `(pcp, dcp, replicated, port)` it belongs to, largest first; puts
    `((pcp, dcp, replicated), rank, "ok" | "error", report | traceback)` per world."""
    torch.set_num_threads(1)
    for pcp, dcp, replicated, port in worlds:
        if rank >= pcp * dcp:
            continue
        try:
            results.put(((pcp, dcp, replicated), rank, "ok", run_world(rank, port, pcp, dcp, replicated)))
        except BaseException:
            results.put(((pcp, dcp, replicated), rank, "error", traceback.format_exc()))
            return
