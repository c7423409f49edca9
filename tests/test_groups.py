"""ParallelDims' group members against an independent brute-force definition; ParallelGroups in a real gloo world."""

from __future__ import annotations

import itertools
import queue as queue_mod
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpllm.config.engine import ParallelConfig
from cpllm.distributed import comm
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.parallel_dims import GROUP_KINDS, ParallelDims
from cpllm.distributed.launch import find_free_port, init_distributed, shutdown_distributed
from cpllm.distributed.shm_group import ShmGroup

WORLD_TIMEOUT_S = 90.0  # hang guard for a whole spawned world (torch import included)
GLOO_TIMEOUT_S = 30.0


def _layouts(max_world: int):
    for dp, pcp, tp in itertools.product(range(1, max_world + 1), repeat=3):
        if dp * pcp * tp <= max_world:
            for dcp in range(1, tp + 1):
                if tp % dcp == 0:
                    yield dp, pcp, tp, dcp


def _brute_force(dp: int, pcp: int, tp: int, dcp: int, replicated: bool = False) -> dict[str, dict[int, list[int]]]:
    """Group members per rank, written from the rank-group table of docs/context_parallel.md with no shared code."""
    coords = {}
    for rank, (d, p, t) in enumerate(itertools.product(range(dp), range(pcp), range(tp))):
        coords[rank] = (d, p, t)

    def members(rank, same, order=lambda other: other):
        return sorted((o for o in coords if same(coords[rank], coords[o])), key=order)

    table: dict[str, dict[int, list[int]]] = {kind: {} for kind in GROUP_KINDS}
    for r in coords:
        table["tp"][r] = members(r, lambda a, b: a[:2] == b[:2])
        table["pcp"][r] = members(r, lambda a, b: (a[0], a[2]) == (b[0], b[2]))
        table["dcp"][r] = members(r, lambda a, b: a[:2] == b[:2] and a[2] // dcp == b[2] // dcp)
        table["cp"][r] = members(
            r,
            lambda a, b: a[0] == b[0] and a[2] // dcp == b[2] // dcp,
            order=lambda o: (coords[o][1], coords[o][2] % dcp),
        )
        table["dp"][r] = members(r, lambda a, b: a[1:] == b[1:])
        table["replica"][r] = members(r, lambda a, b: a[0] == b[0])
        table["kv_shard"][r] = table["dcp" if replicated else "cp"][r]
        table["moe"][r] = table["replica"][r]
    return table


@pytest.mark.parametrize("replicated", [False, True])
@pytest.mark.parametrize("dp,pcp,tp,dcp", list(_layouts(8)))
def test_dims_members_match_brute_force(dp, pcp, tp, dcp, replicated):
    layout = ParallelDims(dp=dp, pcp=pcp, tp=tp, dcp=dcp, kv_replicated=replicated)
    expected = _brute_force(dp, pcp, tp, dcp, replicated)
    assert layout.world_size == dp * pcp * tp == len(expected["tp"])
    for kind in GROUP_KINDS:
        for rank in range(layout.world_size):
            assert layout.members(kind, rank) == expected[kind][rank], (kind, rank)
        groups = layout.all_groups(kind)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(layout.world_size)), kind  # a partition of the world
        assert all(g == expected[kind][g[0]] for g in groups)


@pytest.mark.parametrize("dp,pcp,tp,dcp", list(_layouts(8)))
def test_cp_rank_is_position_in_cp_group(dp, pcp, tp, dcp):
    layout = ParallelDims(dp=dp, pcp=pcp, tp=tp, dcp=dcp)
    for rank in range(layout.world_size):
        d, p, t = layout.coords(rank)
        assert layout.rank_of(d, p, t) == rank
        assert layout.cp_rank(rank) == p * dcp + t % dcp
        assert layout.members("cp", rank)[layout.cp_rank(rank)] == rank
        assert layout.members("dcp", rank)[layout.dcp_rank(rank)] == rank
        assert layout.members("kv_shard", rank)[layout.kv_shard_rank(rank)] == rank
        assert layout.members("moe", rank)[layout.moe_rank(rank)] == rank
    assert layout.cp_size == layout.kv_shard_size == pcp * dcp
    replicated = ParallelDims(dp=dp, pcp=pcp, tp=tp, dcp=dcp, kv_replicated=True)
    assert replicated.kv_shard_size == dcp
    assert all(replicated.kv_shard_rank(r) == replicated.dcp_rank(r) for r in range(layout.world_size))


def test_cp_group_example():
    # DP=1, PCP=2, TP=4, DCP=2: ranks [[0,1,2,3],[4,5,6,7]]; rank 6 has tp 2, so KV heads of tp//2 = 1
    layout = ParallelDims(dp=1, pcp=2, tp=4, dcp=2)
    assert layout.members("cp", 6) == [2, 3, 6, 7]
    assert layout.cp_rank(6) == 2
    assert layout.members("dcp", 6) == [6, 7]
    assert layout.members("pcp", 6) == [2, 6]
    assert layout.all_groups("cp") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_dims_validation():
    with pytest.raises(ValueError, match="decode_context_parallel_size=3 must divide tensor_parallel_size=4"):
        ParallelDims(dp=1, pcp=1, tp=4, dcp=3)
    with pytest.raises(ValueError, match="prefill_context_parallel_size must be an integer >= 1, got 0"):
        ParallelDims(dp=1, pcp=0, tp=1, dcp=1)
    with pytest.raises(ValueError, match="rank=4 is outside the world of size 4"):
        ParallelDims(dp=1, pcp=2, tp=2, dcp=1).coords(4)
    with pytest.raises(ValueError, match="unknown group kind"):
        ParallelDims(dp=1, pcp=1, tp=1, dcp=1).members("pp", 0)


def test_single_needs_no_process_group():
    groups = ParallelGroups.single()
    assert (groups.rank, groups.world_size, groups.cp_rank, groups.replica_driver) == (0, 1, 0, 0)
    assert groups.tp_group is None and groups.replica_group is None
    x = torch.arange(6.0).reshape(2, 3)
    assert comm.all_gather(x, groups.tp_group, dim=1) is x
    assert comm.all_reduce(x, groups.cp_group) is x
    assert comm.broadcast_object({"a": 1}, src=0, group=groups.replica_group) == {"a": 1}


def test_build_without_init_for_world_one():
    if dist.is_initialized():
        pytest.skip("another test left a process group in this process")
    assert ParallelGroups.build(ParallelConfig(), timeout_s=5).world_size == 1
    with pytest.raises(RuntimeError, match="needs 2 ranks"):
        ParallelGroups.build(ParallelConfig(tensor_parallel_size=2), timeout_s=5)


# --- a real world of 4 gloo processes -------------------------------------------------

LAYOUTS_OF_4 = ((1, 2, 2, 2), (2, 2, 1, 1))


def _parallel(dp, pcp, tp, dcp, transport="auto") -> ParallelConfig:
    return ParallelConfig(
        data_parallel_size=dp,
        prefill_context_parallel_size=pcp,
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        collective_transport=transport,
    )


def _observe(groups: ParallelGroups) -> dict:
    """Per group kind: the all-reduced sum of ranks, this rank's group rank and the group size."""
    seen, shared = {}, {}
    for kind in GROUP_KINDS:
        group = getattr(groups, f"{kind}_group")
        total = comm.all_reduce(torch.tensor([groups.rank], dtype=torch.int64), group)
        seen[kind] = (int(total.item()), comm.group_rank(group), comm.group_size(group))
        if group is not None:
            shared[kind] = isinstance(group, ShmGroup)
    seen["shared_memory"] = shared
    seen["coords"] = (groups.dp_rank, groups.pcp_rank, groups.tp_rank, groups.dcp_rank, groups.cp_rank)
    seen["world_cpu_sum"] = int(comm.all_reduce(torch.tensor([groups.rank]), groups.world_cpu_group).item())
    # The replica driver announces its rank to its replica over the gloo control group.
    note = {"driver": groups.rank} if groups.is_replica_driver else None
    seen["announced"] = comm.broadcast_object(note, src=groups.replica_driver, group=groups.replica_group)
    return seen


def _groups_body(rank: int, world: int, port: int) -> dict:
    first = _parallel(*LAYOUTS_OF_4[0])
    groups = init_distributed(
        first,
        rank=rank,
        world_size=world,
        master_addr="127.0.0.1",
        master_port=port,
        timeout_s=GLOO_TIMEOUT_S,
    )
    assert groups.backend == "gloo"
    out = {LAYOUTS_OF_4[0]: _observe(groups)}
    # A second layout of the same world, built on the already-initialised default group.
    second = ParallelGroups.build(_parallel(*LAYOUTS_OF_4[1], transport="gloo"), timeout_s=GLOO_TIMEOUT_S)
    out[LAYOUTS_OF_4[1]] = _observe(second)
    try:
        ParallelGroups.build(_parallel(2, 2, 2, 1), timeout_s=GLOO_TIMEOUT_S)
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def _rank_main(body, rank: int, world: int, port: int, results) -> None:
    try:
        results.put((rank, True, body(rank, world, port)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        shutdown_distributed()


def _run_world(body, world: int) -> dict[int, object]:
    """Run body(rank, world, port) in `world` spawned processes; return each rank's result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(body, r, world, port, results), daemon=True)
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    out, errors = {}, {}
    try:
        for _ in range(world):
            rank, ok, value = results.get(timeout=WORLD_TIMEOUT_S)
            (out if ok else errors)[rank] = value
    except queue_mod.Empty:
        pytest.fail(f"world of {world} hung; results so far from ranks {sorted(out) + sorted(errors)}")
    finally:
        for proc in procs:
            proc.join(10)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    assert not errors, "\n".join(f"rank {r}:\n{tb}" for r, tb in errors.items())
    return out


def test_parallel_groups_in_world_of_4():
    results = _run_world(_groups_body, 4)
    for layout_sizes in LAYOUTS_OF_4:
        dp, pcp, tp, dcp = layout_sizes
        expected = _brute_force(dp, pcp, tp, dcp)
        for rank in range(4):
            seen = results[rank][layout_sizes]
            for kind in GROUP_KINDS:
                members = expected[kind][rank]
                expected_seen = (sum(members), members.index(rank), len(members))
                assert seen[kind] == expected_seen, (layout_sizes, rank, kind)
            d, p, t = divmod(rank, pcp * tp)[0], (rank // tp) % pcp, rank % tp
            assert seen["coords"] == (d, p, t, t % dcp, p * dcp + t % dcp)
            assert seen["world_cpu_sum"] == 0 + 1 + 2 + 3
            # auto (the first layout): every group but dp through shared memory; gloo (the second): none
            auto = layout_sizes == LAYOUTS_OF_4[0]
            assert seen["shared_memory"] == {kind: auto and kind != "dp" for kind in seen["shared_memory"]}
            assert len(seen["shared_memory"]) == sum(len(expected[k][rank]) > 1 for k in GROUP_KINDS)
            assert seen["announced"] == {"driver": expected["replica"][rank][0]}
        for rank in range(4):
            assert "has 4 processes but DP=2 x PCP=2 x TP=2 needs 8" in results[rank]["mismatch"]
