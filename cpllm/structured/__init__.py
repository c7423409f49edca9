"""Structured outputs: JSON schema, regex, choice and grammar constraints, enforced with llguidance.

Only `params` is imported here: it is plain data that SamplingParams (and so the
torch-free scheduler) carries. The grammar engine and the bitmask code load when
the engine first needs them.
"""

from cpllm.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "GuidedDecodingParams"]
