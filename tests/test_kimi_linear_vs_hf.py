"""Kimi Linear on the single-rank engine against transformers on the same tiny random weights (tests/tiny_kimi.py):
Kimi delta attention layers (per-channel decay, short convolution, sigmoid-gated norm) with an MLA layer that
rotates nothing, the DeepSeek MoE with a shared expert. Greedy tokens identical, prompt and sampled-token logprobs
within 1e-4 in float32.

The rule itself first, against transformers' chunked and recurrent KDA on random inputs over a block boundary.
Then a batch of prompts of mixed lengths (1 token to two delta-rule blocks) with prompt logprobs; a small
chunked-prefill budget (chunks continue from the saved convolution window and state, decode rows beside prompt
chunks); a KV cache too small for the batch (requests preempted and recomputed from a zero state); the state's
accounting (spec, capacity log, the planner); config.json in the original checkpoints' spelling; the options
refused (prefix caching and speculative decoding: tests/test_kimi_linear_prefix_spec.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest
import torch

from cpllm import LLM, SamplingParams
from cpllm.config.engine import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from cpllm.config.speculative import SpeculativeConfig
from cpllm.layers.kimi_delta.rule import chunked_kda, l2norm, recurrent_step
from cpllm.layers.registry import state_layer_indices, state_layer_specs
from cpllm.model.loaders.safetensors_source import read_hf_config
from cpllm.planner.cost_model import CostModel, Precision
from cpllm.planner.hardware import builtin_hardware
from cpllm.planner.models import load_model_shape
from reference import check_against_hf
from tiny_kimi import hf_greedy_cached, make_tiny_kimi, save_tiny_kimi

MAX_TOKENS = 8
PROMPT_LENGTHS = (1, 5, 23, 90)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2)
LAYER_STATE_BYTES = (3 * 64 * 3 + 4 * 16 * 16) * 4
"""One KDA layer's state of one request: 192 conv channels x 3 taps, 4 heads x 16 x 16, float32."""
LATENT_BLOCK_BYTES = 4 * (32 + 8) * 4
"""One MLA layer's block of 4 tokens: one latent row of kv_lora_rank + rope = 40 values, float32."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_kimi(str(tmp_path_factory.mktemp("kimi")), seed=1)
    hf = make_tiny_kimi(seed=1)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    return folder, prompts, [hf_greedy_cached(hf, p, MAX_TOKENS) for p in prompts]


def test_rule_matches_transformers():
    """chunked_kda over 100 tokens (two blocks) from a random state, and recurrent_step token by token, against
    transformers' chunk_kimi_delta_attention and recurrent_kimi_delta_attention."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    gen = torch.Generator().manual_seed(0)
    t, h, d = 100, 3, 8
    q, k, v = (torch.randn(t, h, d, generator=gen) for _ in range(3))
    g = -torch.rand(t, h, d, generator=gen) * torch.tensor([0.05, 1.0, 6.0]).view(1, h, 1)  # slow to fast decays
    beta = torch.rand(t, h, generator=gen)
    state = torch.randn(h, d, d, generator=gen)
    want, want_state = hf.chunk_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None],
                                                      initial_state=state[None].clone(), output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    qn, kn = l2norm(q) * d**-0.5, l2norm(k)
    got, got_state = chunked_kda(qn, kn, v, g, beta, state)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state[0], atol=1e-5, rtol=1e-5)
    step_state, outs = state[None], []
    for i in range(t):
        out, step_state = recurrent_step(qn[i : i + 1], kn[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1],
                                         step_state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step_state[0], want_state[0], atol=1e-5, rtol=1e-5)


def test_config_reads_the_model(tiny):
    folder, _, _ = tiny
    config = read_hf_config(folder)
    kda, mla, moe = config.kimi_delta, config.mla, config.moe
    assert kda.linear_layers == (0, 1, 3) and (kda.num_heads, kda.head_dim, kda.conv_dim) == (4, 16, 192)
    assert (mla.rotary, mla.kv_lora_rank, mla.qk_rope_head_dim, config.num_key_value_heads) == (False, 32, 8, 1)
    assert (moe.mlp_only_layers, moe.expert_prefix, moe.expert_weight_names) == ((0,), "block_sparse_moe",
                                                                                 ("w1", "w3", "w2"))
    router = moe.deepseek_router
    assert (router.scoring_func, router.n_group, router.topk_group, router.n_shared_experts) == ("sigmoid", 2, 1, 1)
    assert state_layer_indices(config) == frozenset({0, 1, 3})
    specs = state_layer_specs(config, tp_size=1)
    assert {spec.bytes_per_request for spec in specs.values()} == {LAYER_STATE_BYTES}
    assert state_layer_specs(config, tp_size=2)[0].bytes_per_request == LAYER_STATE_BYTES // 2
    cost = CostModel(load_model_shape(folder), builtin_hardware("cpu"), Precision(kv_bytes=2))
    assert cost.state_bytes_per_request(1) == 3 * LAYER_STATE_BYTES  # `cpllm plan` counts the states
    assert cost.kv_bytes_per_token(1) == 40 * 2  # one latent row, of the one MLA layer


def test_original_checkpoint_spelling(tiny):
    """config.json as Moonshot's checkpoints write it (linear_attn_config with 1-indexed layers, Kimi's MoE keys,
    first_k_dense_replace) reads as the same model."""
    folder, _, _ = tiny
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    original = {key: value for key, value in saved.items()
                if key not in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads",
                               "linear_conv_kernel_dim")}
    original.update(linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "head_dim": 16,
                                        "num_heads": 4, "short_conv_kernel_size": 4},
                    first_k_dense_replace=1)
    assert ModelConfig.from_hf_config(original) == ModelConfig.from_hf_config(saved)


def test_batch_matches_transformers(tiny):
    folder, prompts, refs = tiny
    with LLM(folder, max_model_len=256, block_size=4, quantization="none") as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        check_against_hf(output, *ref)


def test_chunked_prefill_continues_the_state(tiny):
    folder, prompts, refs = tiny
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(folder, max_model_len=256, block_size=4, quantization="none", max_num_batched_tokens=7) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for output, ref in zip(outputs, refs):
        check_against_hf(output, ref[0], ref[1])


def test_preemption_recomputes_the_state(tiny, caplog):
    """Four copies of the 23-token prompt fill the latent pool as they decode: requests are preempted, their state
    slots freed and taken again, and recomputed from a zero state; outputs unchanged. The capacity log counts
    the states."""
    folder, prompts, refs = tiny
    prompts, refs = [prompts[2]] * 4, [refs[2]] * 4
    # 1 MLA layer x 640 bytes per block; 25 blocks: the four prompts take 6 each, their 31 tokens 8 each; the four
    # states of the 3 KDA layers come out of the budget first
    budget = 4 * 3 * LAYER_STATE_BYTES + 25 * LATENT_BLOCK_BYTES
    with caplog.at_level("INFO"):
        with LLM(folder, max_model_len=100, block_size=4, quantization="none", max_num_seqs=4,
                 kv_cache_memory_bytes=budget) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
            assert llm.engine.executor.rank_info.kv.num_blocks == 25
            assert llm.engine.scheduler.num_preemptions > 0
            assert sorted(llm.engine.scheduler.free_state_slots) == [0, 1, 2, 3]  # every slot back
    for output, ref in zip(outputs, refs):
        check_against_hf(output, *ref)
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"layers 0-1, 3 (3): recurrent state (conv 192x3 + delta 4x256 values per request, "
               f"{LAYER_STATE_BYTES} bytes)" in line for line in lines), lines
    assert any("per token and layer, 1 layers: 160 bytes per token stored on a rank" in line for line in lines), lines


def test_refused_options(tiny):
    folder, _, _ = tiny
    model = read_hf_config(folder)
    short = SchedulerConfig(max_model_len=256)
    plain = dict(model_path=folder, model=model, scheduler=short)
    assert EngineConfig(**plain).cache.enable_prefix_caching is False  # off when left unset
    EngineConfig(**plain, cache=CacheConfig(enable_prefix_caching=True))  # tests/test_kimi_linear_prefix_spec.py
    EngineConfig(**plain, speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    with pytest.raises(ValueError, match="compile_decode"):
        EngineConfig(**plain, compile_decode=True)
    odd = dataclasses.replace(model, kimi_delta=dataclasses.replace(model.kimi_delta, num_heads=3))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide linear_num_heads=3"):
        EngineConfig(**{**plain, "model": odd}, parallel=ParallelConfig(tensor_parallel_size=2))
    EngineConfig(**plain, parallel=ParallelConfig(prefill_context_parallel_size=2))  # the state scan runs it


def test_gguf_architecture_read(tmp_path):
    """The `gguf` package names kimi-linear, and its files are read (tests/test_kimi_gguf.py): a file of the
    architecture is no longer refused by its name, only by what it lacks (here the keys Kimi Linear needs)."""
    import gguf
    import numpy as np

    from cpllm.model.loaders.gguf_source import GGUFSource

    assert gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.KIMI_LINEAR] == "kimi-linear"
    path = str(tmp_path / "kimi.gguf")
    writer = gguf.GGUFWriter(path, "kimi-linear")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="kimi-linear GGUF file has no kimi-linear.attention.head_count; Kimi Linear "
                                         "needs it"):
        GGUFSource(path)
