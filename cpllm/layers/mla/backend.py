"""Multi-head latent attention over a latent pool: the `AttentionBackend` of DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash.

An MLA layer caches one latent row per token, shared by every head: the normalised compressed KV (kv_lora_rank
values, r) and the rotated RoPE key (qk_rope_head_dim values), `r + rope` wide (576 for DeepSeek-V3). The pool is
[num_slots, 1, r + rope]: one latent "head", replicated over TP (docs/architecture.md, "Adding a layer kind").

Decode, and every step that reads cached latents, attends in the absorbed form (attention.py): the
key up-projection folded into each query head, so the queries are [N, H, r + rope] and attend the latents directly,
multi-query attention with one KV head whose keys and values are the same latent rows. The value is the latent's
first r columns; the layer keeps those columns of the output and applies the value up-projection per head after
attention (attention is linear in the values, so this commutes with the CP layer's exact merges). Hence the CP layer
(PagedCPAttention) runs unchanged on these pools, handed the same tensor as k_pool and v_pool and the same latent
rows as k and v: the output it accumulates has q's width, r + rope, of which the layer reads r.

So this backend is the GQA implementations (local_attention.py: the C decode kernel reading the pool in place, the
fused SDPA kernels) on one KV head, with two differences:
- `store_kv` writes each latent row once where v_pool is k_pool (the same rows would be written twice);
- `attend` also takes values narrower than the keys (the expanded prefill form: keys [S, H, nope + rope], values
  [S, H, v_head_dim]), padding them with zero columns for the kernels and returning the output at the values' width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.layers.gqa import local_attention
from cpllm.kernels.decode_rows import store_rows_


def _store_rows(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> None:
    # pool[slots[i]] = x[rows[i]]: one C call on eager CPU steps, else index_copy_
    if not store_rows_(pool, slots, x, rows):
        pool.index_copy_(0, slots, x.index_select(0, rows).to(pool.dtype))


def _store_kv(k_pool, v_pool, slots, k, v, rows) -> None:
    # k / v [N, 1, r + rope]: the latent rows; one pool (k_pool is v_pool) is written once
    _store_rows(k_pool, slots, k, rows)
    if v_pool.data_ptr() != k_pool.data_ptr():
        _store_rows(v_pool, slots, v, rows)


def _at_key_width(attend, q, k, v, *args, **kwargs):
    # q [L, Hq, Dk], k [S, Hkv, Dk], v [S, Hkv, Dv] with Dv <= Dk -> out [L, Hq, Dv], lse [L, Hq]
    width, keys = v.shape[-1], k.shape[-1]
    if width > keys:
        raise ValueError(f"MLA attention: values {tuple(v.shape)} are wider than the keys {tuple(k.shape)}")
    if width == keys:
        return attend(q, k, v, *args, **kwargs)
    # The kernels take equal widths: zero columns add nothing to the output's first `width` columns
    out, lse = attend(q, k, F.pad(v, (0, keys - width)), *args, **kwargs)
    return out[..., :width], lse


def _attend(q, k, v, scale: float, causal: bool):
    return _at_key_width(local_attention.attend, q, k, v, scale, causal)


def _rows_to_move(k, v):
    return (k,)  # one latent row is both: it travels once


def _rows_moved(parts):
    return parts[0], parts[0]


def _context_keys(k_pool, v_pool, slots, dtype):
    k = k_pool.index_select(0, slots).to(dtype)  # [S, 1, r + rope]
    return k, (k if v_pool.data_ptr() == k_pool.data_ptr() else v_pool.index_select(0, slots).to(dtype))


class MLAPagedBackend:
    """Latent rows [1, r + rope] per slot in one pool (see the module); the absorbed form's queries attend them."""

    name = "mla"
    store_kv = staticmethod(_store_kv)
    attend = staticmethod(_attend)
    context_keys = staticmethod(_context_keys)
    rows_to_move = staticmethod(_rows_to_move)
    rows_moved = staticmethod(_rows_moved)
    attend_decode = staticmethod(local_attention.attend_decode)
    attend_decode_whole = staticmethod(local_attention.attend_pooled_single_tokens)
    decode_context = staticmethod(local_attention.gather_decode_context)
    attend_gathered_decode = staticmethod(local_attention.attend_gathered_decode)
    decode_form = staticmethod(local_attention.decode_form)


def latent_pool(num_slots: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """An empty latent pool [num_slots, 1, kv_lora_rank + rope_dim]; a layer's kv_cache is (pool, pool)."""
    return torch.zeros(num_slots, 1, kv_lora_rank + rope_dim, dtype=dtype, device=device)
