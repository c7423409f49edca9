"""The parallel context (cpllm/distributed/parallel_context.py): every coordinate it answers is the dims' arithmetic."""

from __future__ import annotations

import pytest
import torch

from cpllm.distributed.parallel_context import ParallelContext
from cpllm.distributed.parallel_dims import GROUP_KINDS, ParallelDims, cp_coords, cp_rank_of

LAYOUTS = [ParallelDims(tp=4, pcp=2, dcp=2), ParallelDims(tp=2, pcp=3, dcp=2, dp=2),
           ParallelDims(tp=4, pcp=2, dcp=2, kv_replicated=True), ParallelDims(tp=2, pcp=2, expert_parallel=True)]


@pytest.mark.parametrize("dims", LAYOUTS, ids=lambda d: f"{d.label()}-dp{d.dp}")
def test_ranks_and_sizes_are_the_dims_groups(dims):
    """For every rank and kind: rank(kind) is its place among members(kind), size(kind) their count, and the
    dims' own coordinates agree (tp, pcp, dcp, cp, kv_shard, moe)."""
    for rank in range(dims.world_size):
        parallel = ParallelContext(dims=dims, global_rank=rank)
        for kind in GROUP_KINDS:
            members = dims.members(kind, rank)
            assert parallel.members(kind) == tuple(members)
            assert (parallel.rank(kind), parallel.size(kind)) == (members.index(rank), len(members))
        dp_rank, pcp_rank, tp_rank = dims.coords(rank)
        assert [parallel.rank(k) for k in ("dp", "pcp", "tp", "dcp", "cp", "kv_shard", "moe")] == [
            dp_rank, pcp_rank, tp_rank, dims.dcp_rank(rank), dims.cp_rank(rank), dims.kv_shard_rank(rank),
            dims.moe_rank(rank)]
        assert parallel.kv_heads(2) == dims.kv_heads(2, rank)


@pytest.mark.parametrize("dims", LAYOUTS[:3], ids=lambda d: d.label())
def test_member_coordinates_invert_the_cp_order(dims):
    """member_coords of the cp group's member i is cp_coords(i); member_cp_ranks of a PCP group lists the cp ranks
    of its members (same DCP rank, every PCP rank)."""
    parallel = ParallelContext.at(dims, pcp_rank=1, tp_rank=1)
    for index in range(parallel.size("cp")):
        assert parallel.member_coords("cp", index) == cp_coords(index, dims.dcp)
        assert cp_rank_of(*cp_coords(index, dims.dcp), dims.dcp) == index
    dcp_rank = parallel.rank("dcp")
    assert parallel.member_cp_ranks("pcp") == tuple(cp_rank_of(p, dcp_rank, dims.dcp) for p in range(dims.pcp))
    owners = torch.arange(dims.cp_size)
    assert torch.equal(cp_rank_of(*cp_coords(owners, dims.dcp), dims.dcp), owners)  # tensors alike


def test_a_rank_alone_skips_its_collectives_and_bad_input_is_refused():
    """Without process groups the context still places the shard (TP rank 1 of 2) and its collectives return the
    tensor as is; an unknown kind or a rank outside the world is a ValueError naming it."""
    parallel = ParallelContext.at(ParallelDims(tp=2), tp_rank=1)
    tp = parallel.comm("tp")
    x = torch.ones(3, 4)
    assert (tp.rank, tp.size, tp.group) == (1, 2, None) and tp.all_reduce(x) is x and tp.all_gather(x) is x
    with pytest.raises(ValueError, match="unknown group kind 'ep'"):
        parallel.rank("ep")
    with pytest.raises(ValueError, match="unknown group kinds"):
        ParallelContext(groups={"ep": None})
    with pytest.raises(ValueError, match="rank=4 is outside the world of size 4"):
        ParallelContext(dims=ParallelDims(tp=2, pcp=2), global_rank=4)
