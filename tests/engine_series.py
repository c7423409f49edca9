"""Several engines, one after another, in one world of real processes: the pytest process is rank 0, the ranks it
spawns stay up, and every rank builds each config's engine in turn. A test that needs many (model, strategy) pairs
under one layout pays for one launch instead of one per pair.

Why this is sound: a world's process groups depend on the layout alone (`ParallelConfig.dims` and the collective
transport), never on the model or the prefill strategy, so every config of a series must agree on those (checked).
Between two engines the driver sends the shutdown step, which ends the workers' step loop (`run_worker`) but not
the world; every rank then builds the next config's runner (weights, KV pools, the block-count agreement) exactly
as a fresh launch would. The last engine's `shutdown` ends the world as `LLM.shutdown` does.

The KV layout (`cp_kv_cache_layout`) may differ between the configs of a series: every world builds both the cp
and the dcp group, and the layout only picks which of them is the KV-shard group (`ParallelDims.members`), so
each engine gets the world's groups with its own dims and that group (`groups_for`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch

from cpllm.config.engine import EngineConfig
from cpllm.distributed.comm import broadcast_object
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.launch import find_free_port, init_distributed, shutdown_distributed
from cpllm.distributed.rank_processes import spawn_workers
from cpllm.engine.engine import LLMEngine
from cpllm.model.tokenization.tokenizer import load_tokenizer
from cpllm.step import SchedulerOutput
from cpllm.worker.executor import Executor
from cpllm.worker.worker import run_worker
from parallel_helpers import assert_same_greedy, generate_counted, greedy_params


def _world_key(config: EngineConfig) -> tuple:
    dims = dataclasses.replace(config.parallel.dims, kv_replicated=False)  # the layout makes no group of its own
    return dims, config.parallel.collective_transport, config.parallel.distributed_timeout_s


def groups_for(groups: ParallelGroups, config: EngineConfig) -> ParallelGroups:
    """The world's groups under `config`'s KV layout: its dims, and the cp (sharded) or dcp (replicated) group as
    the KV-shard group, the same object `ParallelGroups.build` would have made that group."""
    dims = config.parallel.dims
    return dataclasses.replace(groups, dims=dims,
                               kv_shard_group=groups.dcp_group if dims.kv_replicated else groups.cp_group)


def series_worker(rank: int, configs: Sequence[EngineConfig], master_addr: str, master_port: int,
                  threads: int) -> None:
    """A spawned rank of the series: join the world once, then serve each config's steps until its shutdown step."""
    torch.set_num_threads(threads)
    parallel = configs[0].parallel
    groups = init_distributed(parallel, rank=rank, world_size=parallel.dims.world_size, master_addr=master_addr,
                              master_port=master_port, timeout_s=parallel.distributed_timeout_s)
    try:
        for config in configs:
            run_worker(config, groups_for(groups, config))
    finally:
        shutdown_distributed()


def two_passes(engine: LLMEngine, *, prompts: dict, max_tokens: int) -> dict:
    """The layout tests' workload run twice on one engine, greedy (tests/parallel_helpers.py): both passes' outputs,
    the second pass's prefix hits, and the strategy counters."""
    llm = SimpleNamespace(engine=engine)  # all generate_counted reads of an LLM
    first = generate_counted(llm, prompts, greedy_params(max_tokens, prompt_logprobs=True), "p1")
    hits = engine.scheduler.num_prefix_hit_tokens
    second = generate_counted(llm, prompts, greedy_params(max_tokens, prompt_logprobs=False), "p2")
    return dict(first=first, second=second, hits=engine.scheduler.num_prefix_hit_tokens - hits,
                counts=dict(engine.executor.rank_stats().strategy_counts))


def assert_two_passes_match(result: dict, reference: dict, what: str, max_tokens: int) -> None:
    """`two_passes`' outputs equal the single-rank reference (pass 1 with prompt logprobs), and pass 2 hit the
    prefix cache."""
    for name, output in result["first"].items():
        assert len(output.outputs[0].token_ids) == max_tokens, f"{what} {name}"
        assert_same_greedy(output, reference[name], what=f"{what} pass 1 {name}", prompt_logprobs=True)
    for name, output in result["second"].items():
        assert_same_greedy(output, reference[name], what=f"{what} pass 2 {name}", prompt_logprobs=False)
    assert result["hits"] > 0, f"{what}: pass 2 repeats pass 1's prompts and should hit the prefix cache"


def run_series(configs: Sequence[EngineConfig], body: Callable[[LLMEngine], object], *, threads: int = 1) -> list:
    """`body(engine)` for each config's engine in one world; returns each body's result, or the exception that
    stopped it. After a failure the ranks may disagree on where they are, so the world is ended and every later
    config gets a RuntimeError naming the one that failed."""
    keys = {_world_key(c) for c in configs}
    if len(keys) != 1:
        raise ValueError(f"the configs of one series must share the parallel sizes, transport and timeout; got {keys}")
    parallel = configs[0].parallel
    world = parallel.dims.world_size
    port = find_free_port()
    workers = spawn_workers(world, series_worker, (list(configs), "127.0.0.1", port, threads), master_port=port)
    results: list = []
    try:
        groups = init_distributed(parallel, rank=0, world_size=world, master_addr="127.0.0.1", master_port=port,
                                  timeout_s=parallel.distributed_timeout_s, workers=workers)
        torch.set_num_threads(threads)
        for index, config in enumerate(configs):
            executor = Executor(config, groups_for(groups, config), workers)
            engine = LLMEngine(config, load_tokenizer(config.model_path), executor)
            try:
                results.append(body(engine))
            except Exception as error:
                results.append(error)
                break
            if index + 1 < len(configs):  # end this model's step loop on every rank; the world stays up
                with workers.watch():
                    broadcast_object(SchedulerOutput(step_id=-1, shutdown=True), src=groups.replica_driver,
                                     group=groups.replica_group)
            else:
                engine.shutdown()  # the shutdown step, the workers' exit, the end of the world
    except Exception as error:
        if len(results) == len(configs):
            raise
        results.append(error)
    finally:
        workers.terminate_all()
        shutdown_distributed()
    failed = len(results) - 1
    while len(results) < len(configs):
        results.append(RuntimeError(f"not run: the series' world ended at config {failed} "
                                    f"({configs[failed].model_path}): {results[failed]}"))
    return results
