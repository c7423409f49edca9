"""A random model of DeepSeek-V2-Lite's per-layer shape as a Hugging Face folder (issue 25's benchmark;
benchmarks/mla_bench.py measures it).

DeepSeek-V2-Lite: hidden 2048, 16 heads, queries direct (q_lora_rank None), kv_lora_rank 512, rope 64, nope 128,
v 128; 64 routed experts of 1408 rows, 6 active (softmax, greedy), 2 shared experts; the first layer dense
(intermediate 10944); YaRN rotary (factor 40 over 4096 positions, mscale 0.707); 27 layers, vocabulary 102400.
`layers` and `vocab` cut the depth and the vocabulary (every layer after the first stays sparse); everything else
is kept. Nothing is downloaded: transformers' DeepseekV2Config with random weights (N(0, 0.02), norms 1), saved
once as safetensors with the tests' tiny tokenizer (prompts are random ids).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the tiny tokenizer

V2_LITE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
               qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64,
               moe_intermediate_size=1408, num_experts_per_tok=6, n_shared_experts=2, intermediate_size=10944,
               first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
               norm_topk_prob=False, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 0.707,
                                "beta_fast": 32, "beta_slow": 1})
"""The released model's per-layer config fields the benchmark keeps as they are."""

TINY = {**V2_LITE, **dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                          qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                          moe_intermediate_size=32, num_experts_per_tok=2, intermediate_size=96,
                          rope_parameters={**V2_LITE["rope_parameters"], "original_max_position_embeddings": 64})}
"""The same kinds at a tiny size, for the smoke test."""

V32 = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
           qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256,
           moe_intermediate_size=2048, num_experts_per_tok=8, n_shared_experts=1, intermediate_size=18432,
           first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
           rms_norm_eps=1e-6, index_topk=2048, index_head_dim=128, index_n_heads=64,
           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                            "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "beta_fast": 32, "beta_slow": 1})
"""DeepSeek-V3.2's per-layer config fields (issue 38's benchmark, benchmarks/sparse_mla_bench.py): MLA with a
1536-wide low-rank query, 128 heads, and the lightning indexer (64 heads of 128, top 2,048); the first three
layers dense (intermediate 18432), so a model cut to three layers or fewer has no MoE layer."""

TINY_V32 = {**V32, **dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                          kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                          intermediate_size=96, index_topk=64, index_head_dim=32, index_n_heads=16,
                          rope_parameters={**V32["rope_parameters"], "original_max_position_embeddings": 64})}
"""The same kinds at a tiny size, for a smoke run."""

SHAPES = {"v2-lite": V2_LITE, "tiny": TINY, "v3.2": V32, "tiny-v3.2": TINY_V32}
SPARSE_SHAPES = ("v3.2", "tiny-v3.2")
"""Shapes of DeepseekV32Config (an indexer per layer); the others are DeepseekV2Config's."""


def deepseek_config(layers: int, vocab: int, max_positions: int, shape: str = "v2-lite"):
    from tiny_models import tiny_vocab
    from transformers import DeepseekV2Config, DeepseekV32Config

    ids = tiny_vocab()
    config_class = DeepseekV32Config if shape in SPARSE_SHAPES else DeepseekV2Config
    return config_class(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=max_positions,
                            bos_token_id=ids.bos_token_id, eos_token_id=ids.eos_token_id,
                            pad_token_id=ids.pad_token_id, tie_word_embeddings=False, **SHAPES[shape])


def build_folder(cache: str, layers: int, vocab: int, max_positions: int, shape: str = "v2-lite") -> str:
    """The folder, written once and reused."""
    from tiny_models import save_random_hf_folder

    name = f"deepseek-{shape}-shape-l{layers}-v{vocab}-p{max_positions}"
    return save_random_hf_folder(deepseek_config(layers, vocab, max_positions, shape), os.path.join(cache, name))
