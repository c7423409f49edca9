"""Qwen3, Qwen3-MoE, Qwen2-MoE and Mixtral: single rank against transformers, parallel layouts against the single
rank engine (real gloo processes), GGUF against the HF folder, expert placement and config-time refusals.

Each layout launches once (LaunchCache) and runs the shared workload: prompts of lengths {1, 2*PCP-1, 13, 37}
plus one sharing a 24-token prefix, a 9-token step budget (chunked prefill, decodes riding along with chunks),
then the same prompts again (prefix-cache hits, decode-only steps). Qwen3-MoE runs the PCP layouts (its tiny
model has one KV head, so TP=2 replicates it and DCP=2 is allowed), Qwen2-MoE (shared expert) TP x PCP, Mixtral
TP=2. The dense Qwen3 differs from Llama only inside each head (q/k norms), so it is checked on one rank.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize

from cpllm import LLM
from cpllm.config.engine import ParallelConfig
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.model.families.llama import LlamaForCausalLM
from cpllm.model.loaders.loader import open_weights
from cpllm.model.moe.sparse_block import expert_bytes, moe_blocks
from parallel_helpers import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MODEL_SEED,
    LaunchCache,
    assert_same_greedy,
    generate_counted,
    greedy_params,
    max_abs_diff,
    prompt_logprob_values,
    sampled_logprobs,
    workload_prompts,
)
from reference import hf_greedy
from tiny_moe_models import FAMILIES, make_tiny_moe_model, save_tiny_moe_gguf, save_tiny_moe_model

OVERRIDES = {"qwen3_moe": {"num_key_value_heads": 1}}
"""One KV head: TP=2 replicates it, so DCP=2 fits (the other families keep 2 KV heads)."""
MAX_TOKENS = 8
COMMON = dict(quantization="none", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, kv_cache_memory_bytes=2**20, threads_per_rank=1,
              distributed_timeout=60)


@dataclass(frozen=True, slots=True)
class MoELayout:
    family: str
    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    ep: bool = False
    strategy: str = "allgather"
    interleave: int = 1
    kv_layout: str = "sharded"

    def label(self) -> str:
        parts = [self.family, f"tp{self.tp}", f"pcp{self.pcp}"]
        parts += [f"dcp{self.dcp}"] if self.dcp > 1 else []
        parts += [self.strategy] if self.pcp > 1 else []
        parts += ["ep"] if self.ep else []
        parts += [self.kv_layout] if self.kv_layout != "sharded" else []
        return "-".join(parts)

    def engine_options(self) -> dict:
        return dict(tensor_parallel_size=self.tp, prefill_context_parallel_size=self.pcp,
                    decode_context_parallel_size=self.dcp, enable_expert_parallel=self.ep,
                    cp_prefill_strategy=self.strategy, cp_kv_cache_interleave_size=self.interleave,
                    cp_kv_cache_layout=self.kv_layout)


LAYOUTS = [
    MoELayout("qwen3_moe", pcp=2, strategy="allgather"),
    MoELayout("qwen3_moe", pcp=2, strategy="ring", interleave=4, ep=True, kv_layout="replicated"),
    MoELayout("qwen3_moe", tp=2, pcp=2, dcp=2, strategy="ring", ep=True),
    MoELayout("qwen2_moe", tp=2, pcp=2, strategy="pass-q", interleave=4),
    MoELayout("mixtral", tp=2),
]
"""Five launches, two of them on 4 ranks (the suite's time budget; a 4-rank start costs most): PCP=2 alone (the
MoE group is the PCP group; decode steps all-reduce over it); PCP=2 with EP, ring, and decode rows split over PCP
(replicated KV); TP=2 x PCP=2 with DCP=2, EP and ring; the shared expert under TP x PCP, expert-TP over 4 ranks,
pass-Q; TP=2 alone (the MoE group is the TP group)."""


@dataclass
class Run:
    first: dict
    """Prompt name -> output of pass 1 (with prompt logprobs)."""
    second: dict
    """Prompt name -> output of pass 2 (same prompts: prefix hits)."""
    prefix_hits: int


class Launches(LaunchCache):
    def folder(self, family: str) -> str:
        if family not in self._folders:
            path = str(self._tmp.mktemp(family))
            self._folders[family] = save_tiny_moe_model(path, family, seed=MODEL_SEED, **OVERRIDES.get(family, {}))
        return self._folders[family]

    def reference(self, family: str) -> dict:
        """The single-rank engine on the prompts of every layout (PCP 1 and 2)."""
        if family not in self._references:
            prompts = {**workload_prompts(1), **workload_prompts(2)}
            with LLM(self.folder(family), **COMMON) as llm:
                params = greedy_params(MAX_TOKENS, prompt_logprobs=True)
                self._references[family] = generate_counted(llm, prompts, params, "ref")
        return self._references[family]

    def _launch(self, layout: MoELayout) -> Run:
        prompts = workload_prompts(layout.pcp)
        with LLM(self.folder(layout.family), **COMMON, **layout.engine_options()) as llm:
            scheduler = llm.engine.scheduler
            first = generate_counted(llm, prompts, greedy_params(MAX_TOKENS, prompt_logprobs=True), "p1")
            before = scheduler.num_prefix_hit_tokens
            second = generate_counted(llm, prompts, greedy_params(MAX_TOKENS, prompt_logprobs=False), "p2")
            return Run(first=first, second=second, prefix_hits=scheduler.num_prefix_hit_tokens - before)


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_single_rank_matches_transformers(launches, family):
    """Prompt and sampled-token logprobs within 1e-4 of transformers, greedy tokens identical."""
    reference = launches.reference(family)
    hf = make_tiny_moe_model(family, seed=MODEL_SEED, **OVERRIDES.get(family, {}))
    for name in ("len13", "len37"):
        output = reference[name]
        tokens, logprobs, prompt_lp = hf_greedy(hf, output.prompt_token_ids, MAX_TOKENS)
        assert output.outputs[0].token_ids == tokens, (family, name)
        assert max_abs_diff(sampled_logprobs(output), logprobs) <= 1e-4, (family, name)
        assert max_abs_diff(prompt_logprob_values(output), prompt_lp) <= 1e-4, (family, name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS, ids=MoELayout.label)
def test_layout_matches_single_rank(launches, layout):
    reference = launches.reference(layout.family)
    run = launches.run(layout)
    for name, output in run.first.items():
        assert_same_greedy(output, reference[name], what=f"{layout.label()} pass 1 {name}", prompt_logprobs=True)
    for name, output in run.second.items():
        assert_same_greedy(output, reference[name], what=f"{layout.label()} pass 2 {name}", prompt_logprobs=False)
    assert run.prefix_hits > 0, "pass 2 repeats pass 1's prompts and should hit the prefix cache"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family, stacked", [(f, True) for f in FAMILIES] + [("mixtral", False)])
def test_gguf_stacked_experts_match_hf_folder(launches, family, stacked, tmp_path):
    """The same weights as a GGUF file (experts stacked per projection, or one tensor per expert as older
    Mixtral files) give the HF folder's outputs."""
    path = str(tmp_path / f"{family}.gguf")
    save_tiny_moe_gguf(path, launches.folder(family), family, stacked=stacked, **OVERRIDES.get(family, {}))
    prompts = {name: p for name, p in workload_prompts(1).items() if name in ("len13", "shared")}
    with LLM(path, **COMMON) as llm:
        outputs = generate_counted(llm, prompts, greedy_params(MAX_TOKENS, prompt_logprobs=True), "gguf")
    for name, output in outputs.items():
        assert_same_greedy(output, launches.reference(family)[name], what=f"{family} gguf {name}",
                           prompt_logprobs=True)


def test_gguf_quantized_expert_stack_reads_each_expert(launches, tmp_path):
    """A Q8_0 expert stack: each expert's view dequantizes to that expert's quantized weights, slices included."""
    path = str(tmp_path / "q8.gguf")
    folder = launches.folder("qwen3_moe")
    save_tiny_moe_gguf(path, folder, "qwen3_moe", expert_type=QType.Q8_0, **OVERRIDES["qwen3_moe"])
    stored, hf = open_weights(path), open_weights(folder)
    columns = {"model.layers.0.mlp.experts.5.down_proj.weight": (16, 32),  # [hidden 64, expert width 32]
               "model.layers.0.mlp.experts.2.gate_proj.weight": (32, 64)}  # [32, 64]
    for name, (lo, hi) in columns.items():
        assert stored.storage_type(name) == "Q8_0"
        want = torch.from_numpy(dequantize(quantize(hf.get(name).numpy(), QType.Q8_0), QType.Q8_0))
        assert torch.equal(stored.get(name), want)
        assert torch.equal(stored.get(name, dim=0, start=8, end=16), want[8:16])
        assert torch.equal(stored.get(name, dim=1, start=lo, end=hi), want[:, lo:hi])


def _rank_models(folder: str, tp: int, pcp: int, ep: bool) -> list[LlamaForCausalLM]:
    """Every rank's model of a TP x PCP layout, built and loaded in this process (loading needs no group)."""
    source = open_weights(folder)
    config = dataclasses.replace(source.config, quantization="none")
    models = []
    for pcp_rank in range(pcp):
        for tp_rank in range(tp):
            parallel = ParallelContext.at(ParallelDims(tp=tp, pcp=pcp, expert_parallel=ep), pcp_rank=pcp_rank,
                                          tp_rank=tp_rank)
            model = LlamaForCausalLM(config, parallel, torch.float32, 64)
            model.load_weights(source)
            models.append(model)
    return models


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ep", [False, True], ids=["expert-tp", "ep"])
def test_expert_bytes_per_rank_and_placement(launches, ep, caplog):
    """Each of the TP x PCP ranks holds 1/(TP*PCP) of the single rank's expert bytes, and together they hold
    every expert weight exactly once (rows under expert-TP, whole experts under EP); the start-up log says so."""
    folder = launches.folder("qwen3_moe")
    (single,) = _rank_models(folder, 1, 1, ep)
    with caplog.at_level(logging.INFO, logger="cpllm.model.families.llama"):
        ranks = _rank_models(folder, 2, 2, ep)
    assert [expert_bytes(m) for m in ranks] == [expert_bytes(single) // 4] * 4
    placed = ("expert parallel over TP x PCP = 4 ranks, 2 of 8 whole experts per rank" if ep else
              "expert-TP over TP x PCP = 4 ranks, each rank holding 8 of the 32 intermediate rows")
    assert placed in caplog.text
    mib = f"{expert_bytes(single) / 4 / 2**20:.2f} MiB"
    assert f"expert weight bytes on this rank (MoE group rank 3 of 4): {mib}" in caplog.text
    for layer, block in enumerate(moe_blocks(single)):
        whole_gate_up, whole_down = block.experts.plain_weights()
        parts = [moe_blocks(m)[layer].experts.plain_weights() for m in ranks]
        if ep:  # experts [2m, 2m+2) on rank m
            assert torch.equal(torch.cat([g for g, _ in parts]), whole_gate_up)
            assert torch.equal(torch.cat([d for _, d in parts]), whole_down)
        else:  # intermediate rows [8m, 8m+8) of every expert on rank m
            rows = block.experts.held.rows // 4
            gates = torch.cat([g[:, :, :rows] for g, _ in parts], dim=2)
            assert torch.equal(gates, whole_gate_up[:, :, : 4 * rows])
            assert torch.equal(torch.cat([d for _, d in parts], dim=1), whole_down)


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=3, enable_expert_parallel=True), "num_experts=8 is not divisible"),
    (dict(tensor_parallel_size=2, prefill_context_parallel_size=3), "intermediate size 32 is not divisible"),
])
def test_unplaceable_experts_refused_at_config_time(launches, options, message):
    config = open_weights(launches.folder("qwen3_moe")).config
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**options).dims.validate(dataclasses.replace(config, num_attention_heads=12,
                                                                    num_key_value_heads=6))


def test_unsupported_features_refused():
    from cpllm.config.engine import ModelConfig

    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="o_proj bias"):
        ModelConfig(architecture="Qwen3ForCausalLM", qk_norm=True, attention_bias=True, **base)
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig(architecture="JambaForCausalLM", **base)
