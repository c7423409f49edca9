"""Data parallelism under torchrun: engine replicas in one world, behind a front on global rank 0.

Spawned DP (`cpllm serve -dp N` on one machine) isolates its replicas instead (replica_front.py: a process tree
each, ZeroMQ, restarts). Under torchrun the replicas' ranks are torchrun's processes in one world, so a failed
rank fails the world and torchrun's own `--max-restarts` restarts it (the server exits non-zero first).

The replica drivers (global ranks with pcp = tp = 0) advance in lockstep ticks:
the front broadcasts each replica's new requests and aborts over the DP group,
every replica runs one step of its own scheduler, and the outputs are gathered
back on the front. New requests go to the replica with the fewest unfinished ones.
Every message here is a pickled object: they travel over `dp_cpu_group` (gloo),
never over the DP group of the default backend (NCCL on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from cpllm.distributed.comm import broadcast_object
from cpllm.distributed.groups import ParallelGroups
from cpllm.engine.engine import LLMEngine
from cpllm.engine.outputs import RequestOutput
from cpllm.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ReplicaCommands:
    """What one replica must do before its next step."""

    adds: list[tuple[str, list[int], SamplingParams, str | None, float | None]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Tick:
    commands: list[ReplicaCommands]
    shutdown: bool = False


def _apply(engine: LLMEngine, commands: ReplicaCommands) -> None:
    for request_id in commands.aborts:
        engine.abort_request(request_id)
    for request_id, prompt_ids, params, prompt, arrival in commands.adds:
        engine.add_request(request_id, prompt_ids, params, prompt=prompt, arrival_time=arrival)


def _step_and_gather(engine: LLMEngine, group, front: int) -> list[list[RequestOutput]] | None:
    outputs = engine.step() if engine.has_unfinished_requests() else []
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == front else None
    dist.gather_object(outputs, gathered, dst=front, group=group)
    return gathered


def serve_replica(engine: LLMEngine, groups: ParallelGroups) -> None:
    """Loop of a replica driver other than the front: apply commands, step, send outputs, until shutdown."""
    front = dist.get_global_rank(groups.dp_cpu_group, 0)
    while True:
        tick: Tick = broadcast_object(None, src=front, group=groups.dp_cpu_group)
        if tick.shutdown:
            engine.shutdown()
            return
        _apply(engine, tick.commands[groups.dp_rank])
        _step_and_gather(engine, groups.dp_cpu_group, front)


class DataParallelFront:
    """The LLMEngine interface over DP replicas; runs replica 0 itself. Every replica is built from one config,
    so replica 0's limits (max_model_len, KV capacity) and tokenizer are every replica's."""

    def __init__(self, engine: LLMEngine, groups: ParallelGroups):
        self.local = engine
        """Replica 0, run in this process."""
        self.groups = groups
        self.num_replicas = groups.dp_size
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.kv_capacity_tokens = engine.kv_capacity_tokens
        """Tokens one replica's KV cache holds (a request runs on one replica)."""
        self._pending = [ReplicaCommands() for _ in range(self.num_replicas)]
        self._owner: dict[str, int] = {}
        self._load = [0] * self.num_replicas

    @property
    def executor(self):
        """Replica 0's executor (its ranks and their stats; the other replicas' stay on their drivers)."""
        return self.local.executor

    @property
    def structured(self):
        """Replica 0's grammar cache (the server compiles a request's grammar ahead of adding it)."""
        return self.local.structured

    @property
    def kv_cache_usage(self) -> float:
        """Replica 0's fraction of KV blocks in use."""
        return self.local.kv_cache_usage

    @property
    def scheduler_totals(self):
        """Replica 0's preemption and prefix-cache totals (the other replicas' schedulers run on their drivers)."""
        return self.local.scheduler_totals

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.local.check_prompt(prompt_token_ids, params)  # same limits on every replica

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids, params)
        replica = min(range(self.num_replicas), key=lambda r: self._load[r])
        self._pending[replica].adds.append((request_id, list(prompt_token_ids), params, prompt, arrival_time))
        self._owner[request_id] = replica
        self._load[replica] += 1

    def abort_request(self, request_id: str) -> None:
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            self._pending[replica].aborts.append(request_id)
            self._load[replica] -= 1

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def prompt_progress(self) -> dict[str, int]:
        """Replica 0's requests' prompt tokens cached (the others' are known on their drivers: their prompts
        count as done when their first output arrives, engine/progress.py)."""
        return self.local.prompt_progress()

    @property
    def num_running(self) -> int:
        """Unfinished requests of every replica (their schedulers run on their drivers; the isolated front of
        spawned DP reports each replica's scheduled and waiting sequences instead)."""
        return sum(self._load)

    @property
    def num_waiting(self) -> int:
        return self.local.num_waiting

    def step(self) -> list[RequestOutput]:
        tick = Tick(commands=self._pending)
        self._pending = [ReplicaCommands() for _ in range(self.num_replicas)]
        broadcast_object(tick, src=self.groups.rank, group=self.groups.dp_cpu_group)
        _apply(self.local, tick.commands[0])
        outputs = [out for replica in _step_and_gather(self.local, self.groups.dp_cpu_group, self.groups.rank)
                   for out in replica]
        for output in outputs:
            if output.finished and output.request_id in self._owner:
                self._load[self._owner.pop(output.request_id)] -= 1
        return outputs

    def shutdown(self) -> None:
        broadcast_object(Tick(commands=[], shutdown=True), src=self.groups.rank, group=self.groups.dp_cpu_group)
        self.local.shutdown()
