"""The package's dependency rules: the driver side (engine) and the rank side (worker) meet only in
`cpllm.launch_ranks`, through the torch-free step contract `cpllm.step`."""

from __future__ import annotations

import ast
import re
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


# ---- one parallel context (cpllm/distributed/parallel_context.py) -----------------------------------------------

RETIRED_PARALLEL_OBJECTS = {"CP" + "Comm", "TP" + "Shard", "MoE" + "Shard", "PCP" + "Split"}
"""The per-purpose objects the layers received before the parallel context (spelled apart: this file names none)."""
SOURCE_FOLDERS = [PACKAGE, PACKAGE.parent / "tests", PACKAGE.parent / "benchmarks", PACKAGE.parent / "scripts"]
RANK_SIZE = re.compile(r"^(tp|pcp|dcp|dp|cp)(_size)?$|^(replica|world|kv_shard|moe)_size$")
"""Names of a parallel size: `tp`, `dcp_size`, `dims.pcp`, `replica_size` (and `<group>.size`: GROUP_NAMES)."""
GROUP_NAMES = {"tp", "pcp", "dcp", "cp", "dp", "moe", "replica", "kv", "kv_shard"}
NOT_A_RANK = ("size", "heads", "hidden", "width", "rows", "cols", "vocab", "tokens", "features", "experts",
              "intermediate", "dim", "len", "num", "count", "shard", "bytes", "blocks", "context", "devices", "cpu",
              "start", "end", "pos", "interleave")
"""Words that say a name counts or places something other than a rank (`num_heads // tp`, `positions % cp`)."""


def _identifier(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _size_kind(node: ast.AST) -> str | None:
    """The group kind whose size `node` names (`tp`, `self.dims.dcp`, `pcp_size`, `self.pcp.size`), or None."""
    name = _identifier(node)
    if name == "size" and isinstance(node, ast.Attribute) and _identifier(node.value) in GROUP_NAMES:
        return _identifier(node.value)
    return name.removesuffix("_size") if name is not None and RANK_SIZE.match(name) else None


def _leaves(node: ast.AST) -> list[str]:
    """The last identifier of every name or attribute chain in `node` (`self.tp.rank` -> rank), functions called
    left out (`torch.div`)."""
    inner = {id(n.value) for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    inner |= {id(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
    return [_identifier(n) for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute)) and id(n) not in inner and _identifier(n) != "self"]


def _may_be_rank(node: ast.AST) -> bool:
    """Some name in `node` may hold a rank or a coordinate: one saying it counts or places something else does not."""
    return _size_kind(node) is None and any(not any(word in leaf.lower() for word in NOT_A_RANK)
                                            for leaf in _leaves(node))


def _ring_step(left: ast.AST, kind: str) -> bool:
    """`(g.rank - step) % g.size`: a position inside one group moved along it, not a rank taken apart."""
    ranks = {_identifier(n.value) if _identifier(n) == "rank" and isinstance(n, ast.Attribute) else
             (_identifier(n) or "").removesuffix("_rank")
             for n in ast.walk(left) if "rank" in (_identifier(n) or "")}
    return ranks == {kind}


def rank_arithmetic(source: str) -> list[str]:
    """Expressions that take a rank apart or put one together by hand: `r // S`, `r % S` or `a * S + b`, where S
    names a parallel size and r (a, b) may hold a rank or a coordinate (what ParallelDims and the parallel context
    answer: `coords`, `cp_coords`, `cp_rank_of`, `rank(kind)`, `member_coords`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.BinOp):
            continue
        kind = _size_kind(node.right)
        if (isinstance(node.op, (ast.FloorDiv, ast.Mod)) and kind is not None and _may_be_rank(node.left)
                and not _ring_step(node.left, kind)):
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
        if isinstance(node.op, ast.Add):
            for product, other in ((node.left, node.right), (node.right, node.left)):
                if not (isinstance(product, ast.BinOp) and isinstance(product.op, ast.Mult)):
                    continue
                factor = product.left if _size_kind(product.right) else product.right if _size_kind(product.left) \
                    else None
                if factor is not None and _may_be_rank(factor) and _may_be_rank(other):
                    found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def retired_names(source: str) -> list[str]:
    """Identifiers (classes, names, attributes, imports) that bring back a retired parallel object."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = [alias.name for alias in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else \
            [node.name] if isinstance(node, ast.ClassDef) else [_identifier(node)]
        found += [f"{name} (line {node.lineno})" for name in names if name in RETIRED_PARALLEL_OBJECTS]
    return found


def test_layers_receive_one_parallel_context():
    """No module defines or uses CP-comm, TP-shard, MoE-shard or PCP-split objects again: layers take the
    ParallelContext."""
    offenders = {str(path.relative_to(PACKAGE.parent)): names for folder in SOURCE_FOLDERS
                 for path in sorted(folder.rglob("*.py")) if (names := retired_names(path.read_text()))}
    assert offenders == {}


def test_only_distributed_takes_ranks_apart():
    """Outside cpllm/distributed/ no module computes rank coordinates itself: they ask the dims or the context."""
    offenders = {str(path.relative_to(PACKAGE)): found for path in sorted(PACKAGE.rglob("*.py"))
                 if path.relative_to(PACKAGE).parts[0] != "distributed"
                 and (found := rank_arithmetic(path.read_text()))}
    assert offenders == {}


def test_the_parallel_checks_see_an_offence():
    """The checks above flag what they forbid and pass legitimate shard and ring arithmetic."""
    offences = ("my_dcp = comm.cp_rank % self.dcp", "p, d = index // self.dcp, index % self.dcp",
                "rank = self.pcp_rank * self.tp.size + self.tp.rank", "dest = source_pcp * dcp + my_dcp",
                "row = piece // self.dims.dcp", "first = rank % self.replica_size")
    for line in offences:
        assert rank_arithmetic(line), line
    legit = ("shard = config.intermediate_size // tp.size", "start = tp.rank * shard",
             "source = (pcp.rank - step) % pcp.size", "dcp = cp // pcp_size",
             "owner = positions // layout.interleave % cp", "q0 = tp_rank * self.num_heads * d",
             "rows = -(-(self.end - self.start) // self.pcp.size)", "row = p * num_rows + row")
    for line in legit:
        assert rank_arithmetic(line) == [], line
    retired = "from cpllm.model.layers import " + "TP" + "Shard\nclass PCP" + "Split: pass\nx = y.CP" + "Comm"
    assert len(retired_names(retired)) == 3 and retired_names("text = 'TPShard'") == []
