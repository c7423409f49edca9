"""A decode batch restricted to each row's in-window keys, built once per step and window and reused by every
windowed layer of the step (cached in the batch's `StepViews`)."""

from __future__ import annotations

import torch

from cpllm.context_parallel.metadata import AttentionMetadata, DecodeBatch


def window_view(meta: AttentionMetadata, window: int | None) -> DecodeBatch | None:
    """The step's decode batch restricted to each row's in-window keys: the row at position p keeps the local
    slots of positions > p - window, so the decode kernels run it unmasked (every key kept is visible). Built on
    the first call of the step for this window and cached; the batch itself where the window hides nothing
    (or there is no window)."""
    decode = meta.decode
    if decode is None or window is None:
        return decode
    key = ("window", decode.slots.device, window)
    cache = decode.views
    if cache is not None and key in cache.views:
        return cache.views[key]
    view = _window_batch(decode, meta, window)
    if cache is not None:
        cache.views[key] = view
    return view


def _window_batch(decode: DecodeBatch, meta: AttentionMetadata, window: int) -> DecodeBatch:
    layout, requests = meta.kv_layout, meta.requests
    if layout is None:
        raise ValueError("a windowed decode needs the step's KV layout: build the metadata with build_step_batch")
    # The token at position p = context_len - 1 sees positions >= context_len - window.
    starts = [layout.num_local_tokens(max(requests[i].context_len - window, 0)) for i in decode.requests]
    if not any(starts):
        return decode
    lengths = [layout.num_local_tokens(requests[i].context_len) - s for i, s in zip(decode.requests, starts)]
    width = max(max(lengths), 1)
    device = decode.slots.device
    index = (torch.tensor(starts).unsqueeze(1) + torch.arange(width)).clamp_(max=decode.slots.shape[1] - 1)
    slots = decode.slots.gather(1, index.to(device))  # [B, width]
    key_mask = None
    if min(lengths) < width:
        valid = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)  # [B, width]
        key_mask = torch.zeros(len(lengths), 1, 1, width).masked_fill(~valid[:, None, None, :], float("-inf"))
        key_mask = key_mask.to(device)
        # Padding reads slot 0 under the mask, as in the batch itself: the slots gathered there may lie in blocks
        # a windowed KV group has freed.
        slots = slots.masked_fill(~valid.to(device), 0)
    contiguous = None
    if decode.window is not None and lengths[0]:  # one request in consecutive slots: a narrower run of them
        contiguous = (decode.window[0] + starts[0], lengths[0])
    return DecodeBatch(requests=decode.requests, slots=slots, key_mask=key_mask, rows=decode.rows,
                       max_local_context=max(lengths), window=contiguous,
                       lengths=torch.tensor(lengths, dtype=torch.long).to(device))
