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
