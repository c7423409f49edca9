"""Shared pieces of the multi-rank tests: layouts, the workload, KV pool sizing, and comparisons.

A layout runs as one LLM (real processes on gloo); its outputs are compared
with the single-rank engine's on the same workload. Everything here is plain
Python so a test module decides what to launch and when.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from cpllm import LLM, SamplingParams
from reference import as_float
from tiny_models import save_tiny_hf_model

BLOCK_SIZE = 4
MAX_MODEL_LEN = 256
MAX_NUM_BATCHED_TOKENS = 9
"""Small enough that the 13- and 37-token prompts take several steps and decodes ride along with chunks."""
HEAD_DIM = 16
NUM_LAYERS = 2
FLOAT32_BYTES = 4
LOGPROB_ATOL = 1e-4
SHARED_PREFIX = 24
"""Tokens the prefix-sharing prompt has in common with the 37-token prompt."""
LONG_PROMPT = 37
MODEL_SEED = 1
"""Seed of the tiny models the layout modules share."""
MODELS = {"kv2": {}, "kv1": {"num_key_value_heads": 1}}
"""Default tiny Llama (4 heads, 2 KV heads) and one KV head, which DCP=2 with TP=2 needs."""
KV_HEADS = {"kv2": 2, "kv1": 1}


@dataclass(frozen=True, slots=True)
class Layout:
    """One parallel layout of the engine and the workload it runs."""

    tp: int
    pcp: int
    dcp: int
    interleave: int = 1
    strategy: str = "allgather"
    max_tokens: int = 16
    """Greedy tokens generated per request (compared against the reference's first ones)."""
    transport: str = "auto"
    """--collective-transport: "gloo" also runs decode without the PCP splits of the MLP and LM head."""

    @property
    def cp_size(self) -> int:
        return self.pcp * self.dcp

    @property
    def world_size(self) -> int:
        return self.tp * self.pcp

    def label(self) -> str:
        strategy = f"-{self.strategy}" if self.pcp > 1 else ""
        transport = "" if self.transport == "auto" else f"-{self.transport}"
        return f"tp{self.tp}-pcp{self.pcp}-dcp{self.dcp}-i{self.interleave}{strategy}{transport}"

    def engine_options(self) -> dict:
        return dict(
            tensor_parallel_size=self.tp,
            prefill_context_parallel_size=self.pcp,
            decode_context_parallel_size=self.dcp,
            cp_kv_cache_interleave_size=self.interleave,
            cp_prefill_strategy=self.strategy,
            collective_transport=self.transport,
        )


def local_kv_heads(kv_heads: int, tp: int) -> int:
    """KV heads one rank stores: split over TP when there are enough of them, else one replicated head group."""
    return kv_heads // tp if kv_heads >= tp else 1


def kv_bytes_per_block(kv_heads: int, tp: int, block_size: int = BLOCK_SIZE) -> int:
    """Per-rank bytes of one KV block of the tiny models: layers x (K, V) x tokens x heads x head_dim x fp32."""
    return NUM_LAYERS * 2 * block_size * local_kv_heads(kv_heads, tp) * HEAD_DIM * FLOAT32_BYTES


def kv_bytes_for_group_tokens(tokens: int, kv_heads: int, layout: Layout) -> tuple[int, int]:
    """(kv_cache_memory_bytes per rank, blocks per rank) so that the CP group holds about `tokens` tokens."""
    num_blocks = tokens // (BLOCK_SIZE * layout.cp_size)
    return num_blocks * kv_bytes_per_block(kv_heads, layout.tp), num_blocks


def random_prompt(length: int, seed: int, vocab_size: int = 300) -> list[int]:
    rng = random.Random(1000 + seed)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def workload_prompts(pcp: int) -> dict[str, list[int]]:
    """Prompts of lengths {1, 2*PCP-1, 13, 37} plus one sharing a 24-token prefix with the 37-token one.

    Named by length so a layout's prompts are a subset of the reference's (the same
    length always gives the same tokens).
    """
    lengths = sorted({1, 2 * pcp - 1, 13, LONG_PROMPT})
    prompts = {f"len{n}": random_prompt(n, seed=n) for n in lengths}
    prompts["shared"] = prompts[f"len{LONG_PROMPT}"][:SHARED_PREFIX] + random_prompt(7, seed=99)
    return prompts


def reference_prompts() -> dict[str, list[int]]:
    """Every prompt any layout of the suite uses (PCP in {1, 2, 4})."""
    merged: dict[str, list[int]] = {}
    for pcp in (1, 2, 4):
        merged.update(workload_prompts(pcp))
    return merged


def greedy_params(max_tokens: int, *, prompt_logprobs: bool) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1,
                          prompt_logprobs=1 if prompt_logprobs else None)


def generate_counted(llm: LLM, prompts: dict[str, list[int]], params: SamplingParams, tag: str) -> dict:
    """Run `prompts` to completion through the engine's step loop; every request must finish exactly once.

    `tag` makes the request ids of this pass unique. Returns name -> final RequestOutput.
    """
    engine = llm.engine
    ids = {}
    for name, token_ids in prompts.items():
        request_id = f"{tag}-{name}"
        engine.add_request(request_id, token_ids, params)
        ids[request_id] = name
    finished: dict[str, object] = {}
    max_steps = 50 * sum(len(p) + params.max_tokens for p in prompts.values())  # a hang guard, never reached
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if not output.finished:
                continue
            assert output.request_id in ids, f"unknown request {output.request_id!r} came back"
            assert output.request_id not in finished, f"request {output.request_id!r} came back twice"
            finished[output.request_id] = output
    assert not engine.has_unfinished_requests(), f"requests still running after {max_steps} steps"
    assert sorted(finished) == sorted(ids), f"missing: {sorted(set(ids) - set(finished))}"
    return {ids[request_id]: output for request_id, output in finished.items()}


def sampled_logprobs(output) -> list[float]:
    completion = output.outputs[0]
    return [as_float(step[token]) for step, token in zip(completion.logprobs, completion.token_ids)]


def prompt_logprob_values(output) -> list[float]:
    ids = output.prompt_token_ids
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(ids)
    assert output.prompt_logprobs[0] is None
    return [as_float(output.prompt_logprobs[i][ids[i]]) for i in range(1, len(ids))]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def assert_same_greedy(got, want, *, what: str, prompt_logprobs: bool, atol: float = LOGPROB_ATOL) -> None:
    """`got` is a prefix-length run of `want` (the reference may have generated more tokens)."""
    tokens = got.outputs[0].token_ids
    n = len(tokens)
    assert n > 0 and len(want.outputs[0].token_ids) >= n, what
    expected = want.outputs[0].token_ids[:n]
    assert tokens == expected, f"{what}: greedy tokens differ\n{tokens}\n{expected}"
    diff = max_abs_diff(sampled_logprobs(got), sampled_logprobs(want)[:n])
    assert diff <= atol, f"{what}: sampled-token logprobs differ by {diff:.3g}"
    if prompt_logprobs:
        diff = max_abs_diff(prompt_logprob_values(got), prompt_logprob_values(want))
        assert diff <= atol, f"{what}: prompt logprobs differ by {diff:.3g}"
    else:
        assert got.prompt_logprobs is None, f"{what}: prompt logprobs returned without being asked for"


class LaunchCache:
    """Module-wide cache of tiny model folders, single-rank references and one launch per layout.

    A module subclasses it with its own `_launch(layout)` (and usually `reference(model)`); a launch that
    failed is not retried: later tests that need it see its error again.
    """

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._folders: dict[str, str] = {}
        self._references: dict[str, dict] = {}
        self._runs: dict = {}

    def folder(self, model: str) -> str:
        """A saved tiny Llama of MODELS[model] (built once per module)."""
        if model not in self._folders:
            path = str(self._tmp.mktemp(model))
            self._folders[model] = save_tiny_hf_model(path, "llama", seed=MODEL_SEED, **MODELS[model])
        return self._folders[model]

    def run(self, layout: Layout):
        """The layout's results, launching it on first use."""
        if layout not in self._runs:
            try:
                self._runs[layout] = self._launch(layout)
            except Exception as error:
                self._runs[layout] = error
                raise
        result = self._runs[layout]
        if isinstance(result, BaseException):
            raise RuntimeError(f"{layout.label()} failed in an earlier test: {result}") from result
        return result

    def _launch(self, layout: Layout):
        raise NotImplementedError
