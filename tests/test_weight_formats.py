"""The weight-format registry (cpllm/model/formats/registry.py) and the mode table (formats/modes.py) are the one
source of formats: every `--quantization` choice is a mode, every format a mode or a plan names is registered, an
unknown name is refused naming the known ones, and each format builds, describes and specs a small tensor."""

from __future__ import annotations

import argparse
import pathlib
import re

import pytest
import torch

from cpllm.cli import build_parser
from cpllm.config.engine import QUANTIZATION_CHOICES
from cpllm.engine_options import OPTIONS
from cpllm.kernels import int4_matmul
from cpllm.model.formats.experts import FloatExperts, GroupedExperts, MXFP4Weight, OneDNNExperts
from cpllm.model.formats.float_weight import FloatWeight
from cpllm.model.formats.loading import load_experts
from cpllm.model.formats.modes import MODES, quantization_mode
from cpllm.model.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from cpllm.model.formats.plan import (FLOAT_STORAGE, INT4_STORAGE, INT8_STORAGE, MXFP4_STORAGE, WeightPlan,
                                      embedding_plan, experts_plan, lm_head_plan, wanted_plan)
from cpllm.model.formats.registry import FORMATS, weight_format
from test_linear_methods import GroupedSource, weights

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "cpllm"
PICKED_BY_STRING = re.compile(r"""quantization\s*[!=]=\s*["']|quantization\s+(not\s+)?in\s+[(\[]"""
                              r"""|["']int8["'],\s*["']int4["']|["']auto["'],\s*["']none["']""")
"""A mode compared by name, or a hand-written list of modes: what the mode table replaces."""
STORAGE = (*INT4_STORAGE, *INT8_STORAGE, *FLOAT_STORAGE, "Q6_K")
"""Every stored type a plan distinguishes, and one it has no kernel for."""


def _quantization_choices(parser: argparse.ArgumentParser) -> set[tuple[str, ...]]:
    """The choices of every --quantization flag of the parser and its subcommands."""
    found = set()
    for action in parser._actions:
        if "--quantization" in action.option_strings:
            found.add(tuple(action.choices))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _quantization_choices(sub)
    return found


def test_every_quantization_choice_is_a_mode_of_the_table():
    assert QUANTIZATION_CHOICES == tuple(MODES) == ("auto", "none", "int8", "int4")
    assert OPTIONS["quantization"].choices == QUANTIZATION_CHOICES
    assert _quantization_choices(build_parser()) == {QUANTIZATION_CHOICES}  # generate, serve and bench alike


def test_no_module_outside_the_formats_package_picks_a_mode_by_name():
    found = [f"{path.relative_to(PACKAGE)}:{n}" for path in sorted(PACKAGE.rglob("*.py"))
             if "formats" not in path.relative_to(PACKAGE).parts
             for n, line in enumerate(path.read_text().splitlines(), 1) if PICKED_BY_STRING.search(line)]
    assert found == []


def test_every_format_a_mode_or_a_plan_names_is_registered():
    for mode in MODES.values():
        assert {mode.float_weights, mode.mxfp4_experts} <= set(FORMATS), mode
    planned = set()
    for mode in MODES:
        for stored in STORAGE:
            for cpu in (True, False):
                planned |= {wanted_plan(mode, stored, cpu=cpu).format, lm_head_plan(mode, stored, cpu=cpu).format}
            planned.add(embedding_plan(mode, stored).format)
        for stored, widths in ((MXFP4_STORAGE, (64, 32)), (MXFP4_STORAGE, (64, 16)), (None, (64, 32))):
            planned.add(experts_plan(mode, stored, widths).format)
    assert planned == set(FORMATS) == {"float", "int8", "int4"}


def test_unknown_names_are_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"weight format 'fp8' is not registered; known formats: float, int8, int4"):
        weight_format("fp8")
    with pytest.raises(ValueError, match=r"quantization='int3'; choose one of \('auto', 'none', 'int8', 'int4'\)"):
        quantization_mode("int3")
    with pytest.raises(ValueError, match="quantization='fp8'"):
        wanted_plan("fp8", "F32")
    with pytest.raises(ValueError, match=r"weight format 'fp8' is not registered; known formats: float, int8, int4"):
        load_experts(TinyExperts(), FloatExperts(2, 64, 32, torch.float32), WeightPlan("fp8", "by hand"))


def _linear(fmt: str) -> tuple[torch.nn.Module, torch.Tensor, GroupedSource]:
    """One [48 out, 64 in] linear loaded in `fmt` from a float source, and its float reference weight."""
    source = GroupedSource(weights("w.weight"), {})
    empty = FloatWeight.empty(64, 48, torch.float32)
    method = FORMATS[fmt].load_linear(source, [("w.weight", 0, 48)], 0, empty, torch.float32)
    return method, source.get("w.weight"), source


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_builds_describes_and_specs_a_small_linear(fmt):
    method, weight, _ = _linear(fmt)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    want = x @ weight.t()
    got = method.matmul(x)
    assert got.shape == (3, 48)
    tolerance = {"float": 1e-5, "int8": 0.02, "int4": 0.2}[fmt]
    assert (got - want).abs().max() <= tolerance * want.abs().max()
    assert method.weight_format == fmt
    described, spec = method.describe(), method.fused_spec()
    if fmt == "float":
        assert described == "float32 [64, 48]"
        assert spec.kind == "float32" and spec.tensor is method.weight
        return
    assert described.startswith(f"{fmt} groups of 32") and described.endswith("[64 -> 48]")
    if fmt == "int4" and int4_matmul.available():
        assert spec.kind == "int4" and spec.tensor is method.kernel.packed  # the C layer's own layout
    else:
        assert spec is None  # int8 feeds the input twice; aten's layout is not the C layer's


class TinyExperts:
    """An ExpertReader of 2 experts, hidden 64, 32 rows, from float weights and their MXFP4 blocks."""

    def __init__(self):
        gen = torch.Generator().manual_seed(2)
        gate_up = torch.randn(2, 64, 64, generator=gen)  # [n, 2 rows (out), hidden (in)]
        down = torch.randn(2, 64, 32, generator=gen)  # [n, hidden (out), rows (in)]
        self.blocks = [quantize_mxfp4(gate_up), quantize_mxfp4(down)]
        self.floats = [dequantize_mxfp4(*b).transpose(1, 2) for b in self.blocks]  # [n, in, out]

    def fill_floats(self, expert, gate_up, down):
        gate_up.copy_(self.floats[0][expert])
        down.copy_(self.floats[1][expert])

    def mxfp4(self, expert):
        return tuple(MXFP4Weight(blocks=b[expert], scales=s[expert]) for b, s in self.blocks)


@pytest.mark.parametrize("fmt", [name for name, fmt in FORMATS.items() if fmt.load_experts is not None])
def test_each_format_builds_and_describes_a_small_expert_stack(fmt):
    reader = TinyExperts()
    method = load_experts(reader, FloatExperts(2, 64, 32, torch.float32), WeightPlan(fmt, "by hand"))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    for e in range(2):
        want = x @ reader.floats[0][e]
        got = method.matmul(e, x, 0)
        tolerance = {"float": 1e-5, "int8": 0.01, "int4": 0.3}[fmt]
        assert (got - want).abs().max() <= tolerance * want.abs().max(), (fmt, e)
    assert method.fused_spec() is None and method.nbytes > 0
    assert method.weight_format == fmt
    if fmt == "float":
        assert isinstance(method, (FloatExperts, OneDNNExperts))
        assert all(torch.equal(a, b) for a, b in zip(method.plain_weights(), reader.floats))
    else:
        assert isinstance(method, GroupedExperts) and method.describe().startswith(f"{fmt} groups of 32 x2")
        with pytest.raises(ValueError, match=f"experts held as {fmt} groups of 32 x2.*have no plain float weights"):
            method.plain_weights()
