"""Weights by Hugging Face name from safetensors or GGUF files, and the default model's file."""
