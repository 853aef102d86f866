"""The architecture is the tree: one folder per layer, imports pointing one way
(ARCHITECTURE.md, "Layers", whose table is :data:`LAYERS`, row for row).

The test reads every ``import`` in ``amp_graph/`` and ``passes/`` (installed as
``amp_graph.passes``) with :mod:`ast`, including imports inside functions and under
``TYPE_CHECKING``: a cycle dodged at run time is still a cycle. It fails on

* an arrow pointing up (a module importing one of a higher layer),
* a module no layer names (a new module must be placed),
* a flat module at the top of ``amp_graph/`` (beside ``__init__.py``, ``__main__.py`` and
  ``cli.py``, a module belongs in the folder of its layer), a folder that is not a layer, a
  layer that is not one folder, and a package inside a layer's folder,
* a package binding one of its modules' names to something else (``from .m import m`` makes
  ``pkg.m`` the function, and the module is then reachable only through importlib),
* an import cycle, counting the import of a package's ``__init__`` that importing any of its
  modules implies (a package's ``__init__`` may re-export its own modules, nothing more),
* two modules or packages with one name,
* ARCHITECTURE.md's layer table and :data:`LAYERS` out of step.

The checks are plain functions, each also run on a small made-up input with the fault it
looks for, so that a check which has stopped seeing anything fails too.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "amp_graph"
# The only modules at the top of amp_graph/: the public facade and the command line.
TOP_FILES = ("__init__.py", "__main__.py", "cli.py")

# Lowest first: each layer is one folder (a package; passes/ is installed as amp_graph.passes),
# except the facade and the command line, the files at the top. A module belongs to the layer
# of the longest prefix naming it; the bare package name names the facade alone.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("policy", ("amp_graph.policy",)),
    ("ops", ("amp_graph.ops",)),
    ("scaler", ("amp_graph.scaler",)),
    ("passes", ("amp_graph.passes",)),
    ("capture", ("amp_graph.capture",)),
    ("frontends", ("amp_graph.frontends",)),
    ("accuracy", ("amp_graph.accuracy",)),
    ("monitoring", ("amp_graph.monitoring",)),
    ("training", ("amp_graph.training",)),
    ("inspect", ("amp_graph.inspect",)),
    ("integrations", ("amp_graph.integrations",)),
    ("deploy", ("amp_graph.deploy",)),
    ("public API", ("amp_graph",)),
    ("demo", ("amp_graph.demo",)),
    ("command line", ("amp_graph.cli", "amp_graph.__main__")),
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


def _from_source(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    # relative: from the module's package, up level - 1 packages
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imported(module: str, is_package: bool, node: ast.AST, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE}
    if not isinstance(node, ast.ImportFrom):
        return set()
    source = _from_source(module, is_package, node)
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
            below = prefix != PACKAGE and module.startswith(prefix + ".")
            names_it = module == prefix or below
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


def tree_faults(
    package_dir: Path,
    layers: list[tuple[str, tuple[str, ...]]] = LAYERS,
    outside: tuple[str, ...] = ("amp_graph.passes",),
) -> list[str]:
    """How the folders under ``package_dir`` differ from the layers: a flat module beside the
    top files, a folder no layer is, a layer that is not one folder, a package nested in a
    layer's folder. ``outside``: layers whose folder lives elsewhere (passes/)."""
    package = package_dir.name
    faults = [
        f"{path.name}: a flat module at the top of {package}/; put it in its layer's folder"
        for path in sorted(package_dir.glob("*.py"))
        if path.name not in TOP_FILES
    ]
    top = {package, *(f"{package}.{Path(name).stem}" for name in TOP_FILES)}
    folders = {
        f"{package}.{d.name}"
        for d in package_dir.iterdir()
        if d.is_dir() and d.name != "__pycache__" and any(d.rglob("*.py"))
    }
    for name, prefixes in layers:
        if set(prefixes) <= top:
            continue
        if len(prefixes) != 1 or prefixes[0] not in folders | set(outside):
            faults.append(f"layer {name!r} is {list(prefixes)}, not one folder of {package}/")
    named = {prefix for _, prefixes in layers for prefix in prefixes}
    for folder in sorted(folders - named):
        faults.append(f"{folder.split('.')[-1]}/: a folder that is no layer of LAYERS")
    for folder in sorted(folders):
        root = package_dir / folder.split(".")[-1]
        if not (root / "__init__.py").exists():
            faults.append(f"{root.name}/: holds modules but no __init__.py")
        faults += [
            f"{init.parent.relative_to(package_dir)}/: a package inside the layer {root.name}/"
            for init in sorted(root.glob("*/**/__init__.py"))
        ]
    return faults


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that bind a module's attributes: its body, through if/try/with blocks
    (``if TYPE_CHECKING:``), never inside a function or class."""
    found = []
    for node in body:
        found.append(node)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            found += _module_level(getattr(node, field, []))
    return found


def shadowed_modules(files: dict[str, Path]) -> list[str]:
    """'pkg.name (how)' for each module ``pkg.name`` whose package's ``__init__`` binds
    ``name`` to something other than that module: then ``pkg.name`` is not the module."""
    found = []
    for package, path in sorted(files.items()):
        if path.name != "__init__.py":
            continue
        children = {
            m.rsplit(".", 1)[1] for m in files if "." in m and m.rsplit(".", 1)[0] == package
        }
        for node in _module_level(ast.parse(path.read_text(), filename=str(path)).body):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name in children:
                    found.append(f"{package}.{node.name} (a {type(node).__name__})")
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id in children:
                        found.append(f"{package}.{target.id} (assigned)")
            elif isinstance(node, ast.ImportFrom):
                source = _from_source(package, True, node)
                for alias in node.names:
                    bound = alias.asname or alias.name
                    module = f"{package}.{bound}"
                    if bound in children and f"{source}.{alias.name}" != module:
                        found.append(f"{module} (imported {alias.name})")
    return found


SECTION = "## Layers"  # ARCHITECTURE.md's heading of the layer table


def architecture_layers(text: str) -> list[tuple[str, set[str]]]:
    """(layer, the paths its row names) for each row of ARCHITECTURE.md's layer table, in
    order."""
    if SECTION not in text:
        return []
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and cells[0] not in ("layer", "---"):
            rows.append((cells[0], set(re.findall(r"`([^`]+)`", cells[1]))))
    return rows


def layer_paths(prefixes: tuple[str, ...]) -> set[str]:
    """The files or folders a layer is, as ARCHITECTURE.md's table names them."""
    paths = set()
    for prefix in prefixes:
        parts = prefix.split(".")
        if prefix == f"{PACKAGE}.passes":
            paths.add("passes/")
        elif prefix == PACKAGE:
            paths.add(f"{PACKAGE}/__init__.py")
        elif (ROOT / Path(*parts)).is_dir():
            paths.add("/".join(parts) + "/")
        else:
            paths.add("/".join(parts) + ".py")
    return paths


def table_drift(rows: list[tuple[str, set[str]]], layers=LAYERS) -> list[str]:
    """What ARCHITECTURE.md's table (rows) says that LAYERS does not."""
    expected = [(name, layer_paths(prefixes)) for name, prefixes in layers]
    if [name for name, _ in rows] != [name for name, _ in expected]:
        names = [n for n, _ in rows]
        return [f"ARCHITECTURE.md's layers {names} != LAYERS {[n for n, _ in expected]}"]
    return [
        f"{name}: ARCHITECTURE.md names {sorted(paths)}, LAYERS {sorted(want)}"
        for (name, paths), (_, want) in zip(rows, expected, strict=True)
        if paths != want
    ]


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


def test_the_folders_are_the_layers():
    faults = tree_faults(ROOT / PACKAGE)
    assert not faults, "\n".join(faults)


def test_no_package_hides_a_module_of_its_own():
    shadowed = shadowed_modules(module_files())
    assert not shadowed, f"rename the module or stop re-exporting the name: {shadowed}"


def test_architecture_table_is_the_layers():
    rows = architecture_layers((ROOT / "ARCHITECTURE.md").read_text())
    assert len(rows) == len(LAYERS)
    drift = table_drift(rows)
    assert not drift, "\n".join(drift)


def test_the_passes_import_no_front_end_or_runtime(imports):
    """The named case of the layer rule: the passes see neither the capture nor the step."""
    passes = {m: t for m, t in imports.items() if m.startswith("amp_graph.passes")}
    assert passes, "no passes found: the reader lost the passes/ directory"
    reached = {t for targets in passes.values() for t in targets}
    above = ("amp_graph.capture", "amp_graph.frontends", "amp_graph.training")
    assert not {t for t in reached if t.startswith(above)}
    assert all(layer_of(t) <= layer_of("amp_graph.passes") for t in reached)


def test_inspection_is_imported_only_from_the_top(imports):
    top = layer_of(PACKAGE)
    for module, targets in imports.items():
        if layer_of(module) < top and not module.startswith("amp_graph.inspect"):
            assert not {t for t in targets if t.startswith("amp_graph.inspect")}, module


def test_the_reader_sees_the_imports_it_should(imports):
    """Known edges of every import form, so that an empty reading cannot pass the checks."""
    assert "amp_graph.policy" in imports["amp_graph.passes.classify"]  # from x import name
    assert "amp_graph.passes.schema" in imports["amp_graph.passes.classify"]  # from . import m
    assert "amp_graph.passes.meta" in imports["amp_graph.passes.classify"]  # from .m import n
    assert "amp_graph.ops.scaler_ops" in imports["amp_graph.scaler.grad_scaler"]
    assert "amp_graph.ops.fp8_ops" in imports["amp_graph.accuracy.shadow"]  # inside a function
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


def test_check_finds_a_flat_module_and_folders_that_are_not_layers(tmp_path):
    package = tmp_path / "pkg"
    for path in ("__init__.py", "cli.py", "low/__init__.py", "low/a.py", "high/__init__.py"):
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text("")
    layers = [("low", ("pkg.low",)), ("high", ("pkg.high",)), ("top", ("pkg", "pkg.cli"))]
    assert tree_faults(package, layers, outside=()) == []
    (package / "helpers.py").write_text("")  # a new flat module
    (package / "extra").mkdir()
    (package / "extra" / "b.py").write_text("")  # a folder no layer is, without __init__
    (package / "low" / "sub").mkdir()
    (package / "low" / "sub" / "__init__.py").write_text("")  # a package inside a layer
    two = [*layers[:2], ("both", ("pkg.low", "pkg.high")), layers[2]]
    assert tree_faults(package, two, outside=()) == [
        "helpers.py: a flat module at the top of pkg/; put it in its layer's folder",
        "layer 'both' is ['pkg.low', 'pkg.high'], not one folder of pkg/",
        "extra/: a folder that is no layer of LAYERS",
        "extra/: holds modules but no __init__.py",
        "low/sub/: a package inside the layer low/",
    ]


def test_check_finds_a_package_hiding_its_module(tmp_path):
    init = tmp_path / "__init__.py"
    files = {"amp_graph.q": init, "amp_graph.q.diff": tmp_path / "diff.py"}
    files["amp_graph.q.draw"] = tmp_path / "draw.py"
    init.write_text(
        "from . import draw\nfrom .draw import SVG\nfrom amp_graph.q.diff import D\n"
        "def f():\n    from .diff import diff\n    draw = 1\n"
    )
    assert shadowed_modules(files) == []
    init.write_text("if True:\n    from .diff import diff\n\ndef draw():\n    pass\n")
    assert shadowed_modules(files) == [
        "amp_graph.q.diff (imported diff)",
        "amp_graph.q.draw (a FunctionDef)",
    ]


def test_check_finds_architecture_table_out_of_step():
    architecture = (
        "## Layers\n\n| layer | folder | what |\n| --- | --- | --- |\n"
        "| policy | `amp_graph/policy/` | the policy |\n"
        "| passes | `passes/` | the passes |\n\n## Next\n| x | `y` |\n"
    )
    rows = architecture_layers(architecture)
    assert rows == [("policy", {"amp_graph/policy/"}), ("passes", {"passes/"})]
    layers = [("policy", ("amp_graph.policy",)), ("passes", ("amp_graph.passes",))]
    assert table_drift(rows, layers) == []
    assert table_drift(rows[::-1], layers) == [
        "ARCHITECTURE.md's layers ['passes', 'policy'] != LAYERS ['policy', 'passes']"
    ]
    moved = [("policy", {"amp_graph/ops/"}), rows[1]]
    assert table_drift(moved, layers) == [
        "policy: ARCHITECTURE.md names ['amp_graph/ops/'], LAYERS ['amp_graph/policy/']"
    ]
