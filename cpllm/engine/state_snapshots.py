"""Snapshots of per-request states for prefix caching on models with state layers (torch-free).

A layer that keeps a fixed-size state per request (a hybrid's gated DeltaNet layers: cpllm/layers/gated_delta/)
cannot resume a request from cached K/V blocks alone: a prefix hit needs the state as it was after the prefix's
last token. The state pools have extra slots past the live ones (cpllm/state_slots.py), each holding one request's
states of every state layer at a block boundary, named by the prefix hash of the block that boundary ends
(cpllm/engine/kv_blocks.py `block_hash`). The scheduler chooses, per prompt chunk, at most one boundary to save
(`ScheduledChunk.state_save`: the chunk ends there) and, at a prefix hit, the snapshot to start from
(`ScheduledChunk.state_restore`); the ranks copy slots, kind-free (cpllm/worker/kv_cache.py `copy_state_slots`).
Slots are reused least recently used first (docs/context_parallel.md, "Prefix caching for hybrids").
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    """Which snapshot slot holds the state after which prefix (by the hash of the prefix's last block)."""

    def __init__(self, first_slot: int, count: int):
        """Snapshot slots `first_slot .. first_slot + count - 1` of the state pools."""
        if count < 0:
            raise ValueError(f"state snapshot count {count} must be >= 0")
        self.count = count
        self._order: OrderedDict[int, bytes | None] = OrderedDict((first_slot + i, None) for i in range(count))
        """Slot -> the hash it holds (None: nothing yet), least recently used first."""
        self._by_hash: dict[bytes, int] = {}
        self.num_saved = 0
        """Snapshots taken since start."""
        self.num_restored = 0
        """Prefix hits that started from a snapshot, since start."""

    def __len__(self) -> int:
        """Snapshots held now (slots naming a prefix)."""
        return len(self._by_hash)

    def find(self, h: bytes) -> int | None:
        """The slot holding the state after the prefix whose last block hashes to `h` (marked recently used), or
        None."""
        slot = self._by_hash.get(h)
        if slot is not None:
            self._order.move_to_end(slot)
        return slot

    def holds(self, h: bytes) -> bool:
        return h in self._by_hash

    def take(self) -> int | None:
        """A slot to save into (the least recently used; what it held is forgotten), or None without slots. The
        slot names no prefix until `register`: the ranks write it after the step's forward."""
        if not self._order:
            return None
        slot, old = next(iter(self._order.items()))
        if old is not None:
            del self._by_hash[old]
        self._order[slot] = None
        self._order.move_to_end(slot)
        return slot

    def register(self, slot: int, h: bytes) -> None:
        """The step that saved into `slot` ran: it now holds the state after the prefix hashed `h`."""
        if h in self._by_hash:  # saved twice in one step (two requests of the same prompt): keep the first
            return
        self._order[slot] = h
        self._by_hash[h] = slot
        self.num_saved += 1

    def reset(self) -> None:
        for slot in self._order:
            self._order[slot] = None
        self._by_hash.clear()


def snapshot_line(count: int, state_bytes_per_request: int) -> str:
    """The capacity log's line for the snapshot slots: how many, and their bytes on one rank (a snapshot holds one
    request's states of every state layer, the rank's TP share of the heads: `state_bytes_per_request`)."""
    total = count * state_bytes_per_request
    return (f"state snapshots for prefix hits: {count} slots x {state_bytes_per_request / 2**10:.1f} KiB per rank "
            f"({total / 2**20:.2f} MiB, out of the KV budget): at most 2 per prompt (where its cached blocks outrun "
            "the snapshots, and its last block boundary), the least recently used reused first")
