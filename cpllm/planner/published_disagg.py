"""A published disaggregated deployment the planner is checked against (data, not predictions), with its source.

DeepSeek, "DeepSeek-V3/R1 Inference System Overview" (Open Source Week, day 6; github.com/deepseek-ai/open-infra-index,
March 2025): DeepSeek-V3/R1 served on H800 nodes of 8 GPUs, FP8 matmuls, prefill and decode on separate instances.
Prefill: routed experts EP32, MLA and the shared expert DP32, one unit of 4 nodes; decode: EP144 / DP144, one unit
of 18 nodes. Over 24 hours, 56.3% of the input tokens hit the KV cache, and an H800 node averaged about
73.7k input tokens/s in prefill (cache hits included) and about 14.8k output tokens/s in decode, at an average
output speed of 20-22 tokens/s per request.

These are throughputs of a loaded service, not one request's latency: how the planner compares them is
docs/disaggregated.md "Planning a disaggregated deployment" (tests/test_planner_disagg.py asserts it).
"""

from __future__ import annotations

SOURCE = ("DeepSeek open-infra-index, 'DeepSeek-V3/R1 Inference System Overview' (day 6, March "
          "2025): H800 nodes, prefill unit 4 nodes (EP32, DP32 attention), decode unit 18 nodes (EP144)")
MODEL = "deepseek-v3"
GPU = "h800"
WEIGHTS = "fp8"
PREFILL_NODES = 4
"""Nodes of one prefill unit."""
PREFILL_INPUT_TOKENS_PER_NODE_S = 73.7e3
"""Input tokens per second per H800 node during prefill, cache hits included (a throughput)."""
CACHE_HIT = 0.563
"""Share of the input tokens served from the KV cache."""
DECODE_OUTPUT_TOKENS_PER_NODE_S = 14.8e3
"""Output tokens per second per H800 node during decode (a throughput)."""
OUTPUT_TOKENS_PER_REQUEST_S = (20.0, 22.0)
"""Average output speed of one request (tokens/s): 1 / TPOT."""
PROMPT_TOKENS = 4096
"""The prompt length the comparison takes: the source states none (the model's per-token prefill rate changes by
less than 20% between 4K and 16K tokens on this unit)."""
PREFILL_LAYOUT = "8x4x1"
"""The TP x PCP x DCP layout the model runs the unit's 32 GPUs as (TP8 inside each node, PCP4 across the 4 nodes:
the closest of its layouts to DP32 attention; the model has no expert parallelism across nodes)."""
NOT_PREDICTED = {
    "decode": "the decode batch's context lengths are not stated, and at the ~700 requests per node the figures "
              "imply, decode is compute- and all-to-all-bound (EP144), terms the memory-bound decode model lacks",
}
"""Published figures recorded and not compared, with the reason."""
