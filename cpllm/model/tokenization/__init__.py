"""Tokenizers and chat templates, and their on-disk cache."""
