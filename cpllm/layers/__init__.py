"""Layer kinds: one package per kind of attention layer, each owning its parts (docs/architecture.md, "Adding a
layer kind").

A kind declares, in its own package:
- its cache spec (`spec.py`, torch-free): what one layer caches per token or per request, read by the pool
  allocator, the capacity log, the scheduler's block accounting and the planner, none of which names a kind;
- its backend (the `AttentionBackend` of cpllm/context_parallel/backend.py): the local work the CP layer asks of
  it, including what PCP moves for it (`rows_to_move` / `rows_moved`);
- its layer modules (the projections and the attention call the families build their decoder layers from);
- its score modifiers, where it has any (windows, soft-capping, sinks: `window/`).

`registry.py` holds one record per kind (`LAYER_KINDS`): its name, which model configs it serves, its cache spec
and its backends by import path, so that importing the registry (the scheduler does, through cpllm/kv_groups.py)
imports no torch. Code outside a kind's package imports only the modules the package lists in `PUBLIC_MODULES`
(tests/test_layer_kinds_fitness.py).
"""
