"""Start-up work, counted (never timed): GGUF parses, tokenizer conversions, the KV pool's size and its zeros."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import cpllm.model.loaders.gguf_source as gguf_source
import cpllm.model.tokenization.tokenizer as tokenizer_module
from cpllm.engine.llm import LLM
from cpllm.model.loaders import loader
from cpllm.model.tokenization import cache as tokenizer_cache
from cpllm.model.tokenization.tokenizer import load_tokenizer
from cpllm.worker.kv_cache import usable_blocks, zeroed_pool

import tiny_models as tm  # tests/ is on sys.path under pytest


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("startup") / "tiny.gguf")
    tm.save_tiny_gguf(path, "llama")
    return path


@pytest.fixture
def parses(monkeypatch, tmp_path):
    """Counts every parse of a GGUF's metadata: cpllm's (GGUFFile), the tokenizer build's and the
    tokenizer's own scalar read; the tokenizer cache starts empty in a fresh folder."""
    monkeypatch.setenv("CPLLM_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    counts = {"weights": 0, "tokenizer build": 0, "tokenizer scalars": 0}
    reader, build, scalars = gguf_source.GGUFFile, tokenizer_cache.transformers.TokenizersBackend.from_pretrained, \
        tokenizer_module._gguf_scalars

    def counted(kind, fn):
        def call(*args, **kwargs):
            if kind != "tokenizer build" or "gguf_file" in kwargs:
                counts[kind] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(gguf_source, "GGUFFile", counted("weights", reader))
    monkeypatch.setattr(tokenizer_cache.transformers.TokenizersBackend, "from_pretrained",
                        counted("tokenizer build", build))
    monkeypatch.setattr(tokenizer_module, "_gguf_scalars", counted("tokenizer scalars", scalars))
    loader._open_unchanged.cache_clear()
    yield counts
    loader._open_unchanged.cache_clear()


def test_a_second_load_reuses_the_converted_tokenizer(tiny_gguf, parses):
    before = tokenizer_cache.conversions
    cold = load_tokenizer(tiny_gguf)
    assert tokenizer_cache.conversions == before + 1
    warm = load_tokenizer(tiny_gguf)
    assert tokenizer_cache.conversions == before + 1, "the second load must come from the cache"
    assert parses["tokenizer build"] == 1 and parses["tokenizer scalars"] == 1
    text = "hello world, the cat sat on the mat"
    assert warm.encode(text) == cold.encode(text)
    assert (warm.chat_template, warm.eos_token_ids, warm.bos_token_id) == \
        (cold.chat_template, cold.eos_token_ids, cold.bos_token_id)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_cold_build_is_the_tokenizer_auto_tokenizer_builds(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("CPLLM_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    path = str(tmp_path / f"{arch}.gguf")
    tm.save_tiny_gguf(path, arch)
    ours = load_tokenizer(path)
    auto = tokenizer_cache.transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf")
    assert ours.hf_tokenizer.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert ours.hf_tokenizer.special_tokens_map == auto.special_tokens_map
    text = "hello world, <|im_start|> the cat sat"
    assert ours.encode(text) == auto(text).input_ids
    assert ours.hf_tokenizer.decode(auto(text).input_ids) == auto.decode(auto(text).input_ids)


def test_a_warm_start_parses_the_gguf_once(tiny_gguf, parses):
    load_tokenizer(tiny_gguf)  # fills the cache, as an earlier run of the same file would have
    parses.update({kind: 0 for kind in parses})
    with LLM(tiny_gguf, max_model_len=64, block_size=4, max_num_seqs=2) as llm:
        assert llm.generate("hello world")[0].outputs[0].token_ids
    assert parses == {"weights": 1, "tokenizer build": 0, "tokenizer scalars": 0}


def test_the_pool_is_sized_to_what_the_run_can_use(tiny_gguf, parses):
    with LLM(tiny_gguf, max_model_len=64, block_size=4, max_num_seqs=2) as llm:
        assert llm.engine.executor.num_blocks == 2 * 64 // 4
        assert llm.engine.kv_capacity_tokens == 2 * 64
    big = 4 * 2**20  # an explicit size is taken as asked (its spare blocks serve the prefix cache)
    with LLM(tiny_gguf, max_model_len=64, block_size=4, max_num_seqs=2, kv_cache_memory_bytes=big) as llm:
        assert llm.engine.executor.num_blocks > 2 * 64 // 4


def test_usable_blocks_counts_whole_blocks_of_the_kv_shard():
    config = SimpleNamespace(cache=SimpleNamespace(block_size=16),
                             scheduler=SimpleNamespace(max_num_seqs=3, max_model_len=100),
                             parallel=SimpleNamespace(dims=SimpleNamespace(kv_shard_size=2)))
    assert usable_blocks(config) == 3 * 4  # 100 tokens over virtual blocks of 16 x 2 = 32 tokens: 4 blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_pool_reads_zero_before_any_write(dtype):
    pool = zeroed_pool((1 << 16, 2, 8), dtype, torch.device("cpu"))
    assert pool.shape == (1 << 16, 2, 8) and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    pool[7] = 1.0
    assert pool.sum() == 16
