"""The linear methods (cpllm/model/formats/): each weight format multiplies as the plain float weight it
holds, answers the fused layer's and the MLP split's questions itself, and the layers pick them from the plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType as QType

import tiny_models as tm  # tests/ is on sys.path under pytest
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.kernels import int4_matmul
from cpllm.model.formats import packed_weights
from cpllm.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, RowRange, VocabParallelEmbedding
from cpllm.model.formats.experts import FloatExperts, OneDNNExperts
from cpllm.model.formats.methods import (ConcatenatedWeights, FloatHead, FloatWeight, GroupedWeight, OneDNNWeight,
                                        RefinedInt8Rows, StoredInt8Rows)
from cpllm.model.families.llama import LlamaForCausalLM
from cpllm.model.loaders.loader import open_weights
from cpllm.model.formats.groups import quantize_int4, quantize_int8
from cpllm.model.formats.group_kernels import Int4Linear
from cpllm.model.formats.report import weight_bytes


class GroupedSource:
    """An in-memory WeightSource: float tensors, some "stored" as Q4_0 / Q8_0 (their groups quantized here, and
    `get` returning the values those groups hold, as a GGUF file's dequantized read does)."""

    def __init__(self, tensors: dict[str, torch.Tensor], stored: dict[str, str]):
        self.tensors, self.stored = tensors, stored

    def storage_type(self, name: str) -> str:
        return self.stored.get(name, "F32")

    def _slice(self, name: str, dim, start, end) -> torch.Tensor:
        t = self.tensors[name]
        return t if dim is None else t.narrow(dim, start, (t.shape[dim] if end is None else end) - start)

    def get(self, name, *, dim=None, start=0, end=None, dtype=torch.float32) -> torch.Tensor:
        t = self._slice(name, dim, start, end)
        if self.storage_type(name) == "Q8_0":
            t = quantize_int8(t).dequantize()
        elif self.storage_type(name) == "Q4_0":
            t = quantize_int4(t).dequantize()
        return t.to(dtype).contiguous()

    def get_int4_groups(self, name, *, dim=None, start=0, end=None):
        return quantize_int4(self._slice(name, dim, start, end))

    def get_int8_groups(self, name, *, dim=None, start=0, end=None):
        return quantize_int8(self._slice(name, dim, start, end))


def weights(*names: str, rows: int = 48, cols: int = 64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(rows, cols, generator=gen) for n in names}


def column(source, names: list[str], quantization: str, bias: bool = False) -> ColumnParallelLinear:
    rows = source.tensors[f"{names[0]}.weight"].shape[0]
    linear = ColumnParallelLinear(64, [RowRange(name=n, start=0, end=rows) for n in names], bias, torch.float32,
                                  quantization)
    linear.load(source)
    return linear


def test_plain_float_is_the_only_method_under_none():
    source = GroupedSource(weights("a.weight", "b.weight"), {"a.weight": "Q4_0", "b.weight": "Q8_0"})
    linear = column(source, ["a", "b"], "none")
    assert isinstance(linear.method, FloatWeight)
    x = torch.randn(3, 64)
    reference = torch.cat([source.get("a.weight"), source.get("b.weight")]).t()
    torch.testing.assert_close(linear(x), x @ reference)
    assert linear.fused_spec().kind == "float32" and linear.fused_spec().tensor is linear.method.weight
    assert linear.describe() == "float32 [64, 96]"


def test_one_format_is_one_kernel_and_mixed_formats_concatenate():
    source = GroupedSource(weights("a.weight", "b.weight", "c.weight"),
                           {"a.weight": "Q4_0", "b.weight": "Q4_0", "c.weight": "Q6_K"})
    one = column(source, ["a", "b"], "auto")
    assert isinstance(one.method, GroupedWeight) and one.method.weight_format == "int4"
    mixed = column(source, ["a", "c"], "auto")
    assert isinstance(mixed.method, ConcatenatedWeights)
    assert [type(run) for run in mixed.method.runs] == [GroupedWeight, FloatWeight]
    x = torch.randn(2, 64)
    y = mixed(x)
    assert torch.equal(y[:, :48], Int4Linear(quantize_int4(source.tensors["a.weight"]))(x))  # the kernel alone
    torch.testing.assert_close(y[:, 48:], x @ source.get("c.weight").t())  # Q6_K: dequantized
    assert mixed.fused_spec() is None and " | " in mixed.describe()
    assert mixed.method.columns(0, 8) is None  # no plain weight to view


def test_grouped_fused_spec_is_the_vnni_4bit_layout_only():
    source = GroupedSource({**weights("a.weight", "b.weight"), "a.bias": torch.randn(48)},
                           {"a.weight": "Q4_0", "b.weight": "Q8_0"})
    int4, int8 = column(source, ["a"], "auto"), column(source, ["b"], "auto")
    assert int8.method.weight_format == "int8" and int8.fused_spec() is None  # fed twice: not the C layer's form
    if int4_matmul.available():
        spec = int4.fused_spec()
        assert spec.kind == "int4" and spec.tensor is int4.method.kernel.packed
    else:
        assert int4.fused_spec() is None  # aten's kernel: no layout the C layer reads
    with_bias = column(source, ["a"], "auto", bias=True)
    assert with_bias.fused_spec() is None  # the fused layer adds no bias, in any format
    assert with_bias.describe().endswith(" + bias")


def test_row_shard_and_bias():
    source = GroupedSource({"o.weight": torch.randn(48, 128), "q.weight": torch.randn(32, 64),
                            "q.bias": torch.randn(32)}, {"o.weight": "Q4_0"})
    row = RowParallelLinear("o", 128, 48, ParallelContext.at(ParallelDims(tp=2), tp_rank=1), torch.float32, "auto")
    row.load(source)
    x = torch.randn(2, 64)
    assert torch.equal(row(x), Int4Linear(quantize_int4(source.tensors["o.weight"][:, 64:]))(x))
    plain = RowParallelLinear("o", 128, 48, ParallelContext.at(ParallelDims(tp=2), tp_rank=1), torch.float32, "none")
    plain.load(source)
    assert torch.equal(plain.method.weight, source.get("o.weight", dim=1, start=64, end=128).t())
    biased = column(source, ["q"], "none", bias=True)
    torch.testing.assert_close(biased(x), x @ source.tensors["q.weight"].t() + source.tensors["q.bias"])


def test_columns_are_views_and_prepacking_keeps_the_product():
    source = GroupedSource(weights("a.weight"), {})
    linear = column(source, ["a"], "none")
    view = linear.method.columns(8, 24)
    assert view.data_ptr() == linear.method.weight[:, 8].data_ptr() and view.shape == (64, 16)
    x = torch.randn(5, 64)
    before = linear(x)
    linear.prepack()
    if packed_weights.packs(torch.float32, torch.device("cpu")):
        assert isinstance(linear.method, OneDNNWeight) and linear.fused_spec() is None
        assert torch.equal(packed_weights.unpack(linear.method.packed), source.get("a.weight"))
    torch.testing.assert_close(linear(x), before)
    grouped = GroupedWeight(Int4Linear(quantize_int4(source.tensors["a.weight"])))
    assert grouped.prepacked() is grouped  # a kernel's layout is already its own


@pytest.mark.parametrize("stored", ["F32", "Q8_0"])
def test_head_split_gives_the_columns_of_the_whole(stored):
    """A PCP rank's columns of the head equal those columns of the whole shard's logits; int8 refines as whole."""
    source = GroupedSource({"lm_head.weight": torch.randn(80, 64)}, {"lm_head.weight": stored})
    whole = ParallelLMHead(None, "lm_head.weight", 80, 64, ParallelContext(), torch.float32, "auto")
    whole.load(source)
    assert isinstance(whole.method, RefinedInt8Rows if stored == "Q8_0" else FloatHead)
    hidden = torch.randn(3, 64)
    logits = whole.method.logits(hidden)
    split = ParallelLMHead(None, "lm_head.weight", 80, 64, ParallelContext(), torch.float32, "auto")
    split.load(source)
    split.method.split(source, "lm_head.weight", 0, 32, 72)
    part = split.method.part_logits(hidden).float()
    kernel_logits = logits if stored == "F32" else whole.method.head.kernel(hidden).float()
    torch.testing.assert_close(part, kernel_logits[:, 32:72], rtol=1e-6, atol=1e-6)
    assert torch.equal(split.method.refine(hidden, kernel_logits.clone()), logits)


def test_tied_int8_head_shares_the_embedding_rows_and_bytes_count_once():
    source = GroupedSource({"embed.weight": torch.randn(80, 64)}, {"embed.weight": "Q8_0"})
    embedding = VocabParallelEmbedding("embed.weight", 80, 64, ParallelContext(), torch.float32, "auto")
    embedding.load(source)
    assert isinstance(embedding.rows, StoredInt8Rows)
    ids = torch.tensor([3, 79])
    torch.testing.assert_close(embedding(ids), source.get("embed.weight")[ids])
    head = ParallelLMHead(embedding, "lm_head.weight", 80, 64, ParallelContext(), torch.float32, "auto")
    head.load(source)
    assert head.method.head.rows is embedding.rows.int8_rows()
    held = [*embedding.rows.rows.buffers(), *head.method.head.kernel.buffers()]  # one copy of the rows
    assert weight_bytes(torch.nn.ModuleList([embedding, head])) == {
        "int8": sum(t.numel() * t.element_size() for t in held)}


def test_a_biased_4bit_projection_stays_out_of_the_fused_layer(tmp_path):
    """The fused decode layer adds no bias: Qwen2's biased q|k|v in the int4 kernel keeps its layers eager."""
    path = str(tmp_path / "tiny.gguf")
    tm.save_tiny_gguf(path, "qwen2", seed=8, tie_word_embeddings=True,
                      tensor_types=lambda n: QType.Q4_0 if "proj.weight" in n else QType.F32)
    source = open_weights(path)
    model = LlamaForCausalLM(dataclasses.replace(source.config, quantization="auto"), ParallelContext(),
                             torch.float32, 64)
    model.load_weights(source)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, GroupedWeight) and qkv.bias is not None and qkv.fused_spec() is None
    assert model.fused_decode is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_onednn_support_weights_stay_plain_with_the_plain_product(monkeypatch, dtype):
    """A CPU oneDNN cannot pack this dtype for (bf16 on an AVX2-only CPU: its reorder raises) keeps the plain
    weights, whose products are the unpacked ones bit for bit; where this CPU packs, they match the packed ones."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=gen).to(dtype)  # [in, out]
    experts = FloatExperts(2, 64, 24, dtype)
    experts.gate_up.copy_(torch.randn(2, 64, 48, generator=gen))
    experts.down.copy_(torch.randn(2, 24, 64, generator=gen))
    x = torch.randn(5, 64, generator=gen).to(dtype)
    packed_linear, packed_experts = FloatWeight(weight.clone()).prepacked(), experts.prepacked()
    if packed_weights.packs(dtype, torch.device("cpu")):
        assert isinstance(packed_linear, OneDNNWeight) and isinstance(packed_experts, OneDNNExperts)

    monkeypatch.setattr(packed_weights, "_cpu_packs", lambda dtype: False)
    plain_linear = FloatWeight(weight.clone())
    assert plain_linear.prepacked() is plain_linear and experts.prepacked() is experts
    assert torch.equal(plain_linear.matmul(x), x @ weight)
    assert torch.equal(experts.matmul(1, x, 0), x @ experts.gate_up[1])
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(plain_linear.matmul(x), packed_linear.matmul(x), **tolerance)
    torch.testing.assert_close(experts.matmul(1, x, 0), packed_experts.matmul(1, x, 0), **tolerance)
