"""Model families: the Llama stack and the families built on it (registry.py lists them)."""
