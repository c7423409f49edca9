"""The gated-DeltaNet hybrids from llama.cpp GGUF files (`qwen35`, `qwen35moe`, `qwen3next`:
cpllm/model/loaders/gguf_hybrid.py) against transformers on the HF weights they were written from.

The tiny models (tests/tiny_hybrid.py) are saved as HF folders and written the way llama.cpp's converter writes them,
in float32 so the comparison is exact: each norm but the DeltaNet's gated one as 1 + w, A_log as -exp(A_log),
dt_bias as `ssm_dt.bias`, the convolution squeezed, experts stacked per projection (or gate and up in one stack), and
per family Qwen3-Next's in_proj_qkvz split into attn_qkv / attn_gate (in_proj_ba kept as ssm_ba), Qwen3.5's value
heads moved from grouped to tiled order when there are fewer key heads than value heads. Greedy tokens identical,
prompt and sampled-token logprobs within 1e-4; one case under TP = 2; files the loader cannot read are refused with
their name. Kimi Linear's `kimi-linear` files: tests/test_kimi_gguf.py.
"""

from __future__ import annotations

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
from reference import check_against_hf, hf_greedy
from tiny_hybrid import make_tiny_hybrid, save_tiny_hybrid, tiny_hybrid_config
from tiny_models import add_tiny_tokenizer

MAX_TOKENS = 6
PROMPT_LENGTHS = (1, 9, 40)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
COMMON = dict(max_model_len=128, block_size=4, quantization="none", enable_prefix_caching=False)
ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
CASES = {
    # 2 key heads, 4 value heads: Qwen3.5's converter tiles the value heads
    "qwen3_5": ("qwen3_5", {}, {}),
    # as many key heads as value heads: nothing tiled; gate and up in one stack (--fuse-gate-up-exps)
    "qwen3_5_moe": ("qwen3_5_moe", dict(linear_num_key_heads=4), dict(fuse_gate_up=True)),
    "qwen3_next": ("qwen3_next", {}, {}),
}
"""Case -> (family, model overrides, writer options)."""

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
          "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
          "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
          "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
          "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a",
          "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
          "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
          "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
          "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
          "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}
"""HF checkpoint name (after `model.layers.N.`) -> the converter's GGUF name."""


def _tile_v_heads(t: torch.Tensor, dim: int, key_heads: int, per_key: int, width: int) -> torch.Tensor:
    """The converter's reorder along `dim`: value heads from [key head, j] (grouped) to [j, key head] (tiled)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], key_heads, per_key, width, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _converted(name: str, t: torch.Tensor, arch: str, config) -> list[tuple[str, torch.Tensor]]:
    """One HF layer tensor (`name` after `model.layers.N.`) as the converter writes it: [(GGUF name, tensor)]."""
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, r = config.linear_key_head_dim, config.linear_value_head_dim, hv // hk
    qk = 2 * hk * dk
    if arch in ("qwen35", "qwen35moe") and hk != hv and name.startswith("linear_attn."):
        if name in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
            t = torch.cat([t[:qk], _tile_v_heads(t[qk:], 0, hk, r, dv)])
        elif name == "linear_attn.in_proj_z.weight":
            t = _tile_v_heads(t, 0, hk, r, dv)
        elif name in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"):
            t = _tile_v_heads(t, 0, hk, r, 1)
        elif name in ("linear_attn.A_log", "linear_attn.dt_bias"):
            t = _tile_v_heads(t[:, None], 0, hk, r, 1)[:, 0]
        elif name == "linear_attn.out_proj.weight":
            t = _tile_v_heads(t, 1, hk, r, dv)
    if name.endswith("A_log"):
        t = -torch.exp(t)
    elif name.endswith("conv1d.weight"):
        t = t.squeeze(1)
    elif name.endswith("norm.weight") and name != "linear_attn.norm.weight":
        t = t + 1
    if name == "linear_attn.in_proj_qkvz.weight":  # per key head [q, k, v, z] -> [q all | k all | v all], z
        q, k, v, z = t.reshape(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
        return [("attn_qkv.weight", torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)])),
                ("attn_gate.weight", z.flatten(0, 1))]
    return [(_LAYER[name], t)]


def write_hybrid_gguf(path: str, folder: str, family: str, *, fuse_gate_up: bool = False, arch: str | None = None,
                      skip: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None,
                      overrides: dict | None = None, value_heads: int | None = None,
                      quantize_as: dict[str, gguf.GGMLQuantizationType] | None = None) -> None:
    """The folder's weights as llama.cpp's converter writes them (see the module); `quantize_as`: GGUF tensor name
    (after `blk.N.`) -> a block type to store it in. Broken files for the refusals: `arch` another architecture
    name, `skip` GGUF tensors left out, `extra` tensors added, `value_heads` a wrong ssm.time_step_rank."""
    config = tiny_hybrid_config(family, **(overrides or {}))
    arch = arch or ARCH[family]
    writer = gguf.GGUFWriter(path, arch)
    rope = config.rope_parameters
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_rope_freq_base, float(rope["rope_theta"])),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (writer.add_key_length, config.head_dim), (writer.add_value_length, config.head_dim),
                       (writer.add_ssm_conv_kernel, config.linear_conv_kernel_dim),
                       (writer.add_ssm_state_size, config.linear_key_head_dim),
                       (writer.add_ssm_group_count, config.linear_num_key_heads),
                       (writer.add_ssm_time_step_rank, value_heads or config.linear_num_value_heads),
                       (writer.add_ssm_inner_size, config.linear_value_head_dim * config.linear_num_value_heads),
                       (writer.add_full_attention_interval, 4),
                       (writer.add_rope_dimension_count, int(config.head_dim * rope["partial_rotary_factor"])),
                       (writer.add_vocab_size, config.vocab_size)]:
        add(value)
    if family != "qwen3_5":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    add_tiny_tokenizer(writer)
    stacks: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, t in load_file(os.path.join(folder, "model.safetensors")).items():
        t = t.float()
        if name in _GLOBAL:
            tensors.append((_GLOBAL[name], t + 1 if name == "model.norm.weight" else t))
            continue
        _, _, layer, rest = name.split(".", 3)
        if ".experts." in rest:  # mlp.experts.E.proj.weight -> one stack per projection
            _, _, expert, proj, _ = rest.split(".")
            stacks.setdefault((layer, proj), {})[int(expert)] = t
            continue
        tensors += [(f"blk.{layer}.{gname}", v) for gname, v in _converted(rest, t, arch, config)]
    for (layer, proj), experts in sorted(stacks.items()):
        stack = torch.stack([experts[e] for e in range(len(experts))])
        if fuse_gate_up and proj == "up_proj":
            continue
        if fuse_gate_up and proj == "gate_proj":  # the converter's --fuse-gate-up-exps: [E, 2 I, in], gate first
            up = torch.stack([stacks[(layer, "up_proj")][e] for e in range(len(experts))])
            tensors.append((f"blk.{layer}.ffn_gate_up_exps.weight", torch.cat([stack, up], dim=1)))
            continue
        tensors.append((f"blk.{layer}.ffn_{proj.split('_')[0]}_exps.weight", stack))
    for gname, t in tensors:
        qtype = (quantize_as or {}).get(gname.split(".", 2)[-1])
        if gname in skip:
            continue
        if qtype is None:
            writer.add_tensor(gname, np.ascontiguousarray(t.numpy()))
        else:
            writer.add_tensor(gname, gguf.quants.quantize(t.numpy(), qtype), raw_dtype=qtype)
    for gname, data in (extra or {}).items():
        writer.add_tensor(gname, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def _build(name: str, tmp_path_factory) -> tuple:
    """(case, the HF folder, the GGUF file, prompts, transformers' results on the folder's weights)."""
    family, overrides, options = CASES[name]
    folder = save_tiny_hybrid(str(tmp_path_factory.mktemp(name)), family, seed=1, **overrides)
    path = str(tmp_path_factory.mktemp("gguf") / f"{name}.gguf")
    write_hybrid_gguf(path, folder, family, overrides=overrides, **options)
    hf = make_tiny_hybrid(family, seed=1, **overrides)
    prompts = _prompts(hf.config.vocab_size)
    return name, folder, path, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def test_config_read_from_the_file(case):
    """The metadata gives the folder's config; a Qwen3-Next file is read with the separate projections (the
    converter split in_proj_qkvz into them)."""
    name, folder, path, _, _ = case
    got, want = GGUFSource(path).config, read_hf_config(folder)
    fields = ("architecture", "num_hidden_layers", "num_key_value_heads", "head_dim", "intermediate_size", "moe",
              "rope_theta", "rope_scaling", "tie_word_embeddings", "qk_norm", "max_position_embeddings")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # stored as float32
    linear = want.linear_attention
    assert got.linear_attention == type(linear)(**{**{f: getattr(linear, f) for f in linear.__slots__},
                                                   "fused_projections": False})


def test_tensors_read_back_as_the_checkpoint(case):
    """Every tensor the model reads from the folder, read from the file, is the folder's (norms and A_log to
    float32 rounding); out_proj's moved columns also under a TP shard's column slice."""
    name, folder, path, _, _ = case
    source, hf = GGUFSource(path), SafetensorsSource(folder)
    wanted = [n for n in hf.names() if ".in_proj_qkvz." not in n and ".in_proj_ba." not in n]
    assert not set(wanted) - set(source.names())
    for tensor in wanted:
        got, want = source.get(tensor), hf.get(tensor)
        assert got.shape == want.shape, tensor
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), tensor
    out_proj = "model.layers.0.linear_attn.out_proj.weight"
    assert torch.equal(source.get(out_proj, dim=1, start=16, end=48), hf.get(out_proj, dim=1, start=16, end=48))
    if name == "qwen3_next":  # the fused folder tensors, as the separate rows the file holds
        qkvz = hf.get("model.layers.0.linear_attn.in_proj_qkvz.weight").reshape(2, 96, 64)
        assert torch.equal(source.get("model.layers.0.linear_attn.in_proj_z.weight"),
                           qkvz[:, 64:].reshape(64, 64))
        ba = hf.get("model.layers.0.linear_attn.in_proj_ba.weight").reshape(2, 2, 2, 64)  # [h, b | a, j]
        assert torch.equal(source.get("model.layers.0.linear_attn.in_proj_a.weight"), ba[:, 1].reshape(4, 64))


def test_gguf_matches_transformers(case):
    name, _, path, prompts, refs = case
    with LLM(path, **COMMON) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS, name
        check_against_hf(output, *ref)


@pytest.mark.timeout(300)
def test_gguf_under_tp2_matches_transformers(tmp_path_factory):
    """TP = 2 (the tiled case) reads each rank's key heads and their value heads back from the tiled order, and its
    columns of out_proj."""
    _, _, path, prompts, refs = _build("qwen3_5", tmp_path_factory)
    with LLM(path, **COMMON, tensor_parallel_size=2, threads_per_rank=1, distributed_timeout=60) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for output, ref in zip(outputs, refs):
        check_against_hf(output, *ref)


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory) -> str:
    return save_tiny_hybrid(str(tmp_path_factory.mktemp("dense")), "qwen3_5", seed=1)


@pytest.mark.parametrize("broken, message", [
    # a hybrid's tensors under Kimi Linear's name: read as Kimi Linear, which wants its per-layer head_count_kv
    (dict(arch="kimi-linear"), "kimi-linear attention.head_count_kv=2: the converter writes one count per layer"),
    (dict(extra={"blk.0.ssm_in.weight": np.zeros((192, 64), dtype=np.float32)}),
     "GGUF tensor blk.0.ssm_in.weight \\(an unsplit in_proj_qkvz"),
    (dict(value_heads=8), r"blk.0.ssm_a has shape \(4,\); .*ssm.time_step_rank=8"),
    (dict(skip=("blk.5.attn_gate.weight",)), "lacks blk.5.attn_gate.weight: layer 5 is a gated DeltaNet layer"),
    (dict(skip=("blk.3.attn_k_norm.weight",)), "lacks blk.3.attn_k_norm.weight: layer 3 is a full-attention"),
])
def test_unreadable_file_refused_by_name(broken, message, dense_folder, tmp_path):
    path = str(tmp_path / "broken.gguf")
    write_hybrid_gguf(path, dense_folder, "qwen3_5", **broken)
    with pytest.raises(ValueError, match=message):
        GGUFSource(path)


def test_block_quantized_tensors_in_hf_order(dense_folder, tmp_path):
    """Q8_0 in_proj_qkv / in_proj_z of the tiled case: their rows put back as whole blocks, by get and as int8
    groups (a TP shard's rows too); out_proj's columns cross its blocks, so it is handed out dequantized (F32). The
    file runs under quantization=auto (the int8 groups as stored)."""
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = str(tmp_path / "q8.gguf")
    write_hybrid_gguf(path, dense_folder, "qwen3_5",
                      quantize_as={"attn_qkv.weight": q8, "attn_gate.weight": q8, "ssm_out.weight": q8})
    source, hf = GGUFSource(path), SafetensorsSource(dense_folder)
    prefix = "model.layers.4.linear_attn"
    for name in ("in_proj_qkv", "in_proj_z"):
        want = hf.get(f"{prefix}.{name}.weight").numpy()
        want = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(want, q8), q8))  # rows quantize alone
        assert source.storage_type(f"{prefix}.{name}.weight") == "Q8_0"
        assert torch.equal(source.get(f"{prefix}.{name}.weight"), want), name
        groups = source.get_int8_groups(f"{prefix}.{name}.weight", dim=0, start=32, end=64)
        assert torch.equal((groups.codes.float().reshape(32, 2, 32) * groups.d[..., None]).reshape(32, 64),
                           want[32:64]), name
    out_proj = f"{prefix}.out_proj.weight"
    assert source.storage_type(out_proj) == "F32"
    assert torch.allclose(source.get(out_proj), hf.get(out_proj), atol=2e-3)
    with pytest.raises(ValueError, match="F32"):
        source.get_int8_groups(out_proj)
    prompts = _prompts(300)[:2]
    with LLM(path, **{**COMMON, "quantization": "auto"}) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [MAX_TOKENS] * 2
