"""The device path, pinned on the CPU: step metadata moved to the rank's device, float32 accumulation of attention
partials under bf16, no silent fallback from a fused attention kernel, and scripts/gpu_check.py --cpu."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import typing

import pytest
import torch

from cpllm.context_parallel import attention as attention_module
from cpllm.context_parallel import metadata as metadata_module
from cpllm.context_parallel import sdpa
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.merge import merge_attention_partials, merge_two
from cpllm.context_parallel.metadata import (
    AttentionMetadata,
    DecodeBatch,
    LocalChunk,
    RequestAttention,
    StepBatch,
    build_step_batch,
    to_device,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import gpu_check  # noqa: E402  (scripts/gpu_check.py: the step builder and the simulated CP ranks)
from step_plans import eager_plan  # noqa: E402

STEP_CLASSES = (StepBatch, AttentionMetadata, RequestAttention, DecodeBatch, LocalChunk)
STEPS = {  # (context_len, num_new) per request: prefill with context + padded decodes; decodes sharing a prefix
    "mixed": [(0, 9), (6, 5), (10, 1), (3, 1), (0, 1)],
    "shared_decodes": [(17, 1), (17, 1), (18, 1)],
}


def _steps(pcp: int = 2, pcp_rank: int = 1):
    layout = KVLayout(num_shards=pcp, shard_rank=pcp_rank, interleave=1, block_size=4)
    for requests in STEPS.values():
        chunks = gpu_check.make_chunks(requests, layout)
        yield build_step_batch(chunks, layout, pcp, pcp_rank, lambda c: [len(c.token_ids) - 1],
                               plan=eager_plan(chunks, layout, pcp))


def _tensor_fields(cls) -> set[str]:
    hints = typing.get_type_hints(cls, vars(metadata_module))
    return {name for name, hint in hints.items() if "Tensor" in str(hint)}


def _walk(obj, path=""):
    """Independent of metadata.iter_tensors: every (path, value) of a tensor-annotated field, recursively."""
    if dataclasses.is_dataclass(obj):
        tensor_fields = _tensor_fields(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name in tensor_fields:
                yield f"{type(obj).__name__}.{f.name}", value
            yield from _walk(value, f"{path}.{f.name}")
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _walk(item, path)


def test_every_tensor_field_is_covered_and_moved():
    """A tensor field added to the step classes must be moved too: each one is seen non-None here and on the
    target device after the move (the 'meta' device stands in for a GPU)."""
    declared = {f"{cls.__name__}.{name}" for cls in STEP_CLASSES for name in _tensor_fields(cls)}
    assert declared >= {"StepBatch.token_ids", "AttentionMetadata.write_rows", "DecodeBatch.key_mask",
                        "RequestAttention.context_slots", "RequestAttention.new_kv_rows"}
    seen = set()
    for batch in _steps():
        moved = batch.to("meta")
        for name, value in _walk(moved):
            if value is not None:
                seen.add(name)
                assert isinstance(value, torch.Tensor) and value.device.type == "meta", name
        # nothing else anywhere in the object is left on the CPU either
        assert all(t.device.type == "meta" for _, t in metadata_module.iter_tensors(moved))
        assert moved.output_rows == batch.output_rows and moved.attention.num_rows == batch.attention.num_rows
    assert seen == declared, f"tensor fields never exercised by these steps: {sorted(declared - seen)}"


def test_move_keeps_values_shapes_and_dtypes():
    # torch.device("cpu", 0) is not "the same device" for to_device, so the whole pack / copy / split path runs.
    for batch in _steps():
        before = list(metadata_module.iter_tensors(batch))
        after = list(metadata_module.iter_tensors(to_device(batch, torch.device("cpu", 0))))
        assert [p for p, _ in before] == [p for p, _ in after]
        for (path, a), (_, b) in zip(before, after):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    batch = next(_steps())
    assert to_device(batch, "cpu") is batch  # nothing to move: no copy


def test_build_step_batch_device_argument():
    layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=4)
    chunks = gpu_check.make_chunks(STEPS["mixed"], layout)
    batch = build_step_batch(chunks, layout, 1, 0, lambda c: [], plan=eager_plan(chunks, layout), device="meta")
    assert {t.device.type for _, t in metadata_module.iter_tensors(batch)} == {"meta"}


# --- float32 accumulation under bf16 ----------------------------------------------------------------------------


def test_merge_two_keeps_the_wider_dtype():
    o32, o16 = torch.randn(3, 4, 8), torch.randn(3, 4, 8).bfloat16()
    lse = torch.randn(3, 4)
    assert merge_two(o32, lse, o16, lse)[0].dtype == torch.float32
    assert merge_two(o16, lse, o32, lse)[0].dtype == torch.float32
    assert merge_two(o16, lse, o16, lse)[0].dtype == torch.bfloat16
    assert merge_attention_partials(torch.stack([o32, o32]), torch.stack([lse, lse]))[0].dtype == torch.float32


@pytest.mark.parametrize("layout_name", ["single", "pcp2_allgather", "pcp4_ring", "pcp2_dcp2"])
def test_bf16_partials_merge_in_float32(monkeypatch, layout_name):
    """Under bf16 every merge of attention partials (new tokens, ring steps, context all-to-all) gets and returns
    float32 accumulators; the layer's output is bf16 and agrees with a float64 reference."""
    seen = []

    def spy(fn):
        def wrapped(*args):
            result = fn(*args)
            seen.append((fn.__name__, args[0].dtype, result[0].dtype))
            return result
        return wrapped

    monkeypatch.setattr(attention_module, "merge_two", spy(merge_two))
    monkeypatch.setattr(attention_module, "merge_attention_partials", spy(merge_attention_partials))
    pcp, dcp, strategy, interleave = gpu_check.CP_LAYOUTS[layout_name]
    error, writes_ok, dtypes = gpu_check.run_cp_layer(gpu_check.CP_STEPS["mixed"], pcp=pcp, dcp=dcp,
                                                      strategy=strategy, interleave=interleave,
                                                      dtype=torch.bfloat16, device=torch.device("cpu"))
    assert dtypes == {(torch.bfloat16, "cpu")} and writes_ok
    assert seen and all(out == torch.float32 for _, _, out in seen), seen
    # the accumulator (first argument) is float32; in the old code it was the model dtype
    assert all(acc == torch.float32 for _, acc, _ in seen), seen
    assert error <= gpu_check.CP_TOL["bf16"]  # 2e-2 on values of order 1: the kernels' own bf16 rounding


# --- no silent fallback -----------------------------------------------------------------------------------------


def _qkv(q_len=5, k_len=9):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 4, q_len, 16, generator=g), torch.randn(1, 2, k_len, 16, generator=g),
            torch.randn(1, 2, k_len, 16, generator=g))


def test_cpu_kernel_error_propagates(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", broken)
    with caplog.at_level(logging.WARNING, logger=sdpa.__name__), pytest.raises(RuntimeError, match="exploded"):
        sdpa.attention_with_lse(*_qkv(), scale=0.25)
    assert not caplog.records


def test_cuda_kernel_error_propagates(monkeypatch):
    """When the efficient kernel is deemed applicable, its RuntimeError reaches the caller (no matmul retry)."""
    def broken(*args, **kwargs):
        raise RuntimeError("efficient kernel exploded")

    monkeypatch.setattr(sdpa, "_efficient_unsupported", lambda *args: None)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", broken)
    monkeypatch.setattr(sdpa, "_math_attention", lambda *a, **k: pytest.fail("silent fallback to the matmul path"))
    with pytest.raises(RuntimeError, match="exploded"):
        sdpa._cuda_attention(*_qkv(), 0.25, None, False)


def test_unsupported_kernel_warns_once_and_is_correct(monkeypatch, caplog):
    """Where the efficient kernel does not apply (here: CPU tensors, as PyTorch's own check says), the matmul path is
    taken deliberately, announced by exactly one WARNING however many calls follow."""
    monkeypatch.setattr(sdpa, "_warned", set())
    q, k, v = _qkv()
    with caplog.at_level(logging.WARNING, logger=sdpa.__name__):
        for _ in range(3):
            out, lse = sdpa._cuda_attention(q, k, v, 0.25, None, False)
        sdpa._cuda_attention(*_qkv(q_len=2, k_len=7), 0.25, None, False)  # another shape, same reason
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "matmul path" in warnings[0].getMessage()
    ref_out, ref_lse = sdpa.reference_attention(q, k, v, scale=0.25)
    assert (out.double() - ref_out).abs().max() < 1e-5 and (lse.double() - ref_lse).abs().max() < 1e-5


def test_mask_on_another_device_is_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="mask is on meta"):
        sdpa.attention_with_lse(q, k, v, scale=0.25, mask=torch.zeros(1, 1, 5, 9, device="meta"))


# --- the device check itself, on the CPU, so that it cannot rot -------------------------------------------------


def test_gpu_check_passes_on_cpu():
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), "--cpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    failed = [line for line in lines if not line.startswith("PASS")]
    assert proc.returncode == 0 and not failed, proc.stdout + proc.stderr[-3000:]
    names = {line.split()[1] for line in lines}
    assert {"cpu/metadata_on_device", "cpu/sdpa_bf16", "cpu/cp_bf16_pcp4_ring_mixed", "cpu/engine_fp32",
            "cpu/engine_bf16", "cpu/no_matmul_fallback"} <= names, names


# --- control traffic of data parallelism on gloo ----------------------------------------------------------------


def test_dp_control_group_is_gloo_under_nccl(monkeypatch):
    """With NCCL as the default backend, the DP front's object collectives get their own gloo group."""
    import inspect
    import re
    import types

    from cpllm.config.engine import ParallelConfig
    from cpllm.distributed import groups as groups_module
    from cpllm.engine import data_parallel

    @dataclasses.dataclass
    class FakeGroup:
        members: list
        backend: str

    world = FakeGroup(list(range(4)), "nccl")
    fake_dist = types.SimpleNamespace(
        is_initialized=lambda: True, get_world_size=lambda group=None: 4, get_rank=lambda group=None: 1,
        get_backend=lambda group=None: "nccl", group=types.SimpleNamespace(WORLD=world), ProcessGroup=object,
        new_group=lambda members, timeout=None, backend=None: FakeGroup(list(members), backend),
    )
    monkeypatch.setattr(groups_module, "dist", fake_dist)
    groups = groups_module.ParallelGroups.build(
        ParallelConfig(data_parallel_size=2, prefill_context_parallel_size=2), timeout_s=5)
    assert groups.dp_group == FakeGroup([1, 3], "nccl")
    assert groups.dp_cpu_group == FakeGroup([1, 3], "gloo")
    assert groups_module.ParallelGroups.single().dp_cpu_group is None
    # data_parallel.py sends every object over dp_cpu_group, never over dp_group
    assert not re.search(r"\bdp_group\b", inspect.getsource(data_parallel))
    assert "dp_cpu_group" in inspect.getsource(data_parallel)
