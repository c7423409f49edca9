"""A request's `kv_transfer_params`, in the keys vLLM's proxy and NixlConnector use (torch-free).

Prefill instance: the proxy sends `{"do_remote_decode": true}` (with max_tokens 1); the answer's
`kv_transfer_params` are `{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [...],
"remote_engine_id": ..., "remote_host": ..., "remote_port": ..., "remote_request_id": ...}`. Decode instance: the
proxy passes those on with the original request; the consumer pulls the prompt's K/V with them, then decodes.
`remote_block_ids` is one flat table for a model of one KV group and one table per group (vLLM >= 0.11's nesting)
for a model of several (sliding-window layers beside full ones); a model whose layers keep a state per request also
names the producer's `remote_state_slot`, where the states after all but the last prompt token wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpllm.disagg.config import KVTransferConfig


@dataclass(kw_only=True, frozen=True, slots=True)
class RemotePrefill:
    """Where a prefilled prompt's K/V waits (a consumer request's kv_transfer_params)."""

    block_tables: tuple[tuple[int, ...], ...]
    """The producer's virtual block tables of the request, one per KV group (its FREED_BLOCK entries included)."""
    engine_id: str
    """The producer instance (remote_engine_id)."""
    host: str
    """The producer's address (remote_host)."""
    port: int
    """The producer's control port (remote_port); its rank r serves rows on port + 1 + r."""
    request_id: str
    """The request's id on the producer (remote_request_id), which its held blocks are filed under."""
    state_slot: int = -1
    """The producer's slot holding the request's states after all but its last prompt token (remote_state_slot);
    -1: the model keeps no state, or the prompt is one token (the consumer starts from a zero state)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class PullOp:
    """One consumer request's pull, run by every consumer rank before the step's forward (SchedulerOutput.kv_pulls)."""

    remote: RemotePrefill
    """Where the K/V is."""
    request_id: str = ""
    """The consumer's request (its scheduler id), which a failed pull ends."""
    num_tokens: int
    """Positions [first_token, num_tokens) are pulled: every prompt position but the last, which the step computes,
    and but those of the consumer's own prefix-cache hit."""
    block_tables: tuple[tuple[int, ...], ...]
    """The consumer's virtual block tables the rows land in, one per KV group."""
    state_slot: int = -1
    """The consumer's state slot the states land in (-1: none to pull)."""
    first_token: int = 0
    """Positions before it are the consumer's prefix-cache hit (whole blocks of its own), not pulled."""


def remote_prefill(params: dict | None) -> RemotePrefill | None:
    """The consumer side of `kv_transfer_params`, or None when the request is not a remote prefill."""
    if not params or not params.get("do_remote_prefill"):
        return None
    missing = [k for k in ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port") if k not in params]
    if missing:
        raise ValueError(f"kv_transfer_params with do_remote_prefill lacks {missing[0]!r} (the prefill "
                         "instance's answer carries it)")
    if "remote_request_id" not in params:
        raise ValueError("kv_transfer_params with do_remote_prefill lacks 'remote_request_id': cpllm's producer "
                         "answers with it")
    blocks = params["remote_block_ids"]
    tables = blocks if blocks and isinstance(blocks[0], list) else [blocks]  # vLLM >= 0.11 nests one per group
    return RemotePrefill(block_tables=tuple(tuple(int(b) for b in t) for t in tables),
                         engine_id=str(params["remote_engine_id"]), host=str(params["remote_host"]),
                         port=int(params["remote_port"]), request_id=str(params["remote_request_id"]),
                         state_slot=int(params.get("remote_state_slot", -1)))


def wants_remote_decode(params: dict | None) -> bool:
    """A producer request: prefill, then keep the blocks for a consumer."""
    return bool(params and params.get("do_remote_decode"))


def producer_answer(config: KVTransferConfig, request_id: str, block_tables: list[list[int]], tp_size: int,
                    state_slot: int = -1) -> dict[str, Any]:
    """The `kv_transfer_params` a producer returns with a finished remote-decode request (NixlConnector's keys;
    the consumer reads the rest of the producer's layout from its control port, so `tp_size` is informative)."""
    blocks = list(block_tables[0]) if len(block_tables) == 1 else [list(t) for t in block_tables]
    answer = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": blocks,
              "remote_engine_id": config.engine_id, "remote_host": config.kv_ip, "remote_port": config.kv_port,
              "remote_request_id": request_id, "tp_size": tp_size}
    if state_slot >= 0:
        answer["remote_state_slot"] = state_slot
    return answer
