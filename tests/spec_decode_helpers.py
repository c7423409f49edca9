"""A tiny model whose greedy tokens follow a fixed successor map, so that prompt lookup's drafts are mostly right.

The LM head's row for token s(a) is a's embedding (times `scale`): the residual stream of a position still holds
mostly its own token's embedding, so the logits peak on the successor of the current token, and the layers (random,
attention sharpened as in tests/tiny_models.py) move them a little, so some tokens leave the map. The successor map
is cycles of CYCLE tokens over a random order of the vocabulary: a prompt that walks a cycle once is then copied by
the model, and lookup drafts it.

Also what the speculative decoding tests share: running a phase of requests to the end, the per-step block check,
and the sampled-token counts with their statistical bound.
"""

from __future__ import annotations

import collections
import random

import torch

from cpllm import LLM, SamplingParams
from tiny_models import make_tiny_hf_model, tiny_hf_tokenizer

CYCLE = 8
"""Tokens in each cycle of the successor map."""


def successor_map(vocab: int, seed: int) -> dict[int, int]:
    """Token -> its successor: cycles of CYCLE tokens in a random order, the leftover tokens their own successor."""
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist()
    successor = {t: t for t in order}
    for i in range(0, vocab - vocab % CYCLE, CYCLE):
        cycle = order[i : i + CYCLE]
        successor.update(zip(cycle, cycle[1:] + cycle[:1]))
    return successor


def save_cycle_model(folder: str, *, seed: int = 1, scale: float = 1.0, **overrides) -> tuple[str, dict[int, int]]:
    """The tiny Llama of tests/tiny_models.py with its LM head set so greedy decoding follows `successor_map`."""
    model = make_tiny_hf_model("llama", seed=seed, **overrides)
    successor = successor_map(model.config.vocab_size, seed)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # [vocab, hidden]
        head = torch.zeros_like(model.lm_head.weight)
        for token, nxt in successor.items():
            head[nxt] = embed[token] * scale
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder, successor


def walk(successor: dict[int, int], start: int, length: int) -> list[int]:
    """`length` tokens following the map from `start`."""
    tokens = [start]
    while len(tokens) < length:
        tokens.append(successor[tokens[-1]])
    return tokens


def random_tokens(length: int, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


SAMPLED_DRAWS = 4000
SAMPLED_TV_BOUND = 0.08
"""Two independent samples of 4000 over at most 16 outcomes (top_k=2, 4 tokens): the expected total-variation
distance between their empirical distributions is about 0.5 * sum_t sqrt(4 p_t (1 - p_t) / (pi N)) <= 0.036; the
bound is over twice that. Seeds are fixed, so the test is deterministic."""


def sampled_counts(folder: str, prompt: list[int], spec: dict | None, seed: int):
    params = [SamplingParams(n=SAMPLED_DRAWS // 4, seed=seed + 10_000 * i, temperature=1.0, top_k=2, max_tokens=4,
                             ignore_eos=True) for i in range(4)]
    with LLM(folder, block_size=4, max_model_len=128, max_num_seqs=128, max_num_batched_tokens=1024,
             kv_cache_memory_bytes=2**22, threads_per_rank=1, speculative_config=spec) as llm:
        outputs = llm.generate([{"prompt_token_ids": prompt}] * 4, params)
        counts = collections.Counter(tuple(c.token_ids) for output in outputs for c in output.outputs)
        return counts, llm.engine.spec_decode_totals


def check_blocks(engine) -> None:
    """After every step, each decoding request holds the target blocks of its computed tokens and no more."""
    v = engine.tokens_per_block
    for request in engine.scheduler.running:
        if request.num_tokens - request.num_computed_tokens == 1:
            held = engine.scheduler.request_blocks(request.request_id)[0]
            assert held == -(-request.num_computed_tokens // v), (request.request_id, held)


def run_phase(engine, number: int, phase: dict, check_step=None) -> dict:
    """Add the phase's requests together (ids "<number>-<name>") and step the engine until they finish, calling
    `check_step(engine)` after every step; request id -> final output."""
    for name, (prompt, params) in phase.items():
        engine.add_request(f"{number}-{name}", prompt, params)
    outputs = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        if check_step is not None:
            check_step(engine)
    assert not engine.has_unfinished_requests()
    return outputs
