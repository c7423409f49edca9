"""One rank's linear-attention states in a transfer: a producer rank reads the rows of a held slot that a consumer
rank asks for, a consumer rank writes them into its request's live slot (plan: cpllm/disagg/state_plan.py).

A state layer's pools are [slots, rows, width] (cpllm/layers/cache_spec.py STATE); which global rows a TP rank holds
is its kind's `state_rows`. Layers whose rows lie alike on both sides share one plan (every layer of one kind), and
one message carries one move's rows for as many of those layers as fit."""

from __future__ import annotations

from typing import Callable

import torch

from cpllm.disagg.reshard import CacheLayout
from cpllm.disagg.state_plan import StateMove, plan_states

LayerRows = Callable[[int, int], dict]
"""(tp_size, tp_rank) -> layer index -> its pools' global rows on that TP rank (registry.state_layer_rows bound
to the model config)."""


class StatePools:
    """The state layers' pools of one rank."""

    def __init__(self, layers: dict[int, tuple[torch.Tensor, ...]], layer_rows: LayerRows):
        self.layers = layers
        """State layer index -> its pools (conv, delta), each [slots, rows, width]."""
        self.layer_rows = layer_rows
        self._plans: dict[tuple, list[tuple[tuple[int, ...], StateMove]]] = {}

    def __bool__(self) -> bool:
        return bool(self.layers)

    def row_bytes(self, layer: int, pool: int) -> int:
        """Bytes of one row of a layer's pool."""
        t = self.layers[layer][pool]
        return t.shape[-1] * t.element_size()

    def moves(self, src: CacheLayout, dst: CacheLayout, rank: int) -> list[tuple[tuple[int, ...], StateMove]]:
        """What consumer rank `rank` of `dst` pulls from `src`'s ranks: (the layers a move applies to, the move)."""
        key = (tuple(sorted(src.to_dict().items())), tuple(sorted(dst.to_dict().items())), rank)
        if key not in self._plans:
            self._plans[key] = self._plan(src, dst, rank)
        return self._plans[key]

    def _plan(self, src: CacheLayout, dst: CacheLayout, rank: int) -> list[tuple[tuple[int, ...], StateMove]]:
        sides = {tp: [self.layer_rows(tp, r) for r in range(tp)] for tp in {src.dims.tp, dst.dims.tp}}
        alike: dict[tuple, list[int]] = {}  # the layers' rows on every TP rank of both sides -> those layers
        for layer in sorted(self.layers):
            key = tuple(tuple(rows[layer] for rows in sides[tp]) for tp in sorted(sides))
            alike.setdefault(key, []).append(layer)
        out = []
        for layers in alike.values():
            first = layers[0]
            plan = plan_states(src, dst, lambda tp, r, first=first: sides[tp][r][first])
            out += [(tuple(layers), move) for move in plan.to(rank)]
        return out

    def read(self, slot: int, layers: list[int], pool: int, runs) -> list[torch.Tensor]:
        """Each layer's rows `runs` (local [start, end) runs) of `pool` at `slot`, on the CPU. [rows, width] each."""
        out = []
        for layer in layers:
            t = self.layers[layer][pool]
            if not 0 <= slot < t.shape[0]:
                raise ValueError(f"state slot {slot} is outside the {t.shape[0]} slots of layer {layer}")
            out.append(torch.cat([t[slot, a:b] for a, b in runs]).cpu())
        return out

    def write(self, slot: int, layers: tuple[int, ...], move: StateMove, rows: list[torch.Tensor]) -> None:
        """Store a move's rows (one [rows, width] per layer) at the consumer's `slot`."""
        if len(rows) != len(layers):
            raise ValueError(f"{len(rows)} state layers' rows arrived for {len(layers)} layers")
        for layer, part in zip(layers, rows):
            t = self.layers[layer][move.pool]
            if tuple(part.shape) != (move.num_rows, t.shape[-1]):
                raise ValueError(f"state rows of shape {tuple(part.shape)} for layer {layer}'s pool rows "
                                 f"{(move.num_rows, t.shape[-1])}: the instances' models differ")
            part, at = part.to(device=t.device, dtype=t.dtype), 0
            for a, b in move.dst_local:
                t[slot, a:b] = part[at:at + b - a]
                at += b - a


def layer_batches(layers: tuple[int, ...], bytes_per_layer: int, budget: int) -> list[list[int]]:
    """`layers` cut, in order, into batches of about `budget` bytes (at least one layer each): one message each."""
    per = max(1, budget // max(1, bytes_per_layer))
    return [list(layers[i:i + per]) for i in range(0, len(layers), per)]
