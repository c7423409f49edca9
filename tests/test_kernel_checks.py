"""The checked kernel layer (cpllm/kernels/library.py, checks.py, structs.py): every C kernel wrapper fed bad
indices or shapes raises an error naming the value and its limit, and touches no memory through them.

The decode attention and K/V store run on this machine's build and on one compiled without AVX-512 (the plain C
paths an AVX2-only machine runs); the fused decode layer is called directly on a tiny float32 layer. Also: the
kill switch read at every call, and each ctypes struct checked against the compiled C struct's layout.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from cpllm.kernels import build, checks, decode_layer, int4_matmul, library, structs
from cpllm.kernels.decode_attention import paged_decode_attention
from cpllm.kernels.decode_rows import rope_qk_, silu_mul, store_rows_
from cpllm.kernels.prefill_attention import prefill_attention
from cpllm.kernels.rms_norm import rms_norm

pytestmark = pytest.mark.skipif(library.load("decode_rows") is None, reason="no C compiler on this machine")

NUM_SLOTS = 64


@pytest.fixture(scope="module")
def without_avx512(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    """decode_attention and decode_rows compiled for x86-64-v3 (AVX2, no AVX-512), typed as the library types them."""
    folder = tmp_path_factory.mktemp("avx2")
    flags = [("-march=x86-64-v3" if flag == "-march=native" else flag) for flag in build.FLAGS]
    libs = {}
    for name in ("decode_attention", "decode_rows"):
        source, target = Path(build.__file__).with_name(f"{name}.c"), folder / f"{name}.so"
        subprocess.run([build._compiler(), *flags, "-o", str(target), str(source), "-lm"], check=True)
        libs[name] = library.prepare(name, ctypes.CDLL(str(target)))
    return libs


@pytest.fixture(params=["native", "avx2"])
def build_kind(request, monkeypatch):
    """Run the test on this machine's build, then on the build without AVX-512."""
    if request.param == "avx2":
        for name, lib in request.getfixturevalue("without_avx512").items():
            monkeypatch.setitem(library._loaded, name, lib)
    return request.param


def _attention_case(head_dim: int, lengths: list[int], width: int = 8):
    gen = torch.Generator().manual_seed(0)
    pools = [torch.randn(NUM_SLOTS, 2, head_dim, generator=gen) for _ in range(2)]
    slots = torch.randint(0, NUM_SLOTS, (len(lengths), width), generator=gen)
    return torch.randn(len(lengths), 4, head_dim, generator=gen), *pools, slots, torch.tensor(lengths)


@pytest.mark.parametrize("head_dim", [64, 32])  # the AVX-512 unit (64 and 128) and the plain C one
@pytest.mark.parametrize("bad", [70000, NUM_SLOTS, -1])
def test_decode_attention_names_a_slot_outside_the_pool(build_kind, head_dim, bad):
    q, k_pool, v_pool, slots, lengths = _attention_case(head_dim, [5, 8, 3])
    slots[1, 6] = bad
    with pytest.raises(IndexError, match=rf"slot {bad} out of range: the pool has {NUM_SLOTS} slots"):
        paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)


def test_decode_attention_reads_no_slot_past_a_length(build_kind):
    """Slots past a request's length are padding, never read: any value there is fine."""
    q, k_pool, v_pool, slots, lengths = _attention_case(64, [5, 8, 3])
    want = paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)
    slots[0, 5:] = 70000
    slots[2, 3:] = -1
    got = paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_decode_attention_rows_of_one_context_attend_as_each_alone(build_kind):
    """Rows whose contexts are prefixes of one another's (a verify chunk) attend as one group: each row's result is
    its result alone within float32 rounding (the AVX-512 group unit sums in another order; the plain C path runs
    the rows one by one: the same bits), on both builds; a bad slot in the shared context is named."""
    q, k_pool, v_pool, slots, _ = _attention_case(64, [5, 6, 7, 8], width=8)
    slots[:] = slots[3].clone()
    lengths = torch.tensor([5, 6, 7, 8])
    together = paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)
    alone = [paged_decode_attention(q[b:b + 1], k_pool, v_pool, slots[b:b + 1], lengths[b:b + 1], 0.125)
             for b in range(4)]
    assert (together[0] - torch.cat([o for o, _ in alone])).abs().max().item() < 1e-5
    slots[:, 2] = NUM_SLOTS
    with pytest.raises(IndexError, match=rf"slot {NUM_SLOTS} out of range"):
        paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125)


@pytest.mark.parametrize("bad", [9, -1])
def test_decode_attention_names_a_length_over_the_slot_table(build_kind, bad):
    q, k_pool, v_pool, slots, _ = _attention_case(64, [5, 8, 3])
    with pytest.raises(ValueError, match=rf"context length {bad} of request 1 out of range: the slot table holds 8"):
        paged_decode_attention(q, k_pool, v_pool, slots, torch.tensor([5, bad, 3]), 0.125)


def test_decode_attention_refuses_batches_that_disagree():
    q, k_pool, v_pool, slots, lengths = _attention_case(64, [5, 8, 3])
    with pytest.raises(ValueError, match="do not hold the 3 requests"):
        paged_decode_attention(q, k_pool, v_pool, slots[:2], lengths[:2], 0.125)
    with pytest.raises(ValueError, match="do not hold the 3 requests"):
        paged_decode_attention(q, k_pool, v_pool, slots, lengths[:2], 0.125)


def _rows(n: int = 4) -> torch.Tensor:
    return torch.randn(n, 2, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [NUM_SLOTS, 70000, -3])
def test_store_names_a_slot_outside_the_pool_and_writes_nothing(build_kind, dtype, bad):
    pool = torch.zeros(NUM_SLOTS, 2, 16, dtype=dtype)
    with pytest.raises(IndexError, match=rf"slot {bad} out of range: the pool has {NUM_SLOTS} slots"):
        store_rows_(pool, torch.tensor([3, bad, 5]), _rows(), torch.tensor([0, 1, 2]))
    assert not pool.any()


@pytest.mark.parametrize("bad", [4, -1])
def test_store_names_a_row_outside_the_source_and_writes_nothing(build_kind, bad):
    pool = torch.zeros(NUM_SLOTS, 2, 16)
    with pytest.raises(IndexError, match=rf"source row {bad} out of range: the step has 4 rows"):
        store_rows_(pool, torch.tensor([3, 4]), _rows(), torch.tensor([0, bad]))
    assert not pool.any()


def test_store_refuses_slots_and_rows_of_other_counts():
    with pytest.raises(ValueError, match="not one of each"):
        store_rows_(torch.zeros(NUM_SLOTS, 2, 16), torch.tensor([3, 4]), _rows(), torch.tensor([0]))


def test_rope_refuses_tables_of_another_head_size(build_kind):
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    tables = (torch.ones(3, 1, 8), torch.zeros(3, 1, 8))
    with pytest.raises(ValueError, match=r"tables \(3, 1, 8\).*do not fit"):
        rope_qk_(tables, q, k)


def test_rms_norm_refuses_a_weight_of_another_width():
    with pytest.raises(ValueError, match=r"weight \(63,\) does not match the rows' width 64"):
        rms_norm(torch.randn(2, 64), torch.ones(63), 1e-5)


def test_prefill_attention_refuses_keys_and_values_that_disagree():
    q, k = torch.randn(4, 2, 32), torch.randn(6, 1, 32)
    if prefill_attention(q, k, k, 0.1, True) is None:
        pytest.skip("the prefill kernel declines on this machine (no AVX-512)")
    with pytest.raises(ValueError, match="do not fit together"):
        prefill_attention(q, k, torch.randn(5, 1, 32), 0.1, True)
    with pytest.raises(ValueError, match="do not fit together"):
        prefill_attention(q, torch.randn(6, 1, 28), torch.randn(6, 1, 28), 0.1, True)  # another head size


@pytest.mark.skipif(not int4_matmul.available(), reason="no AVX-512 VNNI kernel on this machine")
def test_int4_matmul_names_an_activation_width_the_weight_was_not_packed_for():
    codes = torch.randint(0, 16, (40, 64), dtype=torch.uint8)
    packed = int4_matmul.pack(codes, torch.ones(40, 2), torch.zeros(40, 2))
    assert int4_matmul.matmul(torch.randn(3, 64), packed, 40).shape == (3, 40)
    with pytest.raises(ValueError, match="width 96 and 40 outputs against a weight packed for 64 inputs and 33 to 48"):
        int4_matmul.matmul(torch.randn(3, 96), packed, 40)
    with pytest.raises(ValueError, match="width 64 and 49 outputs"):
        int4_matmul.matmul(torch.randn(3, 64), packed, 49)


def test_the_kill_switch_is_read_at_every_call(monkeypatch):
    """CPLLM_KERNELS=0 set after the kernels ran turns each one off at its next call; unset, they run again."""
    x, w = torch.randn(2, 64), torch.ones(64)
    q, k_pool, v_pool, slots, lengths = _attention_case(64, [5, 8])
    pool, rows = torch.zeros(NUM_SLOTS, 2, 16), _rows()

    def ran() -> list[bool]:
        return [rms_norm(x, w, 1e-5) is not None, silu_mul(torch.randn(2, 64), 32) is not None,
                store_rows_(pool, torch.tensor([1]), rows, torch.tensor([0])),
                rope_qk_((torch.ones(3, 1, 16), torch.zeros(3, 1, 16)), torch.randn(3, 4, 16), torch.randn(3, 2, 16)),
                paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125) is not None,
                library.load("prefill_attention") is not None, library.load("decode_layer") is not None]

    assert all(ran())
    monkeypatch.setenv("CPLLM_KERNELS", "0")
    assert not any(ran()) and not int4_matmul.available()
    monkeypatch.delenv("CPLLM_KERNELS")
    assert all(ran())


class _StepWithoutBound(ctypes.Structure):
    _fields_ = structs.StepSpec._fields_[:-1]  # the step_spec before num_slots


class _LinearSwapped(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("weight", ctypes.c_void_p)]


def test_each_ctypes_struct_matches_the_compiled_layout():
    lib = library.load("decode_layer")
    structs.check_layouts(lib, structs.DECODE_LAYER_STRUCTS)  # what loading the library checked
    with pytest.raises(structs.LayoutMismatch, match=r"_StepWithoutBound does not match C's step_spec: \d+ bytes"):
        structs.check_layouts(lib, {"step_spec": _StepWithoutBound})
    with pytest.raises(structs.LayoutMismatch, match="kind at offset 0, at C's offset 8"):
        structs.check_layouts(lib, {"linear_spec": _LinearSwapped})


class _TinyLayer:
    """One float32 decoder layer of hidden 64, two query heads and one KV head of 32, intermediate 64, and its pools."""

    def __init__(self):
        gen = torch.Generator().manual_seed(2)
        self.weights = [torch.randn(64, n, generator=gen) * 0.1 for n in (128, 64, 128, 64)]  # [in, out]
        self.norm = torch.ones(64)
        linears = [(structs.LINEAR_F32, w) for w in self.weights]
        self.spec = decode_layer.layer_spec((self.norm, self.norm), linears, 2, 1, 32, 64, 1e-5, 32**-0.5)
        self.k_pool, self.v_pool = torch.zeros(NUM_SLOTS, 1, 32), torch.zeros(NUM_SLOTS, 1, 32)

    def run(self, write_rows, write_slots, slots, lengths) -> None:
        batch = slots.shape[0]
        tables = (torch.ones(batch, 1, 32), torch.zeros(batch, 1, 32))
        step = decode_layer.step_spec(tables, write_rows, write_slots, slots, lengths, self.k_pool, 1)
        hidden = torch.randn(batch, 64, generator=torch.Generator().manual_seed(3))
        status = library.load("decode_layer").cpllm_decode_layer(
            hidden.data_ptr(), ctypes.byref(self.spec), ctypes.byref(step), self.k_pool.data_ptr(),
            self.v_pool.data_ptr(), None)
        if status != 0:
            raise checks.decode_layer_error(status, step)


@pytest.fixture
def tiny_layer() -> _TinyLayer:
    lib = library.load("decode_layer")
    if lib is None or lib.cpllm_f32_available() != 1:
        pytest.skip("the fused layer's float32 matmul needs AVX-512")
    return _TinyLayer()


def test_the_fused_layer_runs_a_good_step(tiny_layer):
    tiny_layer.run(torch.tensor([0, 1]), torch.tensor([7, 9]), torch.tensor([[3, 7], [9, 0]]), torch.tensor([2, 1]))
    assert tiny_layer.k_pool[[7, 9]].abs().sum(-1).all() and not tiny_layer.k_pool[8].any()


@pytest.mark.parametrize("case,error,message", [
    ("write_slot", IndexError, f"write slot 64 out of range: the pool has {NUM_SLOTS} slots"),
    ("write_row", IndexError, "source row 2 out of range: the step has 2 rows"),
    ("slot", IndexError, f"slot 99 out of range: the pool has {NUM_SLOTS} slots"),
    ("length", ValueError, "context length 3 of request 0 out of range: the slot table holds 2"),
])
def test_the_fused_layer_names_a_bad_index(tiny_layer, case, error, message):
    write_rows, write_slots = torch.tensor([0, 1]), torch.tensor([7, 9])
    slots, lengths = torch.tensor([[3, 7], [9, 0]]), torch.tensor([2, 1])
    {"write_slot": lambda: write_slots.__setitem__(1, NUM_SLOTS), "write_row": lambda: write_rows.__setitem__(1, 2),
     "slot": lambda: slots.__setitem__((1, 0), 99), "length": lambda: lengths.__setitem__(0, 3)}[case]()
    with pytest.raises(error, match=message):
        tiny_layer.run(write_rows, write_slots, slots, lengths)
    if case.startswith("write"):
        assert not tiny_layer.k_pool.any() and not tiny_layer.v_pool.any()  # refused before the first write


def test_the_fused_step_refuses_index_tensors_the_c_code_would_misread():
    tables = (torch.ones(2, 1, 32), torch.zeros(2, 1, 32))
    pool, rows, slots = torch.zeros(NUM_SLOTS, 1, 32), torch.tensor([0, 1]), torch.tensor([[3, 7], [9, 0]])
    with pytest.raises(ValueError, match="slots must be a contiguous 2-d int64 tensor"):
        decode_layer.step_spec(tables, rows, rows, slots.int(), torch.tensor([2, 1]), pool, 1)
    with pytest.raises(ValueError, match="write_slots must be a contiguous 1-d int64"):
        decode_layer.step_spec(tables, rows, torch.tensor([[1, 2, 3, 4]])[0, ::2], slots, torch.tensor([2, 1]), pool, 1)
    with pytest.raises(ValueError, match="disagree"):
        decode_layer.step_spec(tables, rows, rows, slots, torch.tensor([2]), pool, 1)
    with pytest.raises(ValueError, match="rotary tables"):
        decode_layer.step_spec((tables[0][:1], tables[1][:1]), rows, rows, slots, torch.tensor([2, 1]), pool, 1)


def test_a_layer_spec_refuses_a_weight_of_another_shape():
    """Each weight is read as the shape the layer's sizes give: checked once, when the layers are packed."""
    norm, gen = torch.ones(64), torch.Generator().manual_seed(4)
    good = [(structs.LINEAR_F32, torch.randn(64, n, generator=gen)) for n in (128, 64, 128, 64)]
    decode_layer.layer_spec((norm, norm), good, 2, 1, 32, 64, 1e-5, 0.2)
    wide_gate_up = [*good[:2], (structs.LINEAR_F32, torch.randn(64, 96)), good[3]]
    with pytest.raises(ValueError, match=r"gate\|up weight is torch.float32 \(64, 96\); 64 inputs and 128 outputs"):
        decode_layer.layer_spec((norm, norm), wide_gate_up, 2, 1, 32, 64, 1e-5, 0.2)
    int4_qkv = [(structs.LINEAR_INT4, torch.zeros(8, 3, 320, dtype=torch.uint8)), *good[1:]]  # packed for 96 inputs
    with pytest.raises(ValueError, match=r"q\|k\|v weight is torch.uint8 \(8, 3, 320\); .* torch.uint8 \(8, 2, 320\)"):
        decode_layer.layer_spec((norm, norm), int4_qkv, 2, 1, 32, 64, 1e-5, 0.2)
    with pytest.raises(ValueError, match="norm weights"):
        decode_layer.layer_spec((norm, torch.ones(32)), good, 2, 1, 32, 64, 1e-5, 0.2)
