"""Published results the planner is checked against (data, not predictions), each with its source.

Yang et al., "Context Parallelism for Scalable Million-Token Inference" (arXiv 2411.01783, v3): Llama 3 405B with
FP8 weights on H100 nodes of 8 GPUs, TP8 inside each node. "128K" is taken as 128 x 1024 tokens and "1M" as
1024 x 1024, as `cpllm plan --context 128k / 1m` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL = "llama3-405b"
GPU = "h100"
PAPER = "arXiv 2411.01783"
TABLE7_TOKENS = 128 * 1024
TABLE7 = {  # (nodes, layout label TPxPCPxDCP) -> TTFT seconds of a 128K-token prefill
    (1, "8x1x1"): 42.0,
    (2, "8x2x1"): 21.0,
    (4, "8x4x1"): 10.95,
    (2, "16x1x1"): 29.9,
    (4, "32x1x1"): 19.8,
}
TABLE7_NAMES = {"8x1x1": "CP1", "8x2x1": "CP2", "8x4x1": "CP4", "16x1x1": "TP16", "32x1x1": "TP32"}
TABLE4_TOKENS = 128_000
TABLE4_FASTER = {0.01: "pass-q", 0.025: "pass-q", 0.10: "pass-kv", 1.0: "pass-kv"}
"""CP4 partial prefill by KV cache miss rate T / (T + P): which strategy the paper measured faster (pass-Q at 1%
(898.7 vs 1,023.4 ms) and 2.5%, even at 5%, pass-KV at 10% (2,080.7 vs 2,205.3 ms) and for a full prefill)."""
TABLE4_TIMES = {(0.01, "pass-q"): 0.8987, (0.01, "pass-kv"): 1.0234, (0.10, "pass-kv"): 2.0807,
                (0.10, "pass-q"): 2.2053}
"""Seconds of those CP4 (TP8 x 4 nodes) partial prefills, 128,000 tokens in all (Table 4)."""
ABSTRACT = f"{PAPER} abstract"


@dataclass(kw_only=True, frozen=True, slots=True)
class Point:
    """One published prefill time."""

    name: str
    nodes: int
    layout: str
    """TPxPCPxDCP label of the layout (TP8 in each node, the rest across nodes)."""
    tokens: int
    """New tokens of the prefill."""
    seconds: float
    source: str
    cached: int = 0
    """Tokens already in the KV cache (Table 4's partial prefills)."""
    strategy: str = "ring"
    """The paper's strategy in the cost model's names ("ring" is a fresh prompt's pass-KV; no choice without PCP)."""
    model: str = MODEL
    """The planner's built-in model (models.py) the point ran."""
    gpu: str = GPU
    """The planner's built-in device (hardware.py) the point ran on."""
    weights: str = "fp8"
    """Weight format of the run."""
    devices: int = 0
    """Devices the request ran on; 0: `nodes` whole nodes."""


FRESH: tuple[Point, ...] = tuple(
    Point(name=TABLE7_NAMES[label], nodes=nodes, layout=label, tokens=TABLE7_TOKENS, seconds=seconds,
          source=f"{PAPER} Table 7") for (nodes, label), seconds in TABLE7.items()) + (
    Point(name="CP16 1M", nodes=16, layout="8x16x1", tokens=1024 * 1024, seconds=77.0,
          source=f"{ABSTRACT}: 1M context prefill in 77 s on up to 128 H100s across 16 nodes"),
    Point(name="CP16 128K", nodes=16, layout="8x16x1", tokens=TABLE7_TOKENS, seconds=3.8,
          source=f"{ABSTRACT}: 128K context prefill in 3.8 s (the 16-node scale the abstract states)"),
)
"""Full prefills of a fresh prompt."""
PARTIAL: tuple[Point, ...] = tuple(
    Point(name=f"CP4 {miss:.0%} miss, {strategy}", nodes=4, layout="8x4x1", tokens=round(TABLE4_TOKENS * miss),
          cached=TABLE4_TOKENS - round(TABLE4_TOKENS * miss), seconds=seconds, strategy=strategy,
          source=f"{PAPER} Table 4") for (miss, strategy), seconds in TABLE4_TIMES.items())
"""Partial prefills on a cached context (Table 4)."""
FIT_POINTS = ("CP1", "CP16 1M")
"""The two points the H100's utilisations are fitted on; every other point is a prediction."""
PAPER_UTILIZATION_1M = 0.63
"""The paper's FLOPS utilisation of the 1M run (abstract); its FLOP count is not stated, so it is shown next to the
model's (causal attention FLOPs, both kinds of matmul against the 16-bit peak), not asserted."""
PREDICTION_TOLERANCE = 0.15
"""Largest relative error a prediction of a point outside the fit may have, unless DOCUMENTED_MISSES names it."""
DOCUMENTED_MISSES: dict[str, str] = {
    "CP16 128K": "scaling loss at 8,192 tokens per rank that no published figure gives (ring transfers hide, "
                 "latencies and launches add 2%)",
    "CP4 1% miss, pass-q": "a fixed cost per forward of about 0.77 s (Table 4's own intercept), far above launch "
                           "and NCCL latency figures",
    "CP4 1% miss, pass-kv": "the same fixed cost per forward",
    "CP4 10% miss, pass-kv": "the same fixed cost per forward",
    "CP4 10% miss, pass-q": "the same fixed cost per forward",
}
"""Points predicted outside PREDICTION_TOLERANCE, each with the term the model lacks (docs/context_parallel.md,
"Points outside the fit", derives them)."""

VLLM_44967 = ("vLLM PR 44967 (github.com/vllm-project/vllm/pull/44967, 'Add Dynamic Context Parallelism for "
              "long-context serving', its DeepSeek-V2-Lite table on 8 x H800)")
VLLM_44967_TTFT = {  # (context in K tokens, layout) -> TTFT seconds, "DP" and "Static PrefillCP" columns
    (1, "1x1x1"): 6.77972, (128, "1x1x1"): 15.00576, (256, "1x1x1"): 33.29649, (512, "1x1x1"): 90.43545,
    (1024, "1x1x1"): 245.8525,
    (1, "1x8x1"): 7.91402, (128, "1x8x1"): 10.84596, (256, "1x8x1"): 14.59538, (512, "1x8x1"): 22.2045,
    (1024, "1x8x1"): 43.1716,
}
"""DeepSeek-V2-Lite (BF16) on one node of 8 H800s, TTFT by context length (ms in the PR). DP: each request on one
GPU (1x1x1); static prefill CP: each request over all eight, taken as PCP8 (1x8x1; the PR's table names the
mode, not its size, and eight is the node). The PR measured them "under a concurrent 1M-request serving run: all
services were running at the same time": each TTFT holds the time the request queued behind others, which the
1K rows show (a 1K-token prefill computes in milliseconds). "128k" is taken as 128 x 1024 tokens."""
OTHER_ENGINES: tuple[Point, ...] = tuple(
    Point(name=f"vLLM {'DP' if label == '1x1x1' else 'PCP8'} {k if k < 1024 else 1}{'K' if k < 1024 else 'M'}",
          nodes=1, devices=1 if label == "1x1x1" else 8, layout=label, tokens=k * 1024, seconds=seconds,
          model="deepseek-v2-lite", gpu="h800", weights="bf16", source=VLLM_44967)
    for (k, label), seconds in VLLM_44967_TTFT.items())
"""Context-parallel figures of other engines the planner predicts (with the H100's utilisations carried over)."""
ATOM_1220 = ("ROCm/ATOM PR 1220 (github.com/ROCm/ATOM/pull/1220, 'Enable Prefill Context Parallel (PCP) for "
             "DeepSeek-V4'), section 5.2: TP8 against TP4 x PCP2 on 8 AMD GPUs, concurrency 8, input N / output "
             "1K, mean TTFT")
ATOM_1220_TTFT = {  # (input K tokens, layout) -> mean TTFT seconds
    (8, "8x1x1"): 3.588, (8, "4x2x1"): 2.307, (16, "8x1x1"): 8.012, (16, "4x2x1"): 4.920,
    (32, "8x1x1"): 14.908, (32, "4x2x1"): 9.347, (64, "8x1x1"): 32.727, (64, "4x2x1"): 18.667,
}
"""Recorded, not predicted: NOT_PREDICTED says why."""
NOT_PREDICTED: dict[str, str] = {
    ATOM_1220: "DeepSeek-V4's attention is not the dense causal attention the cost model counts: its layers mix "
               "compressed KV (4x and 128x), a sliding window and a top-k sparse indexer (vLLM PR 43809 lists "
               "the MLA / SWA / C4 / C128 layouts), and its shape is no built-in model here; the AMD GPU model is "
               "not named in the PR text read, and AMD devices are not built in; eight requests ran at once.",
}
"""Published context-parallel figures of other engines the planner cannot predict, with the reason."""
_QUEUED = ("queue wait of a concurrent serving run, which a one-request model lacks (the same run's 1K rows: "
           "6.8 s DP and 7.9 s PCP8 against about 0.01 s predicted)")
DOCUMENTED_MISSES.update({point.name: _QUEUED for point in OTHER_ENGINES if point.name != "vLLM PCP8 1M"})
DOCUMENTED_MISSES["vLLM DP 1M"] = ("the attention rate carried from the H100 fit (405B, 128 heads of 128) is "
                                   "below what DeepSeek-V2-Lite's 16 MLA heads reach on one GPU: predicted long "
                                   "despite the queue wait in the published figure")
"""Other engines' points outside PREDICTION_TOLERANCE join DOCUMENTED_MISSES with the term the model lacks."""
