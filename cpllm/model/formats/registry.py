"""The weight formats, by name: the one place a format is found. A plan (plan.py) names a format; the loaders
(loading.py) build the tensor it plans with that format's entry. A new format is one module that defines its
WeightFormat (entry.py) and one line here; a quantization mode that picks it is one line of modes.py."""

from __future__ import annotations

from cpllm.model.formats.entry import WeightFormat
from cpllm.model.formats.float_format import FLOAT_FORMAT
from cpllm.model.formats.int4_format import INT4_FORMAT
from cpllm.model.formats.int8_format import INT8_FORMAT

FORMATS: dict[str, WeightFormat] = {fmt.name: fmt for fmt in (
    FLOAT_FORMAT,
    INT8_FORMAT,
    INT4_FORMAT,
)}
"""Every weight format, by its name (the plans' `format`)."""


def weight_format(name: str) -> WeightFormat:
    """The format called `name`; a ValueError naming it and the registered ones otherwise."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"weight format {name!r} is not registered; known formats: {', '.join(FORMATS)}")
    return fmt
