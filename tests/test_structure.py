"""The package's dependency rules: the driver side (engine) and the rank side (worker) meet only in
`cpllm.launch_ranks`, through the torch-free step contract `cpllm.step`."""

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


def _module(path: Path) -> str:
    return ".".join(("cpllm", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def _every_import(path: Path, module: str, known: set[str]) -> set[str]:
    """The package's modules a file imports anywhere (top level, in functions, under TYPE_CHECKING), each import of
    a submodule counting its parent packages too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
                parent = parent.rsplit(".", node.level - 1)[0] if node.level > 1 else parent
                base = f"{parent}.{base}" if base else parent
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    edges = set()
    for name in found:
        while name and name not in known:
            name = name.rpartition(".")[0]
        parts = name.split(".")
        edges |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
    return {m for m in edges if m in known and m != module and not module.startswith(m + ".")}


def test_no_import_circles():
    """No module reaches itself through the modules it imports, counting lazy and annotation-only imports: each
    circle found is named (the modules of one strongly connected component)."""
    paths = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _every_import(p, m, set(paths)) for m, p in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                circles.append(sorted([v, *component]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert circles == []
