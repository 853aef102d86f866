"""Imports point one way: data, then the ops libraries, passes, front ends, the training
runtime, and inspection and the CLI on top (README, "How the code is laid out").

The test reads every ``import`` in ``amp_graph/`` and ``passes/`` (installed as
``amp_graph.passes``) with :mod:`ast`, including imports inside functions and under
``TYPE_CHECKING``: a cycle dodged at run time is still a cycle. It fails on

* an arrow pointing up (a module importing one of a higher layer),
* a module no layer names (a new module must be placed),
* an import cycle, counting the import of a package's ``__init__`` that importing any of its
  modules implies (a package's ``__init__`` may re-export its own modules, nothing more),
* two modules or packages with one name.

The checks are plain functions, each also run on a small made-up import graph with the fault
it looks for, so that a check which has stopped seeing anything fails too.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "amp_graph"

# Lowest first. A module belongs to the layer of the longest prefix naming it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "data",
        (
            "amp_graph.rule",
            "amp_graph.policy",
            "amp_graph.tables",
            "amp_graph.fp8.recipe",
            "amp_graph.fp8.filters",
        ),
    ),
    # the ops the graphs call and the scaler: they depend on nothing above them
    (
        "ops and scaler",
        (
            "amp_graph.fp8",
            "amp_graph.kernels",
            "amp_graph.scaler",
            "amp_graph.recompute",
            "amp_graph.cpu_kernels",
            "amp_graph.tensor_stats",
        ),
    ),
    ("passes", ("amp_graph.passes",)),
    (
        "front ends",
        (
            "amp_graph.amp_request",
            "amp_graph.capture",
            "amp_graph.capture_casts",
            "amp_graph.capture_dtypes",
            "amp_graph.capture_fsdp",
            "amp_graph.compiler",
            "amp_graph.backend",
        ),
    ),
    # statistics of chosen nodes while training: over compile's modules, under Graph
    ("monitoring", ("amp_graph.monitoring",)),
    (
        "training runtime",
        (
            "amp_graph.graph",
            "amp_graph.step_graph",
            "amp_graph.step_ops",
            "amp_graph.master_weights",
        ),
    ),
    # FSDP2 policies planned from the AMP plan before sharding: over the compiler
    ("sharding plans", ("amp_graph.fsdp_plan",)),
    (
        "inspection and integrations",
        (
            "amp_graph.inspect",
            "amp_graph.shadow",
            "amp_graph.output_error",
            "amp_graph.autopolicy",
            "amp_graph.lightning",
        ),
    ),
    # inference programs from the front ends' graphs (with autopolicy's calibration)
    ("deployment", ("amp_graph.deploy",)),
    (
        "public API and CLI",
        (
            "amp_graph",
            "amp_graph.__main__",
            "amp_graph.cli",
            "amp_graph.demo",
            "amp_graph.data",
            "amp_graph.models",
        ),
    ),
]


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for the installed layout (passes/ is amp_graph.passes)."""
    files: dict[str, Path] = {}
    for path in [*ROOT.glob("amp_graph/**/*.py"), *ROOT.glob("passes/**/*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "passes":
            parts = [PACKAGE, *parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _imported(module: str, is_package: bool, node: ast.AST, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:  # relative: from the module's package, up level - 1 packages
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    if source.split(".")[0] != PACKAGE:
        return set()
    # "from package import module" imports the module; "from module import name" the module
    return {f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names}


def read_imports(files: dict[str, Path]) -> dict[str, set[str]]:
    """Each module -> the amp_graph modules it imports anywhere in its source."""
    known = set(files)
    imports: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        found: set[str] = set()
        for node in ast.walk(tree):
            found |= _imported(module, is_package, node, known)
        imports[module] = {m for m in found if m != module}
    return imports


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer index)
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            names_it = module == prefix or module.startswith(prefix + ".")
            if names_it and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def unplaced(imports: dict[str, set[str]], layers=LAYERS) -> list[str]:
    return sorted(m for m in imports if layer_of(m, layers) is None)


def upward_arrows(imports: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """'a (layer) -> b (higher layer)' for each import that points up."""
    arrows = []
    for module, targets in sorted(imports.items()):
        here = layer_of(module, layers)
        for target in sorted(targets):
            there = layer_of(target, layers)
            if here is not None and there is not None and there > here:
                arrows.append(f"{module} ({layers[here][0]}) -> {target} ({layers[there][0]})")
    return arrows


def import_cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Cycles of imports. Importing ``a.b.c`` first runs ``a.b``'s ``__init__``, so each module
    also depends on its package (the top package excepted: it is the public facade on top).
    A cycle through a package's ``__init__`` and its own modules alone is how re-exports work;
    a cycle reaching outside the package is one that breaks with the import order."""
    graph = nx.DiGraph()
    for module, targets in imports.items():
        graph.add_node(module)
        graph.add_edges_from((module, t) for t in targets if t in imports)
        package = module.rsplit(".", 1)[0]
        if "." in module and package != PACKAGE and package in imports:
            graph.add_edge(module, package)
    cycles = []
    for component in nx.strongly_connected_components(graph):
        if len(component) < 2:
            continue
        packages = [m for m in component if any(o.startswith(m + ".") for o in component)]
        outer = min(packages, key=len) if packages else None
        inside = outer is not None and all(
            m == outer or m.startswith(outer + ".") for m in component
        )
        explicit = graph.subgraph(component).copy()
        explicit.remove_edges_from(
            [(a, b) for a, b in explicit.edges if b not in imports.get(a, set())]
        )
        if not inside or not nx.is_directed_acyclic_graph(explicit):
            cycles.append(sorted(component))
    return cycles


def repeated_names(modules: set[str]) -> list[str]:
    """Last name parts used by more than one module or package (``__init__`` aside)."""
    names = Counter(m.rsplit(".", 1)[-1] for m in modules if "." in m)
    return sorted(
        f"{name}: " + ", ".join(sorted(m for m in modules if m.endswith("." + name)))
        for name, count in names.items()
        if count > 1
    )


@pytest.fixture(scope="module")
def imports() -> dict[str, set[str]]:
    return read_imports(module_files())


def test_every_module_has_a_layer(imports):
    missing = unplaced(imports)
    assert not missing, f"place these modules in a layer of LAYERS: {missing}"


def test_no_import_points_up(imports):
    arrows = upward_arrows(imports)
    assert not arrows, "imports pointing up a layer:\n" + "\n".join(arrows)


def test_no_import_cycles(imports):
    cycles = import_cycles(imports)
    assert not cycles, f"import cycles: {cycles}"


def test_no_two_modules_share_a_name(imports):
    repeated = repeated_names(set(imports))
    assert not repeated, f"modules sharing a name: {repeated}"


def test_the_passes_import_no_front_end_or_runtime(imports):
    """The named case of the layer rule: the passes see neither the capture nor the step."""
    passes = {m: t for m, t in imports.items() if m.startswith("amp_graph.passes")}
    assert passes, "no passes found: the reader lost the passes/ directory"
    reached = {t for targets in passes.values() for t in targets}
    assert not reached & {"amp_graph.capture", "amp_graph.graph", "amp_graph.step_graph"}
    assert all(layer_of(t) <= layer_of("amp_graph.passes") for t in reached)


def test_inspection_is_imported_only_from_the_top(imports):
    top = layer_of("amp_graph.cli")
    for module, targets in imports.items():
        if layer_of(module) < top and not module.startswith("amp_graph.inspect"):
            assert not {t for t in targets if t.startswith("amp_graph.inspect")}, module


def test_the_reader_sees_the_imports_it_should(imports):
    """Known edges of every import form, so that an empty reading cannot pass the checks."""
    assert "amp_graph.policy" in imports["amp_graph.passes.classify"]  # from x import name
    assert "amp_graph.passes.schema" in imports["amp_graph.passes.classify"]  # from . import m
    assert "amp_graph.passes.meta" in imports["amp_graph.passes.classify"]  # from .m import n
    assert "amp_graph.kernels.scaler_ops" in imports["amp_graph.scaler.grad_scaler"]
    assert "amp_graph.fp8.custom_ops" in imports["amp_graph.shadow"]  # inside a function
    assert len(imports) > 60


# The checks themselves, on made-up graphs holding the faults they look for.

_TOY_LAYERS = [("low", ("pkg.low",)), ("high", ("pkg.high",))]


def test_check_finds_an_upward_arrow():
    imports = {"pkg.low": {"pkg.high"}, "pkg.high": set()}
    assert upward_arrows(imports, _TOY_LAYERS) == ["pkg.low (low) -> pkg.high (high)"]
    assert upward_arrows({"pkg.high": {"pkg.low"}, "pkg.low": set()}, _TOY_LAYERS) == []
    assert unplaced({"pkg.other": set()}, _TOY_LAYERS) == ["pkg.other"]


def test_check_finds_a_cycle_through_a_package_init():
    """The cycle this project had: policy -> fp8.recipe, whose package __init__ imports
    fp8.filters, which imported policy (under TYPE_CHECKING)."""
    imports = {
        "amp_graph.policy": {"amp_graph.fp8.recipe"},
        "amp_graph.fp8": {"amp_graph.fp8.filters", "amp_graph.fp8.recipe"},
        "amp_graph.fp8.filters": {"amp_graph.policy", "amp_graph.fp8.recipe"},
        "amp_graph.fp8.recipe": set(),
    }
    assert import_cycles(imports) == [sorted(imports)]
    imports["amp_graph.fp8.filters"] = {"amp_graph.rule", "amp_graph.fp8.recipe"}
    imports["amp_graph.rule"] = set()
    assert import_cycles(imports) == []  # the fix: Rule below both


def test_check_finds_a_cycle_inside_a_package_but_allows_re_exports():
    reexport = {"p.q": {"p.q.a", "p.q.b"}, "p.q.a": {"p.q.b"}, "p.q.b": set()}
    assert import_cycles(reexport) == []
    reexport["p.q.b"] = {"p.q.a"}
    assert import_cycles(reexport) == [["p.q", "p.q.a", "p.q.b"]]


def test_check_finds_a_repeated_name():
    assert repeated_names({"a.ops", "a.k.ops", "a.x"}) == ["ops: a.k.ops, a.ops"]
    assert repeated_names({"a.tables", "a.inspect.tables"}) == [
        "tables: a.inspect.tables, a.tables"
    ]
