"""Formats of the token embedding's rows: a lookup, not a matmul (the plan: cpllm/model/formats/plan.py,
`embedding_plan`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.model.formats.group_kernels import Int8Rows


class EmbeddingRows(torch.nn.Module):
    """One format of a vocabulary shard's rows; `lookup` embeds local ids."""

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] (rows of this shard) -> [N, hidden] in the model dtype."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def float_rows(self) -> torch.Tensor | None:
        """The rows [rows, hidden] in the model dtype, for a tied float head to copy; None where not held so."""
        return None

    def int8_rows(self) -> Int8Rows | None:
        """The stored int8 rows, for a tied int8 head to share (one copy); None where not held so."""
        return None


class FloatRows(EmbeddingRows):
    """Rows in the model dtype."""

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(rows, hidden, dtype=dtype), requires_grad=False)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def describe(self) -> str:
        return f"{str(self.weight.dtype).removeprefix('torch.')} rows {list(self.weight.shape)}"

    def float_rows(self) -> torch.Tensor:
        return self.weight


class StoredInt8Rows(EmbeddingRows):
    """Q8_0 rows kept as stored and looked up exactly (d q in float32, then the model dtype)."""

    def __init__(self, rows: Int8Rows, dtype: torch.dtype):
        super().__init__()
        self.rows, self.dtype = rows, dtype

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids, self.dtype)

    def describe(self) -> str:
        return f"int8 rows as stored (Q8_0) {list(self.rows.codes.shape)}"

    def int8_rows(self) -> Int8Rows:
        return self.rows
