"""DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention) on the single-rank engine against transformers on the same
tiny random weights (tests/tiny_sparse_mla.py: index_topk 8). Prompts of 1 and 5 tokens attend densely, those of
17 and 40 select 8 keys per query, in prefill and in every decode step. Greedy tokens identical, prompt and
sampled-token logprobs within 1e-4; chunked prefill over cached latents and prefix hits select over the whole
prefix (the cached part read from the index pool); preemption recomputes the same selection.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from cpllm import LLM, SamplingParams
from cpllm.config.engine import EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from cpllm.config.speculative import SpeculativeConfig
from cpllm.layers.registry import kind_of
from cpllm.model.loaders.safetensors_source import read_hf_config
from reference import check_against_hf, hf_greedy
from tiny_sparse_mla import CASES, INDEX_TOPK, make_tiny_sparse, save_tiny_sparse

MAX_TOKENS = 12
PROMPT_LENGTHS = (1, 5, 17, 40)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2)


def random_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    folder = save_tiny_sparse(str(tmp_path_factory.mktemp(request.param)), request.param, seed=1)
    hf = make_tiny_sparse(request.param, seed=1)
    prompts = random_prompts(hf.config.vocab_size)
    return request.param, folder, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def test_config_and_cache_spec(tiny):
    name, folder, _, _ = tiny
    config = read_hf_config(folder)
    assert isinstance(config, ModelConfig) and config.mla is not None
    assert (config.indexer.index_topk, config.indexer.index_head_dim, config.indexer.index_n_heads) == (8, 32, 16)
    assert config.indexer.rope_interleave == (name == "glm5")
    assert config.mla.rope_interleave  # both families always rotate MLA's pairs interleaved
    assert config.moe.mlp_only_layers == (0,)
    kind = kind_of(config)
    assert kind.name == "sparse_mla"
    spec = kind.cache_spec(config, window=None, kv_heads=1, element_bytes=4)
    assert [(p.name, p.heads, p.width) for p in spec.pools] == [("latent", 1, 48), ("index", 1, 32)]
    assert spec.bytes_per_token == (48 + 32) * 4 and not spec.shared_kv


def test_selection_changes_the_answer(tiny):
    """The reference with index_topk above every length (dense MLA) disagrees on the long prompts: the
    comparisons below see the selection."""
    name, _, prompts, refs = tiny
    dense = make_tiny_sparse(name, seed=1, index_topk=1000)
    for prompt, ref in zip(prompts, refs):
        tokens, _, prompt_lp = hf_greedy(dense, prompt, MAX_TOKENS)
        if len(prompt) + MAX_TOKENS - 1 <= INDEX_TOPK:
            assert tokens == ref[0]  # every position sees all its keys: dense
        else:
            assert tokens != ref[0] or max((abs(a - b) for a, b in zip(prompt_lp, ref[2])), default=0) > 1e-2


def test_batch_matches_transformers(tiny, caplog):
    _, folder, prompts, refs = tiny
    with caplog.at_level("INFO"), LLM(folder, max_model_len=256, block_size=4, quantization="none") as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("latent cache (MLA)"))
    assert f"and an index key of {llm.engine.config.model.indexer.index_head_dim} values" in line, line
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        check_against_hf(output, *ref)


@pytest.mark.parametrize("selected_from", [0, 10**9])
def test_prompt_rows_read_selected_rows_or_mask_alike(tiny, monkeypatch, selected_from):
    """A prompt chunk's rows attend their selected latent rows read from the pool (as decode rows do) or every key
    under a mask of the selection, by how many keys the rank holds (SELECTED_FROM x index_topk): both ways match
    transformers, here with every prompt row forced to one way and then the other."""
    import cpllm.layers.sparse_mla.attention as sparse_attention

    monkeypatch.setattr(sparse_attention, "SELECTED_FROM", selected_from)
    _, folder, prompts, refs = tiny
    with LLM(folder, max_model_len=256, block_size=4, quantization="none") as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for output, ref in zip(outputs, refs):
        check_against_hf(output, *ref)


def test_chunked_prefill_and_prefix_hits(tiny):
    _, folder, prompts, refs = tiny
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(folder, max_model_len=256, block_size=4, quantization="none", max_num_batched_tokens=7) as llm:
        token_prompts = [{"prompt_token_ids": p} for p in prompts]
        first = llm.generate(token_prompts, params)
        second = llm.generate(token_prompts, params)
        assert llm.engine.scheduler.num_prefix_hit_tokens >= 36
    for a, b, ref in zip(first, second, refs):
        check_against_hf(a, ref[0], ref[1])
        check_against_hf(b, ref[0], ref[1])


def test_preemption_keeps_every_request(tiny):
    """A cache too small for the batch: requests are preempted and recomputed, outputs unchanged."""
    _, folder, prompts, refs = tiny
    # 3 layers x (48 latent + 32 index values) x 4 tokens x 4 bytes = 3,840 bytes per block; 13 blocks = 52 tokens
    with LLM(folder, max_model_len=52, block_size=4, quantization="none", kv_cache_memory_bytes=13 * 3840) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert llm.engine.executor.rank_info.kv.num_blocks == 13
        assert llm.engine.scheduler.num_preemptions > 0
    for output, ref in zip(outputs, refs):
        check_against_hf(output, *ref)


def test_layouts_and_speculation_are_accepted(tiny):
    """Prompt lookup and a draft model (tests/test_sparse_mla_spec.py), TP, TP x DCP and PCP (both KV layouts,
    every prefill strategy) configure."""
    name, folder, _, _ = tiny
    if name != "v32":
        pytest.skip("a config rule: one family suffices")
    config = read_hf_config(folder)
    short = SchedulerConfig(max_model_len=64)
    EngineConfig(model_path=folder, model=config, scheduler=short,
                 speculative_config=SpeculativeConfig(method="draft_model", model=folder, num_speculative_tokens=2))
    EngineConfig(model_path=folder, model=config, scheduler=short,
                 speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    built = [ParallelConfig(tensor_parallel_size=2),
             ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2),
             ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2, decode_context_parallel_size=2,
                            cp_kv_cache_layout="replicated")]
    built += [ParallelConfig(prefill_context_parallel_size=2, cp_prefill_strategy=strategy)
              for strategy in ("allgather", "ring", "pass-q")]
    for parallel in built:
        EngineConfig(model_path=folder, model=config, parallel=parallel, scheduler=short)


def test_unbuilt_config_fields_are_refused(tiny):
    from cpllm.config.sparse_mla import IndexerConfig

    name, folder, _, _ = tiny
    if name != "glm5":
        pytest.skip("a config rule: one family suffices")
    cfg = {"architectures": ["GlmMoeDsaForCausalLM"], "q_lora_rank": 24, "index_topk": 8}
    assert IndexerConfig.from_hf_config(cfg, 16).index_n_heads == 32  # transformers' GLM-5 default
    with pytest.raises(ValueError, match="indexer_types"):
        IndexerConfig.from_hf_config({**cfg, "indexer_types": ["full", "shared"]}, 16)
    with pytest.raises(ValueError, match="q_lora_rank"):
        IndexerConfig.from_hf_config({**cfg, "q_lora_rank": None}, 16)
    with pytest.raises(ValueError, match="index_head_dim=8"):
        IndexerConfig.from_hf_config({**cfg, "index_head_dim": 8}, 16)
    with pytest.raises(ValueError, match="index_topk=0"):
        dataclasses.replace(IndexerConfig.from_hf_config(cfg, 16), index_topk=0)


def test_glm5_gguf_without_its_keys_is_refused_by_name(tmp_path):
    """GLM-5's `glm-dsa` files are read (tests/test_glm5_gguf.py); one without the keys llama.cpp's converter writes
    is refused, naming the first one missing."""
    import gguf
    import numpy as np

    from cpllm.model.loaders.gguf_file import GGUFFile
    from cpllm.model.loaders.gguf_source import gguf_model_config

    path = str(tmp_path / "glm5.gguf")
    writer = gguf.GGUFWriter(path, "glm-dsa")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="glm-dsa GGUF file has no glm-dsa.block_count; GLM-5 needs it"):
        gguf_model_config(GGUFFile(path), {"token_embd.weight": (8, 4)})
