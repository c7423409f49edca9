"""Published results the planner is checked against (data, not predictions).

Yang et al., "Context Parallelism for Scalable Million-Token Inference" (arXiv 2411.01783): Llama 3 405B with FP8
weights on H100 nodes of 8 GPUs, TP8 inside each node.
"""

from __future__ import annotations

MODEL = "llama3-405b"
GPU = "h100"
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
