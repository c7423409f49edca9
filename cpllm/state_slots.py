"""How many slots the per-request state pools hold (torch-free): the one count the scheduler (engine side) and the
runner (rank side) must agree on, as they agree on the step contract (cpllm/step.py)."""

from __future__ import annotations


def state_slot_counts(*, has_states: bool, max_num_seqs: int, prefix_caching: bool,
                      snapshots: int | None = None) -> tuple[int, int]:
    """(live slots, snapshot slots) of the per-request state pools: a live slot per running request
    (max_num_seqs) and, when prefix caching is on, `snapshots` snapshot slots (None: max_num_seqs;
    cpllm/engine/state_snapshots.py: the states at block boundaries a prefix hit starts from); (0, 0) for a model
    without state layers. The pools hold live + snapshot slots, the snapshots from index `live` on."""
    if not has_states:
        return 0, 0
    if not prefix_caching:
        return max_num_seqs, 0
    return max_num_seqs, max_num_seqs if snapshots is None else snapshots
