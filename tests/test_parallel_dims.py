"""ParallelDims: the one place sizes, the KV layout's shard count and the layout rules live (no process starts)."""

from __future__ import annotations

import dataclasses

import pytest

from cpllm.bench.common import BenchLayout, parse_layout
from cpllm.config.engine import ModelConfig, ParallelConfig
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.planner.plan import valid_layouts

MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=8)


def test_config_builds_its_dims_once():
    parallel = ParallelConfig(tensor_parallel_size=4, prefill_context_parallel_size=2, decode_context_parallel_size=2,
                              data_parallel_size=3, cp_kv_cache_layout="replicated", enable_expert_parallel=True)
    assert parallel.dims == ParallelDims(tp=4, pcp=2, dcp=2, dp=3, kv_replicated=True, expert_parallel=True)
    assert dataclasses.replace(parallel, cp_kv_cache_layout="sharded").dims.kv_replicated is False
    assert parallel.dims.kv_cache_layout == "replicated"  # the option's spelling, unchanged


@pytest.mark.parametrize("replicated, shards", [(False, 4), (True, 2)])
def test_kv_shard_count_and_sizes(replicated, shards):
    dims = ParallelDims(tp=4, pcp=2, dcp=2, dp=2, kv_replicated=replicated)
    assert (dims.world_size, dims.replica_size, dims.cp_size, dims.kv_shard_size) == (16, 8, 4, shards)
    assert all(len(dims.members("kv_shard", r)) == shards for r in range(dims.world_size))


def test_one_label_format():
    assert ParallelDims(tp=8, pcp=4).label() == "8x4x1"
    assert ParallelDims(tp=2, pcp=2, dcp=2, kv_replicated=True).label() == "2x2x2-repl"
    assert parse_layout("1x2x1@3").label() == BenchLayout.of(pcp=2).label(3) == "1x2x1@3"
    labels = [layout.label() for layout in valid_layouts(MODEL, 4)]
    assert "4x1x2" in labels and "1x4x1-repl" in labels and len(labels) == len(set(labels))


def test_model_rules_name_the_options():
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by tensor_parallel_size=3"):
        ParallelDims(tp=3).validate(MODEL)
    with pytest.raises(ValueError, match="Valid DCP sizes here: \\[1, 2\\]"):
        ParallelDims(tp=4, dcp=4).validate(MODEL)
    ParallelDims(tp=4, dcp=2, pcp=2).validate(MODEL)


def test_single_groups_keep_the_dims():
    dims = ParallelDims(kv_replicated=True)
    groups = ParallelGroups.single(dims)
    assert groups.dims is dims and groups.kv_shard_group is None and groups.kv_shard_rank == 0
    assert groups.context().size("pcp") == 1 and groups.replica_ranks == [0]
    with pytest.raises(ValueError, match="one rank"):
        ParallelGroups.single(ParallelDims(tp=2))
