"""Which rows a rank's last layer computes past attention (ModelRunner._rows_kept) and how the sampled rows reach the
driver (ModelRunner._gather_output_rows).

One rank keeps the rows it samples from. Under PCP each rank keeps its own sampled rows (none where it holds none)
unless the last layer's rows meet in a collective after attention: a decode team, split MLPs, a MoE block. The
end-to-end layouts (test_parallel_layouts.py, with and without prompt logprobs) check the numbers; these check the
choice itself on stand-ins for the runner, the step and its plan.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from cpllm.distributed.parallel_context import ParallelContext
from cpllm.model.families.llama import LlamaForCausalLM
from cpllm.model.loaders.loader import open_weights
from cpllm.worker.runner import ModelRunner
from tiny_models import save_tiny_hf_model
from tiny_moe_models import save_tiny_moe_model


def _runner(pcp_size: int, pcp_rank: int, local: bool = True) -> SimpleNamespace:
    return SimpleNamespace(groups=SimpleNamespace(pcp_size=pcp_size, pcp_rank=pcp_rank), _last_layer_local=local,
                           device=torch.device("cpu"))


def _batch(rows: int, output_rows, team: bool = False, mlp_split: bool = False) -> SimpleNamespace:
    plan = SimpleNamespace(team=team, mlp_split=mlp_split)
    return SimpleNamespace(token_ids=torch.zeros(rows, dtype=torch.long), output_rows=output_rows,
                           attention=SimpleNamespace(plan=plan))


def _kept(runner, batch):
    kept = ModelRunner._rows_kept(runner, batch)
    return None if kept is None else kept.tolist()


def test_one_rank_keeps_its_sampled_rows():
    assert _kept(_runner(1, 0), _batch(6, [(0, 5), (0, 2)])) == [5, 2]
    assert _kept(_runner(1, 0), _batch(2, [(0, 0), (0, 1)])) is None  # every row sampled: nothing to skip


def test_each_pcp_rank_keeps_its_own_rows():
    output_rows = [(1, 3), (0, 7), (1, 0)]  # (PCP rank, row) in driver order
    assert _kept(_runner(2, 0), _batch(8, output_rows)) == [7]
    assert _kept(_runner(2, 1), _batch(8, output_rows)) == [3, 0]
    assert _kept(_runner(2, 1), _batch(8, [(0, 7)])) == []  # a rank holding no sampled row computes none


def test_pcp_keeps_every_row_where_the_last_layer_gathers_them():
    output_rows = [(0, 1)]
    assert _kept(_runner(2, 0, local=False), _batch(4, output_rows)) is None  # a MoE block's all-gather
    assert _kept(_runner(2, 0), _batch(4, output_rows, team=True)) is None
    assert _kept(_runner(2, 0), _batch(4, output_rows, mlp_split=True)) is None


def test_kept_rows_reach_the_driver_in_its_order():
    hidden = torch.arange(12.0).view(6, 2)
    batch = _batch(6, [(0, 4), (0, 1)])
    gathered = ModelRunner._gather_output_rows(_runner(1, 0), hidden[[4, 1]], batch, kept=True)
    assert torch.equal(gathered, ModelRunner._gather_output_rows(_runner(1, 0), hidden, batch, kept=False))
    assert torch.equal(gathered, hidden[[4, 1]])


def test_a_dense_llama_computes_its_last_rows_locally(tmp_path):
    source = open_weights(save_tiny_hf_model(str(tmp_path / "tiny"), seed=3))
    model = LlamaForCausalLM(source.config, ParallelContext(), torch.float32, 64)
    assert model.last_layer_rows_local()


def test_a_moe_last_layer_gathers_its_rows(tmp_path):
    source = open_weights(save_tiny_moe_model(str(tmp_path / "moe"), "qwen3_moe", seed=3))
    config = source.config  # layer 1 is dense in the tiny model (mlp_only_layers), layer 0 sparse
    assert LlamaForCausalLM(config, ParallelContext(), torch.float32, 64).last_layer_rows_local()
    sparse_last = dataclasses.replace(config, moe=dataclasses.replace(config.moe, mlp_only_layers=()))
    assert not LlamaForCausalLM(sparse_last, ParallelContext(), torch.float32, 64).last_layer_rows_local()
