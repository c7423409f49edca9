"""The global rows of each state kind's pools (`state_rows` of cpllm/layers/gated_delta/spec.py and
cpllm/layers/kimi_delta/spec.py) against the layers' own load code, and the state plan (cpllm/disagg/state_plan.py)
against those rows.

Rows: the real layer is built for each TP rank in one process (ParallelContext.at: one rank's shard, no process
group) and loaded from checkpoint-shaped tensors whose every row is distinct; the convolution's rows of each TP
rank must be the single rank's rows at the global indexes `state_rows` gives (the conv pool's channels are the
convolution's, in its order: state_updates.py convolves pool channel i with conv_weight row i), and the decay
parameters of its heads the single rank's at the delta pool's global heads.

Plan: for every pair of layouts (TP 1, 2, 4 as the config's heads allow; PCP 1, 2; every DCP dividing TP) every
local row of every consumer rank's pools arrives exactly once, from a producer rank that holds the same global
row; the consumer ranks spread over the PCP copies."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from cpllm.config.engine import ModelConfig
from cpllm.disagg.reshard import CacheLayout
from cpllm.disagg.state_plan import StateMove, plan_states
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.layers import registry
from cpllm.layers.gated_delta.layer import GatedDeltaNet
from cpllm.layers.kimi_delta.layer import KimiDeltaAttention
from test_deepseek_moe import DictSource
from tiny_hybrid import tiny_hybrid_config
from tiny_kimi import tiny_kimi_config

PREFIX = "layer"
CASES = {
    # the tiny hybrid as it is: 2 key heads, TP 1 and 2
    "qwen3_5": ("Qwen3_5ForCausalLM", lambda: tiny_hybrid_config("qwen3_5", linear_value_head_dim=8)),
    # 4 key heads for TP = 4, dk != dv so that a swapped width fails
    "qwen3_next": ("Qwen3NextForCausalLM", lambda: tiny_hybrid_config(
        "qwen3_next", linear_num_key_heads=4, linear_num_value_heads=8, linear_value_head_dim=8)),
    "kimi_linear": ("KimiLinearForCausalLM", tiny_kimi_config),
}
"""Name -> (architecture, the transformers config)."""


@pytest.fixture(scope="module", params=sorted(CASES))
def config(request) -> ModelConfig:
    arch, make = CASES[request.param]
    return ModelConfig.from_hf_config({**make().to_dict(), "architectures": [arch]})


def _kind(config: ModelConfig):
    return registry.layer_kind("kimi_delta" if config.kimi_delta is not None else "gated_delta")


def _tp_sizes(config: ModelConfig) -> list[int]:
    heads = config.kimi_delta.num_heads if config.kimi_delta else config.linear_attention.num_key_heads
    return [tp for tp in (1, 2, 4) if heads % tp == 0]


def _flat(runs) -> list[int]:
    return [row for start, end in runs for row in range(start, end)]


# ---- the rows against the layers -------------------------------------------------------------------------------


def _checkpoint(config: ModelConfig) -> dict[str, torch.Tensor]:
    """The layer's convolution and decay tensors as the checkpoint stores them, each row distinct."""
    def coded(rows: int, width: int) -> torch.Tensor:
        return torch.arange(rows * width, dtype=torch.float32).reshape(rows, 1, width)

    if config.kimi_delta is not None:
        kda = config.kimi_delta
        tensors = {f"{PREFIX}.{p}_conv1d.weight": coded(kda.qkv_dim, kda.conv_kernel) + 1000 * i
                   for i, p in enumerate("qkv")}
        tensors[f"{PREFIX}.dt_bias"] = torch.arange(kda.qkv_dim, dtype=torch.float32)
        tensors[f"{PREFIX}.A_log"] = torch.arange(kda.num_heads, dtype=torch.float32).reshape(1, 1, -1, 1)
        return tensors
    linear = config.linear_attention
    return {f"{PREFIX}.conv1d.weight": coded(linear.conv_dim, linear.conv_kernel),
            f"{PREFIX}.dt_bias": torch.arange(linear.num_value_heads, dtype=torch.float32),
            f"{PREFIX}.A_log": -torch.arange(linear.num_value_heads, dtype=torch.float32)}


def _layer(config: ModelConfig, tp: int, tp_rank: int):
    """The real layer of TP rank `tp_rank` of `tp`, its convolution and decays loaded by its own load()."""
    parallel = ParallelContext.at(ParallelDims(tp=tp), tp_rank=tp_rank)
    if config.kimi_delta is not None:
        layer = KimiDeltaAttention(config.kimi_delta, config.hidden_size, PREFIX, parallel, torch.float32, "none")
    else:
        layer = GatedDeltaNet(config.linear_attention, config.hidden_size, config.rms_norm_eps, PREFIX, parallel,
                              torch.float32, "none")
    layer.load(DictSource(_checkpoint(config)))
    return layer


def test_state_rows_are_the_layers_own_rows(config):
    kind, whole = _kind(config), _layer(config, 1, 0)
    assert kind.state_rows(config, tp_size=1, tp_rank=0)[0] == ((0, whole.conv_channels),)
    for tp in _tp_sizes(config)[1:]:
        for rank in range(tp):
            conv, delta = map(_flat, kind.state_rows(config, tp_size=tp, tp_rank=rank))
            layer = _layer(config, tp, rank)
            assert torch.equal(layer.conv_weight, whole.conv_weight[conv]), (tp, rank)
            assert torch.equal(layer.A_log, whole.A_log[delta]), (tp, rank)
            # KDA's dt_bias is per key channel: [heads, d] rows of the delta pool's heads
            per_head = whole.dt_bias.view(len(whole.A_log), -1)
            assert torch.equal(layer.dt_bias.view(len(delta), -1), per_head[delta]), (tp, rank)


def test_state_rows_partition_each_pool_as_the_spec_sizes_it(config):
    kind = _kind(config)
    whole = kind.state_spec(config, tp_size=1).pools
    for tp in _tp_sizes(config):
        spec = kind.state_spec(config, tp_size=tp)
        held = [kind.state_rows(config, tp_size=tp, tp_rank=r) for r in range(tp)]
        for i, pool in enumerate(spec.pools):
            assert all(len(_flat(rows[i])) == pool.heads for rows in held), (tp, pool.name)
            assert sorted(row for rows in held for row in _flat(rows[i])) == list(range(whole[i].heads))
            assert all(b[0] > a[1] for rows in held for a, b in zip(rows[i], rows[i][1:])), "runs not joined"


def test_state_rows_refusals(config):
    kind = _kind(config)
    with pytest.raises(ValueError, match="tp_rank=2 is outside a TP group of tensor_parallel_size=2"):
        kind.state_rows(config, tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        kind.state_rows(config, tp_size=0, tp_rank=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide"):
        kind.state_rows(config, tp_size=3, tp_rank=0)


def test_registry_gives_every_state_layer_its_rows(config, monkeypatch):
    kind = _kind(config)
    rows = registry.state_layer_rows(config, 2, 1)
    assert sorted(rows) == sorted(registry.state_layer_specs(config, 2))
    assert set(rows.values()) == {kind.state_rows(config, tp_size=2, tp_rank=1)}
    without = tuple(dataclasses.replace(k, state_rows=None) if k is kind else k for k in registry.LAYER_KINDS)
    monkeypatch.setattr(registry, "LAYER_KINDS", without)
    with pytest.raises(ValueError, match=f"layer kind '{kind.name}' keeps states but gives no state_rows"):
        registry.state_layer_rows(config, 2, 1)


# ---- the plan --------------------------------------------------------------------------------------------------


def _layouts(tp_sizes: list[int]):
    for tp, pcp in itertools.product(tp_sizes, (1, 2)):
        for dcp in (d for d in (1, 2, 4) if tp % d == 0):
            yield CacheLayout(dims=ParallelDims(tp=tp, pcp=pcp, dcp=dcp), interleave=1, block_size=4)


def _check(src: CacheLayout, dst: CacheLayout, rows_of) -> None:
    plan = plan_states(src, dst, rows_of)
    tp_of = lambda dims, rank: dims.coords(rank)[2]  # noqa: E731
    for d in range(dst.num_ranks):
        want = rows_of(dst.dims.tp, tp_of(dst.dims, d))
        assert plan.num_pools == len(want)
        for pool, runs in enumerate(want):
            moves = [m for m in plan.to(d) if m.pool == pool]
            got: list[int] = []
            for m in moves:
                assert [b - a for a, b in m.src_local] == [b - a for a, b in m.dst_local], m
                assert src.dims.coords(m.src_rank)[1] == d % src.dims.pcp, ("copies not spread", m)
                held = _flat(rows_of(src.dims.tp, tp_of(src.dims, m.src_rank))[pool])
                sent = [held[i] for i in _flat(m.src_local)]
                assert sent == [_flat(runs)[i] for i in _flat(m.dst_local)], ("rows land elsewhere", m)
                got += _flat(m.dst_local)
            assert sorted(got) == list(range(len(_flat(runs)))), f"rank {d} pool {pool}: rows missing or twice"


def test_plan_covers_every_consumer_row_once_for_every_layout_pair(config):
    kind = _kind(config)
    rows_of = lambda tp, rank: kind.state_rows(config, tp_size=tp, tp_rank=rank)  # noqa: E731
    layouts = list(_layouts(_tp_sizes(config)))
    for src, dst in itertools.product(layouts, layouts):
        _check(src, dst, rows_of)


def _layout(tp: int = 1, pcp: int = 1, dcp: int = 1) -> CacheLayout:
    return CacheLayout(dims=ParallelDims(tp=tp, pcp=pcp, dcp=dcp), interleave=1, block_size=4)


def _gated_rows(tp: int, rank: int):
    """The gated DeltaNet's rows of a small config (2 key heads of width 2, 4 value heads of width 3)."""
    from types import SimpleNamespace

    from cpllm.config.linear_attention import LinearAttentionConfig
    from cpllm.layers.gated_delta.spec import state_rows

    linear = LinearAttentionConfig(linear_layers=(0,), num_key_heads=2, num_value_heads=4, key_head_dim=2,
                                   value_head_dim=3, conv_kernel=4, rotary_dim=2)
    return state_rows(SimpleNamespace(linear_attention=linear), tp_size=tp, tp_rank=rank)


def test_worked_example_tp2_to_one_rank():
    # producer TP ranks hold conv channels q [0,2) k [4,6) v [8,14) and q [2,4) k [6,8) v [14,20)
    plan = plan_states(_layout(tp=2), _layout(), _gated_rows)
    assert plan.moves == (
        StateMove(src_rank=0, dst_rank=0, pool=0, src_local=((0, 2), (2, 4), (4, 10)),
                  dst_local=((0, 2), (4, 6), (8, 14))),
        StateMove(src_rank=1, dst_rank=0, pool=0, src_local=((0, 2), (2, 4), (4, 10)),
                  dst_local=((2, 4), (6, 8), (14, 20))),
        StateMove(src_rank=0, dst_rank=0, pool=1, src_local=((0, 2),), dst_local=((0, 2),)),
        StateMove(src_rank=1, dst_rank=0, pool=1, src_local=((0, 2),), dst_local=((2, 4),)))


def test_consumer_ranks_spread_over_the_pcp_copies():
    # one TP shard on two PCP ranks; the consumer's TP = 2 x PCP = 2 ranks take copies 0, 1, 0, 1
    plan = plan_states(_layout(pcp=2), _layout(tp=2, pcp=2), _gated_rows)
    assert [{m.src_rank for m in plan.to(d)} for d in range(4)] == [{0}, {1}, {0}, {1}]
    assert {m.num_rows for m in plan.sent_by(0)} == {10, 2}  # half the conv channels, half the value heads


def test_plan_refusals():
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide linear_num_key_heads=2"):
        plan_states(_layout(tp=4), _layout(), _gated_rows)
    gap = lambda tp, rank: ((((0, 8),),) if tp == 1 else (((0, 4),),) if rank == 0 else (((6, 8),),))  # noqa: E731
    with pytest.raises(ValueError, match=r"global row 4 of state pool 0 \(on consumer TP rank 0 of tp_size=1\) is "
                                         "held by no producer TP rank of tp_size=2"):
        plan_states(_layout(tp=2), _layout(), gap)
    twice = lambda tp, rank: (((0, 5),),) if tp == 2 else (((0, 8),),)  # noqa: E731
    with pytest.raises(ValueError, match="global row 0 of state pool 0 is held twice: by producer TP rank 0 and "
                                         "by 1 of tp_size=2"):
        plan_states(_layout(tp=2), _layout(), twice)
    pools = lambda tp, rank: (((0, 4),),) * tp  # noqa: E731  (one pool on TP = 1, two on TP = 2)
    with pytest.raises(ValueError, match="the consumer's state layers have 2 pools, the producer's 1"):
        plan_states(_layout(), _layout(tp=2), pools)
    empty = lambda tp, rank: (((3, 3),),)  # noqa: E731
    with pytest.raises(ValueError, match=r"pool 0 of TP rank 0 \(tp_size=1\): run \(3, 3\) is not a non-empty"):
        plan_states(_layout(), _layout(), empty)


def test_rows_and_plan_are_torch_free():
    import subprocess
    import sys
    code = ("import sys, cpllm.disagg.state_plan, cpllm.layers.registry as r; "
            "assert r.layer_kind('gated_delta').state_rows and r.layer_kind('kimi_delta').state_rows; "
            "assert 'torch' not in sys.modules, 'the state plan or the rows imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
