"""Grouped-query attention: K and V rows per position in paged pools, the Llama family's kind (and the base the
other row kinds read through: `local_attention` holds the C-kernel and SDPA implementations)."""

from cpllm.layers.gqa.spec import kv_rows, serves
from cpllm.layers.kind import LayerKind

KIND = LayerKind(name="gqa", serves=serves, cache_spec=kv_rows,
                 backends={"gqa": "cpllm.layers.gqa.backend:GQAPagedBackend"})

PUBLIC_MODULES = ("spec", "backend", "local_attention")
"""Modules other packages may import (the rest are this kind's own)."""
