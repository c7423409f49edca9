"""The engine's parallel dimensions: their sizes, every rule a layout must obey, and which ranks form each group.

One frozen `ParallelDims` is built from the configuration (`ParallelConfig.dims`) and validated there, once; the
process groups (cpllm/distributed/groups.py), the runner, the attention layer, the planner and the bench read
their sizes, ranks and group members from it. Pure arithmetic: no torch, no process.

Global ranks are laid out as `arange(world).reshape(DP, PCP, TP)` (TP varies fastest). Group kinds, by members:

    tp        the TP ranks of one (dp, pcp) coordinate
    pcp       the PCP ranks of one (dp, tp) coordinate
    dcp       DCP consecutive TP ranks, which hold the same KV heads
    cp        the PCP x DCP ranks that hold the same KV heads, ordered pcp_rank * DCP + dcp_rank
    kv_shard  the ranks one request's cached K/V is divided over: cp (sharded layout) or dcp (replicated layout:
              every PCP rank holds a whole copy)
    dp        the ranks of one (pcp, tp) coordinate across replicas
    replica   the PCP x TP ranks of one replica, driver (lowest rank) first
    moe       the same ranks as replica, flattened as pcp_rank * TP + tp_rank: the MoE layers' group
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpllm.config.moe import check_moe_placement

SHARDED, REPLICATED = "sharded", "replicated"
KV_CACHE_LAYOUTS = (SHARDED, REPLICATED)
"""sharded: each token's K/V on one rank of the PCP x DCP group (most capacity); replicated: a full copy on
every PCP rank, sharded over DCP only (decode needs no PCP collective, PCP ranks split the decode batch)."""
GROUP_KINDS = ("tp", "pcp", "dcp", "cp", "kv_shard", "dp", "replica", "moe")
"""Every kind of group `ParallelDims.members` knows, in the order the process groups are created."""
OPTION_NAMES = {"tp": "tensor_parallel_size", "pcp": "prefill_context_parallel_size",
                "dcp": "decode_context_parallel_size", "dp": "data_parallel_size"}
"""The engine option each size comes from: errors name what the user wrote."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ParallelDims:
    """Sizes of the parallel dimensions and the KV layout; world = DP x PCP x TP."""

    tp: int = 1
    """Tensor-parallel ranks: attention heads and MLP columns split over them (fastest-varying coordinate)."""
    pcp: int = 1
    """Prefill context-parallel ranks: each prompt's new tokens split along the sequence over them."""
    dcp: int = 1
    """Decode context-parallel ranks: consecutive TP ranks sharing KV heads, which also shard the KV cache."""
    dp: int = 1
    """Data-parallel replicas, each with its own scheduler and KV cache (slowest-varying coordinate)."""
    kv_replicated: bool = False
    """The replicated KV layout (every PCP rank holds a whole copy, sharded over DCP); False: sharded over
    PCP x DCP."""
    expert_parallel: bool = False
    """MoE models: whole experts split over the MoE group instead of every expert's rows (expert-TP)."""

    def __post_init__(self) -> None:
        for dim, option in OPTION_NAMES.items():
            value = getattr(self, dim)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} must be an integer >= 1, got {value!r}")
        if self.tp % self.dcp != 0:
            raise ValueError(f"decode_context_parallel_size={self.dcp} must divide tensor_parallel_size={self.tp} "
                             "(the DCP group is DCP of the TP ranks; for multi-head latent attention, whose one "
                             "latent head every TP rank holds, any divisor of TP is valid)")

    # ---- sizes -------------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.dp * self.pcp * self.tp

    @property
    def replica_size(self) -> int:
        """Ranks of one replica (PCP x TP), also the MoE group's size."""
        return self.pcp * self.tp

    @property
    def cp_size(self) -> int:
        """Ranks of the cp group: PCP x DCP."""
        return self.pcp * self.dcp

    @property
    def kv_shard_size(self) -> int:
        """Ranks one request's KV cache is divided over: PCP x DCP (sharded) or DCP (replicated)."""
        return self.dcp if self.kv_replicated else self.pcp * self.dcp

    @property
    def kv_cache_layout(self) -> str:
        """The layout's name, one of KV_CACHE_LAYOUTS (as the option spells it)."""
        return REPLICATED if self.kv_replicated else SHARDED

    def label(self) -> str:
        """TPxPCPxDCP, '-repl' appended under the replicated layout (DP is not part of it: replicas are alike)."""
        return f"{self.tp}x{self.pcp}x{self.dcp}{'-repl' if self.kv_replicated else ''}"

    # ---- one rank's coordinates ----------------------------------------------------------------------------

    def rank_of(self, dp_rank: int, pcp_rank: int, tp_rank: int) -> int:
        """Global rank at coordinates (dp_rank, pcp_rank, tp_rank)."""
        return (dp_rank * self.pcp + pcp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pcp_rank, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the world of size {self.world_size}")
        return rank // (self.pcp * self.tp), (rank // self.tp) % self.pcp, rank % self.tp

    def dcp_rank(self, rank: int) -> int:
        return self.coords(rank)[2] % self.dcp

    def cp_rank(self, rank: int) -> int:
        """Position in the cp group: pcp_rank * DCP + dcp_rank."""
        _, pcp_rank, tp_rank = self.coords(rank)
        return cp_rank_of(pcp_rank, tp_rank % self.dcp, self.dcp)

    def kv_shard_rank(self, rank: int) -> int:
        """Position in the KV-shard group: the KV layout's owner index of this rank's tokens."""
        return self.dcp_rank(rank) if self.kv_replicated else self.cp_rank(rank)

    def moe_rank(self, rank: int) -> int:
        """Position in the MoE group: pcp_rank * TP + tp_rank."""
        return rank % self.replica_size

    def group_rank(self, kind: str, rank: int) -> int:
        """Position of `rank` in its group of this kind (its group rank)."""
        return self.members(kind, rank).index(rank)

    def kv_heads(self, num_kv_heads: int, rank: int) -> tuple[int, int]:
        """(first KV head, count) that global rank `rank` holds (`kv_heads_of_tp_rank` at its TP coordinate)."""
        return kv_heads_of_tp_rank(num_kv_heads, self.tp, self.coords(rank)[2])

    # ---- group members -------------------------------------------------------------------------------------

    def members(self, kind: str, rank: int) -> list[int]:
        """Global ranks of `rank`'s group of this kind, in group-rank order."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; choose one of {GROUP_KINDS}")
        if kind == "kv_shard":
            kind = "dcp" if self.kv_replicated else "cp"
        dp_rank, pcp_rank, tp_rank = self.coords(rank)
        first_dcp = tp_rank - tp_rank % self.dcp
        if kind == "tp":
            return [self.rank_of(dp_rank, pcp_rank, t) for t in range(self.tp)]
        if kind == "pcp":
            return [self.rank_of(dp_rank, p, tp_rank) for p in range(self.pcp)]
        if kind == "dcp":
            return [self.rank_of(dp_rank, pcp_rank, first_dcp + d) for d in range(self.dcp)]
        if kind == "cp":
            return [self.rank_of(dp_rank, p, first_dcp + d) for p in range(self.pcp) for d in range(self.dcp)]
        if kind == "dp":
            return [self.rank_of(d, pcp_rank, tp_rank) for d in range(self.dp)]
        first = dp_rank * self.replica_size  # replica and moe
        return list(range(first, first + self.replica_size))

    def all_groups(self, kind: str) -> list[list[int]]:
        """Every group of this kind, ordered by its lowest rank (the same on all ranks)."""
        groups: list[list[int]] = []
        seen: set[int] = set()
        for rank in range(self.world_size):
            if rank not in seen:
                members = self.members(kind, rank)
                seen.update(members)
                groups.append(members)
        return groups

    # ---- the rules that need the model -----------------------------------------------------------------------

    def validate(self, model: Any) -> None:
        """Every rule the model's shapes put on the layout (`model`: a cpllm.config.engine ModelConfig, which imports this
        module), checked before any weight is cut."""
        tp, kv_heads = self.tp, model.num_key_value_heads
        if model.mla is not None and kv_heads != 1:
            # MLA's cache is one latent row per token that every query head reads: one KV "head", replicated
            # on all TP ranks (kv_heads_of_tp_rank(1, TP, t) = head 0), so every DCP dividing TP shards it
            raise ValueError(f"multi-head latent attention caches one latent head, not num_key_value_heads={kv_heads}")
        if model.num_attention_heads % tp != 0:
            raise ValueError(f"num_attention_heads={model.num_attention_heads} is not divisible by "
                             f"tensor_parallel_size={tp}")
        if kv_heads >= tp and kv_heads % tp != 0:
            raise ValueError(f"num_key_value_heads={kv_heads} is not divisible by tensor_parallel_size={tp}")
        if kv_heads < tp and tp % kv_heads != 0:
            raise ValueError(
                f"tensor_parallel_size={tp} is not a multiple of num_key_value_heads={kv_heads} "
                "(KV heads are replicated when there are fewer than TP of them)"
            )
        dense_mlp = model.moe is None or not all(map(model.moe.is_sparse, range(model.num_hidden_layers)))
        if dense_mlp and model.intermediate_size % tp != 0:
            raise ValueError(
                f"intermediate_size={model.intermediate_size} is not divisible by tensor_parallel_size={tp}"
            )
        _check_dcp_placement(tp, self.dcp, kv_heads)
        if model.moe is not None:
            check_moe_placement(model.moe, tp=tp, pcp=self.pcp, expert_parallel=self.expert_parallel)


def kv_heads_of_tp_rank(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first KV head, count) that TP rank `tp_rank` holds: the one placement rule of the engine.

    With at least TP KV heads each rank holds its own `num_kv_heads // tp_size`; with fewer,
    they are replicated and rank t holds head `t // (tp_size // num_kv_heads)`.
    """
    if num_kv_heads >= tp_size:
        per_rank = num_kv_heads // tp_size
        return tp_rank * per_rank, per_rank
    return tp_rank // (tp_size // num_kv_heads), 1


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads every TP rank holds (the same count on each: `kv_heads_of_tp_rank`); what the K/V pools, the
    planner and the bench's volume formulas size per rank."""
    return kv_heads_of_tp_rank(num_kv_heads, tp_size, 0)[1]


def cp_coords(cp_rank, dcp_size: int):
    """(pcp_rank, dcp_rank) of the cp group's member at group rank `cp_rank` (an int, or an integer tensor of
    them): the cp group is ordered pcp_rank * DCP + dcp_rank."""
    return cp_rank // dcp_size, cp_rank % dcp_size


def cp_rank_of(pcp_rank, dcp_rank, dcp_size: int):
    """The cp group rank of the member at (pcp_rank, dcp_rank) (ints, or integer tensors): `cp_coords` inverted."""
    return pcp_rank * dcp_size + dcp_rank


def valid_dcp_sizes(tp_size: int, num_kv_heads: int) -> list[int]:
    """Every DCP size for which each DCP group holds one set of KV heads."""
    if num_kv_heads >= tp_size:
        return [1]
    ranks_per_head = tp_size // num_kv_heads
    return [d for d in range(1, ranks_per_head + 1) if ranks_per_head % d == 0]


def _check_dcp_placement(tp: int, dcp: int, kv_heads: int) -> None:
    """Every DCP group (DCP consecutive TP ranks) must hold the same KV heads, or decode mixes heads silently."""
    for first in range(0, tp, dcp):
        held = {kv_heads_of_tp_rank(kv_heads, tp, t) for t in range(first, first + dcp)}
        if len(held) > 1:
            heads = sorted(h for start, count in held for h in range(start, start + count))
            raise ValueError(
                f"decode_context_parallel_size={dcp} with tensor_parallel_size={tp} and "
                f"num_key_value_heads={kv_heads}: the DCP group of TP ranks {list(range(first, first + dcp))} "
                f"holds different KV heads {heads}, but every rank of a DCP group must hold the same KV heads "
                f"(KV heads are replicated over TP / num_key_value_heads ranks each, and DCP must divide that "
                f"number). Valid DCP sizes here: {valid_dcp_sizes(tp, kv_heads)}"
            )
