"""Configuration: frozen dataclasses and their value checks, no I/O (engine.py: the engine's configs; the rest: per-feature fields and rules)."""
