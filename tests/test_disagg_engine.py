"""Disaggregated prefill/decode between two engines of different layouts (cpllm/disagg, docs/disaggregated.md).

A producer prefills each prompt (max_tokens 1, do_remote_decode) and keeps its blocks; a consumer of another
layout pulls the K/V of every prompt position but the last over ZeroMQ, re-sharded to its own ranks, block size
and pools, computes the last prompt token and decodes. Its greedy tokens must be the single-rank engine's and its
logprobs within 1e-4; the producer frees the blocks once released, or after its abort timeout when nobody pulls.
"""

from __future__ import annotations

import socket
import time

import pytest

from cpllm import LLM, SamplingParams
from parallel_helpers import assert_same_greedy, random_prompt
from tiny_models import save_tiny_hf_model

MAX_TOKENS = 8
PROMPTS = {"len1": random_prompt(1, seed=1), "len13": random_prompt(13, seed=13), "len37": random_prompt(37, seed=37)}
COMMON = dict(max_model_len=128, max_num_batched_tokens=16, threads_per_rank=1, distributed_timeout=60,
              kv_cache_memory_bytes=1 << 20)


def free_ports(count: int) -> int:
    """A base port with `count` consecutive ports free a moment ago (the control port and one per rank)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65000:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def transfer(role: str, port: int, **extra) -> dict:
    config = {"kv_connector": "CpllmConnector", "kv_role": role, "kv_ip": "127.0.0.1", "kv_port": port}
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def greedy(**extra_args) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1,
                          extra_args=extra_args or None)


def prefill(producer: LLM, prompt: list[int]):
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    out = producer.generate({"prompt_token_ids": prompt}, params)[0]
    assert out.kv_transfer_params is not None and out.kv_transfer_params["do_remote_prefill"]
    return out


def disaggregated(producer: LLM, consumer: LLM, reference: LLM, kv_heads: int) -> None:
    """Every prompt: prefill on the producer, decode on the consumer, compared with `reference` (one rank)."""
    stats = consumer.engine.executor.rank_stats  # the consumer's driver rank's counters
    for name, prompt in PROMPTS.items():
        first = prefill(producer, prompt)
        before = stats().kv_rows_pulled
        got = consumer.generate({"prompt_token_ids": prompt},
                                greedy(kv_transfer_params=first.kv_transfer_params))[0]
        want = reference.generate({"prompt_token_ids": prompt}, greedy())[0]
        assert_same_greedy(got, want, what=name, prompt_logprobs=False)
        assert first.outputs[0].token_ids == want.outputs[0].token_ids[:1], name
        # every position but the last, each KV head once, summed over the consumer's ranks (the driver's share)
        assert stats().kv_rows_pulled - before == _driver_share(consumer, len(prompt) - 1, kv_heads), name
        producer.engine.step()  # takes the consumer's release
        assert producer.engine.scheduler.held == {}, name
        assert producer.engine.pool.num_used == 0, name


def _driver_share(consumer: LLM, positions: int, kv_heads: int) -> int:
    """Rows the consumer's driver rank owns: its positions of the layout times its KV heads."""
    from cpllm.disagg.reshard import CacheLayout

    config = consumer.engine.config
    layout = CacheLayout(dims=config.parallel.dims, interleave=config.parallel.cp_kv_cache_interleave_size,
                         block_size=config.cache.block_size)
    owned = sum(1 for p in range(positions) if layout.owner(p) == layout.shard_rank(0))
    return owned * len(layout.heads(kv_heads, 0))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {"kv2": save_tiny_hf_model(str(tmp_path_factory.mktemp("kv2")), "llama", seed=3),
            "kv1": save_tiny_hf_model(str(tmp_path_factory.mktemp("kv1")), "llama", seed=3, num_key_value_heads=1)}


@pytest.mark.parametrize("kv_layout", ["sharded", "replicated"])
def test_pcp2_producer_to_one_rank_consumer(folders, monkeypatch, kv_layout):
    """Sharded: each position from the PCP rank that owns it; replicated: both PCP ranks hold every position."""
    # 2 KiB messages: 4 positions of the tiny model's 2 KV heads each, so a move goes as several messages
    monkeypatch.setattr("cpllm.disagg.rank_transfer.MESSAGE_BYTES", 2048)
    p_port, c_port = free_ports(3), free_ports(2)
    with LLM(folders["kv2"], prefill_context_parallel_size=2, cp_kv_cache_interleave_size=2, block_size=4,
             cp_kv_cache_layout=kv_layout, kv_transfer_config=transfer("kv_producer", p_port),
             **COMMON) as producer, \
         LLM(folders["kv2"], block_size=8, enable_prefix_caching=False,
             kv_transfer_config=transfer("kv_consumer", c_port), **COMMON) as consumer:
        disaggregated(producer, consumer, consumer, kv_heads=2)
        # 12 and 36 positions pulled, at most 4 a message; both instances on this host: every one via /dev/shm
        stats = consumer.engine.executor.rank_stats()
        assert stats.kv_messages_pulled >= 12 // 4 + 36 // 4
        assert stats.kv_messages_by_shm == stats.kv_messages_pulled


def test_one_rank_producer_to_tp2_dcp2_consumer(folders):
    p_port, c_port = free_ports(2), free_ports(3)
    with LLM(folders["kv1"], block_size=8, enable_prefix_caching=False,
             kv_transfer_config=transfer("kv_producer", p_port), **COMMON) as producer, \
         LLM(folders["kv1"], tensor_parallel_size=2, decode_context_parallel_size=2, block_size=4,
             kv_transfer_config=transfer("kv_consumer", c_port, transfer_timeout_s=5.0, shared_memory=False),
             **COMMON) as consumer:
        disaggregated(producer, consumer, producer, kv_heads=1)
        assert consumer.engine.executor.rank_stats().kv_messages_by_shm == 0  # shared_memory off: TCP
        # then the producer's row server dies: both consumer ranks fail their pull and agree to end the request
        first = prefill(producer, PROMPTS["len13"])
        producer.engine.executor.close_kv_row_server()
        with pytest.raises(RuntimeError, match="could not be pulled from the prefill instance"):
            consumer.generate({"prompt_token_ids": PROMPTS["len13"]},
                              greedy(kv_transfer_params=first.kv_transfer_params))
        assert_pull_failure_left_nothing(consumer, producer)


def test_prefix_hit_on_the_consumer_pulls_only_the_rest(folders):
    """The consumer holds the first 24 positions of the second prompt (the first one's blocks, pulled and
    registered): it pulls only positions 24 .. P-2, and its tokens are still the single rank's."""
    first_prompt = random_prompt(37, seed=37)
    second_prompt = first_prompt[:24] + random_prompt(13, seed=14)
    with LLM(folders["kv2"], block_size=4, kv_transfer_config=transfer("kv_producer", free_ports(2)),
             **COMMON) as producer, \
         LLM(folders["kv2"], block_size=8, kv_transfer_config=transfer("kv_consumer", free_ports(2)),
             **COMMON) as consumer:
        stats, scheduler = consumer.engine.executor.rank_stats, consumer.engine.scheduler
        for name, prompt, hit in (("first", first_prompt, 0), ("second", second_prompt, 24)):
            params = prefill(producer, prompt).kv_transfer_params
            rows, hits = stats().kv_rows_pulled, scheduler.num_prefix_hit_tokens
            got = consumer.generate({"prompt_token_ids": prompt}, greedy(kv_transfer_params=params))[0]
            assert scheduler.num_prefix_hit_tokens - hits == hit, name
            assert stats().kv_rows_pulled - rows == (len(prompt) - 1 - hit) * 2, name  # 2 KV heads
            want = producer.generate({"prompt_token_ids": prompt}, greedy())[0]
            assert_same_greedy(got, want, what=name, prompt_logprobs=False)
        producer.engine.step()  # takes the releases
        assert producer.engine.scheduler.held == {}


def test_speculation_on_the_consumer(folders):
    """Prompt-lookup drafts (no draft cache to move) verified on the consumer after the pull: the single rank's
    tokens, with drafts accepted."""
    pattern = random_prompt(7, seed=7)
    prompt = (pattern * 4)[:26]  # repeats: the lookup finds drafts and the tiny model follows some
    with LLM(folders["kv2"], block_size=4, kv_transfer_config=transfer("kv_producer", free_ports(2)),
             **COMMON) as producer, \
         LLM(folders["kv2"], block_size=8, kv_transfer_config=transfer("kv_consumer", free_ports(2)), **COMMON,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                 "prompt_lookup_min": 1}) as consumer:
        params = prefill(producer, prompt).kv_transfer_params
        sampling = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1,
                                  extra_args={"kv_transfer_params": params})
        got = consumer.generate({"prompt_token_ids": prompt}, sampling)[0]
        want = producer.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16,
                                                                              ignore_eos=True, logprobs=1))[0]
        assert_same_greedy(got, want, what="ngram on the consumer", prompt_logprobs=False)
        totals = consumer.engine.spec_decode_totals
        assert totals.num_drafts > 0 and totals.num_accepted_tokens > 0, totals


def test_unpulled_blocks_freed_after_abort_timeout(folders):
    with LLM(folders["kv2"], block_size=4, kv_transfer_config=transfer("kv_producer", free_ports(2),
                                                                         abort_timeout_s=0.5), **COMMON) as producer:
        first = prefill(producer, PROMPTS["len13"])
        held = first.kv_transfer_params["remote_block_ids"]
        assert producer.engine.scheduler.held[first.request_id][0] == held and producer.engine.pool.num_used > 0
        time.sleep(1.0)
        producer.engine.step()
        assert producer.engine.scheduler.held == {} and producer.engine.pool.num_used == 0
        assert producer.engine.kv_transfer.num_expired == 1


def test_refusals(folders):
    from cpllm.disagg.config import kv_transfer_config

    with pytest.raises(ValueError, match="kv_connector='NixlConnector'"):
        kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="kv_role='kv_sender'"):
        kv_transfer_config({"kv_connector": "CpllmConnector", "kv_role": "kv_sender"})
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        LLM(folders["kv2"], data_parallel_size=2, kv_transfer_config=transfer("kv_both", 20000), **COMMON)
    with pytest.raises(ValueError, match="speculative_config method='draft_model'"):
        LLM(folders["kv2"], kv_transfer_config=transfer("kv_both", 20000), **COMMON,
            speculative_config={"method": "draft_model", "model": folders["kv2"], "num_speculative_tokens": 2})
    with LLM(folders["kv2"], **COMMON) as plain:
        with pytest.raises(ValueError, match="needs an engine started with kv_transfer_config"):
            prefill(plain, PROMPTS["len13"])
        assert not plain.engine.has_unfinished_requests()
    with LLM(folders["kv2"], kv_transfer_config=transfer("kv_consumer", free_ports(2)), **COMMON) as consumer:
        with pytest.raises(ValueError, match="do_remote_decode on an instance with kv_role='kv_consumer'"):
            prefill(consumer, PROMPTS["len13"])
        with pytest.raises(ValueError, match="prompt_logprobs with do_remote_prefill"):
            params = SamplingParams(max_tokens=2, prompt_logprobs=1, extra_args={"kv_transfer_params": {
                "do_remote_prefill": True, "remote_block_ids": [0], "remote_engine_id": "e", "remote_host": "h",
                "remote_port": 1, "remote_request_id": "r"}})
            consumer.generate({"prompt_token_ids": PROMPTS["len13"]}, params)
        with pytest.raises(ValueError, match="lacks 'remote_block_ids'"):
            consumer.generate({"prompt_token_ids": PROMPTS["len13"]},
                              greedy(kv_transfer_params={"do_remote_prefill": True}))


def test_a_pull_after_the_abort_timeout_is_refused(folders):
    """The blocks went back to the pool: the consumer's pull fails naming the request, instead of reading them."""
    with LLM(folders["kv2"], block_size=4, kv_transfer_config=transfer("kv_producer", free_ports(2),
                                                                         abort_timeout_s=0.5), **COMMON) as producer:
        first = prefill(producer, PROMPTS["len13"])
        time.sleep(1.0)
        producer.engine.step()
        with LLM(folders["kv2"], block_size=8, kv_transfer_config=transfer("kv_consumer", free_ports(2)),
                 **COMMON) as consumer:
            with pytest.raises(RuntimeError, match="could not be pulled from the prefill instance.*is not held here"):
                consumer.generate({"prompt_token_ids": PROMPTS["len13"]},
                                  greedy(kv_transfer_params=first.kv_transfer_params))
            assert_pull_failure_left_nothing(consumer, producer)


def assert_pull_failure_left_nothing(consumer: LLM, reference: LLM) -> None:
    """The failed request holds no block of the consumer, and none of its rows went into the prefix cache: the
    same prompt computed there (a prefix hit would read the pulled rows) is the reference's."""
    assert not consumer.engine.has_unfinished_requests() and consumer.engine.pool.num_used == 0
    want = reference.generate({"prompt_token_ids": PROMPTS["len13"]}, greedy())[0]
    for _ in range(2):  # the second run hits the first's blocks
        got = consumer.generate({"prompt_token_ids": PROMPTS["len13"]}, greedy())[0]
        assert_same_greedy(got, want, what="after the failed pull", prompt_logprobs=False)


def test_a_producer_that_dies_mid_transfer_fails_only_the_request(folders):
    """The producer's control port grants the lease, then its rank's row server is gone: the pull times out, the
    request ends with an error naming the failure, the consumer frees its blocks and serves on."""
    with LLM(folders["kv2"], block_size=4, kv_transfer_config=transfer("kv_producer", free_ports(2)),
             **COMMON) as producer, \
         LLM(folders["kv2"], block_size=8, kv_transfer_config=transfer("kv_consumer", free_ports(2),
                                                                         transfer_timeout_s=1.0), **COMMON) as consumer:
        first = prefill(producer, PROMPTS["len13"])
        producer.engine.executor.close_kv_row_server()  # the rows' server dies, the control port lives
        with pytest.raises(RuntimeError, match="could not be pulled from the prefill instance.*no answer from "
                                               "127.0.0.1:.* to 'rows' within 1.0 s"):
            consumer.generate({"prompt_token_ids": PROMPTS["len13"]},
                              greedy(kv_transfer_params=first.kv_transfer_params))
        assert_pull_failure_left_nothing(consumer, producer)
