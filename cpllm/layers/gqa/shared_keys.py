"""The shared-key view of a decode batch: the form the GQA kind's SDPA paths read where requests share a prefix.

Where two or more of a step's decode requests start from the same cached block (metadata.py marks the batch:
`DecodeBatch.shared_prefix`), their B rows can run as one query block over the union of their slots [1, U], with a
key mask [1, 1, B, U] saying which keys each row sees, so each shared key is read once. The view is built from the
host-side batch (never moved to a device) on the step's first call, and cached for every later layer in the batch's
`StepViews`, per device, which the CPU batch and its device copy share.
"""

from __future__ import annotations

import dataclasses

import torch

from cpllm.context_parallel.metadata import DecodeBatch, consecutive_window, to_device

_CPU = torch.device("cpu")


def shared_key_view(decode: DecodeBatch) -> DecodeBatch | None:
    """The shared-key form of a step's decode batch: its B rows as one query block over the union of their slots
    [1, U], with key_mask [1, 1, B, U] saying which keys each row sees. Built on the first call of the step and
    cached for every later layer; None where no request shares keys or padding the union to every row would cost
    more than it saves (B * U > 2 * sum of lengths)."""
    if decode.shared_prefix is None or decode.views is None:
        return None
    cache, device = decode.views.views, decode.slots.device
    key = ("shared-keys", device)
    if key in cache:
        return cache[key]
    host_key = ("shared-keys", _CPU)
    if host_key not in cache:
        cache[host_key] = _host_view(decode.shared_prefix.batch)
    host = cache[host_key]
    view = host if host is None or device == _CPU else dataclasses.replace(
        to_device(host, device, non_blocking=True), rows=decode.rows)
    cache[key] = view
    return view


def _host_view(host: DecodeBatch) -> DecodeBatch | None:
    lengths = host.lengths.tolist()
    own = [host.slots[b, :length] for b, length in enumerate(lengths)]  # each request's local context slots
    union = torch.unique(torch.cat(own))
    if len(lengths) * union.numel() > 2 * sum(lengths):  # padding the union costs more than it saves
        return None
    return _shared_key_batch(host, host.requests, union, own)


def _shared_key_batch(host: DecodeBatch, members: tuple[int, ...], union: torch.Tensor,
                      own: list[torch.Tensor]) -> DecodeBatch:
    """The view of `host`'s rows `members` over `union` [U] of their slots (`own[b]`: row b's slots)."""
    visible = torch.zeros(len(members), union.numel(), dtype=torch.bool)
    for b, slots in enumerate(own):
        visible[b, torch.searchsorted(union, slots)] = True
    key_mask = torch.zeros(1, 1, len(members), union.numel()).masked_fill(~visible[None, None], float("-inf"))
    slots = union.unsqueeze(0)
    return DecodeBatch(requests=members, slots=slots, key_mask=key_mask, rows=host.rows,
                       max_local_context=max(s.numel() for s in own), shared_keys=True,
                       window=consecutive_window(slots))
