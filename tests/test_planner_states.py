"""`cpllm plan` on a gated-DeltaNet hybrid: K/V bytes per token from the full layers only, and each request's
recurrent states counted per request (cpllm/planner/cost_model.py), against the shapes of tests/tiny_hybrid.py worked
out by hand and the engine's own start-up figures (tests/test_qwen3_5_vs_hf.py logs the same per-layer state)."""

from __future__ import annotations

from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.planner.cost_model import CostModel, Precision
from cpllm.planner.hardware import builtin_hardware
from cpllm.planner.models import load_model_shape
from cpllm.planner.plan import PlanRequest, predict
from tiny_hybrid import save_tiny_hybrid

# tiny_hybrid: 8 layers, 3 and 7 full (2 KV heads of 16), 6 DeltaNet layers of 2 key heads and 4 value heads of 16,
# a 4-tap convolution over q|k|v = 2*32 + 64 = 128 channels; states float32
STATE_LAYER_BYTES = (128 * 3 + 4 * 16 * 16) * 4
KV_ROW_BYTES = 2 * 2 * 16 * 2  # K and V, 2 heads of 16, 2-byte cache


def test_hybrid_states_per_request_and_kv_of_full_layers_only(tmp_path):
    model = load_model_shape(save_tiny_hybrid(str(tmp_path), "qwen3_5", seed=1))
    cost = CostModel(model, builtin_hardware("cpu"), Precision(kv_bytes=2))
    assert cost.kv_bytes_per_token(1) == 2 * KV_ROW_BYTES
    assert cost.state_bytes_per_request(1) == 6 * STATE_LAYER_BYTES
    assert cost.state_bytes_per_request(2) == 6 * STATE_LAYER_BYTES / 2  # whole key heads per TP rank
    one = ParallelDims(tp=1)
    memory = cost.memory(one)
    assert memory.state_bytes_per_request == 6 * STATE_LAYER_BYTES
    assert cost.memory(one, requests=0).kv_capacity_tokens > memory.kv_capacity_tokens  # the state set aside
    request = PlanRequest(context=100)
    pcp = ParallelDims(tp=1, pcp=2)
    assert predict(cost, pcp, request).memory_per_device_bytes == (
        cost.weights_per_device(pcp) + 50 * 2 * KV_ROW_BYTES + 6 * STATE_LAYER_BYTES)  # states on every PCP rank
