"""Sliding windows, logit soft-capping and attention sinks under every CP layout, in real gloo process groups.

Worlds (PCP, DCP) of 1 x 1, 2 x 1, 1 x 2 and 2 x 2 ranks (TP = DCP) with the sharded KV layout, and 2 x 1, 2 x 2
with the replicated one; one set of four spawned processes runs them all, one after the other
(tests/cp_window_helpers.py). In each world every prefill strategy it can run (all-gather, pass-KV ring, pass-Q;
pass-Q is refused with the replicated layout), interleave 1 and the block size, and steps that mix a
chunked-prefill continuation on a long cached context, fresh prompts and decode rows (prompts and contexts 3-6x
windows of 8 and 13 tokens), decode-only steps, a fresh 6-window prompt, and one decode far past its window; each
with a window alone, soft-capping with sinks, and all three. Every rank compares every local row and head with
float64 attention computed directly from positions (window mask, tanh cap, the sink in each head's denominator),
and its pools with exactly the context plus the new tokens it stores.

The sinks are drawn in [6, 11] where every capped score lies in [-10, 10], so they move the outputs by O(0.1-1)
(asserted): a sink counted per shard or per piece (DCP = 2, PCP = 2: several partials per row) fails by far more
than the tolerance. Each rank's backend counts its attend calls, and the count must equal a brute-force count of
the (query run, key run) pairs in which some key is inside some query's window: a piece the window leaves empty
issues no call. A decode rank whose shard has no key in any of its rows' windows makes no decode call either.
Block tables of windowed cases hold FREED_BLOCK before the window (as a windowed KV group's do): reading such a
slot raises.

Without processes: one rank against transformers' own sliding-window mask function and Gemma 2's and GPT-OSS's
attention; the pieces of every head-tail run keep each visible (query, key) pair exactly once (also with query
blocks); long runs in query blocks against direct attention; the in-window decode view cached per step; the sink
merge rule; bad modifiers and plans refused.
"""

from __future__ import annotations

import queue as queue_mod
import time

import pytest
import torch.multiprocessing as mp

import cp_window_helpers as helpers
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.partition import rank_token_ranges
from cpllm.distributed.launch import find_free_port
from cpllm.layers.window.modifier import ScoreMods, score_mods
from step_plans import eager_plan

ATOL = 2e-5
WORLDS = [(2, 2, False), (2, 2, True), (2, 1, False), (1, 2, False), (2, 1, True), (1, 1, False)]
"""(PCP, DCP, replicated KV layout), largest first; world = PCP x DCP (TP = DCP)."""
HANG_GUARD_S = 400.0


def _launch_all() -> dict:
    """Every world; {(pcp, dcp, replicated): {rank: report}} or an error text for a world that failed or hung."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ports: list[int] = []
    while len(ports) < len(WORLDS):
        port = find_free_port()
        if port not in ports:
            ports.append(port)
    plan = [(*world, port) for world, port in zip(WORLDS, ports)]
    size = max(p * d for p, d, _ in WORLDS)
    procs = [ctx.Process(target=helpers.rank_main, args=(rank, plan, results), daemon=True) for rank in range(size)]
    for proc in procs:
        proc.start()
    reports: dict = {key: {} for key in WORLDS}
    pending = {(key, rank) for key in WORLDS for rank in range(key[0] * key[1])}
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while pending:
            try:
                key, rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_mod.Empty:
                for key in {k for k, _ in pending}:
                    reports[key] = f"ranks {sorted(r for k, r in pending if k == key)} hung"
                break
            pending.discard((key, rank))
            if status == "ok":
                reports[key][rank] = value
                continue
            reports[key] = f"rank {rank} failed:\n{value}"
            for other in {k for k, _ in pending} - {key}:
                reports[other] = "not run: an earlier world failed"
            break
    finally:
        for proc in procs:
            if pending:
                proc.kill()
            proc.join(30)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    return reports


@pytest.fixture(scope="module")
def reports():
    return _launch_all()


def _world(reports, world) -> dict:
    got = reports[world]
    if isinstance(got, str):
        pytest.fail(f"world {world}: {got}")
    assert sorted(got) == list(range(world[0] * world[1]))
    return got


def _world_id(world):
    pcp, dcp, replicated = world
    return f"pcp{pcp}-dcp{dcp}-{'repl' if replicated else 'sharded'}"


# --- brute-force count of the pieces a window leaves non-empty -------------------------------------------------


def _sees(q_positions, k_positions, window) -> bool:
    """Some query position sees some key position (j <= i, i - j < window)."""
    return any(j <= i and (window is None or i - j < window) for i in q_positions for j in k_positions)


def _key_runs(strategy: str, req, pcp: int, q_start: int, key_pcp_ranks) -> list[tuple[int, int]]:
    if strategy == "allgather":  # all new keys in one buffer: those before the run, and the run itself
        return [(0, q_start)] if q_start else []
    return [r for p in key_pcp_ranks for r in rank_token_ranges(req.new, pcp, p)]


def _own_calls(length: int, window) -> int:
    """Calls of a query run against its own keys: one, or the blocks a run longer than the window is split into
    (the split itself: test_pieces_keep_each_visible_pair_exactly_once)."""
    from cpllm.layers.window.modifier import ScoreMods
    from cpllm.layers.window.pieces import new_key_pieces
    return len(new_key_pieces(((0, 0, length),), 0, length, ScoreMods(window=window))) if length else 0


def expected_attend_calls(world, strategy: str, interleave: int, reqs, coords, window,
                          count_own: bool = True) -> int:
    """The attend calls of one rank's prefill pieces (new-token and cached-context ones): one per (query run, key
    run) pair where the window leaves a visible key; the run itself always counts, as the calls its own split
    makes (`_own_calls`; not at all without `count_own`)."""
    pcp, dcp, replicated = world
    pcp_rank, _, _, kv_rank = coords
    kv_size = dcp if replicated else pcp * dcp
    layout = KVLayout(num_shards=kv_size, shard_rank=kv_rank, interleave=interleave, block_size=helpers.BLOCK)
    calls = 0
    for req in reqs:
        if req.new == 1:
            continue  # decode rows: the decode calls
        p0 = req.context
        # New-token pieces: pass-Q attends every PCP rank's query runs to this rank's key runs; the others this
        # rank's query runs to every PCP rank's (all-gather: one buffer) key runs.
        if strategy == "pass-q":
            pairs = [(q, p) for q_rank in range(pcp) for q in rank_token_ranges(req.new, pcp, q_rank)
                     for p in [pcp_rank]]
        else:
            pairs = [(q, None) for q in rank_token_ranges(req.new, pcp, pcp_rank)]
        for (qs, qe), key_rank in pairs:
            own = [(qs, qe)] if strategy == "allgather" else []
            ranks = range(pcp) if key_rank is None else [key_rank]
            for ks, ke in own + _key_runs(strategy, req, pcp, qs, ranks):
                if ks == qs:
                    calls += _own_calls(ke - ks, window) if count_own else 0
                elif ke <= qs and _sees(range(p0 + qs, p0 + qe), range(p0 + ks, p0 + ke), window):
                    calls += 1
        if req.context == 0:
            continue
        # Cached context: every query run of every piece of the KV-shard group, against this rank's shard.
        owned = [j for j in range(req.context) if layout.owner(j) == kv_rank]
        query_ranks = [pcp_rank] * kv_size if replicated else [piece // dcp for piece in range(kv_size)]
        for q_rank in query_ranks:
            for qs, qe in rank_token_ranges(req.new, pcp, q_rank):
                calls += _sees(range(p0 + qs, p0 + qe), owned, window)
    return calls


def decode_keys_in_window(world, interleave: int, reqs, coords, held, window) -> bool:
    """Some decode row this rank holds has a key of this rank's shard inside its window."""
    pcp, dcp, replicated = world
    kv_size = dcp if replicated else pcp * dcp
    layout = KVLayout(num_shards=kv_size, shard_rank=coords[3], interleave=interleave, block_size=helpers.BLOCK)
    for i, req in enumerate(reqs):
        if req.new == 1 and helpers.base.token_id(i, 0) in held:
            first = req.context - window + 1 if window is not None else 0
            if any(layout.owner(j) == coords[3] for j in range(max(first, 0), req.context + 1)):
                return True
    return False


# --- the tests ---------------------------------------------------------------------------------------------------


DECODE_PLANS = {(1, 1, False): "one-shard", (2, 1, False): "pcp-decode", (1, 2, False): "gathered-decode",
                (2, 2, False): "gathered-decode", (2, 1, True): "one-shard", (2, 2, True): "gathered-decode"}
"""The decode path each world's decode-only steps take: every one of them is covered."""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", WORLDS, ids=_world_id)
def test_window_softcap_sinks_match_direct_attention(reports, world):
    ranks = _world(reports, world)
    failures, sink_effect = [], 0.0
    for rank, report in sorted(ranks.items()):
        for key, case in report["cases"].items():
            strategy, interleave, name, mods = key
            where = f"{strategy} i{interleave} {name} {mods.name} rank {rank} {report['coords']} ({case['plan']})"
            want_plan = DECODE_PLANS[world] if name in ("decode_only", "one_decode") else "prefill"
            if case["plan"] != want_plan:
                failures.append(f"{where}: plan {case['plan']}, want {want_plan}")
            failures += [f"{where}: {p}" for p in case["problems"]]
            if not case["max_err"] <= ATOL:
                failures.append(f"{where}: max abs error {case['max_err']:.3g} > {ATOL} at {case['worst']}")
            if mods.sinks:
                sink_effect = max(sink_effect, case["sink_effect"])
    assert not failures, "\n".join(failures[:40])
    assert sink_effect > 0.1, f"the sinks barely move the outputs ({sink_effect:.3g}): the test could not see them"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", WORLDS, ids=_world_id)
def test_pieces_outside_the_window_issue_no_attend_call(reports, world):
    ranks = _world(reports, world)
    failures, skipped = [], 0
    for rank, report in sorted(ranks.items()):
        for key, case in report["cases"].items():
            strategy, interleave, name, mods = key
            reqs = helpers.scenario(name, helpers.case_window(mods))
            calls = case["calls"]
            where = f"{strategy} i{interleave} {name} {mods.name} rank {rank}"
            got = calls["attend"] + calls["attend_scored"]
            want = expected_attend_calls(world, strategy, interleave, reqs, report["coords"], mods.window)
            if got != want:
                failures.append(f"{where}: {got} attend calls, want {want}")
            if mods.window is not None:
                skipped += (expected_attend_calls(world, strategy, interleave, reqs, report["coords"], None, False)
                            - expected_attend_calls(world, strategy, interleave, reqs, report["coords"], mods.window,
                                                    False))
            decodes = calls["attend_decode"] + calls["attend_decode_whole"] + calls["attend_gathered_decode"]
            if name in ("decode_only", "one_decode"):
                sees = decode_keys_in_window(world, interleave, reqs, report["coords"], set(case["held"]),
                                             mods.window)
                if sees != (decodes > 0):
                    failures.append(f"{where}: {decodes} decode calls, but keys in the window: {sees}")
    assert not failures, "\n".join(failures[:40])
    if world[0] > 1:
        assert skipped > 0, "no piece was skipped: the scenarios do not exercise the window's skip"


def test_a_sink_counted_per_shard_is_not_the_sink_counted_once():
    """The merge rule itself, on two shards of one row's keys: the sink applied once after merging the partials
    equals direct attention with the sink in the denominator; applied to each shard's partial before the merge
    it does not (by O(0.1) here), which is what the process tests above would catch."""
    import torch

    from cpllm.context_parallel.merge import apply_sinks, merge_attention_partials
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 5, generator=g, dtype=torch.float64) * 2  # [shard, keys] of one row, one head
    values = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    sink = torch.tensor([3.0], dtype=torch.float64)  # about the rows' lse: it matters
    flat_s, flat_v = scores.reshape(-1), values.reshape(-1, 4)
    direct = (torch.exp(flat_s)[:, None] * flat_v).sum(0) / (torch.exp(flat_s).sum() + torch.exp(sink))
    lses = torch.logsumexp(scores, dim=1)  # [shard]
    outs = torch.einsum("sk,skd->sd", torch.softmax(scores, dim=1), values)  # [shard, D]
    merged, lse = merge_attention_partials(outs[:, None, None].float(), lses[:, None, None].float())
    once = apply_sinks(merged, lse, sink.float())[0, 0]
    assert torch.allclose(once.double(), direct, atol=1e-5)
    per_shard = apply_sinks(outs[:, None].float(), lses[:, None].float(), sink.float())  # [shard, 1, D]
    merged_wrong, _ = merge_attention_partials(per_shard[:, :, None], lses[:, None, None].float())
    assert (merged_wrong[0, 0].double() - direct).abs().max() > 0.1


# --- against transformers' own attention functions (one rank, no processes) --------------------------------------


def _one_rank_step(reqs, layer, sinks, seed: int):
    """One step of `layer` on one rank (a chunked-prefill continuation, a fresh prompt and decodes together):
    returns the data and {(request, token): output row [HQ, D]}."""
    import torch

    from cpllm.context_parallel.kv_layout import KVLayout
    from cpllm.context_parallel.metadata import build_step_batch
    from cpllm.step import ScheduledChunk
    layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=helpers.BLOCK)
    tables, num_blocks = helpers.base.block_tables(reqs, 1)
    data = helpers.base.make_data(reqs, helpers.HQ, seed)
    chunks = [ScheduledChunk(request_id=str(i), token_ids=tuple(helpers.base.token_id(i, j) for j in range(r.new)),
                             start_pos=r.context, block_table=tables[i], sample=True, prompt_logits=False)
              for i, r in enumerate(reqs)]
    batch = build_step_batch(chunks, layout, 1, 0, lambda c: [], plan=eager_plan(chunks, layout))
    k_pool, v_pool = (torch.zeros(num_blocks * helpers.BLOCK, helpers.HKV, helpers.D) for _ in range(2))
    for i, (req, (_, k, v)) in enumerate(zip(reqs, data)):
        for pos in range(req.context):
            slot = layout.slot(pos, tables[i])
            k_pool[slot], v_pool[slot] = k[pos], v[pos]
    n, where = batch.attention.num_rows, {}
    q_loc, k_loc, v_loc = (torch.zeros(n, h, helpers.D) for h in (helpers.HQ, helpers.HKV, helpers.HKV))
    for row in range(n):
        i, j = divmod(int(batch.token_ids[row]) - 1, 1000)
        q, k, v = data[i]
        q_loc[row], k_loc[row], v_loc[row] = q[j], k[reqs[i].context + j], v[reqs[i].context + j]
        where[(i, j)] = row
    out = layer(q_loc, k_loc, v_loc, k_pool, v_pool, batch.attention, sinks=sinks)
    return data, {key: out[row] for key, row in where.items()}, batch.attention.plan.value


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("steps", ["mixed", "decode"])
def test_one_rank_matches_transformers_attention(family, steps):
    """Mistral's sliding window (the mask transformers 5 builds: sliding_window_overlay on the causal mask, on
    absolute positions), Gemma 2's soft-capped eager attention and GPT-OSS's eager attention with sinks, each with a
    window of 8 over prompts and contexts 3-6x as long, against PagedCPAttention on one rank."""
    import types

    import torch
    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_attention
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_attention

    from cpllm.context_parallel.attention import PagedCPAttention
    from cpllm.distributed.parallel_context import ParallelContext
    window, softcap = 8, (10.0 if family == "gemma2" else None)
    sinks = torch.rand(helpers.HQ, generator=torch.Generator().manual_seed(5)) * 5 + 20 if family == "gpt_oss" \
        else None  # about the rows' lse (scores are large here: no cap)
    Req = helpers.Req
    reqs = ([Req(3 * window + 5, 2 * window + 1), Req(0, 5 * window), Req(6 * window, 1), Req(5, 1)]
            if steps == "mixed" else [Req(6 * window + 3, 1), Req(4 * window, 1), Req(2, 1)])
    layer = PagedCPAttention(ParallelContext(), helpers.SCALE, mods=score_mods(window=window, softcap=softcap))
    data, got, plan = _one_rank_step(reqs, layer, sinks, seed=11)
    assert plan == ("prefill" if steps == "mixed" else "one-shard")
    mask_fn = sliding_window_causal_mask_function(window)
    module = types.SimpleNamespace(num_key_value_groups=helpers.HQ // helpers.HKV, training=False,
                                   head_dim=helpers.D, sinks=sinks)
    worst, sink_effect = 0.0, 0.0
    for i, (req, (q, k, v)) in enumerate(zip(reqs, data)):
        q_pos, length = range(req.context, req.context + req.new), req.context + req.new
        zero = torch.tensor(0)
        keep = mask_fn(zero, zero, torch.tensor(q_pos)[:, None], torch.arange(length)[None, :])  # [T, P + T]
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))[None, None]
        args = (module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask)
        if family == "gpt_oss":
            want, _ = gpt_oss_attention(*args, scaling=helpers.SCALE)
            plain, _ = gemma2_attention(*args, scaling=helpers.SCALE)  # the same without the sinks
            sink_effect = max(sink_effect, (want - plain).abs().max().item())
        else:
            want, _ = gemma2_attention(*args, scaling=helpers.SCALE, softcap=softcap)
        for j in range(req.new):
            worst = max(worst, (got[(i, j)] - want[0, j]).abs().max().item())
    assert worst <= 2e-5
    assert family != "gpt_oss" or sink_effect > 0.05, f"the sinks barely matter here ({sink_effect:.3g})"


# --- the pieces themselves ---------------------------------------------------------------------------------------


def _coverage(pieces, q_start: int, q_len: int, key_index):
    """{(query, key): times kept} over the pieces; `key_index(row)` is the new-token index of a key row."""
    import torch
    kept: dict = {}
    for piece in pieces:
        queries = range(q_start + piece.queries.start, q_start + piece.queries.stop)
        keys = [key_index(r) for r in range(piece.keys.start, piece.keys.stop)]
        if piece.mask is not None:
            keep = piece.mask
        elif piece.causal:
            keep = torch.ones(len(queries), len(keys), dtype=torch.bool)
            keep = keep.triu() if piece.reverse else keep.tril()
        else:
            keep = torch.ones(len(queries), len(keys), dtype=torch.bool)
        assert keep.shape == (len(queries), len(keys))
        for a, i in enumerate(queries):
            for b, j in enumerate(keys):
                if keep[a, b]:
                    kept[(i, j)] = kept.get((i, j), 0) + 1
    return kept


@pytest.mark.parametrize("block", [1024, 16, 5])
@pytest.mark.parametrize("window", [None, 1, 8, 13])
def test_pieces_keep_each_visible_pair_exactly_once(monkeypatch, block, window):
    """Head-tail runs of a 96-token prompt on PCP = 2 (and a 40-token one in one run): for every query run, the
    pieces against every key run keep exactly the pairs the window shows, each once, with query blocks of
    `block` rows for runs longer than that."""
    from cpllm.layers.window import pieces as window_module
    from cpllm.layers.window.modifier import ScoreMods
    from cpllm.layers.window.pieces import new_key_pieces
    monkeypatch.setattr(window_module, "QUERY_BLOCK", block)
    mods = ScoreMods(window=window)
    for total, pcp in ((96, 2), (40, 1)):
        runs = {p: rank_token_ranges(total, pcp, p) for p in range(pcp)}
        source = [(start, start, end - start) for p in range(pcp) for start, end in runs[p]]  # row = index
        for p in range(pcp):
            for qs, qe in runs[p]:
                kept = _coverage(new_key_pieces(source, qs, qe - qs, mods), qs, qe - qs, lambda r: r)
                want = {(i, j): 1 for i in range(qs, qe) for j in range(total)
                        if j <= i and (window is None or i - j < window)}
                assert kept == want, (qs, qe)


def test_long_runs_in_query_blocks_match_direct_attention(monkeypatch):
    """One rank, QUERY_BLOCK set to 16: a 100-token fresh prompt and a 70-token continuation on a cached context
    attend themselves in blocks, with windows of 8 and 20 and a soft-cap, against float64 attention."""
    import torch

    from cpllm.layers.window import pieces as window_module
    from cpllm.context_parallel.attention import PagedCPAttention
    from cpllm.distributed.parallel_context import ParallelContext
    monkeypatch.setattr(window_module, "QUERY_BLOCK", 16)
    Req = helpers.Req
    reqs = [Req(0, 100), Req(45, 70), Req(60, 1)]
    for mods in (helpers.Mods(8, None, False), helpers.Mods(20, 10.0, True)):
        sinks = torch.rand(helpers.HQ, generator=torch.Generator().manual_seed(2)) * 5 + 6 if mods.sinks else None
        layer = PagedCPAttention(ParallelContext(), helpers.SCALE, mods=score_mods(window=mods.window, softcap=mods.softcap))
        data, got, _ = _one_rank_step(reqs, layer, sinks, seed=4)
        refs, _ = helpers.reference_outputs(reqs, data, slice(0, helpers.HQ), mods, sinks)
        worst = max((got[(i, j)].double() - refs[i][j]).abs().max().item()
                    for i, r in enumerate(reqs) for j in range(r.new))
        assert worst <= 2e-5, mods


def test_the_window_view_is_built_once_per_step_and_only_where_the_window_hides_keys():
    """Every layer of a step gets the same in-window view of the decode batch (cached per window), and a window
    that hides no key gives the batch itself (no copy); a view row keeps exactly its in-window local slots."""
    from cpllm.context_parallel.kv_layout import KVLayout
    from cpllm.context_parallel.metadata import build_step_batch
    from cpllm.layers.window.decode_view import window_view
    from cpllm.step import ScheduledChunk
    layout = KVLayout(num_shards=2, shard_rank=1, interleave=2, block_size=4)
    chunks = [ScheduledChunk(request_id=str(i), token_ids=(1,), start_pos=ctx, block_table=tuple(range(8 * i, 8 * i + 8)),
                             sample=True, prompt_logits=False) for i, ctx in enumerate((40, 5))]
    meta = build_step_batch(chunks, layout, 1, 0, lambda c: [], plan=eager_plan(chunks, layout)).attention
    view = window_view(meta, 8)
    assert window_view(meta, 8) is view and window_view(meta, 64) is meta.decode
    assert window_view(meta, None) is meta.decode
    for b, ctx in enumerate((40, 5)):  # positions this rank (cp rank 1, interleave 2) holds in the window
        want = [layout.slot(p, chunks[b].block_table) for p in range(max(ctx - 7, 0), ctx + 1) if layout.owner(p) == 1]
        assert view.slots[b, : int(view.lengths[b])].tolist() == want


def test_bad_score_modifiers_are_refused():
    import torch

    from cpllm.context_parallel.attention import PagedCPAttention
    from cpllm.distributed.parallel_context import ParallelContext
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        score_mods(window=0)
    with pytest.raises(ValueError, match="softcap must be > 0"):
        score_mods(softcap=0.0)
    layer = PagedCPAttention(ParallelContext(), helpers.SCALE)
    with pytest.raises(ValueError, match=r"sinks \(3,\): want one logit per local query head, \[4\]"):
        _one_rank_step([helpers.Req(4, 1)], layer, torch.zeros(3), seed=1)


def test_scored_layers_refuse_the_fused_and_compiled_plans(monkeypatch):
    """A layer with a window refuses a fused, team or compiled plan (kernels that know no window): the families with
    such layers build no fused decode layers and refuse --compile-decode, so the runner never plans one."""
    import dataclasses

    from cpllm.context_parallel import metadata as metadata_module
    from cpllm.context_parallel.attention import PagedCPAttention
    from cpllm.distributed.parallel_context import ParallelContext
    from cpllm.context_parallel.plan import StepPath, StepPlan
    layer = PagedCPAttention(ParallelContext(), helpers.SCALE, mods=ScoreMods(window=8))
    real = metadata_module.build_step_batch
    for path in (StepPath.FUSED, StepPath.COMPILED, StepPath.TP_TEAM):
        plan = StepPlan(path=path)
        def planned(*args, forced=plan, **kwargs):  # the step laid out as usual, carrying the forced plan
            batch = real(*args, **kwargs)
            return dataclasses.replace(batch, attention=dataclasses.replace(batch.attention, plan=forced))
        monkeypatch.setattr(metadata_module, "build_step_batch", planned)
        with pytest.raises(ValueError, match=f"plan '{plan.value}' runs kernels that know no window"):
            _one_rank_step([helpers.Req(20, 1)], layer, None, seed=1)
