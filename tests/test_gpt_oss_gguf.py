"""GPT-OSS from a llama.cpp `gpt-oss` GGUF file (cpllm/model/loaders/gguf_gpt_oss.py) against transformers.

The tiny model (tests/tiny_gpt_oss.py, windows of 8 on the sliding layer) is written as llama.cpp's converter
writes a released checkpoint: the MXFP4 expert blocks repacked (gate and up split out of gate_up's interleaved rows,
the scale byte first, llama.cpp's nibble order), the embedding F16, the other dense tensors F32, the sinks as
`attn_sinks.weight`, YaRN and the window in the metadata. The tiny model's lowered SwiGLU limit travels in
`swiglu_clamp_exp` (llama.cpp itself hard-codes the released 7.0, which a file without the key gets).
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cpllm import LLM
from cpllm.model.loaders.gguf_gpt_oss import hf_mxfp4_blocks
from cpllm.model.loaders.gguf_source import GGUFSource
from cpllm.model.formats.mxfp4 import dequantize_mxfp4
from cpllm.model.loaders.safetensors_source import read_hf_config
from parallel_helpers import (
    MODEL_SEED,
    assert_same_greedy,
    generate_counted,
    greedy_params,
    max_abs_diff,
    prompt_logprob_values,
    workload_prompts,
)
from test_gpt_oss_vs_hf import COMMON, MAX_TOKENS, MODEL, check_against_transformers
from tiny_gpt_oss import load_dequantized_reference, make_tiny_gpt_oss, save_mxfp4_folder
from tiny_models import _add_metadata, tiny_vocab

QType = gguf.GGMLQuantizationType
EMBEDDING = "model.embed_tokens.weight"
_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
          "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
          "mlp.router.bias": "ffn_gate_inp.bias"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF blocks [..., G, 16] (byte j: elements 2j, 2j + 1) and scales [..., G] -> llama.cpp's MXFP4 rows
    [..., G * 17]: per block the scale byte, then byte j holding elements j (low nibble) and j + 16 (high)."""
    codes = np.stack((blocks & 0x0F, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)  # element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    rows = np.concatenate((scales[..., None], packed), axis=-1).astype(np.uint8)
    return rows.reshape(*rows.shape[:-2], -1)


def _gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    short = module.split(".")[-1]
    return f"blk.{layer}.{_LAYER[rest] if rest in _LAYER else f'{_ATTN[short]}.{kind}'}"


def _experts(writer: gguf.GGUFWriter, layer: str, state: dict[str, torch.Tensor]) -> None:
    """One layer's experts as llama.cpp stores them: gate / up split from gate_up's interleaved rows."""
    prefix = f"model.layers.{layer}.mlp.experts"
    bias = state[f"{prefix}.gate_up_proj_bias"].numpy()
    for part, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
        writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.bias", np.ascontiguousarray(bias[:, rows]))
        if f"{prefix}.gate_up_proj_blocks" in state:
            blocks, scales = (state[f"{prefix}.gate_up_proj_{k}"].numpy()[:, rows] for k in ("blocks", "scales"))
            writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", gguf_mxfp4_rows(blocks, scales),
                              raw_dtype=QType.MXFP4)
        else:  # float experts: [E, in, 2I] -> [E, I, in]
            weight = state[f"{prefix}.gate_up_proj"].transpose(1, 2).numpy()[:, rows]
            writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", np.ascontiguousarray(weight))
    writer.add_tensor(f"blk.{layer}.ffn_down_exps.bias", state[f"{prefix}.down_proj_bias"].numpy())
    if f"{prefix}.down_proj_blocks" in state:
        rows = gguf_mxfp4_rows(state[f"{prefix}.down_proj_blocks"].numpy(), state[f"{prefix}.down_proj_scales"].numpy())
        writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", rows, raw_dtype=QType.MXFP4)
    else:
        weight = state[f"{prefix}.down_proj"].transpose(1, 2)  # [E, I, hidden] -> [E, hidden, I]
        writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", weight.contiguous().numpy())


def write_gpt_oss_gguf(path: str, config, state: dict[str, torch.Tensor], *, skip: tuple[str, ...] = (),
                       rope_type: gguf.RopeScalingType | None = None,
                       swiglu_limits: tuple[float, ...] | None = (), expert_count: int | None = None) -> None:
    """`state` (HF names; experts as MXFP4 blocks or floats) as llama.cpp's converter writes a gpt-oss file.
    `skip`: GGUF tensor names left out; `rope_type`: a scaling type written over YaRN (broken files);
    `swiglu_limits`: the swiglu_clamp_exp values (empty: the config's limit for every layer; None: no key);
    `expert_count`: a count written instead of the config's."""
    writer = gguf.GGUFWriter(path, "gpt-oss")
    _add_metadata(writer, config, tiny_vocab())  # shapes, eps, rope base and YaRN, the tokenizer
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    writer.add_expert_count(expert_count or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    if swiglu_limits is not None:
        writer.add_swiglu_clamp_exp(list(swiglu_limits) or [float(config.swiglu_limit)] * config.num_hidden_layers)
    if rope_type is not None:
        writer.add_rope_scaling_type(rope_type)  # a second value for the key: the last one written wins
    for name, tensor in state.items():
        if ".mlp.experts." in name:
            if name.endswith("gate_up_proj_bias"):
                _experts(writer, name.split(".")[2], state)
            continue
        gname = _gguf_name(name)
        if gname in skip:
            continue
        values = tensor.float().numpy()
        writer.add_tensor(gname, values.astype(np.float16) if gname == "token_embd.weight" else values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[str, str, torch.nn.Module]:
    """(the MXFP4 HF folder, the same model as a GGUF file, transformers on the weights the file holds)."""
    folder = str(tmp_path_factory.mktemp("mxfp4"))
    dequantized = save_mxfp4_folder(folder, seed=MODEL_SEED, **MODEL)
    # the file's embedding is F16: the folder and the reference get the same rounded values
    state = load_file(f"{folder}/model.safetensors")
    embedding = state[EMBEDDING] = state[EMBEDDING].half().float()
    save_file(state, f"{folder}/model.safetensors", metadata={"format": "pt"})
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-gpt-oss.gguf")
    write_gpt_oss_gguf(path, make_tiny_gpt_oss(seed=MODEL_SEED, **MODEL).config, state)
    hf = load_dequantized_reference({**dequantized, EMBEDDING: embedding}, seed=MODEL_SEED, **MODEL)
    return folder, path, hf


def test_mxfp4_block_dequantizes_to_hand_computed_values():
    """One GGUF block: scale byte 129 (x 2^2), byte 0 = 0x21 (element 0: code 1 = 0.5, element 16: code 2 = 1),
    byte 1 = 0xF7 (element 1: code 7 = 6, element 17: code 15 = -6), byte 2 = 0x9A (element 2: code 10 = -1,
    element 18: code 9 = -0.5): 2, 24, -4 at 0..2, 4, -24, -2 at 16..18, zeros elsewhere."""
    raw = np.zeros((1, 17), dtype=np.uint8)
    raw[0, :4] = (129, 0x21, 0xF7, 0x9A)
    want = np.zeros(32, dtype=np.float32)
    want[[0, 1, 2, 16, 17, 18]] = (2, 24, -4, 4, -24, -2)
    blocks, scales = hf_mxfp4_blocks(raw)
    assert blocks.shape == (1, 1, 16) and scales.tolist() == [[129]]
    assert dequantize_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales)).flatten().tolist() == want.tolist()
    assert gguf.quants.dequantize(raw, QType.MXFP4).flatten().tolist() == want.tolist()  # llama.cpp's reading too


def test_test_encoder_agrees_with_the_gguf_package(files):
    """The test's repacking of the checkpoint's blocks reads back, through gguf's own MXFP4 dequantizer, as the
    weights the HF blocks encode; and cpllm's reading gives the checkpoint's blocks byte for byte."""
    folder, path, _ = files
    state = load_file(f"{folder}/model.safetensors")
    prefix = "model.layers.0.mlp.experts"
    blocks, scales = state[f"{prefix}.down_proj_blocks"], state[f"{prefix}.down_proj_scales"]
    rows = gguf_mxfp4_rows(blocks.numpy(), scales.numpy())
    assert np.array_equal(gguf.quants.dequantize(rows, QType.MXFP4), dequantize_mxfp4(blocks, scales).numpy())
    source = GGUFSource(path)
    for name in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_scales", "gate_up_proj_bias"):
        full = f"model.layers.1.mlp.experts.{name}"
        assert torch.equal(source.get(full, dtype=state[full].dtype), state[full]), name
        assert torch.equal(source.get(full, dim=0, start=3, end=5, dtype=state[full].dtype), state[full][3:5]), name
    assert source.storage_type("model.layers.0.mlp.experts.down_proj_blocks") == "MXFP4"


def test_config_read_from_the_file(files):
    folder, path, _ = files
    got, want = GGUFSource(path).config, read_hf_config(folder)
    fields = ("architecture", "num_hidden_layers", "num_key_value_heads", "head_dim", "layer_types", "sliding_window",
              "attention_sinks", "attention_bias", "rope_theta", "moe", "tie_word_embeddings")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # stored as float32
    assert got.layer_types == ("sliding_attention", "full_attention")  # llama.cpp's gpt-oss rule: even layers slide
    keys = ("rope_type", "factor", "original_max_position_embeddings", "truncate")
    assert {k: got.rope_scaling.get(k) for k in keys} == {k: want.rope_scaling.get(k) for k in keys}


def _run(path: str, quantization: str, **options) -> dict:
    prompts = {name: p for name, p in workload_prompts(1).items() if name in ("len13", "len37")}
    with LLM(path, **{**COMMON, "quantization": quantization, **options}) as llm:
        return generate_counted(llm, prompts, greedy_params(MAX_TOKENS, prompt_logprobs=True), quantization)


@pytest.fixture(scope="module")
def single_rank(files) -> dict:
    return _run(files[1], "none")


@pytest.mark.timeout(300)
def test_gguf_matches_transformers_on_the_weights_it_holds(files, single_rank):
    """Greedy tokens identical, prompt and sampled-token logprobs within 1e-4 (prompts of 13 and 37 tokens
    over windows of 8, chunked prefill)."""
    check_against_transformers(single_rank, files[2], names=("len13", "len37"))


@pytest.mark.timeout(300)
def test_gguf_under_tp2_matches_single_rank(files, single_rank):
    """TP = 2 reads its shard from the file: half the heads with their sinks and biases, half of every expert's
    intermediate rows (the interleaved gate / up columns rebuilt from the split stacks, their biases)."""
    got = _run(files[1], "none", tensor_parallel_size=2)
    for name, output in got.items():
        assert_same_greedy(output, single_rank[name], what=f"gguf tp2 {name}", prompt_logprobs=True)


@pytest.mark.timeout(300)
def test_gguf_mxfp4_experts_under_auto_run_as_the_folder_does(files, caplog):
    """quantization=auto runs the file's MXFP4 experts as their exact 8-bit form, as for the HF folder: the same
    blocks, so the same numbers as the folder's run."""
    folder, path, _ = files
    with caplog.at_level(logging.INFO, logger="cpllm.model.families.llama"):
        got = _run(path, "auto")
    assert "mlp.experts.gate_up_proj: int8 (stored MXFP4, run as its exact 8-bit form) x2" in caplog.text
    want = _run(folder, "auto")
    for name, output in got.items():
        assert output.outputs[0].token_ids == want[name].outputs[0].token_ids, name
        assert max_abs_diff(prompt_logprob_values(output), prompt_logprob_values(want[name])) <= 1e-5, name


def test_float_experts_and_llama_cpp_defaults(tmp_path):
    """Experts stored as floats (a checkpoint converted from float weights) read back as HF's tensors; a file
    without swiglu_clamp_exp gets llama.cpp's limit of 7.0."""
    model = make_tiny_gpt_oss(seed=MODEL_SEED, **MODEL)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    path = str(tmp_path / "float.gguf")
    write_gpt_oss_gguf(path, model.config, state, swiglu_limits=None)
    source = GGUFSource(path)
    assert source.config.moe.swiglu_limit == 7.0
    prefix = "model.layers.0.mlp.experts"
    assert not source.has(f"{prefix}.gate_up_proj_blocks")
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        assert torch.equal(source.get(f"{prefix}.{name}"), state[f"{prefix}.{name}"]), name
    got = source.get(f"{prefix}.gate_up_proj", dim=0, start=2, end=3)  # one expert, as the model reads them
    assert torch.equal(got, state[f"{prefix}.gate_up_proj"][2:3])
    assert torch.equal(source.get("model.layers.1.self_attn.sinks"), state["model.layers.1.self_attn.sinks"])


@pytest.mark.parametrize("broken, message", [
    (dict(skip=("blk.1.attn_sinks.weight",)), "lacks blk.1.attn_sinks.weight"),
    (dict(skip=("blk.0.ffn_gate_inp.bias",)), "lacks blk.0.ffn_gate_inp.bias"),
    (dict(rope_type=gguf.RopeScalingType.LONGROPE), "rope scaling type 'longrope' is not supported"),
    (dict(swiglu_limits=(1.5, 7.0)), r"swiglu_clamp_exp=\[1.5, 7.0\]"),
    (dict(expert_count=4), r"blk.0.ffn_gate_exps.weight has shape \(8, 32, 64\); .*expert_count=4"),
])
def test_inconsistent_file_refused_with_the_value(broken, message, tmp_path):
    model = make_tiny_gpt_oss(seed=MODEL_SEED, **MODEL)
    path = str(tmp_path / "broken.gguf")
    write_gpt_oss_gguf(path, model.config, {k: v.detach() for k, v in model.state_dict().items()}, **broken)
    with pytest.raises(ValueError, match=message):
        GGUFSource(path)
