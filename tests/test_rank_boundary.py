"""The driver side learns about ranks only as plain data from the executor (cpllm/worker/rank_stats.py).

The source checks read cpllm/ as text; the engine check runs one single-rank LLM on the tiny model.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from types import SimpleNamespace

import pytest

import tiny_models as tm  # tests/ is on sys.path under pytest
from cpllm import LLM, SamplingParams
from cpllm.config.engine import PREFILL_STRATEGIES
from cpllm.engine.data_parallel import DataParallelFront
from cpllm.worker.rank_stats import RankInfo, RankStats

ROOT = pathlib.Path(__file__).resolve().parents[1]
RANK_SIDE_MODULES = ("cpllm.worker.runner", "cpllm.model.families.llama", "cpllm.model.execution.fused_decode",
                     "cpllm.model.execution.decode_graph")
"""Modules that hold a rank's runner or model: within cpllm only the rank side imports them."""


def _driver_side_sources() -> list[pathlib.Path]:
    """cpllm's modules outside the rank side (worker/, model/, the layers below them), and the tests."""
    rank_side = ("worker", "model", "context_parallel", "kernels", "distributed")
    files = [path for path in (ROOT / "cpllm").rglob("*.py") if path.relative_to(ROOT / "cpllm").parts[0]
             not in rank_side]
    return files + sorted((ROOT / "tests").glob("*.py"))


def _reaches_into_a_rank(path: pathlib.Path) -> list[str]:
    """Where `path` reads a runner attribute, or (in cpllm) imports a module holding a runner or a model."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr in ("runner", "_runner"):
            found.append(f"{path.name}:{node.lineno} reads .{node.attr}")
        imported = [node.module] if isinstance(node, ast.ImportFrom) else \
            [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if path.parts[-2] != "tests":  # tests may unit-test a model directly
            found += [f"{path.name}:{node.lineno} imports {m}" for m in imported if m in RANK_SIDE_MODULES]
    return found


def test_nothing_outside_worker_touches_a_runner_or_a_model():
    assert [where for path in _driver_side_sources() for where in _reaches_into_a_rank(path)] == []


def _plain(value) -> bool:
    """Built from str, int, float, bool, None, tuples, frozensets, mappings and frozen dataclasses of them."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(map(_plain, value))
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if dataclasses.is_dataclass(value):
        return all(_plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def test_the_executor_describes_its_rank_in_plain_data(tmp_path):
    folder = tm.save_tiny_hf_model(str(tmp_path / "tiny"), seed=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(folder, max_model_len=128, block_size=4, kv_cache_memory_bytes=2**20, quantization="none") as llm:
        executor = llm.engine.executor
        before = executor.rank_stats()
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], params)
        info, after = executor.rank_info, executor.rank_stats()
    assert isinstance(info, RankInfo) and isinstance(after, RankStats) and _plain(info) and _plain(after)
    assert executor.replica_ranks == (0,) and info.rank == 0 and info.devices == frozenset({"cpu"})
    assert info.kv.num_blocks == executor.num_blocks and info.kv.block_size == 4 and info.kv.dtype == "float32"
    assert 0 < info.kv.bytes <= 2**20 and llm.engine.kv_capacity_tokens == info.kv.num_blocks * 4
    assert sum(before.plan_counts.values()) == 0
    assert sum(after.plan_counts.values()) >= params.max_tokens  # one prompt step, then a step per decode token
    assert set(after.strategy_counts) <= set(PREFILL_STRATEGIES)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.rank = 1


def test_the_data_parallel_front_forwards_nothing_implicitly():
    """Every member the LLM and the server use is spelled out (replica 0's where it is one replica's)."""
    assert "__getattr__" not in vars(DataParallelFront)
    executor = SimpleNamespace(replica_ranks=(0, 1))
    local = SimpleNamespace(config="config", tokenizer="tokenizer", max_model_len=64, kv_capacity_tokens=128,
                            executor=executor, structured="grammars", kv_cache_usage=0.25, num_waiting=3)
    front = DataParallelFront(local, SimpleNamespace(dp_size=2))
    used = dict(config="config", tokenizer="tokenizer", max_model_len=64, kv_capacity_tokens=128,
                executor=executor, structured="grammars", kv_cache_usage=0.25, num_waiting=3, num_running=0)
    for name, value in used.items():
        assert getattr(front, name) == value, name
    for method in ("check_prompt", "add_request", "abort_request", "has_unfinished_requests", "step", "shutdown"):
        assert callable(getattr(front, method)), method
