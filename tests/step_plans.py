"""The step plan a test hands `build_step_batch` when it lays a step out by hand: the one a rank of eager layers
makes for the layout (cpllm/context_parallel/plan.py `plan_step`), or a path the test forces on a step of single
tokens (a path of a rank the test does not build, e.g. the gathered decode on one rank)."""

from __future__ import annotations

from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.plan import RankCapabilities, StepPath, StepPlan, plan_step


def eager_plan(chunks, layout: KVLayout, pcp_size: int = 1, *, replicated: bool = False,
               strategy: str | None = None, path: StepPath | None = None) -> StepPlan:
    """The plan of a step of `chunks` on a rank of eager layers of `layout` (its KV shards) over `pcp_size` PCP
    ranks; `path`: the path of a step of single tokens instead of the layout's own (a prefill step keeps its)."""
    plan = plan_step(chunks, RankCapabilities(pcp_size=pcp_size, kv_shards=layout.num_shards, replicated=replicated),
                     strategy)
    if path is None or plan.path is StepPath.PREFILL:
        return plan
    return StepPlan(path=path, strategy=strategy)
