"""DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-5) read from config.json, and the layouts it runs under
(no I/O, no torch).

Both families are MLA (cpllm/config/deepseek.py) with a lightning indexer per layer: every cached token keeps an
index key beside its latent row, and each query attends only the `index_topk` tokens the indexer scores highest
(cpllm/layers/sparse_mla/). What transformers 5.24 computes is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SPARSE_MLA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
"""Hugging Face architectures whose MLA layers select their keys with an indexer."""
INDEXER_DEFAULTS = {
    "DeepseekV32ForCausalLM": dict(index_topk=2048, index_head_dim=128, index_n_heads=64),
    "GlmMoeDsaForCausalLM": dict(index_topk=2048, index_head_dim=128, index_n_heads=32),
}
"""transformers 5.24's defaults of each family, for a field config.json leaves out."""


@dataclass(kw_only=True, frozen=True, slots=True)
class IndexerConfig:
    """The lightning indexer of one sparse-MLA model (every layer has its own weights of these shapes)."""

    index_topk: int
    """Tokens each query attends to at most (all of them while its context is no longer)."""
    index_head_dim: int
    """Width of an index key and of each index query head; its first qk_rope_head_dim values rotate."""
    index_n_heads: int
    """Index query heads whose ReLU scores are summed with per-token weights."""
    rope_interleave: bool
    """The index's rotary pairs are (0, 1), (2, 3), ... (GLM-5) rather than (i, i + d/2) (DeepSeek-V3.2)."""

    def __post_init__(self) -> None:
        for name in ("index_topk", "index_head_dim", "index_n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], rope_dim: int) -> "IndexerConfig":
        arch = (cfg.get("architectures") or [""])[0]
        if arch not in SPARSE_MLA_ARCHITECTURES:
            raise ValueError(f"{arch!r} is not a sparse-MLA architecture ({', '.join(SPARSE_MLA_ARCHITECTURES)})")
        fields = {key: cfg.get(key) or default for key, default in INDEXER_DEFAULTS[arch].items()}
        if cfg.get("q_lora_rank") is None:
            raise ValueError(f"{arch} needs q_lora_rank: the indexer's queries come from the low-rank query")
        if fields["index_head_dim"] < rope_dim:
            raise ValueError(f"index_head_dim={fields['index_head_dim']} is narrower than qk_rope_head_dim="
                             f"{rope_dim}, the part of an index key that rotates")
        _check_every_layer_indexes(cfg)
        return cls(**fields, rope_interleave=arch == "GlmMoeDsaForCausalLM")


def _check_every_layer_indexes(cfg: dict[str, Any]) -> None:
    """GLM-5's layers may reuse the previous layer's top-k ("shared" in indexer_types, "S" in index_topk_pattern,
    or index_topk_freq > 1, as transformers derives them); that is not built: every layer must run its indexer."""
    types = cfg.get("indexer_types")
    pattern = cfg.get("index_topk_pattern")
    if types is None and pattern is not None:
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is not None and any(kind != "full" for kind in types):
        raise ValueError(f"indexer_types={list(types)}: layers that reuse another layer's top-k ('shared') are "
                         "not built; every layer must be 'full'")
    if types is None and cfg.get("index_topk_freq", 1) > 1:
        raise ValueError(f"index_topk_freq={cfg['index_topk_freq']}: layers that reuse another layer's top-k are "
                         "not built; every layer must run its indexer (index_topk_freq 1)")
