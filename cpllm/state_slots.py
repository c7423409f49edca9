"""How many slots the per-request state pools hold (torch-free): the one count the scheduler (engine side) and the
runner (rank side) must agree on, as they agree on the step contract (cpllm/step.py)."""

from __future__ import annotations


def state_slot_counts(*, has_states: bool, max_num_seqs: int, prefix_caching: bool,
                      snapshots: int | None = None, produces: bool = False) -> tuple[int, int, int]:
    """(live slots, snapshot slots, held slots) of the per-request state pools: a live slot per running request
    (max_num_seqs); when prefix caching is on, `snapshots` snapshot slots (None: max_num_seqs;
    cpllm/engine/state_snapshots.py: the states at block boundaries a prefix hit starts from); on a disaggregated
    producer (`produces`), max_num_seqs held slots, each keeping a prefilled prompt's states until a consumer pulls
    them (cpllm/disagg). (0, 0, 0) for a model without state layers. The pools hold live, then snapshot, then held
    slots."""
    if not has_states:
        return 0, 0, 0
    held = max_num_seqs if produces else 0
    if not prefix_caching:
        return max_num_seqs, 0, held
    return max_num_seqs, max_num_seqs if snapshots is None else snapshots, held


def engine_state_slots(config) -> tuple[int, int, int]:
    """`state_slot_counts` of an EngineConfig (the same call on the engine and on every rank)."""
    from cpllm.layers.registry import state_layer_indices  # the layer registry: torch-free

    kv = config.kv_transfer_config
    return state_slot_counts(has_states=bool(state_layer_indices(config.model)),
                             max_num_seqs=config.scheduler.max_num_seqs,
                             prefix_caching=config.cache.enable_prefix_caching,
                             snapshots=config.cache.state_snapshots, produces=kv is not None and kv.produces)
