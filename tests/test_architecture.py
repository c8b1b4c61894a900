"""The package's layering rules, checked on its source: no import cycles between modules
(through function-level imports too), no module over 600 lines, no `_`-prefixed name
imported from another module nor reached as another module's object's attribute, the
serving layers never importing `benchmarks/`, and `core/` free of torch (that last one
runs in a subprocess in tests/core/test_kv_cache_utils.py)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagedserve"


@functools.cache
def _modules() -> dict[str, ast.Module]:
    """Every module's syntax tree, parsed once for all the tests here (read-only)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = ast.parse(path.read_text(encoding="utf-8"))
    return out


def _imports(tree: ast.Module, module_level_only: bool) -> list[ast.ImportFrom | ast.Import]:
    if not module_level_only:
        return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    found = []
    for node in tree.body:  # imports inside functions run later, not at import time
        found += [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))
                  and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return found


def _is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports only a type checker runs."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(node: ast.AST) -> list[ast.ImportFrom | ast.Import]:
    """Every import that can run, at any depth (a function-level import runs when the
    function does, and a cycle through it is still a cycle), but for those under `if
    TYPE_CHECKING:` (its `else:` branch runs, and counts)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [node]
    children = node.orelse if _is_type_checking(node) else list(ast.iter_child_nodes(node))
    return [imp for child in children for imp in _runtime_imports(child)]


def _import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (and the packages above them, which
    importing runs first), from every import that can run."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, tree in mods.items():
        for node in _runtime_imports(tree):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names += [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                    target = ".".join(parts[:i])
                    if target in mods and target != mod and not mod.startswith(target + "."):
                        graph[mod].add(target)
    return graph


def test_no_import_cycles_between_modules():
    """No module imports, at any depth, one that imports it back (directly or around a
    longer circle): the layers stay a stack, each importable and testable above the
    ones below it."""
    mods = _modules()
    graph = _import_graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            assert state.get(n) != 1, "import cycle: " + " -> ".join(path[path.index(n):] + [n])
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m)


def test_no_private_names_cross_modules():
    offenders = []
    for mod, tree in _modules().items():
        for node in _imports(tree, module_level_only=False):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedserve"):
                offenders += [f"{mod}: from {node.module} import {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert offenders == []


# The packages a server runs: a benchmark is a client of them, never a part.
SERVING = ("core", "engine", "worker", "executor", "attention", "layers", "models", "model_loader",
           "structured_output", "distributed", "entrypoints")


def test_serving_layers_never_import_benchmarks():
    """At any depth (function-level imports included), nor by a module path in a string
    (importlib): the CLI finds a benchmark through the `pagedserve.benchmarks`
    entry-point group the benchmarks declare in pyproject.toml."""
    offenders = []
    for mod, tree in _modules().items():
        if mod.split(".")[1:2] and mod.split(".")[1] in SERVING:
            for node in _imports(tree, module_level_only=False):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                offenders += [f"{mod}: {name}" for name in names if name.startswith("pagedserve.benchmarks")]
            offenders += [f"{mod}:{n.lineno}: {n.value!r}" for n in ast.walk(tree) if isinstance(n, ast.Constant)
                          and isinstance(n.value, str) and n.value.startswith("pagedserve.benchmarks.")]
    assert offenders == []


MAX_MODULE_LINES = 600


def test_no_module_over_600_lines():
    """A module longer than this holds more than one idea: split it where its seams are."""
    long = {str(p.relative_to(PACKAGE.parent)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert long == {}


# Private attributes of other libraries' objects that we read on purpose, with why.
EXTERNAL_PRIVATE_ATTRIBUTES = {
    "_version",  # torch.Tensor's in-place version counter: a cached repack of a weight stays valid while it holds
}


def test_no_private_attribute_reaches_across_modules():
    """`obj._name` where obj is not self/cls, `_name` is not defined in the same module and
    obj is not another library's module: a reach into another of our modules' internals
    (say so in that module's public names instead)."""
    offenders = []
    for mod, tree in _modules().items():
        external: set[str] = set()
        defined: set[str] = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                external |= {(a.asname or a.name).split(".")[0] for a in n.names if not a.name.startswith("pagedserve")}
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and not (n.module or "").startswith("pagedserve"):
                external |= {a.asname or a.name for a in n.names}
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                defined.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):  # class fields, module globals
                defined.add(n.id)
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            root = n.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            if (isinstance(root, ast.Name) and root.id in external) or n.attr in defined:
                continue
            if n.attr not in EXTERNAL_PRIVATE_ATTRIBUTES:
                offenders.append(f"{mod}:{n.lineno}: {ast.unparse(n)}")
    assert offenders == []


def test_the_suites_heavy_first_list_names_files_that_exist() -> None:
    """tests/conftest.py orders these first; a renamed file would silently drop out."""
    from tests.conftest import HEAVY_FIRST

    root = Path(__file__).resolve().parents[1]
    assert [p for p in HEAVY_FIRST if not (root / p).is_file()] == []


def test_the_readme_and_the_performance_page_stay_short() -> None:
    """The README is read first and whole (under 25,000 bytes); docs/performance.md holds the
    current figures only, past runs living in git history (under 400 lines)."""
    root = PACKAGE.parent
    assert (root / "README.md").stat().st_size < 25_000
    assert len((root / "docs" / "performance.md").read_text(encoding="utf-8").splitlines()) < 400
