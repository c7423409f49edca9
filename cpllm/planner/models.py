"""Model shapes the planner knows by name, and reading one from a model folder, config.json or GGUF file."""

from __future__ import annotations

import json
import os

from cpllm.config.engine import ModelConfig

BUILTIN_MODELS: dict[str, dict] = {
    # Llama 3.1 405B (the paper's model): 126 layers, 128 query / 8 KV heads of 128.
    "llama3-405b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=16384,
                        intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0),
    "llama3-70b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192,
                       intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0),
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0),
    # DeepSeek-V2-Lite (vLLM PR 44967's model; config.json of deepseek-ai/DeepSeek-V2-Lite): 27 layers, hidden 2048,
    # 16 MLA heads (queries direct, latent 512 + rope 64, nope 128, value 128), the first layer dense (10944), the
    # rest 64 routed experts of 1408 with 6 active and 2 shared.
    "deepseek-v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048,
                             intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64,
                             num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, moe_layer_freq=1,
                             topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
                             max_position_embeddings=163840, rope_theta=10000.0,
                             rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                           "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                                           "beta_slow": 1}),
    # DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3): 61 layers, hidden 7168, 128 MLA heads (queries through
    # a rank-1536 latent, KV latent 512 + rope 64, nope 128, value 128), the first 3 layers dense (18432), the rest
    # 256 routed experts of 2048 with 8 active (8 groups, top 4) and 1 shared.
    "deepseek-v3": dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
                        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256,
                        num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3, moe_layer_freq=1,
                        topk_method="noaux_tc", n_group=8, topk_group=4, routed_scaling_factor=2.5,
                        norm_topk_prob=True, max_position_embeddings=163840, rope_theta=10000.0,
                        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
                         rope_theta=100000.0),
}


def load_model_shape(spec: str) -> ModelConfig:
    """A built-in name, a config.json, a model folder holding one, or a .gguf file."""
    if spec.lower() in BUILTIN_MODELS:
        return ModelConfig.from_hf_config(BUILTIN_MODELS[spec.lower()])
    if os.path.isdir(spec):
        spec = os.path.join(spec, "config.json")
    if spec.endswith(".json"):
        with open(spec) as handle:
            return ModelConfig.from_hf_config(json.load(handle))
    if spec.endswith(".gguf"):
        from cpllm.model.loaders.loader import open_weights

        return open_weights(spec).config
    raise ValueError(f"model {spec!r} is neither a built-in name ({', '.join(BUILTIN_MODELS)}), a config.json, "
                     "a model folder nor a .gguf file")
