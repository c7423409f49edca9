"""Disaggregated prefill/decode of the cache kinds beyond one full-attention group (cpllm/disagg,
docs/disaggregated.md "What moves for each cache kind"): sliding-window groups move only the window of the
consumer's first query, sparse-MLA layers move their latent rows and their indexer's keys, and linear-attention
layers move the states after all but the last prompt token, re-cut for the consumer's TP. The consumer's greedy
tokens must be the single-rank engine's and its logprobs within 1e-4.
"""

from __future__ import annotations

import pytest

from cpllm import LLM
from parallel_helpers import assert_same_greedy, random_prompt
from test_disagg_engine import COMMON, free_ports, greedy, prefill, transfer
from tiny_hybrid import save_tiny_hybrid
from tiny_kimi import save_tiny_kimi
from tiny_models import save_tiny_hf_model
from tiny_sparse_mla import save_tiny_sparse
from tiny_window_models import WINDOW, save_tiny_window_model

PROMPTS = {"len1": random_prompt(1, seed=1), "len13": random_prompt(13, seed=13),
           "len37": random_prompt(37, seed=37)}
"""Prompts up to 4.6 windows long (and past the indexer's 8 selected tokens)."""


def run_pair(producer: LLM, consumer: LLM, reference: LLM, prompts: dict[str, list[int]]) -> list[tuple[int, int]]:
    """Each prompt: prefill on the producer, decode on the consumer, against `reference`; returns the rows the
    consumer's driver rank pulled and the consumer's prefix-hit tokens, per prompt. The producer ends holding
    nothing in any group's pool."""
    stats, scheduler, pulled = consumer.engine.executor.rank_stats, consumer.engine.scheduler, []
    for name, prompt in prompts.items():
        params = prefill(producer, prompt).kv_transfer_params
        rows, hits = stats().kv_rows_pulled, scheduler.num_prefix_hit_tokens
        got = consumer.generate({"prompt_token_ids": prompt}, greedy(kv_transfer_params=params))[0]
        pulled.append((stats().kv_rows_pulled - rows, scheduler.num_prefix_hit_tokens - hits))
        want = reference.generate({"prompt_token_ids": prompt}, greedy())[0]  # the consumer's: prefix hits too
        assert_same_greedy(got, want, what=name, prompt_logprobs=False)
        producer.engine.step()  # takes the consumer's release
        scheduler = producer.engine.scheduler
        assert scheduler.held == {} and scheduler.held_states == {}, name
        assert [p.num_used for p in producer.engine.pools] == [0] * len(producer.engine.pools), name
        assert len(scheduler.free_held_slots) == (scheduler.config.max_num_seqs if scheduler.uses_state else 0)
    return pulled


def window_rows(prompt_len: int) -> int:
    """Positions a windowed layer group moves for a prompt: those the query at prompt_len - 1 reads, but itself."""
    return min(prompt_len - 1, WINDOW - 1)


def test_full_and_window_groups_from_pcp2_to_one_rank(tmp_path):
    """Qwen2 with layer 0 full and layers 1-2 sliding: the full group moves every position but the last, the
    windowed group only its window, from a PCP=2 producer (interleave 2, block 4) to one rank (block 8). Then a
    prompt sharing 24 positions with a pulled one: the consumer's prefix hit keeps only the window's blocks of the
    windowed group and pulls the rest."""
    folder = save_tiny_window_model(str(tmp_path / "qwen2"), "qwen2", seed=1)  # 2 KV heads
    with LLM(folder, prefill_context_parallel_size=2, cp_kv_cache_interleave_size=2, block_size=4,
             kv_transfer_config=transfer("kv_producer", free_ports(3)), **COMMON) as producer, \
         LLM(folder, block_size=8, kv_transfer_config=transfer("kv_consumer", free_ports(2)), **COMMON) as consumer:
        pulled = run_pair(producer, consumer, consumer, PROMPTS)
        assert pulled == [(2 * (n - 1 + window_rows(n)), 0) for n in (1, 13, 37)]  # 2 KV heads, both groups
        second = PROMPTS["len37"][:24] + random_prompt(20, seed=20)
        [(rows, hits)] = run_pair(producer, consumer, consumer, {"hit": second})
        assert (rows, hits) == (2 * (len(second) - 1 - 24 + window_rows(len(second))), 24)


def test_every_layer_sliding_from_one_rank_to_tp2_dcp2(tmp_path):
    """Mistral, every layer windowed: the consumer's table starts with freed entries and holds only the window."""
    folder = save_tiny_window_model(str(tmp_path / "mistral"), "mistral", seed=1, num_key_value_heads=1)
    with LLM(folder, block_size=4, kv_transfer_config=transfer("kv_producer", free_ports(2)),
             **COMMON) as producer, \
         LLM(folder, tensor_parallel_size=2, decode_context_parallel_size=2, cp_kv_cache_interleave_size=2,
             block_size=8, kv_transfer_config=transfer("kv_consumer", free_ports(3)), **COMMON) as consumer:
        rows = [r for r, _ in run_pair(producer, consumer, producer, PROMPTS)]
        assert rows[0] == 0 and 0 < rows[2] < WINDOW  # the driver's share of the window, never the prompt


def test_sparse_mla_latents_and_index_keys_to_tp2_dcp2(tmp_path):
    """DeepSeek-V3.2's layers: each position's latent row and indexer key land on their DCP owner, and the
    consumer's selection over its shards (13 and 37 positions, 8 selected) picks what one rank picks."""
    folder = save_tiny_sparse(str(tmp_path / "v32"), "v32", seed=1)
    with LLM(folder, block_size=4, kv_transfer_config=transfer("kv_producer", free_ports(2)),
             **COMMON) as producer, \
         LLM(folder, tensor_parallel_size=2, decode_context_parallel_size=2, block_size=8,
             kv_transfer_config=transfer("kv_consumer", free_ports(3)), **COMMON) as consumer:
        rows = [r for r, _ in run_pair(producer, consumer, producer, PROMPTS)]
        assert rows[1:] == [6, 18]  # one latent row per position, half the positions on the driver (DCP=2)


STATES = dict(COMMON, max_num_seqs=4)  # the tiny hybrids' states: 4 live and 4 held slots in the 1 MiB budget


def test_gated_delta_states_from_one_rank_to_tp2_with_prefix_hits(tmp_path):
    """Qwen3.5 (6 DeltaNet layers, 2 full): the states after P - 1 tokens, saved in a held slot on the producer,
    land in the consumer's live slot cut for TP=2 (each rank its q, k and v channels of the convolution and its
    value heads). Both sides cache prefixes (states in snapshots): a consumer hit pulls the rest, and the state."""
    folder = save_tiny_hybrid(str(tmp_path / "qwen3_5"), "qwen3_5", seed=1)
    with LLM(folder, block_size=4, enable_prefix_caching=True, kv_transfer_config=transfer("kv_producer", free_ports(2)),
             **STATES) as producer, \
         LLM(folder, tensor_parallel_size=2, block_size=8, enable_prefix_caching=True,
             kv_transfer_config=transfer("kv_consumer", free_ports(3)), **STATES) as consumer:
        pulled = run_pair(producer, consumer, producer, PROMPTS)
        assert [rows for rows, _ in pulled] == [0, 12, 36]  # the driver holds 1 of the full layers' 2 KV heads
        consumer.generate({"prompt_token_ids": PROMPTS["len37"]}, greedy())  # its snapshot at position 32
        second = PROMPTS["len37"][:32] + random_prompt(12, seed=20)
        assert run_pair(producer, consumer, producer, {"hit": second}) == [(43 - 32, 32)]  # the rest and the state


def test_kda_states_and_mla_latents_from_pcp2_to_one_rank(tmp_path):
    """Kimi Linear (KDA state layers beside MLA layers): both PCP copies hold the states, the consumer reads one."""
    folder = save_tiny_kimi(str(tmp_path / "kimi"), seed=1)
    with LLM(folder, prefill_context_parallel_size=2, cp_kv_cache_interleave_size=2, block_size=4,
             kv_transfer_config=transfer("kv_producer", free_ports(3)), **STATES) as producer, \
         LLM(folder, block_size=8, kv_transfer_config=transfer("kv_consumer", free_ports(2)), **STATES) as consumer:
        run_pair(producer, consumer, consumer, PROMPTS)


def test_a_producer_of_another_model_is_refused_by_its_signature(tmp_path):
    """A consumer whose KV groups differ from the producer's (every layer windowed there, none here) fails the
    pull by name before it reads a row, and holds nothing after."""
    windowed = save_tiny_window_model(str(tmp_path / "mistral"), "mistral", seed=1)
    full = save_tiny_hf_model(str(tmp_path / "llama"), "llama", seed=1, num_hidden_layers=2)
    with LLM(windowed, block_size=4, kv_transfer_config=transfer("kv_producer", free_ports(2)),
             **COMMON) as producer, \
         LLM(full, block_size=8, kv_transfer_config=transfer("kv_consumer", free_ports(2)), **COMMON) as consumer:
        params = prefill(producer, PROMPTS["len13"]).kv_transfer_params
        with pytest.raises(RuntimeError, match="could not be pulled.*another model"):
            consumer.generate({"prompt_token_ids": PROMPTS["len13"]}, greedy(kv_transfer_params=params))
        assert consumer.engine.pool.num_used == 0
