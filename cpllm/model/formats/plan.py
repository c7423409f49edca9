"""Which format each weight runs in, from the quantization mode (modes.py) and how the tensor is stored
(torch-free). The formats named here are the registry's keys (registry.py).

Linear layers (q/k/v, o, gate/up, down):

| stored as                     | none  | auto  | int8  | int4  |
|-------------------------------|-------|-------|-------|-------|
| Q4_0, Q4_1, Q4_K (GGUF)       | float | int4  | int4  | int4  |
| Q8_0 (GGUF)                   | float | int8  | int8  | int8  |
| F32, F16, BF16 (GGUF, HF)     | float | float | int8  | int4  |
| other GGUF quants (Q6_K, ...) | float | float | float | float |

int4 = 4-bit codes with a scale and zero per 32 inputs; int8 = 8-bit codes with a scale per 32 inputs (Q8_0's
scheme). GGUF blocks of both run as stored, nothing requantized (cpllm/model/formats/groups.py); float weights are
quantized at load only when int8 / int4 is asked for. A weight whose input width on this rank is not a multiple
of QUANT_GROUP (a TP split off the group boundaries) runs in float instead, and says why; explicit int8 / int4
requests are checked against the model's shapes in cpllm.config.engine, before anything starts.

The token embedding is a lookup, not a matmul: a Q8_0 one keeps its int8 rows unless the mode is none (exact,
3.6x smaller than float32), any other is float. The LM head always runs in the model's dtype: the kernel returns
bfloat16, which rounds logits of magnitude 16-32 to steps of 1/8. Measured on SmolLM2's first answer token to
"What is the capital of France?": the top two logits, 0.08 apart in float32, came out tied, and greedy decoding
took the other branch. Kept in float32 the SmolLM2 head costs 4.5 ms per token against 3.2 in the kernel at
1 thread, 5.3 against 1.7 at 2 (best of 30 on a shared machine). So under `auto` a head stored as Q8_0 runs in
the kernel and the best 16 logits of each row are then recomputed in float32 from the stored rows
(cpllm/model/formats/refined_head.py): the float head's greedy choices at the kernel's price. Any other head, and
every head under int8 / int4, stays float.

Routed experts: float checkpoints keep float experts in every mode. Experts stored as MXFP4 blocks (GPT-OSS)
run, under a mode other than none, in the format the mode names for them (`mxfp4_experts`): int8 = the blocks'
exact 8-bit form, int4 = the blocks re-quantized to 4-bit groups (lossy).
"""

from __future__ import annotations

from dataclasses import dataclass

from cpllm.config.engine import QUANT_GROUP
from cpllm.model.formats.modes import FLOAT, quantization_mode

INT4_STORAGE = ("Q4_0", "Q4_1", "Q4_K")
"""GGUF types run as stored as 4-bit groups."""
INT8_STORAGE = ("Q8_0",)
"""GGUF types run as stored as 8-bit groups."""
FLOAT_STORAGE = ("F32", "F16", "BF16", "F64")
"""Float storage (GGUF type names, and safetensors' dtype names, which are spelled the same)."""
MXFP4_STORAGE = "MXFP4"
"""The storage type of expert weights held as MXFP4 blocks (`*_blocks` / `*_scales`, cpllm/model/formats/mxfp4.py)."""
RUN_AS_STORED = {**{t: "int4" for t in INT4_STORAGE}, **{t: "int8" for t in INT8_STORAGE}}
"""Stored type -> the format that runs its blocks as stored, nothing requantized."""


@dataclass(frozen=True, slots=True)
class WeightPlan:
    """How one weight (or one run of packed parts) is held and multiplied."""

    format: str
    """A key of the format registry (registry.py); "float" is the model dtype, dequantized when stored quantized."""
    reason: str
    """Why, for the start-up log (e.g. "stored Q4_1, run as stored")."""


NOT_QUANTIZED = WeightPlan(FLOAT, "quantization=none")
"""The plan of every weight under quantization=none."""


def wanted_plan(mode: str, stored: str, *, cpu: bool = True) -> WeightPlan:
    """The format `mode` asks for a linear weight stored as `stored`, before its shape is checked."""
    rule = quantization_mode(mode)
    if not rule.quantizes:
        return NOT_QUANTIZED
    if not cpu:
        return WeightPlan(FLOAT, "the int4 kernel runs on CPU only")
    if stored in RUN_AS_STORED:
        return WeightPlan(RUN_AS_STORED[stored], f"stored {stored}, run as stored")
    if stored in FLOAT_STORAGE:
        if rule.float_weights == FLOAT:
            return WeightPlan(FLOAT, f"stored {stored}")
        return WeightPlan(rule.float_weights, f"stored {stored}, quantized at load")
    return WeightPlan(FLOAT, f"stored {stored}, no kernel for it: dequantized")


def embedding_plan(mode: str, stored: str) -> WeightPlan:
    """The token embedding: Q8_0 rows kept as stored (exact, 3.6x smaller than float32) unless mode is none."""
    rule = quantization_mode(mode)
    if rule.quantizes and stored in INT8_STORAGE:
        return WeightPlan("int8", f"stored {stored}, rows looked up as stored")
    return WeightPlan(FLOAT, f"stored {stored}" if rule.quantizes else "quantization=none")


def lm_head_plan(mode: str, stored: str, *, cpu: bool = True) -> WeightPlan:
    """The LM head: int8 with its best logits refined in float32 for a Q8_0 head under auto, else float (see the
    module: bfloat16 logits alone tie)."""
    rule = quantization_mode(mode)
    if not rule.quantizes:
        return NOT_QUANTIZED
    if rule.refined_int8_head and cpu and stored in INT8_STORAGE:
        return WeightPlan("int8", f"stored {stored}, run as stored; the best logits of each row recomputed in float32")
    return WeightPlan(FLOAT, f"stored {stored}, kept in the model dtype (bfloat16 kernel output would round logits)")


def experts_plan(mode: str, stored: str | None, in_widths: tuple[int, ...], *, cpu: bool = True) -> WeightPlan:
    """The format of a stack of routed experts whose inputs on this rank are `in_widths` wide (gate|up, down);
    `stored`: their quantized storage type (MXFP4_STORAGE), or None for float tensors."""
    rule = quantization_mode(mode)
    if not rule.quantizes:
        return NOT_QUANTIZED
    if stored != MXFP4_STORAGE:
        return WeightPlan(FLOAT, "stored as floats: routed experts run in the model dtype")
    if not cpu:
        return WeightPlan(FLOAT, "stored MXFP4, dequantized: the int4 kernel runs on CPU only")
    if any(width % QUANT_GROUP for width in in_widths):
        return WeightPlan(FLOAT, f"stored MXFP4, dequantized: an input width of {in_widths} on this rank is not a "
                                 f"multiple of {QUANT_GROUP}")
    fmt = rule.mxfp4_experts
    how = "its exact 8-bit form" if fmt == "int8" else "re-quantized to 4-bit groups"
    return WeightPlan(fmt, f"stored MXFP4, run as {how}")


def fit_kernel(plan: WeightPlan, in_width: int) -> WeightPlan:
    """`plan`, or float with the reason when the input width on this rank does not fall on group boundaries."""
    if plan.format == FLOAT or in_width % QUANT_GROUP == 0:
        return plan
    return WeightPlan(FLOAT, f"{plan.reason}; but its input width {in_width} on this rank is not a multiple "
                             f"of {QUANT_GROUP}: dequantized")


def plan_packed(mode: str, stored: list[str], in_width: int, *, cpu: bool = True
                ) -> tuple[list[WeightPlan], list[tuple[str, list[int]]]]:
    """Plans of packed parts (q|k|v, gate|up): (plan per part, runs [(format, part indices)]).

    Consecutive parts of one format form a run, one kernel each, outputs concatenated: parts of different formats
    (e.g. Q4_K q and k with a Q6_K v, as llama.cpp's Q4_K_M files store them) then do not dequantize their
    neighbours. Packed parts share their input, so they fit the kernel, or not, together.
    """
    plans = [fit_kernel(wanted_plan(mode, s, cpu=cpu), in_width) for s in stored]
    runs: list[tuple[str, list[int]]] = []
    for i, plan in enumerate(plans):
        if runs and runs[-1][0] == plan.format:
            runs[-1][1].append(i)
        else:
            runs.append((plan.format, [i]))
    return plans, runs
