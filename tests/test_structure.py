"""The package's dependency rules: the driver side (engine) and the rank side (worker) meet only in
`cpllm.launch`, through the torch-free step contract `cpllm.step`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cpllm"


def runtime_imports(path: Path) -> set[str]:
    """Modules a file imports when it runs (imports under `if TYPE_CHECKING:` are for annotations only)."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for block in ast.walk(tree)
               if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
               for stmt in block.body for node in ast.walk(stmt)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize(("side", "forbidden"), [("engine", "cpllm.worker"), ("worker", "cpllm.engine")])
def test_engine_and_worker_do_not_import_each_other(side, forbidden):
    offenders = {path.name: sorted(m for m in runtime_imports(path) if m.startswith(forbidden))
                 for path in (PACKAGE / side).glob("*.py")}
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_step_contract_is_plain_python():
    assert {m for m in runtime_imports(PACKAGE / "step.py") if m.startswith(("torch", "cpllm"))} == set()
