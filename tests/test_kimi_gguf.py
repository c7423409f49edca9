"""Kimi Linear from llama.cpp's `kimi-linear` GGUF files (cpllm/model/loaders/gguf_kimi.py) against transformers on
the HF weights they were written from.

The tiny model (tests/tiny_kimi.py) is saved as an HF folder and written the way llama.cpp's converter
(conversion/kimi_linear.py) writes it, in float32 so the comparison is exact: names through the `gguf` package's own
tensor map for the architecture (the converter's map_tensor_name), after its renames (dt_bias -> dt_proj.bias,
e_score_correction_bias -> e_score_correction.bias) and on the original checkpoint's names (a dense layer's `mlp.*`);
A_log as -exp(A_log), the convolutions reshaped to [1, C, 1, K], kv_b_proj split per head into k_b (transposed) and
v_b, experts stacked per projection; the metadata as its set_gguf_parameters writes it from the original
config.json (head_count_kv per layer: 0 on the KDA layers; kda.head_dim, ssm.conv_kernel; MLA's widths; the MoE's
keys, sigmoid gating). That config spells the expert groups `num_expert_group`, which the converter does not read
(it looks for `n_group`): a file carries no expert_group_count, and is ungrouped, as the released model is
(num_expert_group 1); the main case is built so. A second case writes the groups (a config spelling n_group) and
kv_b_proj whole, as llama.cpp's loader still accepts. Greedy tokens identical, prompt and sampled-token logprobs
within 1e-4; the main case also under TP = 2; Q8_0 projections and experts read as their blocks; malformed files
refused with the tensor or key named.
"""

from __future__ import annotations

import json
import os
import random

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cpllm import LLM, SamplingParams
from cpllm.model.loaders.gguf_source import GGUFSource
from cpllm.model.loaders.safetensors_source import SafetensorsSource, read_hf_config
from reference import check_against_hf
from tiny_kimi import hf_greedy_cached, make_tiny_kimi, save_tiny_kimi
from tiny_models import add_tiny_tokenizer

ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.KIMI_LINEAR]
MAX_TOKENS = 6
PROMPT_LENGTHS = (1, 9, 40)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
COMMON = dict(max_model_len=128, block_size=4, quantization="none")
CASES = {
    "ungrouped": (dict(n_group=1), dict()),
    "grouped-kv_b-whole": (dict(), dict(write_groups=True, split_kv_b=False)),
}
"""Case -> (model overrides, writer options)."""


def _original_config(folder: str) -> dict:
    """config.json as Moonshot's checkpoints spell it (what the converter reads): linear_attn_config with 1-indexed
    layers, first_k_dense_replace, the router's activation."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    types = cfg.pop("layer_types")
    cfg["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, kind in enumerate(types) if kind == "linear_attention"],
        "full_attn_layers": [i + 1 for i, kind in enumerate(types) if kind == "full_attention"],
        "head_dim": cfg.pop("linear_head_dim"), "num_heads": cfg.pop("linear_num_heads"),
        "short_conv_kernel_size": cfg.pop("linear_conv_kernel_dim")}
    cfg["first_k_dense_replace"] = cfg.pop("mlp_layer_types").count("dense")
    cfg["moe_router_activation_func"] = "sigmoid"
    return cfg


def _metadata(writer: gguf.GGUFWriter, hp: dict, write_groups: bool, head_count_kv) -> None:
    """The keys TextModel.set_gguf_parameters and KimiLinearModel.set_gguf_parameters write from `hp`."""
    linear, layers = hp["linear_attn_config"], hp["num_hidden_layers"]
    rope, rank = hp["qk_rope_head_dim"], hp["kv_lora_rank"]
    per_layer = [1 if i + 1 in linear["full_attn_layers"] else 0 for i in range(layers)]  # MLA as MQA: one KV head
    writer.add_block_count(layers)
    writer.add_context_length(hp["model_max_length"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(per_layer if head_count_kv is None else head_count_kv)
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_expert_count(hp["num_experts"])
    writer.add_expert_used_count(hp["num_experts_per_token"])
    if write_groups:  # only a config spelling `n_group` gives the converter this key
        writer.add_expert_group_count(hp["num_expert_group"])
    writer.add_expert_group_used_count(hp["topk_group"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_value_length(hp["head_dim"])
    writer.add_vocab_size(hp["vocab_size"])
    writer.add_ssm_conv_kernel(linear["short_conv_kernel_size"])
    writer.add_kda_head_dim(linear["head_dim"])
    if hp.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(hp["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    writer.add_rope_dimension_count(rope)
    writer.add_key_length(rank + rope)
    writer.add_key_length_mla(hp["qk_nope_head_dim"] + rope)
    writer.add_value_length_mla(hp["v_head_dim"])
    writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    writer.add_expert_shared_count(hp["num_shared_experts"])
    writer.add_leading_dense_block_count(hp["first_k_dense_replace"])
    writer.add_expert_weights_scale(hp["routed_scaling_factor"])


def _converted(name: str, t: torch.Tensor, hp: dict, split_kv_b: bool) -> list[tuple[str, torch.Tensor]]:
    """One checkpoint tensor as KimiLinearModel.modify_tensors hands it on: [(HF-side name, tensor)]."""
    if name.endswith((".q_conv1d.weight", ".k_conv1d.weight", ".v_conv1d.weight")):
        t = t.reshape(1, t.shape[0], 1, t.shape[-1])
    name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    if name.endswith(".dt_bias"):
        name = name.replace(".dt_bias", ".dt_proj.bias")
    if name.endswith("kv_b_proj.weight") and split_kv_b:
        heads, nope, v = hp["num_key_value_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"]
        k_b, v_b = t.view(heads, nope + v, t.shape[-1]).split([nope, v], dim=1)
        return [(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)),
                (name.replace("kv_b_proj", "v_b_proj"), v_b)]
    return [(name, t)]


def write_kimi_gguf(path: str, folder: str, *, write_groups: bool = False, split_kv_b: bool = True,
                    skip: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None,
                    replace: dict[str, np.ndarray] | None = None, head_count_kv=None,
                    quantize_as: dict[str, gguf.GGMLQuantizationType] | None = None) -> None:
    """The folder's weights as llama.cpp's converter writes them (see the module); `quantize_as`: GGUF tensor name
    (after `blk.N.`) -> a block type to store it in. Broken files for the refusals: `skip` GGUF tensors left out,
    `extra` added, `replace` stored instead, `head_count_kv` another value."""
    hp = _original_config(folder)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.KIMI_LINEAR, hp["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, ARCH)
    _metadata(writer, hp, write_groups, head_count_kv)
    add_tiny_tokenizer(writer)
    dense = hp["first_k_dense_replace"]
    tensors: list[tuple[str, torch.Tensor]] = []
    stacks: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in load_file(os.path.join(folder, "model.safetensors")).items():
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) < dense:  # the original checkpoint's dense `mlp`
            name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".experts." in name:  # block_sparse_moe.experts.E.wK.weight: stacked per projection
            stacks.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = t.float()
            continue
        tensors += _converted(name, t.float(), hp, split_kv_b)
    out = [(names.get_name(n, try_suffixes=(".weight", ".bias")), t) for n, t in tensors]
    for (layer, w), experts in sorted(stacks.items()):
        kind = {"w1": "gate", "w2": "down", "w3": "up"}[w]
        out.append((f"blk.{layer}.ffn_{kind}_exps.weight", torch.stack([experts[e] for e in sorted(experts)])))
    for gname, t in out:
        assert gname is not None
        qtype = (quantize_as or {}).get(gname.split(".", 2)[-1])
        if gname in skip:
            continue
        if qtype is not None:
            writer.add_tensor(gname, gguf.quants.quantize(t.numpy(), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, (replace or {}).get(gname, np.ascontiguousarray(t.numpy())))
    for gname, data in (extra or {}).items():
        writer.add_tensor(gname, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _build(name: str, tmp_path_factory) -> tuple:
    """(the HF folder, the GGUF file, prompts, transformers' results on the folder's weights)."""
    overrides, options = CASES[name]
    folder = save_tiny_kimi(str(tmp_path_factory.mktemp(name)), seed=1, **overrides)
    path = str(tmp_path_factory.mktemp("gguf") / f"{name}.gguf")
    write_kimi_gguf(path, folder, **options)
    hf = make_tiny_kimi(seed=1, **overrides)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    return folder, path, prompts, [hf_greedy_cached(hf, p, MAX_TOKENS) for p in prompts]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def test_config_read_from_the_file(case):
    """The metadata gives the folder's config: the layer pattern, the KDA and MLA shapes, the MoE and its router."""
    folder, path, _, _ = case
    got, want = GGUFSource(path).config, read_hf_config(folder)
    fields = ("architecture", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "kimi_delta", "mla", "moe", "tie_word_embeddings",
              "max_position_embeddings")
    # rms_norm_eps and routed_scaling_factor are stored as float32: read back as their decimal values
    fields += ("rms_norm_eps",)
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}


def test_tensors_read_back_as_the_checkpoint(case):
    """Every tensor of the folder, read from the file, is the folder's (A_log to float32 rounding): the dense layer's
    under `mlp`, kv_b_proj from k_b / v_b as MLAAttention joins them; a TP shard's rows of a convolution."""
    folder, path, _, _ = case
    source, hf = GGUFSource(path), SafetensorsSource(folder)
    for name in hf.names():
        want = hf.get(name)
        if name.endswith("kv_b_proj.weight") and not source.has(name):
            k_b, v_b = source.get(name.replace("kv_b_proj", "k_b_proj")), source.get(name.replace("kv_b_proj",
                                                                                                  "v_b_proj"))
            got = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(want.shape)
        else:
            got = source.get(name.replace("layers.0.block_sparse_moe.", "layers.0.mlp."))
        assert got.shape == want.shape, name
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), name
    conv = "model.layers.1.self_attn.v_conv1d.weight"
    assert torch.equal(source.get(conv, dim=0, start=32, end=64), hf.get(conv, dim=0, start=32, end=64))


def test_gguf_matches_transformers(case):
    _, path, prompts, refs = case
    with LLM(path, **COMMON) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        check_against_hf(output, *ref)


@pytest.mark.timeout(300)
def test_gguf_under_tp2_matches_transformers(tmp_path_factory):
    """TP = 2: each rank reads its KDA heads' rows (projections, the reshaped convolutions, dt_bias, A_log) and its
    MLA heads of the split k_b / v_b."""
    _, path, prompts, refs = _build("ungrouped", tmp_path_factory)
    with LLM(path, **COMMON, tensor_parallel_size=2, threads_per_rank=1, distributed_timeout=60) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for output, ref in zip(outputs, refs):
        check_against_hf(output, *ref)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_tiny_kimi(str(tmp_path_factory.mktemp("refused")), seed=1, n_group=1)


@pytest.mark.parametrize("broken, message", [
    (dict(replace={"blk.0.ssm_beta.weight": np.zeros((8, 64), dtype=np.float32)}),
     r"blk.0.ssm_beta.weight has shape \(8, 64\); the metadata \(attention.head_count=4, .*needs \(4, 64\)"),
    (dict(replace={"blk.3.ssm_conv1d_k.weight": np.zeros((1, 64, 1, 3), dtype=np.float32)}),
     r"blk.3.ssm_conv1d_k.weight has shape \(1, 64, 1, 3\); .*ssm.conv_kernel=4.*needs \(64, 1, 4\)"),
    (dict(skip=("blk.2.attn_k_b.weight",)), "lacks blk.2.attn_k_b.weight: layer 2 is an MLA layer"),
    (dict(skip=("blk.1.ssm_f_b.weight",)), "lacks blk.1.ssm_f_b.weight: layer 1 is a Kimi delta attention layer"),
    (dict(head_count_kv=1), r"attention.head_count_kv=1: the converter writes one count per layer"),
    (dict(extra={"blk.0.attn_gate.weight": np.zeros((64, 64), dtype=np.float32)}),
     r"GGUF tensor blk.0.attn_gate.weight \(a full-rank output gate"),
])
def test_malformed_file_refused_by_name(broken, message, folder, tmp_path):
    path = str(tmp_path / "broken.gguf")
    write_kimi_gguf(path, folder, **broken)
    with pytest.raises(ValueError, match=message):
        GGUFSource(path)


def test_block_quantized_tensors(folder, tmp_path):
    """Q8_0 KDA projections, MLA query and routed experts (as a quantized file stores them): read back as the
    dequantized blocks, handed out as int8 groups; the file runs under quantization=auto."""
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = str(tmp_path / "q8.gguf")
    write_kimi_gguf(path, folder, quantize_as={name: q8 for name in (
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate_exps.weight",
        "ffn_up_exps.weight", "ffn_down_exps.weight")})
    source, hf = GGUFSource(path), SafetensorsSource(folder)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.2.self_attn.q_proj.weight",
                 "model.layers.1.block_sparse_moe.experts.3.w2.weight"):
        want = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(hf.get(name).numpy(), q8), q8))
        assert source.storage_type(name) == "Q8_0", name
        assert torch.equal(source.get(name), want), name
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 17)]
    with LLM(path, **{**COMMON, "quantization": "auto"}) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [MAX_TOKENS] * 2
