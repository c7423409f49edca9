"""One rank's part of a transfer: a producer rank serves the rows a consumer rank asks for, a consumer rank pulls
the rows it owns from the producer ranks that hold them (plan: cpllm/disagg/reshard.py). No rank ever holds more
than its own rows: each move is one message between one producer rank and one consumer rank."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from cpllm.disagg.config import KVTransferConfig
from cpllm.disagg.engine_transfer import model_signature
from cpllm.disagg.state_plan import StateMove
from cpllm.disagg.state_transfer import LayerRows, StatePools, layer_batches
from cpllm.distributed.comm import all_reduce
from cpllm.disagg.params import PullOp, RemotePrefill
from cpllm.disagg.reshard import CacheLayout, Move, plan_reshard, split_ranges
from cpllm.disagg.rows import from_frames, layer_pools, positions_of, read_rows, slots_of, to_frames, write_rows
from cpllm.disagg.shm_rows import ShmWriter, host_key, mapped_frames
from cpllm.disagg.wire import Server, TransferError, as_json, call
from cpllm.kv_groups import first_key
from cpllm.layers.registry import state_layer_rows

logger = logging.getLogger(__name__)

MESSAGE_BYTES = 64 << 20
"""About the most row bytes one message carries: a long move goes as several, so neither side ever holds more
than one message per move of a request in flight."""


class RankTransfer:
    """The transfer side of one replica rank (built by the runner when kv_transfer_config is set)."""

    def __init__(self, config: KVTransferConfig, layout: CacheLayout, rank: int, signature: dict,
                 caches: list[tuple[torch.Tensor, ...]], layer_rows: LayerRows | None = None):
        """`signature`: engine_transfer.model_signature of this instance's model (the producer's must match);
        `caches`: every layer's cache, in layer order; `layer_rows`: the state layers' rows by TP rank (a model
        with state layers)."""
        self.config, self.layout, self.rank, self.signature = config, layout, rank, signature
        self.num_kv_heads = num_kv_heads = signature["num_kv_heads"]
        self.windows = [window for window, _ in signature["groups"]]
        """Each KV group's sliding window (None: full attention): a windowed group moves only its window."""
        self.group_pools = [layer_pools([caches[i] for i in layers]) for _, layers in signature["groups"]]
        """Each KV group's pools, every layer's in layer order."""
        self.pools = [pool for pools in self.group_pools for pool in pools]
        self.states = StatePools({i: caches[i] for i in signature["state_layers"]}, layer_rows)
        """The state layers' pools (empty for a model without them)."""
        self.first_head = layout.heads(num_kv_heads, rank).start
        self.head_bytes = [sum(p.shape[-1] * p.element_size() for p in pools) for pools in self.group_pools]
        """Bytes of one (position, KV head) over each group's pools (this rank's dtype)."""
        self._layouts: dict[tuple[str, int, str], CacheLayout] = {}
        self._write_lock = threading.Lock()
        self.rows_sent = 0
        """Position x head rows this rank served, since start."""
        self.rows_pulled = 0
        """Position x head rows this rank pulled (over all KV groups), since start."""
        self.bytes_pulled = 0
        """Bytes of rows (and states) this rank pulled, since start."""
        self.messages_pulled = 0
        """Row messages this rank received, since start."""
        self.messages_by_shm = 0
        """Of those, the ones whose rows came through /dev/shm (a producer on this host)."""
        self.failed: dict[str, str] = {}
        """The last step's failed pulls on any rank of the replica: consumer request id -> why."""
        self.host_key = host_key() if config.shared_memory else None
        """This host's key (shm_rows.host_key): rows to or from a peer with the same key go through /dev/shm."""
        self.shm = ShmWriter(expiry_s=2 * config.transfer_timeout_s) if config.produces else None
        self.server = (Server(config.kv_ip, config.rank_port(rank), self._serve, f"kv-rows-{rank}")
                       if config.produces else None)

    def _serve(self, header: dict, frames: list) -> tuple[dict, list]:
        if header.get("op") == "state":
            rows = self.states.read(header["slot"], header["layers"], header["pool"], header["runs"])
            return self._answer(header, rows)
        if header.get("op") != "rows":
            raise ValueError(f"unknown op {header.get('op')!r}")
        heads = range(*header["heads"])
        mine = self.layout.heads(self.num_kv_heads, self.rank)
        if heads.start < mine.start or heads.stop > mine.stop:
            raise ValueError(f"rank {self.rank} holds KV heads {list(mine)}, was asked for {list(heads)}")
        positions = positions_of(header["ranges"])
        if len(positions) and any(self.layout.owner(int(p)) != self.layout.shard_rank(self.rank)
                                  for p in positions[:: max(1, len(positions) // 64)]):
            raise ValueError(f"rank {self.rank} was asked for positions it does not own")  # a stale plan
        pools = self.group_pools[header["group"]]
        slots = slots_of(self.layout, header["block_ids"], positions)
        if len(slots) and int(slots.min()) < 0:
            raise ValueError(f"rank {self.rank} was asked for positions of freed blocks (before a window)")
        rows = read_rows(pools, slots, slice(heads.start - mine.start, heads.stop - mine.start))
        self.rows_sent += len(positions) * len(heads)
        return self._answer(header, rows)

    def _answer(self, header: dict, rows: list[torch.Tensor]) -> tuple[dict, list]:
        """The rows as an answer: through /dev/shm to a consumer on this host, else as the message's frames."""
        shapes, data = to_frames(rows)
        dtype = str(rows[0].dtype).removeprefix("torch.") if rows else "float32"
        if self.host_key is not None and header.get("host_key") == self.host_key:  # the consumer is on this host
            name = self.shm.write(data)
            if name is not None:
                return {"shapes": shapes, "dtype": dtype, "shm": name, "sizes": [len(f) for f in data]}, []
        return {"shapes": shapes, "dtype": dtype}, data

    def remote_layout(self, remote: RemotePrefill) -> CacheLayout:
        """The producer's layout, asked of its control port once per producer."""
        key = (remote.host, remote.port, remote.engine_id)
        if key not in self._layouts:
            answer, _ = call(remote.host, remote.port, {"op": "layout"}, timeout_s=self.config.transfer_timeout_s)
            if answer["engine_id"] != remote.engine_id:
                raise ValueError(f"{remote.host}:{remote.port} is engine {answer['engine_id']!r}, not "
                                 f"{remote.engine_id!r}")
            theirs = {k: answer.get(k) for k in self.signature}
            if theirs != self.signature:
                raise ValueError(f"the producer's model is {theirs}, this one {self.signature} (KV heads, layers, "
                                 "KV groups by window under max_model_len, state layers): another model?")
            self._layouts[key] = CacheLayout.from_dict(answer["layout"])
        return self._layouts[key]

    def pull(self, ops: tuple[PullOp, ...], group=None) -> None:
        """Every row of every op's positions this rank owns, from the producer ranks holding them, into its pools.
        A pull that fails (a producer that died or refused, a timeout) fails only its request: the ranks agree
        over `group` (the replica's; None for one rank) which ops failed, and `failed` says so until the next
        step, so that the engine ends those requests (their rows are never read as a prompt's)."""
        local = {}
        for index, op in enumerate(ops):
            try:
                self._pull_op(op)
            except (TransferError, ValueError, KeyError) as error:
                logger.warning("kv transfer: rank %d could not pull request %s from %s:%d: %s", self.rank,
                               op.remote.request_id, op.remote.host, op.remote.port, error)
                local[index] = f"{type(error).__name__}: {error}"
        self.failed = agree_failures(local, ops, self.rank, group, self.pools[0].device if self.pools else None)

    def _pull_op(self, op: PullOp) -> None:
        """The moves of one op, asked of their producer ranks at once (one thread each), written as they come."""
        src = self.remote_layout(op.remote)
        jobs = [(self._pull_move, op, g, move) for g, first in enumerate(self._first_pulled(op))
                for move in plan_reshard(src, self.layout, self.num_kv_heads, op.num_tokens, first).to(self.rank)]
        if self.states and op.num_tokens > 0:  # the states after positions 0 .. num_tokens - 1
            if op.remote.state_slot < 0 or op.state_slot < 0:
                raise ValueError(f"the producer named no state slot for request {op.remote.request_id} (its "
                                 "kv_transfer_params lack remote_state_slot), and this model keeps states")
            jobs += [(self._pull_states, op, layers, move) for layers, move in self.states.moves(src, self.layout,
                                                                                                  self.rank)]
        if not jobs:
            return
        # the producer still holds the blocks (a stale pull would read blocks given to another request)
        call(op.remote.host, op.remote.port, {"op": "lease", "request_id": op.remote.request_id},
             timeout_s=self.config.transfer_timeout_s)
        start, bytes_before = time.perf_counter(), self.bytes_pulled
        with ThreadPoolExecutor(max_workers=min(len(jobs), 16), thread_name_prefix="kv-pull") as pool:
            for done in [pool.submit(*job) for job in jobs]:
                done.result()  # a failed move fails the pull (TransferError names the peer)
        # one line per pull, read by benchmarks/disagg_mixed.py (transfer time against the bytes moved)
        logger.info("kv transfer: rank %d pulled %d tokens of request %s, %d bytes in %.2f ms", self.rank,
                    op.num_tokens, op.remote.request_id, self.bytes_pulled - bytes_before,
                    (time.perf_counter() - start) * 1e3)

    def _first_pulled(self, op: PullOp) -> list[int]:
        """Each KV group's first pulled position: past the consumer's own prefix hit and, for a windowed group,
        within the window of the step's query at num_tokens (keys q - W < j <= q)."""
        return [min(op.num_tokens, max(op.first_token, first_key(w, op.num_tokens))) for w in self.windows]

    def _pull_move(self, op: PullOp, group: int, move: Move) -> None:
        """One move, a message of at most MESSAGE_BYTES at a time: fetched from its producer rank, then stored."""
        per_message = max(1, MESSAGE_BYTES // max(1, self.head_bytes[group] * len(move.heads)))
        for ranges in split_ranges(move.ranges, per_message):
            header = {"op": "rows", "group": group, "block_ids": list(op.remote.block_tables[group]),
                      "heads": as_json(move.heads), "ranges": as_json(ranges), "request_id": op.remote.request_id}
            self._store(op, group, move.heads, ranges, self._fetch(op, move.src_rank, header))

    def _pull_states(self, op: PullOp, layers: tuple[int, ...], move: StateMove) -> None:
        """One state move for `layers`, as many layers a message as MESSAGE_BYTES holds: into the live slot."""
        layer_bytes = move.num_rows * self.states.row_bytes(layers[0], move.pool)
        for batch in layer_batches(layers, layer_bytes, MESSAGE_BYTES):
            header = {"op": "state", "slot": op.remote.state_slot, "layers": batch, "pool": move.pool,
                      "runs": as_json(move.src_local), "request_id": op.remote.request_id}
            rows = self._fetch(op, move.src_rank, header)
            with self._write_lock:
                self.states.write(op.state_slot, tuple(batch), move, rows)
                self.bytes_pulled += len(batch) * layer_bytes
                self.messages_pulled += 1

    def _fetch(self, op: PullOp, src_rank: int, header: dict) -> list[torch.Tensor]:
        """One message's rows from producer rank `src_rank` (copies: from /dev/shm or from the frames)."""
        answer, frames = call(op.remote.host, op.remote.port + 1 + src_rank, {**header, "host_key": self.host_key},
                              timeout_s=self.config.transfer_timeout_s)
        if "shm" not in answer:
            return from_frames(answer["shapes"], frames, answer["dtype"])
        with mapped_frames(answer["shm"], answer["sizes"]) as mapped:  # the producer is on this host
            rows = from_frames(answer["shapes"], mapped, answer["dtype"])
        with self._write_lock:
            self.messages_by_shm += 1
        return rows

    def _store(self, op: PullOp, group: int, heads: range, ranges, rows: list[torch.Tensor]) -> None:
        positions = positions_of(ranges)
        slots = slots_of(self.layout, op.block_tables[group], positions)
        h0 = heads.start - self.first_head
        with self._write_lock:  # moves of different producer ranks land from several threads
            write_rows(self.group_pools[group], slots, slice(h0, h0 + len(heads)), rows)
            self.rows_pulled += len(positions) * len(heads)
            self.bytes_pulled += len(positions) * len(heads) * self.head_bytes[group]
            self.messages_pulled += 1

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.shm is not None:
            self.shm.close()


def agree_failures(local: dict[int, str], ops: tuple[PullOp, ...], rank: int, group, device) -> dict[str, str]:
    """Which ops failed on any rank (one all-reduce over the replica's `group`): request id -> why (this rank's
    message, or the highest failing rank's number where only another rank failed)."""
    if group is None:
        return {ops[i].request_id: message for i, message in local.items()}
    flags = torch.zeros(len(ops), dtype=torch.long, device=device)
    for i in local:
        flags[i] = rank + 1
    all_reduce(flags, group, op=dist.ReduceOp.MAX)
    return {op.request_id: local.get(i, f"consumer rank {int(f) - 1} could not pull the prompt's K/V from "
                                        f"{op.remote.host}:{op.remote.port} (its log says why)")
            for i, (op, f) in enumerate(zip(ops, flags.tolist())) if f}


def rank_transfer(config, dims, rank: int, caches: list[tuple[torch.Tensor, ...]]) -> RankTransfer | None:
    """The rank's RankTransfer under `config.kv_transfer_config` (an EngineConfig), else None."""
    kv = config.kv_transfer_config
    if kv is None:
        return None
    layout = CacheLayout(dims=dims, interleave=config.parallel.cp_kv_cache_interleave_size,
                         block_size=config.cache.block_size)
    model = config.model
    return RankTransfer(kv, layout, dims.moe_rank(rank), model_signature(config), caches,
                        lambda tp_size, tp_rank: state_layer_rows(model, tp_size, tp_rank))
