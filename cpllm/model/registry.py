"""Which model class builds each Hugging Face architecture (the runner asks here, never names a family)."""

from __future__ import annotations

import torch

from cpllm.model.families.deepseek import DeepseekForCausalLM
from cpllm.model.families.deepseek_sparse import DeepseekSparseForCausalLM
from cpllm.model.families.gemma import GemmaForCausalLM
from cpllm.model.families.gpt_oss import GptOssForCausalLM
from cpllm.model.families.kimi_linear import KimiLinearForCausalLM
from cpllm.model.families.llama import LlamaForCausalLM
from cpllm.model.families.qwen3_5 import Qwen35ForCausalLM

MODEL_CLASSES: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "Glm4MoeLiteForCausalLM": DeepseekForCausalLM,
    "Qwen3_5ForCausalLM": Qwen35ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen35ForCausalLM,
    "Qwen3NextForCausalLM": Qwen35ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekSparseForCausalLM,
    "GlmMoeDsaForCausalLM": DeepseekSparseForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
}
"""Architecture name -> the class whose constructor takes (config, tp, comm, dtype, max_positions, moe, pcp)."""


def model_class(architecture: str) -> type[torch.nn.Module]:
    """The class that builds `architecture` (ModelConfig has already refused unsupported names)."""
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(f"no model class for architecture {architecture!r} "
                         f"(known: {', '.join(sorted(MODEL_CLASSES))})") from None
