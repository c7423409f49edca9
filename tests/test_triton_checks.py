"""The checked Triton wrappers (cpllm/kernels/triton_attention.py, triton_prefill.py, triton_checks.py): fed bad
slots, lengths, dtypes or shapes, each raises an error naming the value and its limit before any kernel is
launched; the slot padding past a request's length is never checked (it is never read); a table checked once and
changed in place is checked again; and the kill switch CPLLM_KERNELS=0 sends the gqa-triton backend's calls to its
torch path, read at every call.

The kernels are replaced by recorders here: every case is about what happens before a launch (the kernels
themselves run under Triton's interpreter in tests/test_triton_attention.py), so no triton is needed.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from cpllm.context_parallel.metadata import DecodeBatch
from cpllm.kernels import triton_attention
from cpllm.kernels.triton_attention import paged_decode_attention
from cpllm.kernels.triton_prefill import prefill_attention

NUM_SLOTS = 64


class _Recorder:
    """Stands for a @triton.jit kernel: `kernel[grid](...)` records the launch."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
        return launch


@pytest.fixture
def kernels(monkeypatch) -> dict[str, _Recorder]:
    """The decode split and merge kernels and the prefill kernel, replaced by recorders."""
    recorders = {"split": _Recorder(), "merge": _Recorder(), "prefill": _Recorder()}
    monkeypatch.setattr(triton_attention, "_kernels", lambda: (recorders["split"], recorders["merge"]))
    fake = types.ModuleType("cpllm.kernels.triton_prefill_kernels")
    fake.prefill_kernel = recorders["prefill"]
    monkeypatch.setitem(sys.modules, "cpllm.kernels.triton_prefill_kernels", fake)
    return recorders


def _launched(kernels: dict[str, _Recorder]) -> int:
    return sum(recorder.launches for recorder in kernels.values())


def _decode_case(lengths: list[int], width: int = 8, dtype=torch.int64):
    gen = torch.Generator().manual_seed(0)
    pools = [torch.randn(NUM_SLOTS, 2, 16, generator=gen) for _ in range(2)]
    slots = torch.randint(0, NUM_SLOTS, (len(lengths), width), generator=gen).to(dtype)
    return torch.randn(len(lengths), 4, 16, generator=gen), *pools, slots, torch.tensor(lengths).to(dtype)


@pytest.mark.parametrize("bad", [70000, NUM_SLOTS, -1])
def test_decode_names_a_slot_outside_the_pool(kernels, bad):
    q, k_pool, v_pool, slots, lengths = _decode_case([5, 8, 3])
    slots[1, 6] = bad
    with pytest.raises(IndexError, match=rf"^triton decode attention: slot {bad} out of range: the pool has "
                                         rf"{NUM_SLOTS} slots$"):
        paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)
    assert _launched(kernels) == 0


@pytest.mark.parametrize("bad", [9, -1])
def test_decode_names_a_length_over_the_slot_table(kernels, bad):
    q, k_pool, v_pool, slots, lengths = _decode_case([5, bad, 3])
    with pytest.raises(ValueError, match=rf"^triton decode attention: context length {bad} of request 1 out of "
                                         r"range: the slot table holds 8 slots per request$"):
        paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)
    assert _launched(kernels) == 0


def test_decode_checks_no_slot_past_a_length(kernels):
    """Padding past a length is never read (a CUDA graph's static table keeps stale rows there): any value is
    fine, in int64 or in the graphs' int32 tables."""
    for dtype in (torch.int64, torch.int32):
        q, k_pool, v_pool, slots, lengths = _decode_case([5, 8, 0], dtype=dtype)
        slots[0, 5:] = 70000
        slots[2, :] = -1
        out, lse = paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)
        assert out.shape == (3, 4, 16) and lse.shape == (3, 4)
    assert kernels["split"].launches == 2


def test_decode_refuses_tables_of_another_dtype_or_device(kernels):
    q, k_pool, v_pool, slots, lengths = _decode_case([5, 8])
    with pytest.raises(TypeError, match=r"triton decode attention: slots must be int32 or int64, got torch.float32"):
        paged_decode_attention(q, k_pool, v_pool, slots.float(), lengths, 0.125)
    with pytest.raises(TypeError, match=r"lengths must be int32 or int64, got torch.bool"):
        paged_decode_attention(q, k_pool, v_pool, slots, lengths.bool(), 0.125)
    with pytest.raises(ValueError, match=r"triton decode attention: slots is on meta, the pools on cpu"):
        paged_decode_attention(q, k_pool, v_pool, slots.to("meta"), lengths, 0.125)
    with pytest.raises(ValueError, match=r"q on meta, pools on cpu"):
        paged_decode_attention(q.to("meta"), k_pool, v_pool, slots, lengths, 0.125)
    with pytest.raises(ValueError, match=r"slots \(3, 8\) and lengths \(2,\) do not match a batch of 2"):
        paged_decode_attention(q, k_pool, v_pool, torch.zeros(3, 8, dtype=torch.long), lengths, 0.125)
    assert _launched(kernels) == 0


def test_a_table_changed_in_place_is_checked_again(kernels):
    """The check of an unchanged table is remembered (one check per step on CUDA), never past an in-place change
    of the table or of a view of it; tables made under inference_mode (no version counter) are checked each call."""
    q, k_pool, v_pool, slots, lengths = _decode_case([5, 8])
    paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)
    paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)
    slots[1, 2] = 70000
    with pytest.raises(IndexError, match="slot 70000 out of range"):
        paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)
    slots[1, 2] = 0
    paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)
    lengths[0] = 20
    with pytest.raises(ValueError, match="context length 20 of request 0"):
        paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)
    lengths[0] = 5
    context = slots[1]  # a prefill's context slots: a view of the table
    prefill_attention(q[:2], k_pool, v_pool, 0.125, slots=context)
    slots[1, 0] = -3
    with pytest.raises(IndexError, match="triton prefill attention: slot -3 out of range"):
        prefill_attention(q[:2], k_pool, v_pool, 0.125, slots=slots[1])
    with torch.inference_mode():
        table = torch.zeros(4, dtype=torch.long)
        prefill_attention(q[:2], k_pool, v_pool, 0.125, slots=table)
        table[3] = NUM_SLOTS
        with pytest.raises(IndexError, match=rf"slot {NUM_SLOTS} out of range: the pool has {NUM_SLOTS} slots"):
            prefill_attention(q[:2], k_pool, v_pool, 0.125, slots=table)
    assert kernels["split"].launches == 3 and kernels["prefill"].launches == 2


@pytest.mark.parametrize("bad", [70000, NUM_SLOTS, -1])
def test_prefill_names_a_context_slot_outside_the_pool(kernels, bad):
    q, k_pool, v_pool, _, _ = _decode_case([5, 8, 3])
    slots = torch.tensor([3, 1, bad, 7])
    new = torch.randn(3, 2, 16)
    with pytest.raises(IndexError, match=rf"^triton prefill attention: slot {bad} out of range: the pool has "
                                         rf"{NUM_SLOTS} slots$"):
        prefill_attention(q, k_pool, v_pool, 0.125, slots=slots, new_k=new, new_v=new)
    assert _launched(kernels) == 0
    prefill_attention(q, k_pool, v_pool, 0.125, slots=slots[:2], new_k=new, new_v=new)  # the good ones
    assert kernels["prefill"].launches == 1


def test_prefill_refuses_bad_shapes_dtypes_and_devices(kernels):
    q, k_pool, v_pool, _, _ = _decode_case([5, 8, 3])
    new = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="give new_k and new_v together"):
        prefill_attention(q, k_pool, v_pool, 0.125, new_k=new)
    with pytest.raises(ValueError, match=r"new keys \(2, 2, 16\)"):
        prefill_attention(q, k_pool, v_pool, 0.125, new_k=new[:2], new_v=new[:2])
    with pytest.raises(ValueError, match=r"slots must be \[S\], got \(2, 2\)"):
        prefill_attention(q, k_pool, v_pool, 0.125, slots=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match=r"triton prefill attention: slots must be int32 or int64, got torch.float64"):
        prefill_attention(q, k_pool, v_pool, 0.125, slots=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"several devices \(\['cpu', 'meta'\]\)"):
        prefill_attention(q, k_pool, v_pool, 0.125, new_k=new.to("meta"), new_v=new.to("meta"))
    with pytest.raises(ValueError, match="slots is on meta, the pools on cpu"):
        prefill_attention(q, k_pool, v_pool, 0.125, slots=torch.zeros(2, dtype=torch.long, device="meta"))
    assert _launched(kernels) == 0


def test_the_kill_switch_sends_the_triton_backend_to_its_torch_path(kernels, monkeypatch):
    """CPLLM_KERNELS=0, read at each call, turns the Triton kernels off as it turns the C ones off: the gqa-triton
    backend then answers every call with the GQA backend's torch path (the same values); unset, the kernels run."""
    from cpllm.layers.gqa.backend import GQAPagedBackend
    from cpllm.layers.gqa_triton.backend import TritonPagedBackend

    monkeypatch.setattr(triton_attention, "_triton", lambda: (None, None))  # "triton imports"
    monkeypatch.setattr(triton_attention, "interpreting", lambda: True)  # the CPU tensors count as the kernels'
    q, k_pool, v_pool, slots, lengths = _decode_case([5, 8])
    padding = torch.arange(slots.shape[1]) >= lengths[:, None]  # [B, W]
    key_mask = torch.zeros(padding.shape).masked_fill(padding, float("-inf"))[:, None, None]  # [B, 1, 1, W]
    decode = DecodeBatch(requests=(0, 1), slots=slots, key_mask=key_mask, rows=torch.tensor([[0, 1]]),
                         max_local_context=int(lengths.max()), lengths=lengths)
    keys = k_pool[:9]

    def calls():
        return (TritonPagedBackend.attend(q, keys, keys, 0.3, False),
                TritonPagedBackend.attend_decode(q, k_pool, v_pool, decode, 0.3))

    calls()
    assert kernels["prefill"].launches == 1 and kernels["split"].launches == 1
    monkeypatch.setenv("CPLLM_KERNELS", "0")
    assert not triton_attention.available()
    (out, lse), (dec_out, dec_lse) = calls()
    assert kernels["prefill"].launches == 1 and kernels["split"].launches == 1  # nothing launched
    want = GQAPagedBackend.attend(q, keys, keys, 0.3, False)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    want_decode = GQAPagedBackend.attend_decode(q, k_pool, v_pool, decode, 0.3)
    assert torch.equal(dec_out, want_decode[0]) and torch.equal(dec_lse, want_decode[1])
    monkeypatch.delenv("CPLLM_KERNELS")
    calls()
    assert kernels["prefill"].launches == 2 and kernels["split"].launches == 2
