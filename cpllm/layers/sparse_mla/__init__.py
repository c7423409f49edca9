"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): MLA whose queries attend only the `index_topk` cached tokens a
lightning indexer scores highest; an index key per position beside the latent row."""

from cpllm.layers.kind import LayerKind
from cpllm.layers.sparse_mla.spec import latent_and_index_rows, serves

KIND = LayerKind(name="sparse_mla", serves=serves, cache_spec=latent_and_index_rows,
                 backends={"sparse_mla": "cpllm.layers.sparse_mla.backend:SparseMLABackend"})

PUBLIC_MODULES = ("spec", "attention", "topk")
"""Modules other packages may import."""
