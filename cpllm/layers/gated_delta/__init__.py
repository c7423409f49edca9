"""Gated DeltaNet (Qwen3.5, Qwen3-Next): linear attention with a short causal convolution, the gated delta rule
and a gated RMSNorm on its output; a fixed-size state per request instead of K/V rows (docs/architecture.md,
"Layer kinds")."""

from cpllm.layers.gated_delta.spec import row_spec, serves, state_layers, state_rows, state_spec
from cpllm.layers.kind import LayerKind

KIND = LayerKind(name="gated_delta", serves=serves, cache_spec=row_spec, state_layers=state_layers,
                 state_spec=state_spec, state_rows=state_rows)

PUBLIC_MODULES = ("spec", "layer", "rule", "pcp_prefill", "state_updates")
"""Modules other packages may import."""
