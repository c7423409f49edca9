"""Fitness of the layer-kind structure (docs/architecture.md, "Adding a layer kind"): the CP layer and the ranks'
runner name no layer kind, and no module outside a kind's package reaches into that package's own modules.

Read from the source (imports, identifiers and string constants of the code, not its comments), so a new kind
that needs a branch in cpllm/context_parallel/ or cpllm/worker/ fails here instead of growing one."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from cpllm.layers import registry

PACKAGE = Path(__file__).resolve().parent.parent / "cpllm"
LAYERS = PACKAGE / "layers"
KIND_PACKAGES = sorted(p.name for p in LAYERS.iterdir() if (p / "__init__.py").exists())
KIND_NAMES = {kind.name for kind in registry.LAYER_KINDS} | set(registry.BACKENDS) | set(KIND_PACKAGES)
"""Every name a kind goes by: its registry key, its backends' keys, its package."""
KIND_WORDS = ("latent", "mla", "triton", "softcap", "sliding")
"""Parts of identifiers that would mean a kind-specific branch in kind-free code (sinks are not among them: an
extra logit in each head's denominator is a term of the exact merge, cpllm/context_parallel/merge.py)."""
KIND_FREE = ("context_parallel", "worker")


def _python_files(folder: Path):
    return sorted(folder.rglob("*.py"))


def _module_name(path: Path) -> str:
    return ".".join(("cpllm", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def _imports(tree: ast.AST, module: str) -> set[str]:
    """Absolute names of the modules a module imports (`from x import y` counted as x.y and x)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parent = module.rsplit(".", node.level)[0]
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
        # attribute docstrings: a string expression right after an assignment
        for body in (getattr(node, "body", None), getattr(node, "orelse", None)):
            if isinstance(body, list):
                for stmt in body:
                    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                        ids.add(id(stmt.value))
    return ids


def _kind_mentions(source: str, module: str) -> list[str]:
    tree = ast.parse(source)
    found, docs = [], _docstrings(tree)
    for name in _imports(tree, module):
        if name.startswith("cpllm.layers.") and name != "cpllm.layers.registry" and \
                name.split(".")[2] in KIND_PACKAGES:
            found.append(f"imports {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in KIND_NAMES:
                found.append(f"the string {node.value!r} (line {node.lineno})")
        word = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else \
            node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else node.arg \
            if isinstance(node, ast.arg) else None
        if word is not None and any(part in word.lower() for part in KIND_WORDS):
            found.append(f"the name {word!r} (line {node.lineno})")
    return found


@pytest.mark.parametrize("folder", KIND_FREE)
def test_the_cp_layer_and_the_runner_name_no_layer_kind(folder):
    offences = {str(path.relative_to(PACKAGE)): found for path in _python_files(PACKAGE / folder)
                if (found := _kind_mentions(path.read_text(), _module_name(path)))}
    assert not offences, offences


def test_no_module_reaches_into_another_kinds_package():
    offences = []
    for path in _python_files(PACKAGE):
        offences += _private_imports(path.read_text(), _module_name(path))
    assert not offences, offences


def _private_imports(source: str, module: str) -> list[str]:
    offences = []
    for name in _imports(ast.parse(source), module):
        parts = name.split(".")
        if len(parts) < 4 or parts[:2] != ["cpllm", "layers"] or parts[2] not in KIND_PACKAGES:
            continue
        kind = parts[2]
        if module.startswith(f"cpllm.layers.{kind}"):
            continue  # the kind's own modules
        public = importlib.import_module(f"cpllm.layers.{kind}").PUBLIC_MODULES
        if parts[3] not in public:
            offences.append(f"{module} imports {name}: cpllm.layers.{kind} exports only {public}")
    return offences


def test_the_fitness_checks_see_an_offence():
    """The checks above can fail: a runner module naming a kind, and one importing a kind's own module."""
    source = "from cpllm.layers.mla.backend import MLAPagedBackend\nlatent_width = 'mla'\n"
    found = _kind_mentions(source, "cpllm.worker.bad")
    assert any("imports cpllm.layers.mla" in f for f in found) and "the string 'mla' (line 2)" in found
    assert "the name 'latent_width' (line 2)" in found
    assert _private_imports(source, "cpllm.model.bad") == []  # mla's backend is public (the sparse kind extends it)
    private = "from cpllm.layers.sparse_mla.indexer import Indexer\n"
    assert ("cpllm.model.bad imports cpllm.layers.sparse_mla.indexer: cpllm.layers.sparse_mla exports only "
            "('spec', 'attention', 'topk')") in _private_imports(private, "cpllm.model.bad")
    assert _private_imports(private, "cpllm.layers.sparse_mla.other") == []
