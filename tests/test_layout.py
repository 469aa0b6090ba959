"""The package's shape (issue 29): folders by role, imports that flow one way, no import cycle.

Every import statement of every module counts, wherever it stands (module level, inside a function,
under ``if TYPE_CHECKING``): a lazy import is still a dependency, and a cycle hidden in a function is
still a cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parents[1] / "splat_metal_method"
NAME = PACKAGE.name

# The roles, from the top down: a folder may import only those after it in this list (and itself).
# bench drives the method; method is what nerfstudio loads; export reads trained runs;
# engine/data/viewer/verify serve the method; patches fix upstream packages; ops is the op layer.
LAYERS = [
    ["bench"],
    ["method"],
    ["export"],
    ["engine", "data", "viewer", "verify"],
    ["patches"],
    ["ops"],
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: Set[str]) -> Set[str]:
    """The package's modules that ``name`` imports (``from . import x`` counts x if it is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == NAME)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            elif (node.module or "").split(".")[0] == NAME:
                base = node.module
            else:
                continue
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> Dict[str, Set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def role(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2:
        return "top"
    return parts[1] if (PACKAGE / parts[1]).is_dir() else "top"


def test_cycle_finder_finds_a_cycle():
    """The checker itself: a planted cycle (and one through a lazy import) is reported."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_anywhere_in_the_package():
    found = cycles(graph())
    assert found == [], "import cycles (every import counts, lazy ones too):\n" + "\n".join(map(" <-> ".join, found))


def test_imports_flow_down_the_roles():
    rank = {r: i for i, layer in enumerate(LAYERS) for r in layer}
    wrong = []
    for module, deps in graph().items():
        src = role(module)
        if src == "top":
            continue
        for dep in deps:
            dst = role(dep)
            if dst == "top" or dst == src:
                continue
            if rank[dst] <= rank[src]:
                wrong.append(f"{module} ({src}) imports {dep} ({dst})")
    assert wrong == [], "\n".join(sorted(wrong))


def test_every_folder_has_a_role_and_few_modules_stay_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 4, top
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert set(folders) <= {r for layer in LAYERS for r in layer}, folders


# What the package (the wheel) holds under bench/: `splat-metal-bench` and what it runs. The step model, the peers'
# calibration, stored figures, the scale ledger and the run beside msplat are benchmarks/step_model/, outside it.
BENCH_MODULES = {"__init__", "__main__", "cli", "scenes", "step_ledger", "timing"}


def test_the_package_holds_no_benchmark_code():
    assert {p.stem for p in (PACKAGE / "bench").glob("*.py")} == BENCH_MODULES
    wrong = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            wrong += [f"{name} imports {n}" for n in names if n.split(".")[0] in ("benchmarks", "step_model")]
    assert wrong == [], wrong
