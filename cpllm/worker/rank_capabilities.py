"""This rank's capabilities, read once at start-up from what it built: the one record the step plans read
(cpllm/context_parallel/plan.py `plan_step`)."""

from __future__ import annotations

from cpllm.context_parallel.plan import GraphBuckets, RankCapabilities
from cpllm.distributed.groups import ParallelGroups


def rank_capabilities(groups: ParallelGroups, model, *, kv_groups: int, compiled: bool,
                      decode_graphs, states: bool = False) -> RankCapabilities:
    """What this rank can run, once its model is loaded, its pools allocated, its decode team formed (or not) and
    its CUDA graphs captured (or not): `model` the loaded family model (its `fused_decode`, dense MLPs' decode
    splits and LM head), `kv_groups` the model's KV groups, `compiled` whether decode steps run compiled,
    `decode_graphs` the captured graphs (cpllm/model/execution/cuda_graphs.py `DecodeGraphs`, or None), `states`
    whether the model has per-request state layers."""
    fused = model.fused_decode
    graphs = None
    if decode_graphs is not None:
        graphs = GraphBuckets(sizes=tuple(decode_graphs.sizes), width=decode_graphs.static.width)
    return RankCapabilities(
        pcp_size=groups.pcp_size, pcp_rank=groups.pcp_rank, kv_shards=groups.dims.kv_shard_size,
        replicated=groups.dims.kv_replicated, kv_groups=kv_groups,
        fused=fused.capability() if fused is not None else None, compiled=compiled, graphs=graphs,
        mlp_split=any(getattr(module, "decode_split", None) is not None for module in model.modules()),
        lm_head_split=model.lm_head.pcp is not None, states=states)
