"""A tiny model whose greedy tokens follow a fixed successor map, so that prompt lookup's drafts are mostly right.

The LM head's row for token s(a) is a's embedding (times `scale`): the residual stream of a position still holds
mostly its own token's embedding, so the logits peak on the successor of the current token, and the layers (random,
attention sharpened as in tests/tiny_models.py) move them a little, so some tokens leave the map. The successor map
is cycles of CYCLE tokens over a random order of the vocabulary: a prompt that walks a cycle once is then copied by
the model, and lookup drafts it.
"""

from __future__ import annotations

import random

import torch

from tiny_models import make_tiny_hf_model, tiny_hf_tokenizer

CYCLE = 8
"""Tokens in each cycle of the successor map."""


def successor_map(vocab: int, seed: int) -> dict[int, int]:
    """Token -> its successor: cycles of CYCLE tokens in a random order, the leftover tokens their own successor."""
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist()
    successor = {t: t for t in order}
    for i in range(0, vocab - vocab % CYCLE, CYCLE):
        cycle = order[i : i + CYCLE]
        successor.update(zip(cycle, cycle[1:] + cycle[:1]))
    return successor


def save_cycle_model(folder: str, *, seed: int = 1, scale: float = 1.0, **overrides) -> tuple[str, dict[int, int]]:
    """The tiny Llama of tests/tiny_models.py with its LM head set so greedy decoding follows `successor_map`."""
    model = make_tiny_hf_model("llama", seed=seed, **overrides)
    successor = successor_map(model.config.vocab_size, seed)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # [vocab, hidden]
        head = torch.zeros_like(model.lm_head.weight)
        for token, nxt in successor.items():
            head[nxt] = embed[token] * scale
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder, successor


def walk(successor: dict[int, int], start: int, length: int) -> list[int]:
    """`length` tokens following the map from `start`."""
    tokens = [start]
    while len(tokens) < length:
        tokens.append(successor[tokens[-1]])
    return tokens


def random_tokens(length: int, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]
