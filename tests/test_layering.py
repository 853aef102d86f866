"""Layers point one way: graph passes below, the training runtime beside them, inspection on
top. Read from the source (every import, the lazy ones inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = (
    "amp_graph.scaler",
    "amp_graph.kernels",
    "amp_graph.graph",
    "amp_graph.step_ops",
    "amp_graph.master_weights",
)


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[0] == "passes":
        parts = ["amp_graph", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (no import at run time)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    return skipped


def _imports(path: Path, name: str) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return {m for m in found if m.startswith("amp_graph")}


def _files() -> dict[str, Path]:
    files = [*(ROOT / "amp_graph").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]
    return {_module_name(f): f for f in files}


def _graph() -> dict[str, set[str]]:
    modules = _files()
    return {
        name: {m for m in _imports(path, name) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_passes_never_import_the_training_runtime():
    graph = _graph()
    for module, imported in graph.items():
        if module.startswith("amp_graph.passes"):
            bad = {m for m in imported if m.startswith(RUNTIME)}
            assert not bad, f"{module} imports the training runtime: {sorted(bad)}"


def test_no_import_cycles_between_modules():
    """Packages (``__init__``) re-export their modules, so edges into a package are left out;
    every module-to-module edge must be acyclic."""
    graph = _graph()
    packages = {name for name, path in _files().items() if path.name == "__init__.py"}
    digraph = nx.DiGraph()
    for module, imported in graph.items():
        if module in packages:
            continue
        digraph.add_edges_from((module, m) for m in imported if m not in packages)
    cycles = list(nx.simple_cycles(digraph))
    assert not cycles, f"import cycles: {cycles}"


def test_inspection_is_on_top():
    graph = _graph()
    for module, imported in graph.items():
        if not module.startswith("amp_graph.inspect") and module not in (
            "amp_graph",
            "amp_graph.cli",
            "amp_graph.demo",
        ):
            inspect_imports = {m for m in imported if m.startswith("amp_graph.inspect")}
            assert not inspect_imports, f"{module} imports inspection: {sorted(inspect_imports)}"
