"""Engine-level context-parallel checks beyond the layout matrix: bf16, seeded n > 1 sampling, DP x PCP x TP in
one world, and shared-prefix decode on a CP group of several ranks.

Real processes on gloo through the offline LLM API (see test_parallel_layouts.py); every layout launches once per
module and runs all the workloads its tests read. References are single-rank engines on the same weights:
- fp32, prefix caching off, so its slots are disjoint and its decode batches of 3-4 requests take the padded path:
  the layouts' shared-key decodes (run with the kernels off: `Setup.kernels`) are compared against the other
  code path;
- bf16, for the bf16 layouts.

Prompt logprob values are those of the sharpened tiny models (tests/tiny_models.py): logits of std ~0.16, so
logprobs sit near -log(300) = -5.7 and the greedy margins are ~1e-3..5e-2.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

import cpllm.layers.gqa.shared_keys as shared_keys_module
from cpllm import LLM, SamplingParams
from parallel_helpers import LaunchCache, max_abs_diff, prompt_logprob_values, random_prompt, sampled_logprobs
from reference import as_float
from tiny_models import save_tiny_hf_model

SEED = 2
MODELS = {"kv1": {"num_key_value_heads": 1}, "kv2": {}}
"""One KV head (TP=2 replicates it, so DCP=2 is allowed) and the default 2 KV heads (split over TP=2)."""
COMMON = dict(block_size=4, max_model_len=128, max_num_batched_tokens=32, kv_cache_memory_bytes=2**20,
              threads_per_rank=1, distributed_timeout=60)
"""A 32-token step budget: the 45-token prompts are chunked, the 4 shared-prefix suffixes prefill in one step."""
LOGPROB_ATOL = 1e-4

# --- workloads ------------------------------------------------------------------------------------------------

PROMPT_LENGTHS = (3, 29, 45)
"""Prompt logprob workload (bf16 and DP): a prompt shorter than 2*PCP, one chunk, two chunks."""
GREEDY_TOKENS = 6


def greedy(max_tokens: int, *, prompt_logprobs: bool = False) -> SamplingParams:
    """Greedy with the top-2 logprobs per step (the margin between them tells a near tie)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2,
                          prompt_logprobs=1 if prompt_logprobs else None)


def logprob_prompts() -> list[list[int]]:
    return [random_prompt(n, seed=200 + n) for n in PROMPT_LENGTHS]


SAMPLED_TOKENS = 8
SAMPLING_REQUESTS = (  # (prompt length, params)
    (11, SamplingParams(n=3, temperature=0.8, seed=1234, max_tokens=SAMPLED_TOKENS, ignore_eos=True, logprobs=1)),
    (23, SamplingParams(n=3, temperature=0.8, seed=99, top_k=40, max_tokens=SAMPLED_TOKENS, ignore_eos=True,
                        logprobs=1)),
    (30, SamplingParams(n=3, temperature=0.8, seed=7, top_p=0.9, max_tokens=SAMPLED_TOKENS, ignore_eos=True,
                        logprobs=1)),
    (17, SamplingParams(n=1, temperature=0.8, seed=2024, max_tokens=SAMPLED_TOKENS, ignore_eos=True, logprobs=1)),
)
"""Several seeded requests, three of them with n=3 (children seeded seed+index), run together in one batch."""

SHARED_PREFIX = 48
"""Whole virtual blocks for cp_size 1, 2 and 4 (block_size 4): every request hits all of it in the prefix cache."""
SHARED_SUFFIX = 5
SHARED_REQUESTS = 4
SHARED_TOKENS = 8
"""Decode steps of the shared batch: 4 x (48 + 5 + g) keys against a union of 48 + 4 x (5 + g) stays on the shared
path (len(members) * union <= 2 * sum(lengths)) while g <= 19."""


def shared_prefix_prompts() -> tuple[list[int], list[list[int]]]:
    prefix = random_prompt(SHARED_PREFIX, seed=480)
    return prefix, [prefix + random_prompt(SHARED_SUFFIX, seed=500 + i) for i in range(SHARED_REQUESTS)]


def as_inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


class SharedKeySpy:
    """Counts `_shared_key_batch` calls (member counts) on this process, i.e. on global rank 0 (the driver runs
    its own ModelRunner in-process; the other ranks build the same metadata in their own interpreters)."""

    def __init__(self):
        self.member_counts: list[int] = []

    def __enter__(self) -> "SharedKeySpy":
        self._original = original = shared_keys_module._shared_key_batch

        def spy(requests, members, union, lengths):
            self.member_counts.append(len(members))
            return original(requests, members, union, lengths)

        shared_keys_module._shared_key_batch = spy
        return self

    def __exit__(self, *exc) -> None:
        shared_keys_module._shared_key_batch = self._original


@dataclass
class Run:
    """What one LLM produced on the workloads it was given (None: not run)."""

    logprob_outputs: list | None = None
    sampling_outputs: list | None = None
    shared_outputs: list | None = None
    shared_member_counts: list[int] = field(default_factory=list)
    """Members of each shared-key decode batch built on rank 0 during the shared-prefix batch."""
    shared_prefix_hits: int = 0
    replica0_requests: set[str] = field(default_factory=set)
    """Under DP: ids of the requests the front gave to replica 0."""


def run_logprobs(llm: LLM, run: Run) -> None:
    run.logprob_outputs = llm.generate(as_inputs(logprob_prompts()), greedy(GREEDY_TOKENS, prompt_logprobs=True))


def run_sampling(llm: LLM, run: Run) -> None:
    prompts = [random_prompt(n, seed=300 + n) for n, _ in SAMPLING_REQUESTS]
    run.sampling_outputs = llm.generate(as_inputs(prompts), [params for _, params in SAMPLING_REQUESTS])


def run_shared_prefix(llm: LLM, run: Run) -> None:
    prefix, prompts = shared_prefix_prompts()
    llm.generate(as_inputs([prefix]), greedy(1))  # fills the prefix cache (when it is on)
    scheduler = llm.engine.scheduler
    hits_before = scheduler.num_prefix_hit_tokens
    with SharedKeySpy() as spy:
        run.shared_outputs = llm.generate(as_inputs(prompts), greedy(SHARED_TOKENS))
    run.shared_member_counts = spy.member_counts
    run.shared_prefix_hits = scheduler.num_prefix_hit_tokens - hits_before


DP_LENGTHS = PROMPT_LENGTHS + (8, 21)


def dp_prompts() -> list[list[int]]:
    return [random_prompt(n, seed=200 + n) for n in DP_LENGTHS]


def run_dp_prompts(llm: LLM, run: Run) -> None:
    """Greedy with prompt logprobs on DP_LENGTHS; under DP, records which requests the front sent replica 0."""
    replicas = getattr(llm.engine, "replicas", None)  # ReplicaFront: each replica its own process tree
    replica0 = replicas[0] if replicas else None
    if replica0 is not None:
        original = replica0.send

        def recording_send(message):
            if message[0] == "add":
                run.replica0_requests.add(message[1])
            return original(message)

        replica0.send = recording_send
    try:
        run.logprob_outputs = llm.generate(as_inputs(dp_prompts()), greedy(GREEDY_TOKENS, prompt_logprobs=True))
    finally:
        if replica0 is not None:
            del replica0.send  # the class's method again


# --- launches -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    model: str
    dtype: str = "float32"
    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    dp: int = 1
    interleave: int = 1
    strategy: str = "allgather"
    prefix_caching: bool = True
    kernels: bool = True
    """False: CPLLM_KERNELS=0 on every rank. Where the C decode kernel runs, decode-only steps read each request's
    own slots; the shared-key form (what CUDA runs) is reached with the kernels off."""
    workloads: tuple = ()

    def label(self) -> str:
        return (f"{self.model}-{self.dtype}-dp{self.dp}-tp{self.tp}-pcp{self.pcp}-dcp{self.dcp}-i{self.interleave}"
                f"-{self.strategy}")

    def options(self) -> dict:
        return dict(COMMON, dtype=self.dtype, tensor_parallel_size=self.tp, prefill_context_parallel_size=self.pcp,
                    decode_context_parallel_size=self.dcp, data_parallel_size=self.dp,
                    cp_kv_cache_interleave_size=self.interleave, cp_prefill_strategy=self.strategy,
                    enable_prefix_caching=self.prefix_caching)


REF_FP32 = Setup("kv1", prefix_caching=False, workloads=(run_logprobs, run_sampling, run_shared_prefix))
REF_BF16 = Setup("kv1", dtype="bfloat16", workloads=(run_logprobs,))
REF_KV2 = Setup("kv2", prefix_caching=False, workloads=(run_dp_prompts,))

PCP2 = Setup("kv1", pcp=2, interleave=2, strategy="ring", kernels=False, workloads=(run_sampling, run_shared_prefix))
TP2_DCP2 = Setup("kv1", tp=2, dcp=2, kernels=False, workloads=(run_sampling, run_shared_prefix))
PCP2_DCP2 = Setup("kv1", tp=2, pcp=2, dcp=2, kernels=False, workloads=(run_sampling, run_shared_prefix))
BF16_PCP2 = Setup("kv1", dtype="bfloat16", pcp=2, workloads=(run_logprobs,))
BF16_TP2_DCP2 = Setup("kv1", dtype="bfloat16", tp=2, dcp=2, interleave=2, workloads=(run_logprobs,))
DP2_PCP2_TP2 = Setup("kv2", dp=2, pcp=2, tp=2, interleave=2, workloads=(run_dp_prompts,))


class Launches(LaunchCache):
    """Model folders (this module's seed) and one run per setup; a launch that failed is not retried."""

    def folder(self, model: str) -> str:
        if model not in self._folders:
            self._folders[model] = save_tiny_hf_model(str(self._tmp.mktemp(model)), "llama", seed=SEED,
                                                      **MODELS[model])
        return self._folders[model]

    def _launch(self, setup: Setup) -> Run:
        run = Run()
        with kernels_on(setup.kernels), LLM(self.folder(setup.model), **setup.options()) as llm:
            for workload in setup.workloads:
                workload(llm, run)
        return run


@contextmanager
def kernels_on(on: bool):
    """CPLLM_KERNELS=0 while the block runs (the spawned ranks inherit it) unless `on`."""
    before = os.environ.get("CPLLM_KERNELS")
    if not on:
        os.environ["CPLLM_KERNELS"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CPLLM_KERNELS", None)
        else:
            os.environ["CPLLM_KERNELS"] = before


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory)


def assert_same_tokens_and_logprobs(got, want, *, what: str, atol: float = LOGPROB_ATOL) -> float:
    """Every completion of `got` (n of them) equals `want`'s token for token, logprobs within `atol`; returns the
    largest logprob difference."""
    assert len(got.outputs) == len(want.outputs), what
    largest = 0.0
    for a, b in zip(got.outputs, want.outputs):
        assert a.index == b.index
        assert a.token_ids == b.token_ids, f"{what} sample {a.index}: tokens differ\n{a.token_ids}\n{b.token_ids}"
        got_lp = [as_float(step[t]) for step, t in zip(a.logprobs, a.token_ids)]
        want_lp = [as_float(step[t]) for step, t in zip(b.logprobs, b.token_ids)]
        diff = max_abs_diff(got_lp, want_lp)
        assert diff <= atol, f"{what} sample {a.index}: logprobs differ by {diff:.3g}"
        largest = max(largest, diff)
    return largest


# --- a. bf16 under PCP and DCP ------------------------------------------------------------------------------------

BF16_VS_FP32_ATOL = 0.02
"""bf16 layouts against the fp32 single-rank engine, prompt and sampled-token logprobs (measured max 6.8e-3)."""
BF16_VS_BF16_ATOL = 0.01
"""bf16 layouts against the bf16 single-rank engine (measured max 4.1e-3: the layouts reduce in other orders, and
the LM head rounds logits of ~0.5 to bf16, an ulp of 3.9e-3, before they become float32)."""
NEAR_TIE = 0.01
"""Greedy tokens are compared up to the first step whose fp32 top-2 logprob margin is below this: a near tie at
bf16 precision (noise above) may legitimately go either way, and every later token then differs."""


def top2_margin(step: dict) -> float:
    first, second = sorted((as_float(v) for v in step.values()), reverse=True)[:2]
    return first - second


def tokens_before_near_tie(fp32_output) -> int:
    completion = fp32_output.outputs[0]
    for k, step in enumerate(completion.logprobs):
        if top2_margin(step) < NEAR_TIE:
            return k
    return len(completion.token_ids)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", [BF16_PCP2, BF16_TP2_DCP2], ids=Setup.label)
def test_bf16_layout_close_to_fp32_and_bf16_single_rank(launches, setup):
    got = launches.run(setup).logprob_outputs
    fp32 = launches.run(REF_FP32).logprob_outputs
    bf16 = launches.run(REF_BF16).logprob_outputs
    compared = 0
    for n, g, f, b in zip(PROMPT_LENGTHS, got, fp32, bf16, strict=True):
        what = f"{setup.label()} len{n}"
        tokens = g.outputs[0].token_ids
        assert len(tokens) == GREEDY_TOKENS, what
        diff_fp32 = max_abs_diff(prompt_logprob_values(g), prompt_logprob_values(f))
        diff_bf16 = max_abs_diff(prompt_logprob_values(g), prompt_logprob_values(b))
        assert diff_fp32 <= BF16_VS_FP32_ATOL, f"{what}: prompt logprobs differ from fp32 by {diff_fp32:.3g}"
        assert diff_bf16 <= BF16_VS_BF16_ATOL, f"{what}: prompt logprobs differ from bf16 by {diff_bf16:.3g}"
        k = tokens_before_near_tie(f)
        compared += k
        for ref, name, atol in ((f, "fp32", BF16_VS_FP32_ATOL), (b, "bf16", BF16_VS_BF16_ATOL)):
            want = ref.outputs[0].token_ids
            assert tokens[:k] == want[:k], f"{what}: greedy tokens differ from {name} single rank\n{tokens}\n{want}"
            lp = max_abs_diff(sampled_logprobs(g)[:k], sampled_logprobs(ref)[:k])
            assert lp <= atol, f"{what}: sampled-token logprobs differ from {name} by {lp:.3g}"
        print(f"{what}: prompt logprobs vs fp32 {diff_fp32:.2e}, vs bf16 {diff_bf16:.2e}; {k} greedy tokens compared")
    assert compared >= 2 * len(PROMPT_LENGTHS), f"only {compared} greedy tokens before near ties (measured 15)"


# --- b. n > 1 and seeded random sampling under CP ------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", [PCP2, TP2_DCP2, PCP2_DCP2], ids=Setup.label)
def test_seeded_sampling_matches_single_rank(launches, setup):
    got = launches.run(setup).sampling_outputs
    want = launches.run(REF_FP32).sampling_outputs
    largest = 0.0
    for (n, params), g, w in zip(SAMPLING_REQUESTS, got, want, strict=True):
        what = f"{setup.label()} len{n} seed{params.seed}"
        assert len(g.outputs) == params.n, what
        assert all(len(c.token_ids) == SAMPLED_TOKENS for c in g.outputs), what
        largest = max(largest, assert_same_tokens_and_logprobs(g, w, what=what))
        if params.n > 1:  # children draw from their own generators (seed + index)
            assert len({tuple(c.token_ids) for c in g.outputs}) == params.n, f"{what}: samples repeat each other"
    print(f"{setup.label()}: seeded samples equal, logprobs within {largest:.2e}")


# --- c. DP x PCP x TP in one world ---------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_dp2_pcp2_tp2_matches_single_rank(launches):
    """8 ranks: two replicas of PCP=2 x TP=2 (2 KV heads split over TP); both replicas serve requests."""
    run = launches.run(DP2_PCP2_TP2)
    want = launches.run(REF_KV2).logprob_outputs
    ids = [o.request_id for o in run.logprob_outputs]
    assert run.replica0_requests and set(ids) - run.replica0_requests, (
        f"requests were not spread over both replicas: replica 0 served {sorted(run.replica0_requests)} of {ids}")
    largest = 0.0
    for n, g, w in zip(DP_LENGTHS, run.logprob_outputs, want, strict=True):
        what = f"{DP2_PCP2_TP2.label()} len{n} (replica {0 if g.request_id in run.replica0_requests else 1})"
        assert len(g.outputs[0].token_ids) == GREEDY_TOKENS, what
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"{what}: greedy tokens differ"
        diff = max_abs_diff(sampled_logprobs(g), sampled_logprobs(w))
        assert diff <= LOGPROB_ATOL, f"{what}: sampled-token logprobs differ by {diff:.3g}"
        largest = max(largest, diff)
        diff = max_abs_diff(prompt_logprob_values(g), prompt_logprob_values(w))
        assert diff <= LOGPROB_ATOL, f"{what}: prompt logprobs differ by {diff:.3g}"
        largest = max(largest, diff)
    print(f"{DP2_PCP2_TP2.label()}: replica 0 served {sorted(run.replica0_requests)} of {ids}; "
          f"logprobs within {largest:.2e}")


# --- d. shared-prefix decode on a CP group ----------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", [PCP2, TP2_DCP2, PCP2_DCP2], ids=Setup.label)
def test_shared_prefix_decode_matches_single_rank(launches, setup):
    run = launches.run(setup)
    reference = launches.run(REF_FP32)
    # Without prefix caching the reference's slots are disjoint: decode batches of 3 or 4 requests are padded (two
    # members always pass the shared-key test, union <= sum, whatever they share).
    assert max(reference.shared_member_counts, default=0) <= 2, reference.shared_member_counts
    assert run.shared_prefix_hits == SHARED_REQUESTS * SHARED_PREFIX, run.shared_prefix_hits
    assert run.shared_member_counts.count(SHARED_REQUESTS) >= SHARED_TOKENS - 1, (
        f"{setup.label()}: the 4-request decode batches did not take the shared-key path: {run.shared_member_counts}")
    largest = 0.0
    for i, (g, w) in enumerate(zip(run.shared_outputs, reference.shared_outputs, strict=True)):
        assert len(g.outputs[0].token_ids) == SHARED_TOKENS
        largest = max(largest, assert_same_tokens_and_logprobs(g, w, what=f"{setup.label()} shared request {i}"))
    print(f"{setup.label()}: shared-key batches {run.shared_member_counts}, logprobs within {largest:.2e}")


# --- the tiny models' attention is peaked ---------------------------------------------------------------------


MIN_MEAN_MAX_ATTENTION = 0.3
"""Uniform causal attention over 37 tokens has a mean row max of ~0.11; the sharpened models measure ~0.65."""


@pytest.mark.parametrize("model", sorted(MODELS))
def test_tiny_model_attention_is_peaked(model):
    """Guards tiny_models.QK_SCALE: near-uniform attention would hide position, mask and merge bugs above."""
    import torch

    from tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("llama", seed=SEED, attn_implementation="eager", **MODELS[model])
    with torch.no_grad():
        out = hf(torch.tensor([random_prompt(37, seed=37)]), output_attentions=True)
    for layer, attention in enumerate(out.attentions):  # [1, heads, 37, 37]
        mean_max = attention[0].max(dim=-1).values.mean().item()
        assert mean_max > MIN_MEAN_MAX_ATTENTION, f"layer {layer}: mean max attention {mean_max:.3f}"
    assert torch.isfinite(out.logits).all()
    assert out.logits[0].argmax(dim=-1).unique().numel() > 10, "greedy tokens collapsed onto a few ids"
