"""Attention backends (cpllm/context_parallel/backend.py, registered in cpllm/layers/registry.py): the registry, the
GQA backend's interface, and the CP layer doing all of its local work through the backend it is given."""

from __future__ import annotations

import pytest
import torch

from cpllm.context_parallel.attention import PagedCPAttention
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.context_parallel.backend import AttentionBackend
from cpllm.layers import registry as backend_module
from cpllm.layers.registry import BACKENDS, attention_backend
from cpllm.layers.gqa.backend import GQAPagedBackend
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import build_step_batch
from cpllm.context_parallel.plan import StepPath
from cpllm.step import ScheduledChunk
from step_plans import eager_plan

HQ, HKV, D, BLOCK = 4, 2, 8, 4
METHODS = [name for name in AttentionBackend.__dict__ if not name.startswith("_")]


def test_registry_names_each_backend():
    assert isinstance(attention_backend("gqa"), GQAPagedBackend) and attention_backend().name == "gqa"
    assert all(attention_backend(name).name == name for name in BACKENDS)
    with pytest.raises(ValueError, match="no attention backend 'linear'"):
        attention_backend("linear")


def test_gqa_backend_has_the_whole_interface():
    backend = attention_backend("gqa")
    missing = [name for name in METHODS if not hasattr(backend, name)]
    assert not missing and "attend" in METHODS and "attend_decode" in METHODS and "store_kv" in METHODS


class _Counting:
    """A backend wrapping the GQA one and counting its calls: stands in for a new kind."""

    name = "counting"

    def __init__(self):
        self.inner, self.calls = GQAPagedBackend(), {}

    def __getattr__(self, method):
        inner = getattr(self.inner, method)

        def call(*args, **kwargs):
            self.calls[method] = self.calls.get(method, 0) + 1
            return inner(*args, **kwargs)
        return call


def _step(requests, plan=None):
    g = torch.Generator().manual_seed(len(requests))
    layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=BLOCK)
    chunks = [ScheduledChunk(request_id=str(i), token_ids=tuple([1] * new), start_pos=ctx,
                             block_table=tuple(range(1 + 8 * i, 9 + 8 * i)), sample=True, prompt_logits=False)
              for i, (ctx, new) in enumerate(requests)]
    meta = build_step_batch(chunks, layout, 1, 0, lambda c: [], plan=eager_plan(chunks, layout, path=plan)).attention
    pools = [torch.randn(80 * BLOCK, HKV, D, generator=g) for _ in range(2)]
    q, k, v = (torch.randn(meta.num_rows, h, D, generator=g) for h in (HQ, HKV, HKV))
    return (q, k, v), pools, meta


@pytest.mark.parametrize("requests, plan, used", [
    ([(0, 9), (6, 5), (10, 1)], None, {"rows_to_move", "rows_moved", "store_kv", "attend", "context_keys",
                                       "attend_decode"}),
    ([(10, 1), (3, 1)], None, {"store_kv", "attend_decode_whole"}),
    ([(10, 1), (3, 1)], StepPath.GATHERED_DECODE, {"store_kv", "attend_decode"}),
])
def test_the_cp_layer_attends_only_through_its_backend(monkeypatch, requests, plan, used):
    (q, k, v), pools, meta = _step(requests, plan)
    want = PagedCPAttention(ParallelContext(), scale=D**-0.5)(q, k, v, *[p.clone() for p in pools], meta)
    counting = _Counting()
    monkeypatch.setitem(BACKENDS, "counting", lambda: counting)
    layer = PagedCPAttention(ParallelContext(), scale=D**-0.5, backend=backend_module.attention_backend("counting"))
    got = layer(q, k, v, *pools, meta)
    assert set(counting.calls) == used and torch.equal(got, want)


# --- the metadata does not depend on the kernels; the SDPA path builds the shared-key view itself ---------------


def _shared_prefix_step(requests):
    """requests: (context_len, num_new); every request's block table starts with the same 4 blocks (16 tokens)."""
    g = torch.Generator().manual_seed(7)
    layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=BLOCK)
    chunks = [ScheduledChunk(request_id=str(i), token_ids=tuple([1] * new), start_pos=ctx,
                             block_table=(1, 2, 3, 4, 10 + 4 * i, 11 + 4 * i), sample=True, prompt_logits=False)
              for i, (ctx, new) in enumerate(requests)]
    pools = [torch.randn(40 * BLOCK, HKV, D, generator=g) for _ in range(2)]
    q, k, v = (torch.randn(len(chunks) + sum(n - 1 for _, n in requests), h, D, generator=g) for h in (HQ, HKV, HKV))
    return chunks, layout, pools, (q, k, v)


def _structure(obj):
    """Every tensor of a step's metadata (path, dtype, shape, values) and its decode batch's plain fields."""
    from cpllm.context_parallel.metadata import iter_tensors
    decode = obj.attention.decode
    return ([(path, t.dtype, tuple(t.shape), t.tolist()) for path, t in iter_tensors(obj)],
            (decode.shared_keys, decode.window, decode.max_local_context, decode.shared_prefix is not None))


SHARED_STEPS = {"decode_only": [(17, 1), (18, 1), (17, 1), (19, 1)], "mixed": [(17, 1), (18, 1), (19, 1), (0, 5)]}


@pytest.mark.parametrize("name", sorted(SHARED_STEPS))
def test_step_metadata_is_the_same_with_and_without_the_kernels(monkeypatch, name):
    """The runner lays a step out alike whatever kernels built: each request's own slots and the shared-prefix
    hint, never the union (which the SDPA path builds on first use)."""
    chunks, layout, _, _ = _shared_prefix_step(SHARED_STEPS[name])
    on = build_step_batch(chunks, layout, 1, 0, lambda c: [], plan=eager_plan(chunks, layout))
    monkeypatch.setenv("CPLLM_KERNELS", "0")
    off = build_step_batch(chunks, layout, 1, 0, lambda c: [], plan=eager_plan(chunks, layout))
    assert _structure(on) == _structure(off)
    decode = on.attention.decode
    assert not decode.shared_keys and decode.lengths is not None and decode.shared_prefix is not None
    assert decode.slots.shape[0] == 4 - (name == "mixed")


@pytest.mark.parametrize("name", sorted(SHARED_STEPS))
def test_the_sdpa_path_builds_the_union_once_and_matches_the_kernel(monkeypatch, name):
    """With the kernel, decode rows sharing a prefix read their own slots (no union built); with CPLLM_KERNELS=0
    the SDPA path reads the shared-key view, built once for every layer of the step; the outputs agree."""
    from cpllm.layers.gqa import shared_keys as shared_keys_module
    from cpllm.kernels import decode_attention
    if not decode_attention.built():
        pytest.skip("the C decode kernel is not built here")
    built = []
    original = shared_keys_module._shared_key_batch
    monkeypatch.setattr(shared_keys_module, "_shared_key_batch", lambda *a: built.append(len(a[1])) or original(*a))
    chunks, layout, pools, (q, k, v) = _shared_prefix_step(SHARED_STEPS[name])
    layer = PagedCPAttention(ParallelContext(), scale=D**-0.5)

    def run_step(layers: int = 3):
        meta = build_step_batch(chunks, layout, 1, 0, lambda c: [], plan=eager_plan(chunks, layout)).attention
        step_pools = [p.clone() for p in pools]
        return [layer(q, k, v, *step_pools, meta) for _ in range(layers)], meta

    with_kernel, _ = run_step()
    assert built == []  # the kernel path pays nothing for the union
    monkeypatch.setenv("CPLLM_KERNELS", "0")
    sdpa, meta = run_step()
    assert built == [meta.decode.slots.shape[0]]  # once for the step's three layers
    for a, b in zip(with_kernel, sdpa, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
