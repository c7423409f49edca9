"""Score modifiers: what a layer changes in its attention scores, applied by the CP layer to every piece it
attends (docs/context_parallel.md, "Windows, soft-capping and sinks").

They compose: a sliding window (a mask on absolute positions, pieces.py), soft-capping (every scaled score `s`
becomes `c * tanh(s / c)` before the mask) and sinks (one logit per head in the denominator, applied once after
the last merge, cpllm/context_parallel/merge.py `apply_sinks`). The CP layer (cpllm/context_parallel/
attention.py, pass_q.py) asks the modifier, never a backend, which keys a piece keeps and how to attend it: a
piece the window leaves unmasked and uncapped goes to the backend's plain `attend` (its fastest kernel), any
other to the modifier's own float32 math (`scored_attention`), so no backend implements a scored path. Decode
rows read the batch's in-window view (decode_view.py), which needs no mask; a soft-capped decode passes the
backend's decode call its `score_mod` (the backend's math path applies it; the kernels take none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.sdpa import attention_with_lse
from cpllm.layers.window import pieces
from cpllm.layers.window.decode_view import window_view
from cpllm.layers.window.pieces import Piece


@dataclass(kw_only=True, frozen=True, slots=True)
class ScoreMods:
    """What a layer changes in its attention scores (None: nothing of that kind)."""

    window: int | None = None
    """Sliding window W: query i sees keys i - W < j <= i."""
    softcap: float | None = None
    """Scores (after the scale) become softcap * tanh(score / softcap) before the mask."""

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"window must be an integer >= 1 (or None), got {self.window!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 (or None), got {self.softcap!r}")

    def first_visible(self, q_first: int) -> int:
        """Smallest key position any query at or after position `q_first` can see (0 without a window)."""
        return 0 if self.window is None else max(q_first - self.window + 1, 0)

    def new_key_pieces(self, source_rows, q_start: int, q_len: int) -> list[Piece]:
        """The attend calls of a query run against one source's key runs (pieces.new_key_pieces)."""
        return pieces.new_key_pieces(source_rows, q_start, q_len, self)

    def context_range(self, layout: KVLayout, context_len: int, q_first: int) -> tuple[int, int]:
        """Local indices [lo, hi) of this rank's cached context that queries from `q_first` on can see."""
        return pieces.context_range(layout, context_len, q_first, self)

    def context_piece(self, layout: KVLayout, context_len: int, lo_base: int, q_first: int,
                      q_len: int) -> Piece | None:
        """The attend call of a query run against this rank's cached context read from `lo_base` on."""
        return pieces.context_piece(layout, context_len, lo_base, q_first, q_len, self)

    def decode_view(self, meta):
        """The step's decode batch as this layer's decode rows read it (their in-window keys)."""
        return window_view(meta, self.window)

    @property
    def decode_kwargs(self) -> dict:
        """What a decode call on the backend needs to know: the score function, if the scores change."""
        return {} if self.softcap is None else {"score_mod": self.score_mod}

    def score_mod(self, scores: torch.Tensor) -> torch.Tensor:
        """The scaled scores as this layer uses them: softcap * tanh(s / softcap) (before any mask)."""
        return scores if self.softcap is None else torch.tanh(scores / self.softcap) * self.softcap

    def attend(self, backend, scale: float, q, k, v, piece: Piece):
        """One piece on this rank -> (out, lse): the backend's plain `attend` where neither a mask nor a soft-cap
        applies, else `scored_attention` on the rows."""
        if piece.reverse:  # query t sees key s >= t: causal with both runs reversed, the output turned back
            out, lse = self.attend(backend, scale, _flip(q), _flip(k), _flip(v),
                                   Piece(piece.queries, piece.keys, True, None))
            return out.flip(0), lse.flip(0)
        if piece.mask is None and self.softcap is None:
            return backend.attend(q, k, v, scale, piece.causal)
        return scored_attention(_rows(q), _rows(k), _rows(v), scale, causal=piece.causal, mask=piece.mask,
                                score_mod=None if self.softcap is None else self.score_mod)


def score_mods(window: int | None = None, softcap: float | None = None) -> ScoreMods | None:
    """The modifier of a layer with this window and soft-cap; None when it has neither (the plain paths)."""
    return None if window is None and softcap is None else ScoreMods(window=window, softcap=softcap)


def scored_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool = False,
                     mask: torch.Tensor | None = None, score_mod=None):
    """Attention with a bool keep-mask [L, S] (a window's band, from positions; True keeps) and/or a score
    function: SDPA with the mask where there is none, else the float32 matmul path (scores, score_mod, mask,
    log-sum-exp). Rows that see no key get (0, -inf)."""
    # q [L, Hq, D], k/v [S, Hkv, D] -> out [L, Hq, D], lse [L, Hq]
    if mask is not None:
        mask = mask.to(q.device)[None, None]  # [1, 1, L, S]
    out, lse = attention_with_lse(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        scale=scale, causal=causal, mask=mask, score_mod=score_mod,
    )
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _rows(keys) -> torch.Tensor:
    # a backend's context keys may be a lazy view of its pools (AttentionBackend.context_keys): read them out
    return keys if isinstance(keys, torch.Tensor) else keys.tensor()


def _flip(keys):
    return _rows(keys).flip(0)
