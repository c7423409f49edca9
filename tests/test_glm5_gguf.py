"""GLM-5 from llama.cpp's `glm-dsa` GGUF files (cpllm/model/loaders/gguf_glm_dsa.py) against transformers on the HF
weights they were written from.

The tiny GLM-5 (tests/tiny_sparse_mla.py: index_topk 8, 16 index heads of width 32, the first layer dense) is saved
as an HF folder and written the way llama.cpp's converter (conversion/glm.py, GlmMoeDsaModel on DeepseekV2Model)
writes it, in float32 so the comparison is exact: the hyperparameters as its load_hparams reads them
(AutoConfig(...).to_dict()), names through the `gguf` package's own tensor map for the architecture (the converter's
map_tensor_name) after ModelBase.filter_tensors' rename (e_score_correction_bias -> e_score_correction.bias),
kv_b_proj split per head into k_b (transposed) and v_b, experts stacked per projection, and a multi-token-prediction
block appended as blk.3 (a whole layer plus nextn.*: GLM-5 checkpoints carry one past num_hidden_layers, which the
converter keeps unless --no-mtp), with the metadata of TextModel, DeepseekV2Model and GlmMoeDsaModel's
set_gguf_parameters (block_count counting the MTP block, nextn_predict_layers, the indexer's keys and
attention.indexer.types). Prompts of 5 tokens attend densely, those of 17 and 40 select 8 keys per query. Greedy
tokens identical, prompt and sampled-token logprobs within 1e-4, also under TP = 2; Q8_0 projections and experts
read as their blocks; malformed files refused with the tensor or key named.
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
from tiny_models import add_tiny_tokenizer
from tiny_sparse_mla import make_tiny_sparse, save_tiny_sparse

ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GLM_DSA]
OVERRIDES = dict(first_k_dense_replace=1)
"""A config.json whose first_k_dense_replace agrees with its mlp_layer_types (the converter reads the former, as
GLM-5's own config.json states both alike)."""
MAX_TOKENS = 6
PROMPT_LENGTHS = (5, 17, 40)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
COMMON = dict(max_model_len=128, block_size=4, quantization="none")
NEXTN_EXTRA = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")
"""The MTP block's own tensors beside its decoder layer (model.layers.N.*)."""


def _hparams(folder: str, mtp: bool) -> dict:
    """What the converter's load_hparams reads: transformers' config as a dictionary (plus the checkpoint's MTP
    block count, which the tiny model's config does not carry)."""
    from transformers import AutoConfig

    hp = AutoConfig.from_pretrained(folder).to_dict()
    hp["num_nextn_predict_layers"] = 1 if mtp else 0
    return hp


def _metadata(writer: gguf.GGUFWriter, hp: dict, blocks: int, mtp: bool, indexer_types, context: int | None) -> None:
    """The keys TextModel, DeepseekV2Model and GlmMoeDsaModel.set_gguf_parameters write from `hp`."""
    rope, rank = hp["qk_rope_head_dim"], hp["kv_lora_rank"]
    writer.add_block_count(blocks)
    writer.add_context_length(context or hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(1)  # DeepseekV2Model: MLA as MQA
    writer.add_rope_freq_base(hp["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_expert_used_count(hp["num_experts_per_tok"])
    writer.add_expert_group_count(hp["n_group"])
    writer.add_expert_group_used_count(hp["topk_group"])
    writer.add_leading_dense_block_count(hp["first_k_dense_replace"])
    writer.add_vocab_size(hp["vocab_size"])
    writer.add_q_lora_rank(hp["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(hp["qk_nope_head_dim"] + rope)
    writer.add_value_length_mla(hp["v_head_dim"])
    writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    writer.add_expert_count(hp["n_routed_experts"])
    writer.add_expert_shared_count(hp["n_shared_experts"])
    writer.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp["norm_topk_prob"]:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rope)
    if mtp:
        writer.add_nextn_predict_layers(hp["num_nextn_predict_layers"])
    writer.add_uint32(f"{ARCH}.attention.indexer.head_count", hp["index_n_heads"])
    writer.add_uint32(f"{ARCH}.attention.indexer.key_length", hp["index_head_dim"])
    writer.add_uint32(f"{ARCH}.attention.indexer.top_k", hp["index_topk"])
    if indexer_types is None:
        indexer_types = [kind == "full" for kind in hp["indexer_types"]]
    if indexer_types != "absent":  # gguf 0.19 has no add_indexer_types: the key llama.cpp's writer names
        writer.add_array(f"{ARCH}.attention.indexer.types", indexer_types)


def _checkpoint(folder: str, hp: dict) -> dict[str, torch.Tensor]:
    """The folder's tensors plus, with an MTP block, one past the last layer: a copy of the last layer's and the
    block's own (values are never read; shapes as GLM-5's)."""
    tensors = {name: t.float() for name, t in load_file(os.path.join(folder, "model.safetensors")).items()}
    last, nextn = hp["num_hidden_layers"] - 1, hp["num_hidden_layers"]
    if not hp["num_nextn_predict_layers"]:
        return tensors
    gen = torch.Generator().manual_seed(7)
    prefix = f"model.layers.{last}."
    tensors.update({name.replace(prefix, f"model.layers.{nextn}."): t.clone()
                    for name, t in tensors.items() if name.startswith(prefix)})
    hidden = hp["hidden_size"]
    tensors[f"model.layers.{nextn}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen)
    for rest in NEXTN_EXTRA[1:]:
        tensors[f"model.layers.{nextn}.{rest}"] = torch.ones(hidden)
    return tensors


def _converted(name: str, t: torch.Tensor, hp: dict) -> list[tuple[str, torch.Tensor]]:
    """One checkpoint tensor as ModelBase.filter_tensors and DeepseekV2Model.modify_tensors hand it on (experts
    aside): [(HF-side name, tensor)]."""
    name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    if name.endswith("kv_b_proj.weight"):
        heads, nope, v = hp["num_key_value_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"]
        k_b, v_b = t.view(heads, nope + v, t.shape[-1]).split([nope, v], dim=1)
        return [(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)),
                (name.replace("kv_b_proj", "v_b_proj"), v_b)]
    return [(name, t)]


def write_glm5_gguf(path: str, folder: str, *, mtp: bool = True, skip: tuple[str, ...] = (),
                    replace: dict[str, np.ndarray] | None = None, indexer_types=None, context: int | None = None,
                    gating: gguf.ExpertGatingFuncType | None = None,
                    quantize_as: dict[str, gguf.GGMLQuantizationType] | None = None) -> None:
    """The folder's weights as llama.cpp's converter writes them (see the module); `mtp=False`: as --no-mtp writes
    them; `quantize_as`: GGUF tensor name (after `blk.N.`) -> a block type to store it in. Broken files for the refusals: `skip` GGUF tensors left out, `replace` stored instead, `indexer_types`
    another value ("absent": no key), `context` another context_length, `gating` an expert_gating_func."""
    hp = _hparams(folder, mtp)
    blocks = hp["num_hidden_layers"] + hp["num_nextn_predict_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA, blocks)
    writer = gguf.GGUFWriter(path, ARCH)
    _metadata(writer, hp, blocks, mtp, indexer_types, context)
    if gating is not None:
        writer.add_expert_gating_func(gating)
    add_tiny_tokenizer(writer, chat_template=False)
    tensors: list[tuple[str, torch.Tensor]] = []
    stacks: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in _checkpoint(folder, hp).items():
        parts = name.split(".")
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.proj.weight: stacked per projection
            stacks.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = t
            continue
        tensors += _converted(name, t, hp)
    for (layer, proj), experts in sorted(stacks.items()):
        tensors.append((f"model.layers.{layer}.mlp.experts.{proj}.weight",
                        torch.stack([experts[e] for e in sorted(experts)])))
    for name, t in tensors:
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        qtype = (quantize_as or {}).get(gname.split(".", 2)[-1])
        if gname in skip:
            continue
        if qtype is not None:
            writer.add_tensor(gname, gguf.quants.quantize(t.numpy(), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, (replace or {}).get(gname, np.ascontiguousarray(t.numpy())))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple:
    """(the HF folder, the GGUF file, prompts, transformers' results on the folder's weights)."""
    folder = save_tiny_sparse(str(tmp_path_factory.mktemp("glm5")), "glm5", seed=1, **OVERRIDES)
    path = str(tmp_path_factory.mktemp("gguf") / "glm5.gguf")
    write_glm5_gguf(path, folder)
    hf = make_tiny_sparse("glm5", seed=1, **OVERRIDES)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    return folder, path, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


CONFIG_FIELDS = ("architecture", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "vocab_size", "mla", "moe", "indexer", "tie_word_embeddings",
                 "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "bos_token_id")


def test_config_read_from_the_file(built):
    """The metadata gives the folder's config: 3 layers (block_count less the MTP block), MLA, the indexer (its
    interleaved rotary), the MoE with its dense first layer and its router."""
    folder, path, _, _ = built
    got, want = GGUFSource(path).config, read_hf_config(folder)
    assert {f: getattr(got, f) for f in CONFIG_FIELDS} == {f: getattr(want, f) for f in CONFIG_FIELDS}
    assert (got.indexer.index_topk, got.indexer.index_n_heads, got.indexer.rope_interleave) == (8, 16, True)


def test_tensors_read_back_as_the_checkpoint(built, tmp_path):
    """Every tensor of the folder, read from the file, is the folder's (kv_b_proj from k_b / v_b as MLAAttention
    joins them); the MTP block is not offered; a --no-mtp file offers the same tensors."""
    folder, path, _, _ = built
    source, hf = GGUFSource(path), SafetensorsSource(folder)
    for name in hf.names():
        want = hf.get(name)
        if name.endswith("kv_b_proj.weight"):
            assert not source.has(name), name
            k_b, v_b = (source.get(name.replace("kv_b_proj", part)) for part in ("k_b_proj", "v_b_proj"))
            got = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(want.shape)
        else:
            got = source.get(name)
        assert got.shape == want.shape, name
        assert torch.equal(got, want), name
    assert not [name for name in source.names() if name.startswith("model.layers.3.")]
    no_mtp = str(tmp_path / "no-mtp.gguf")
    write_glm5_gguf(no_mtp, folder, mtp=False)
    assert GGUFSource(no_mtp).names() == source.names()
    assert GGUFSource(no_mtp).config == source.config


def test_gguf_matches_transformers(built):
    _, path, prompts, refs = built
    with LLM(path, **COMMON) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        check_against_hf(output, *ref)


def test_selection_changes_the_answer(built):
    """The reference with index_topk above every length (dense MLA) disagrees on the selecting prompts, so the
    comparison above sees the indexer's weights; the 5-token prompt attends densely either way (its decode steps
    past 8 tokens select)."""
    _, _, prompts, refs = built
    dense = make_tiny_sparse("glm5", seed=1, index_topk=1000, **OVERRIDES)
    dense_refs = [hf_greedy(dense, p, MAX_TOKENS) for p in prompts]
    assert dense_refs[0][2] == pytest.approx(refs[0][2], abs=1e-6)
    assert all(d[2] != r[2] for d, r in zip(dense_refs[1:], refs[1:]))  # prompt logprobs of 17 and 40 tokens


@pytest.mark.timeout(300)
def test_gguf_under_tp2_matches_transformers(built):
    """TP = 2: each rank reads its heads' rows of q_b, o_proj and the split k_b / v_b; the indexer is replicated."""
    _, path, prompts, refs = built
    with LLM(path, **COMMON, tensor_parallel_size=2, threads_per_rank=1, distributed_timeout=60) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY)
    for output, ref in zip(outputs, refs[1:]):
        check_against_hf(output, *ref)


@pytest.fixture(scope="module")
def folder(built) -> str:
    return built[0]


@pytest.mark.parametrize("broken, message", [
    (dict(replace={"blk.1.indexer.attn_q_b.weight": np.zeros((256, 24), dtype=np.float32)}),
     r"blk.1.indexer.attn_q_b.weight has shape \(256, 24\); .*indexer.head_count=16, indexer.key_length=32.*"
     r"needs \(512, 24\)"),
    (dict(replace={"blk.2.attn_k_b.weight": np.zeros((4, 16, 32), dtype=np.float32)}),
     r"blk.2.attn_k_b.weight has shape \(4, 16, 32\); .*needs \(4, 32, 16\)"),
    (dict(skip=("blk.0.indexer.k_norm.bias",)), "lacks blk.0.indexer.k_norm.bias: layer 0 is a sparse-MLA layer "
     "with its indexer and a dense MLP"),
    (dict(skip=("blk.2.exp_probs_b.bias",)), r"lacks blk.2.exp_probs_b.bias: layer 2 .* experts"),
    (dict(indexer_types=[True, False, True]), r"indexer_types=\['full', 'shared', 'full'\]: layers that reuse"),
    (dict(indexer_types=[True, True]), "attention.indexer.types has 2 entries; the model has 3 layers"),
    (dict(indexer_types="absent", context=1048576), "no attention.indexer.types and context_length=1048576: "
     "llama.cpp reads it as GLM-5.2"),
    (dict(gating=gguf.ExpertGatingFuncType.SOFTMAX), "expert_gating_func=1: GLM-5's router scores by sigmoid"),
])
def test_malformed_file_refused_by_name(broken, message, folder, tmp_path):
    path = str(tmp_path / "broken.gguf")
    write_glm5_gguf(path, folder, **broken)
    with pytest.raises(ValueError, match=message):
        GGUFSource(path)


def test_file_without_indexer_types_is_glm5(folder, tmp_path):
    """Below a context of 1048576 a file without attention.indexer.types is GLM-5 / 5.1 (every layer full), as
    llama.cpp reads it."""
    path = str(tmp_path / "untyped.gguf")
    write_glm5_gguf(path, folder, indexer_types="absent")
    assert GGUFSource(path).config.indexer == read_hf_config(folder).indexer


def test_block_quantized_tensors(folder, tmp_path):
    """Q8_0 MLA, indexer and expert projections (as a quantized file stores them; q_lora_rank 24 leaves q_b and the
    indexer's wq_b, whose rows are 24 wide, in float32): read back as the dequantized blocks, handed out as int8
    groups; the file runs under quantization=auto."""
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = str(tmp_path / "q8.gguf")
    write_glm5_gguf(path, folder, quantize_as={name: q8 for name in (
        "attn_q_a.weight", "attn_kv_a_mqa.weight", "attn_output.weight", "indexer.attn_k.weight",
        "indexer.proj.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")})
    source, hf = GGUFSource(path), SafetensorsSource(folder)
    for name in ("model.layers.1.self_attn.indexer.wk.weight", "model.layers.2.self_attn.indexer.weights_proj.weight",
                 "model.layers.0.self_attn.o_proj.weight", "model.layers.2.mlp.experts.5.down_proj.weight"):
        want = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(hf.get(name).numpy(), q8), q8))
        assert source.storage_type(name) == "Q8_0", name
        assert torch.equal(source.get(name), want), name
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 17)]
    with LLM(path, **{**COMMON, "quantization": "auto"}) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [MAX_TOKENS] * 2
