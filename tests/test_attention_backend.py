"""Attention backends (cpllm/context_parallel/backend.py): the registry, the GQA backend's interface, and the CP
layer doing all of its local work through the backend it is given."""

from __future__ import annotations

import pytest
import torch

from cpllm.context_parallel import backend as backend_module
from cpllm.context_parallel.attention import CPComm, PagedCPAttention
from cpllm.context_parallel.backend import BACKENDS, AttentionBackend, attention_backend
from cpllm.context_parallel.gqa_backend import GQAPagedBackend
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import build_step_batch
from cpllm.context_parallel.plan import StepPlan
from cpllm.step import ScheduledChunk

HQ, HKV, D, BLOCK = 4, 2, 8, 4
METHODS = [name for name in AttentionBackend.__dict__ if not name.startswith("_")]


def test_registry_names_each_backend():
    assert isinstance(attention_backend("gqa"), GQAPagedBackend) and attention_backend().name == "gqa"
    assert all(factory().name == name for name, factory in BACKENDS.items())
    with pytest.raises(ValueError, match="no attention backend 'mla'"):
        attention_backend("mla")


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
    layout = KVLayout(cp_size=1, cp_rank=0, interleave=1, block_size=BLOCK)
    chunks = [ScheduledChunk(request_id=str(i), token_ids=tuple([1] * new), start_pos=ctx,
                             block_table=tuple(range(1 + 8 * i, 9 + 8 * i)), sample=True, prompt_logits=False)
              for i, (ctx, new) in enumerate(requests)]
    meta = build_step_batch(chunks, layout, 1, 0, lambda c: [], plan=plan).attention
    pools = [torch.randn(80 * BLOCK, HKV, D, generator=g) for _ in range(2)]
    q, k, v = (torch.randn(meta.num_rows, h, D, generator=g) for h in (HQ, HKV, HKV))
    return (q, k, v), pools, meta


@pytest.mark.parametrize("requests, plan, used", [
    ([(0, 9), (6, 5), (10, 1)], None, {"store_kv", "attend", "context_keys", "attend_decode"}),
    ([(10, 1), (3, 1)], None, {"store_kv", "attend_decode_whole"}),
    ([(10, 1), (3, 1)], StepPlan.GATHERED_DECODE, {"store_kv", "attend_decode"}),
])
def test_the_cp_layer_attends_only_through_its_backend(monkeypatch, requests, plan, used):
    (q, k, v), pools, meta = _step(requests, plan)
    want = PagedCPAttention(CPComm(), scale=D**-0.5)(q, k, v, *[p.clone() for p in pools], meta)
    counting = _Counting()
    monkeypatch.setitem(BACKENDS, "counting", lambda: counting)
    layer = PagedCPAttention(CPComm(), scale=D**-0.5, backend=backend_module.attention_backend("counting"))
    got = layer(q, k, v, *pools, meta)
    assert set(counting.calls) == used and torch.equal(got, want)
