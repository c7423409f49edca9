"""The quantization modes (`--quantization`, ModelConfig.quantization): what each asks of the weight formats.

A mode is a rule, not a format: it says which registered format (cpllm/model/formats/registry.py) a tensor runs
in given how it is stored; cpllm/model/formats/plan.py applies the rule to each tensor. The CLI's choices and
`QUANTIZATION_CHOICES` are this table's keys, in its order. Torch-free: cpllm.config.engine reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOAT = "float"
"""The format of a weight held in the model dtype (dequantized where stored quantized)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class QuantizationMode:
    """One value of `quantization` and the formats it picks."""

    name: str
    """The option's value ("auto", "none", "int8", "int4")."""
    quantizes: bool
    """False: every weight runs in FLOAT and no tensor's storage type is looked at (the exact path)."""
    float_weights: str
    """The format a linear weight stored in a float type runs in: FLOAT, or the format it is quantized to at load
    (an explicit request, whose shapes cpllm.config.engine checks before anything starts)."""
    refined_int8_head: bool
    """A Q8_0 LM head runs in the int4 kernel with each row's best logits recomputed in float32 (plan.py); other
    modes keep the head in the model dtype."""
    mxfp4_experts: str
    """The format routed experts stored as MXFP4 blocks run in (on CPU, where their widths fit the groups)."""


MODES: dict[str, QuantizationMode] = {mode.name: mode for mode in (
    QuantizationMode(name="auto", quantizes=True, float_weights=FLOAT, refined_int8_head=True,
                     # MXFP4 blocks' exact 8-bit form: on the tiny GPT-OSS against its dequantized float run
                     # (tests/test_gpt_oss_vs_hf.py) prompt logprobs moved 0.0064 at most (0.001 on average; the
                     # kernel rounds activations to int8), where the re-quantized int4 form moved them up to 0.21
                     # (0.04 on average) and changed every greedy continuation
                     mxfp4_experts="int8"),
    QuantizationMode(name="none", quantizes=False, float_weights=FLOAT, refined_int8_head=False,
                     mxfp4_experts=FLOAT),
    QuantizationMode(name="int8", quantizes=True, float_weights="int8", refined_int8_head=False,
                     mxfp4_experts="int8"),
    QuantizationMode(name="int4", quantizes=True, float_weights="int4", refined_int8_head=False,
                     mxfp4_experts="int4"),
)}
"""Every quantization mode, by name, in the order the CLI lists them (the default: cpllm.config.engine's
DEFAULT_QUANTIZATION)."""

QUANTIZATION_CHOICES = tuple(MODES)
"""The accepted values of `quantization`, in the table's order."""


def quantization_mode(name: str) -> QuantizationMode:
    """The mode called `name`; a ValueError naming it and the choices otherwise."""
    mode = MODES.get(name)
    if mode is None:
        raise ValueError(f"quantization={name!r}; choose one of {QUANTIZATION_CHOICES}")
    return mode
