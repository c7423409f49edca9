"""The state scan of a gated DeltaNet layer under PCP (cpllm/layers/gated_delta/pcp_prefill.py,
cpllm/context_parallel/state_scan.py) against the same layer on one rank, in one process: each PCP rank is a thread
with its own copy of the layer and of the state pools, their all-gathers met at a barrier.

Two steps: fresh prompts of several lengths (one spanning several 64-token blocks per run, one of 2 tokens that
leaves a PCP rank without rows, one of 5 whose runs are shorter than the convolution's halo), a continuation from a
random state, and a decode row; then the next scheduler chunk of each (the state carries between chunks) beside
decode rows. Every output row and every request's state must match the single rank's, on every PCP rank, to float32
rounding (the runs' 64-token blocks start elsewhere than the single rank's): outputs reach about 12, their
differences about 3e-5; a state missing from a run moves them by O(1)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from cpllm.config.linear_attention import LinearAttentionConfig
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import build_step_batch
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.layers.gated_delta.layer import GatedDeltaNet
from cpllm.step import ScheduledChunk
from step_plans import eager_plan

HIDDEN, BLOCK, VOCAB, SLOTS = 32, 4, 500, 6
LINEAR = LinearAttentionConfig(linear_layers=(0,), num_key_heads=2, num_value_heads=4, key_head_dim=8,
                               value_head_dim=6, conv_kernel=4, rotary_dim=2)  # dk != dv: a transposed map fails
PREFIX = "layer"
TIMEOUT_S = 60.0


class DictSource:
    """The layer's weights from a dict (a WeightSource of float32 tensors)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def names(self):
        return sorted(self.tensors)

    def has(self, name):
        return name in self.tensors

    def storage_type(self, name):
        return "F32"

    def get(self, name, *, dim=None, start=0, end=None, dtype=torch.float32):
        tensor = self.tensors[name]
        if dim is not None:
            tensor = tensor.narrow(dim, start, (tensor.shape[dim] if end is None else end) - start)
        return tensor.to(dtype)


def _weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    def normal(*shape, std=0.3):
        return torch.randn(*shape, generator=gen) * std

    hv, kd, vd = LINEAR.num_value_heads, LINEAR.key_dim, LINEAR.value_dim
    return {f"{PREFIX}.in_proj_qkv.weight": normal(2 * kd + vd, HIDDEN), f"{PREFIX}.in_proj_z.weight": normal(vd, HIDDEN),
            f"{PREFIX}.in_proj_b.weight": normal(hv, HIDDEN), f"{PREFIX}.in_proj_a.weight": normal(hv, HIDDEN),
            f"{PREFIX}.conv1d.weight": normal(LINEAR.conv_dim, 1, LINEAR.conv_kernel, std=0.6),
            # decays spread: some heads forget within a few tokens, others keep their state over the prompt
            f"{PREFIX}.dt_bias": normal(hv, std=0.5), f"{PREFIX}.A_log": torch.rand(hv, generator=gen) * 2.5 - 1.5,
            f"{PREFIX}.norm.weight": 1 + normal(LINEAR.value_head_dim, std=0.1),
            f"{PREFIX}.out_proj.weight": normal(HIDDEN, vd)}


def _layer(weights) -> GatedDeltaNet:
    layer = GatedDeltaNet(LINEAR, HIDDEN, 1e-6, PREFIX, ParallelContext(), torch.float32, "none")
    source = DictSource(weights)
    for module in layer.modules():
        if module is not layer and hasattr(module, "load"):
            module.load(source)
    layer.load(source)
    return layer


class ThreadComm:
    """The PCP group of `size` threads: all_gather concatenates every thread's tensor along dim 0, in rank order."""

    def __init__(self, rank: int, size: int, shared: dict):
        self.rank, self.size, self.shared = rank, size, shared

    def all_gather(self, x: torch.Tensor, *, dim: int = 0) -> torch.Tensor:
        barrier, box = self.shared["barrier"], self.shared["box"]
        box[self.rank] = x.clone()
        barrier.wait()
        out = torch.cat([box[p] for p in range(self.size)], dim=dim)
        barrier.wait()  # nobody overwrites its entry before everyone has read
        return out


def _chunk(rid: int, tokens, start: int) -> ScheduledChunk:
    end = start + len(tokens)
    return ScheduledChunk(request_id=str(rid), token_ids=tuple(tokens), start_pos=start,
                          block_table=tuple(range(1, end // BLOCK + 3)), sample=True, prompt_logits=False,
                          state_slot=rid)


def _run_rank(layer, chunks, pools, embed, pcp_size: int, pcp_rank: int):
    """One rank's step: (its outputs by (request, new-token index), its pools after the step)."""
    layout = KVLayout(num_shards=pcp_size, shard_rank=pcp_rank, interleave=1, block_size=BLOCK)
    batch = build_step_batch(chunks, layout, pcp_size, pcp_rank, lambda c: [len(c.token_ids) - 1],
                             plan=eager_plan(chunks, layout, pcp_size))
    out = layer(embed[batch.token_ids], pools, batch.attention)
    rows = {}
    for i, request in enumerate(batch.attention.requests):
        for run in request.local_chunks:
            for j in range(run.length):
                rows[(i, run.new_start + j)] = out[run.row + j]
    return rows, pools


def _run_pcp(base, chunks, pools, embed, pcp_size: int):
    shared = {"barrier": threading.Barrier(pcp_size, timeout=TIMEOUT_S), "box": {}}
    results, errors = [None] * pcp_size, []

    def rank(p):
        try:
            layer = copy.deepcopy(base)
            layer.pcp = ThreadComm(p, pcp_size, shared)
            results[p] = _run_rank(layer, chunks, pools[p], embed, pcp_size, p)
        except BaseException as exc:  # noqa: BLE001 - reported below, and the others released
            errors.append(exc)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(p,)) for p in range(pcp_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S * 4)
    if errors:
        raise errors[0]
    return results


def _pools(gen: torch.Generator):
    conv = torch.randn(SLOTS, LINEAR.conv_dim, LINEAR.conv_kernel - 1, generator=gen)
    delta = torch.randn(SLOTS, LINEAR.num_value_heads, LINEAR.key_head_dim * LINEAR.value_head_dim, generator=gen)
    return conv, delta * 0.3


@pytest.mark.parametrize("pcp_size", [2, 3])
def test_pcp_state_scan_matches_one_rank(pcp_size):
    gen = torch.Generator().manual_seed(pcp_size)
    base = _layer(_weights(gen))
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)

    def tokens(n):
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    # request id = state slot; lengths: several blocks per run, 2 tokens, runs shorter than the halo, continuation
    lengths = {0: 300, 1: 2, 2: 5, 3: 17}
    step1 = [_chunk(0, tokens(300), 0), _chunk(1, tokens(2), 0), _chunk(4, tokens(1), 9), _chunk(2, tokens(5), 0),
             _chunk(3, tokens(17), 40)]  # slot 3 continues from the random state in its slot; slot 4 decodes
    step2 = [_chunk(0, tokens(70), 300), _chunk(1, tokens(1), 2), _chunk(2, tokens(9), 5),
             _chunk(3, tokens(1), 57), _chunk(4, tokens(1), 10)]
    assert lengths[3] == len(step1[4].token_ids)
    reference_pools = _pools(gen)
    pools = [tuple(p.clone() for p in reference_pools) for _ in range(pcp_size)]
    for chunks in (step1, step2):
        expected, reference_pools = _run_rank(base, chunks, reference_pools, embed, 1, 0)
        results = _run_pcp(base, chunks, pools, embed, pcp_size)
        seen = set()
        for rows, rank_pools in results:
            for key, row in rows.items():
                torch.testing.assert_close(row, expected[key], rtol=1e-4, atol=1e-4, msg=lambda m: f"output row {key}: {m}")
                seen.add(key)
            for got, want in zip(rank_pools, reference_pools):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert seen == set(expected)  # every row computed somewhere
        pools = [r[1] for r in results]
