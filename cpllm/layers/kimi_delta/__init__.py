"""Kimi delta attention (Kimi Linear): the gated DeltaNet's delta rule with a decay per key channel instead of per
head, a short causal convolution, and a sigmoid-gated RMSNorm on its output; a fixed-size state per request
instead of K/V rows (docs/architecture.md, "Layer kinds")."""

from cpllm.layers.kimi_delta.spec import row_spec, serves, state_layers, state_rows, state_spec
from cpllm.layers.kind import LayerKind

KIND = LayerKind(name="kimi_delta", serves=serves, cache_spec=row_spec, state_layers=state_layers,
                 state_spec=state_spec, state_rows=state_rows)

PUBLIC_MODULES = ("spec", "layer", "rule")
"""Modules other packages may import."""
