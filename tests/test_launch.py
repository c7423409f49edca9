"""Launch (spawned driver + workers on gloo), the comm helpers, and failure handling.

Every multi-process test runs its driver in a spawned child, so the pytest process
never joins a process group, and waits on it with a bound (a hang fails the test).
"""

from __future__ import annotations

import functools
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpllm.config.engine import ParallelConfig
from cpllm.distributed import comm
from cpllm.distributed.launch import find_free_port, init_distributed, is_torchrun, shutdown_distributed, torchrun_env
from cpllm.distributed.rank_processes import spawn_workers
from cpllm.distributed.shm_group import SLOT_BYTES, ShmGroup, open_shm_group

HANG_GUARD_S = 90.0
"""Longest a test waits for its processes; only reached when something hangs."""


def _pid_gone(pid: int) -> bool:
    """True when the process no longer exists or is a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids, bound_s: float = 30.0) -> list[int]:
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        alive = [pid for pid in pids if not _pid_gone(pid)]
        if not alive:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if not _pid_gone(pid)]


# --- plain functions ------------------------------------------------------------------


def test_is_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not is_torchrun()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not is_torchrun()  # MASTER_ADDR still missing
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert is_torchrun()
    assert torchrun_env() == {"rank": 1, "world_size": 2, "master_addr": "10.0.0.1", "master_port": 1234}


def test_find_free_port_can_be_bound():
    port = find_free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_init_distributed_checks_world_size():
    parallel = ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2)
    with pytest.raises(ValueError, match="3 processes started but DP=1 x PCP=2 x TP=2 needs 4"):
        init_distributed(parallel, rank=0, world_size=3, master_addr="127.0.0.1", master_port=1, timeout_s=1)
    single = init_distributed(
        ParallelConfig(), rank=0, world_size=1, master_addr="127.0.0.1", master_port=1, timeout_s=1
    )
    assert single.world_size == 1 and single.backend is None and single.tp_group is None


def test_comm_helpers_on_group_of_one_return_input():
    x = torch.randn(2, 3)
    assert comm.all_gather(x, None, dim=1) is x
    assert comm.reduce_scatter(x, None, dim=0) is x
    assert comm.all_to_all(x, None, input_split_sizes=[2], output_split_sizes=[2]) is x
    assert comm.ring_exchange(x, None).wait() is x
    assert comm.group_size(None) == 1 and comm.group_rank(None) == 0


# --- harness: a spawned driver (rank 0) that spawns its workers -----------------------


def _init(rank: int, world: int, port: int, timeout_s: float):
    parallel = ParallelConfig(tensor_parallel_size=world, distributed_timeout_s=timeout_s)
    return init_distributed(
        parallel, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, timeout_s=timeout_s
    )


def _worker_main(rank: int, body, world: int, port: int, out_dir: str) -> None:
    """A spawned worker (a fresh interpreter): its result travels back as a file."""
    try:
        torch.save(body(rank, world, port), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        shutdown_distributed()


def _driver_main(body, world: int, results, out_dir: str) -> None:
    """Rank 0: spawn ranks 1.. with spawn_workers, run the body, report, join the workers."""
    try:
        port = find_free_port()
        handles = spawn_workers(world, _worker_main, (body, world, port, out_dir), master_port=port)
        results.put(("pids", handles.pids))
        with handles.watch():
            value = body(0, world, port)
        # Plain pickles: a tensor put on a multiprocessing queue travels as a shared file descriptor
        # that dies with this process, and the reader may get to it only after this process exited.
        results.put((0, pickle.dumps(value)))
        shutdown_distributed()
        handles.join(timeout_s=60)
        for rank in range(1, world):
            results.put((rank, pickle.dumps(torch.load(os.path.join(out_dir, f"{rank}.pt")))))
        results.put(("joined", None))
    except BaseException as exc:
        results.put(("driver_error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _run_driver(body, world: int, out_dir) -> tuple[dict, object]:
    """Start the driver, collect messages until it joined (or failed) and exited."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    driver = ctx.Process(target=_driver_main, args=(body, world, results, str(out_dir)), daemon=False)
    driver.start()
    messages: dict = {}
    try:
        while "joined" not in messages and "driver_error" not in messages:
            key, value = results.get(timeout=HANG_GUARD_S)
            messages[key] = value
    except queue_mod.Empty:
        pytest.fail(f"processes hung; messages so far: {messages}")
    finally:
        driver.join(HANG_GUARD_S)
        if driver.exitcode is None:
            driver.kill()
            driver.join()
    return messages, driver


# --- comm helpers in a world of 3 -------------------------------------------------------


def _x(rank: int) -> torch.Tensor:
    return torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(100 + rank))


def _y(rank: int, world: int) -> torch.Tensor:
    return torch.randn(2, 2 * world, 4, generator=torch.Generator().manual_seed(200 + rank))


def _count(src: int, dst: int) -> int:
    """Rows rank src sends to rank dst in the uneven all_to_all (zero included)."""
    return (src + 2 * dst) % 3


def _rows(src: int, dst: int) -> torch.Tensor:
    # [count, 2]: each row says where it came from and where it goes
    return torch.tensor([[src * 100 + dst * 10 + k, -1.0] for k in range(_count(src, dst))]).reshape(-1, 2)


def _big(rank: int) -> torch.Tensor:
    """Larger than a shared-memory slot: the ShmGroup sends it through gloo."""
    return torch.full((SLOT_BYTES // 4 + 8,), float(rank + 1))


def _copied(buffers):
    """all_gather_rows' views copied out before the next collective may overwrite them (None stays None)."""
    return None if buffers is None else tuple(t.clone() for t in buffers)


def _placed(rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """Rank r holds tokens r and 2 world - 1 - r (a head-tail split of 2 world tokens), in rows 0 and 1: the
    token's number, in a float column and, transposed, in an int column pair."""
    tokens = torch.tensor([rank, 2 * world - 1 - rank])
    return tokens.float().view(2, 1), torch.stack([tokens, -tokens]).t()


def _placements(rank: int, world: int) -> list[tuple[int, int, int]]:
    return [(0, rank, 1), (1, 2 * world - 1 - rank, 1)]


def _helpers(rank: int, g) -> dict:
    world = comm.group_size(g)
    out = {
        "gather0": comm.all_gather(_x(rank), g, dim=0),
        "gather1": comm.all_gather(_x(rank).transpose(0, 2), g, dim=1),  # non-contiguous input
        "reduce": comm.all_reduce(_x(rank).clone(), g),
        "max": comm.all_reduce(_x(rank).clone(), g, op=dist.ReduceOp.MAX),
        "min_bf16": comm.all_reduce(_x(rank).to(torch.bfloat16), g, op=dist.ReduceOp.MIN),
        "big_sum": comm.all_reduce(_big(rank), g)[-4:],
        "scatter0": comm.reduce_scatter(_y(rank, world).transpose(0, 1), g, dim=0),
        "scatter1": comm.reduce_scatter(_y(rank, world), g, dim=1),
        "a2a": comm.all_to_all(
            torch.cat([_rows(rank, j) for j in range(world)]),
            g,
            input_split_sizes=[_count(rank, j) for j in range(world)],
            output_split_sizes=[_count(i, rank) for i in range(world)],
        ),
        "in_place": _copied(comm.all_gather_rows(_placed(rank, world), _placements(rank, world), 2 * world, g)),
        "big_rows": comm.all_gather_rows((_big(rank).view(-1, 1),), [(0, 0, 1)], world * SLOT_BYTES // 4 + 16, g),
        "obj": comm.broadcast_object({"step": 7} if rank == 0 else None, src=0, group=g),
        "big_obj": len(comm.broadcast_object(b"x" * SLOT_BYTES if rank == 1 else None, src=1, group=g)),
    }
    ring, current = [], _x(rank)
    for _ in range(world - 1):
        current = comm.ring_exchange(current, g).wait()
        ring.append(current)
    out["ring"] = ring
    return out


def _comm_body(rank: int, world: int, port: int) -> dict:
    _init(rank, world, port, timeout_s=30)
    shm = open_shm_group(dist.group.WORLD, list(range(world)), rank, timeout_s=30)
    assert isinstance(shm, ShmGroup)
    out = {"gloo": _helpers(rank, dist.group.WORLD), "shm": _helpers(rank, shm)}
    # A subgroup whose group ranks differ from global ranks: [0, 2] (rank 1 is not a member,
    # but must still call new_group).
    sub = dist.new_group([0, 2])
    if rank != 1:
        sub_shm = open_shm_group(sub, [0, 2], rank, timeout_s=30)
        for name, g in (("gloo", sub), ("shm", sub_shm)):
            out[name]["sub_ring"] = comm.ring_exchange(_x(rank), g).wait()
            out[name]["sub_obj"] = comm.broadcast_object(f"from {rank}", src=2, group=g)
            out[name]["sub_gather"] = comm.all_gather(_x(rank), g)
    return out


def test_comm_helpers_in_world_of_3(tmp_path):
    """Every helper on a gloo group and on a shared-memory group of the same ranks (its fast path and its
    gloo fallback for payloads over a slot)."""
    world = 3
    messages, driver = _run_driver(_comm_body, world, tmp_path)
    assert "driver_error" not in messages, messages.get("driver_error")
    assert "joined" in messages and driver.exitcode == 0
    xs = [_x(r) for r in range(world)]
    ys = [_y(r, world) for r in range(world)]
    for rank in range(world):
        for transport, got in pickle.loads(messages[rank]).items():
            torch.testing.assert_close(got["gather0"], torch.cat(xs, dim=0))
            torch.testing.assert_close(got["gather1"], torch.cat([x.transpose(0, 2) for x in xs], dim=1))
            torch.testing.assert_close(got["reduce"], sum(xs))
            torch.testing.assert_close(got["max"], torch.stack(xs).amax(0))
            torch.testing.assert_close(got["min_bf16"], torch.stack(xs).to(torch.bfloat16).amin(0))
            torch.testing.assert_close(got["big_sum"], torch.full((4,), 6.0))
            torch.testing.assert_close(got["scatter0"], sum(ys).transpose(0, 1)[2 * rank : 2 * rank + 2])
            torch.testing.assert_close(got["scatter1"], sum(ys)[:, 2 * rank : 2 * rank + 2])
            torch.testing.assert_close(got["a2a"], torch.cat([_rows(i, rank) for i in range(world)]))
            assert got["obj"] == {"step": 7} and got["big_obj"] == SLOT_BYTES, transport
            assert got["big_rows"] is None, "past the slots: no shared buffers (the caller all-gathers)"
            if transport == "gloo":
                assert got["in_place"] is None, "only one host's shared memory gathers rows in place"
            else:  # every rank's rows at their places: token t at row t, a transposed (strided) source included
                tokens = torch.arange(2 * world)
                assert got["in_place"][0].view(-1).tolist() == tokens.float().tolist()
                assert got["in_place"][1].tolist() == torch.stack([tokens, -tokens]).t().tolist()
            assert [r.tolist() for r in got["ring"]] == [xs[(rank - s) % world].tolist() for s in (1, 2)]
            if rank != 1:
                other = 2 - rank
                torch.testing.assert_close(got["sub_ring"], xs[other])
                torch.testing.assert_close(got["sub_gather"], torch.cat([xs[0], xs[2]]))
                assert got["sub_obj"] == "from 2"
    assert _wait_gone(messages["pids"].values()) == []


# --- failures -----------------------------------------------------------------------------

KILLED_RANK, KILL_STEP, KILL_CODE = 2, 3, 17


def _dying_body(rank: int, world: int, port: int) -> None:
    """Steps of broadcast + all_reduce; rank 2 dies abruptly at step 3, mid-run."""
    groups = _init(rank, world, port, timeout_s=30)
    for step in range(1000):
        if rank == KILLED_RANK and step == KILL_STEP:
            os._exit(KILL_CODE)
        comm.broadcast_object(step if rank == 0 else None, src=0, group=groups.replica_group)
        comm.all_reduce(torch.ones(4), groups.tp_group)
    return None


def _dying_driver(world: int, results, out_dir: str) -> None:
    try:
        port = find_free_port()
        handles = spawn_workers(world, _worker_main, (_dying_body, world, port, out_dir), master_port=port)
        results.put(("pids", handles.pids))
        groups = _init(0, world, port, timeout_s=30)
        step = 0
        while True:  # the driver's loop: check the workers around every step
            with handles.watch():
                comm.broadcast_object(step, src=0, group=groups.replica_group)
                comm.all_reduce(torch.ones(4), groups.tp_group)
            step += 1
    except RuntimeError as exc:
        results.put(("error", (str(exc), step)))


def test_killed_worker_is_named_and_every_process_exits(tmp_path):
    world = 3
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    driver = ctx.Process(target=_dying_driver, args=(world, results, str(tmp_path)), daemon=False)
    driver.start()
    messages = {}
    try:
        while "error" not in messages:
            key, value = results.get(timeout=HANG_GUARD_S)
            messages[key] = value
    except queue_mod.Empty:
        pytest.fail(f"the driver did not report the dead worker; messages: {messages}")
    finally:
        driver.join(HANG_GUARD_S)
        if driver.exitcode is None:
            driver.kill()
            driver.join()
    error, step = messages["error"]
    assert f"worker rank {KILLED_RANK}" in error and f"exited with code {KILL_CODE}" in error, error
    assert step == KILL_STEP  # the first step rank 2 never joined, mid-run
    assert driver.exitcode == 0
    assert _wait_gone(messages["pids"].values()) == []


HUNG_TIMEOUT_S = 2.0


def _short_timeout_group(rank: int, transport: str):
    # Start-up uses a generous timeout (spawning is slow on a loaded machine); only the
    # collective under test runs on a group with a short one.
    group = dist.new_group([0, 1], timeout=timedelta(seconds=HUNG_TIMEOUT_S))
    return group if transport == "gloo" else open_shm_group(group, [0, 1], rank, timeout_s=HUNG_TIMEOUT_S)


def _hung_peer_body(rank: int, world: int, port: int, transport: str) -> None:
    _init(rank, world, port, timeout_s=30)
    _short_timeout_group(rank, transport)
    dist.barrier()
    time.sleep(HANG_GUARD_S)  # alive but never joins the collective


def _hung_peer_driver(results, out_dir: str, transport: str) -> None:
    port = find_free_port()
    body = functools.partial(_hung_peer_body, transport=transport)
    handles = spawn_workers(2, _worker_main, (body, 2, port, out_dir), master_port=port)
    results.put(("pids", handles.pids))
    _init(0, 2, port, timeout_s=30)
    group = _short_timeout_group(0, transport)
    dist.barrier()
    try:
        with handles.watch():
            comm.all_reduce(torch.ones(4), group)
        results.put(("error", None))
    except Exception as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_collective_with_hung_peer_times_out_and_workers_are_stopped(tmp_path, transport):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    driver = ctx.Process(target=_hung_peer_driver, args=(results, str(tmp_path), transport), daemon=False)
    driver.start()
    messages = {}
    try:
        while "error" not in messages:
            key, value = results.get(timeout=HANG_GUARD_S)
            messages[key] = value
    except queue_mod.Empty:
        pytest.fail(f"the all_reduce with a hung peer did not time out; messages: {messages}")
    finally:
        driver.join(HANG_GUARD_S)
        if driver.exitcode is None:
            driver.kill()
            driver.join()
    assert messages["error"] is not None and "timed out" in messages["error"].lower(), messages["error"]
    assert _wait_gone(messages["pids"].values()) == []


def _sleeping_worker(rank: int) -> None:
    time.sleep(HANG_GUARD_S)


def _vanishing_driver(results) -> None:
    handles = spawn_workers(3, _sleeping_worker, (), master_port=find_free_port())
    results.put(("pids", handles.pids))
    time.sleep(1.0)  # let the workers start their parent watch
    os._exit(0)  # no atexit, no cleanup: as if the driver were SIGKILLed


def test_workers_exit_when_driver_dies_abruptly():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    driver = ctx.Process(target=_vanishing_driver, args=(results,), daemon=False)
    driver.start()
    try:
        key, pids = results.get(timeout=HANG_GUARD_S)
    finally:
        driver.join(HANG_GUARD_S)
    assert key == "pids" and sorted(pids) == [1, 2]
    assert _wait_gone(pids.values()) == []


def _failing_worker(rank: int) -> None:
    raise ValueError(f"bad input on rank {rank}")


def test_join_reports_failed_worker():
    handles = spawn_workers(2, _failing_worker, (), master_port=find_free_port())
    with pytest.raises(RuntimeError, match="worker rank 1 exited with code 1"):
        handles.join(timeout_s=HANG_GUARD_S)
    with pytest.raises(RuntimeError, match=r"(?s)worker rank 1 \(pid \d+\) exited with code 1:\n.*ValueError: bad input on rank 1"):
        handles.check_alive()


def test_join_terminates_workers_past_the_timeout():
    handles = spawn_workers(2, _sleeping_worker, (), master_port=find_free_port())
    with pytest.raises(RuntimeError, match=r"worker ranks \[1\] were still running"):
        handles.join(timeout_s=0.5)
    assert handles.dead_ranks()[1] < 0  # stopped by a signal


def test_worker_failing_at_start_is_reported_at_once_with_its_error():
    """The driver waits for its workers in the store; a worker that dies first is named with its traceback."""
    timeout_s = 60.0
    port = find_free_port()
    handles = spawn_workers(3, _failing_worker, (), master_port=port)
    start = time.monotonic()
    # A rank still exiting past the grace period (a loaded machine) is named as having reported its error.
    with pytest.raises(RuntimeError, match=r"(?s)while starting: worker rank \d \(pid \d+\) "
                                           r"(exited with code 1|reported an error):\n.*ValueError: bad input on rank \d"):
        init_distributed(ParallelConfig(tensor_parallel_size=3), rank=0, world_size=3, master_addr="127.0.0.1",
                         master_port=port, timeout_s=timeout_s, workers=handles)
    assert time.monotonic() - start < timeout_s / 2  # not a store timeout
    assert _wait_gone(handles.pids.values()) == []


def test_worker_function_from_main_is_refused():
    def local():  # defined here, but pretend it is the user's script
        pass

    local.__module__ = "__main__"
    with pytest.raises(ValueError, match="importable module, not in __main__"):
        spawn_workers(2, local, (), master_port=find_free_port())
