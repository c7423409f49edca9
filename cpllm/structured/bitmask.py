"""Token bitmasks: one bit per vocabulary id, 32 ids per int32 word, as llguidance writes them."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, every bit set (everything allowed)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1  # [rows, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets the logits of disallowed ids to -inf, in place. logits: [rows, vocab]; bitmask: [rows, words]."""
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask of {bitmask.shape[0]} rows for logits of {logits.shape[0]} rows")
    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    keep = allowed(bitmask.to(logits.device), covered)
    logits[:, :covered].masked_fill_(~keep, float("-inf"))
    if covered < vocab:  # ids beyond the mask are ids the grammar's tokenizer never produces
        logits[:, covered:] = float("-inf")
