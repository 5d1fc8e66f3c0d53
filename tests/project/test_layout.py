"""The folders are the architecture: the engine (`kvlab/*.py`) imports nothing from serving, the
workbook or the benchmarks; serving imports only the engine; no two of kvlab's modules import
each other in a cycle; no two files share a name; no function is a wall of code.

Read from the source (ast), so every import counts, the ones inside functions too: a lazy
import is still a dependency, only a later one.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGE = ROOT / "kvlab"
LAYERS = ("kvlab.serve", "kvlab.workbook", "kvlab.bench")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def runtime_nodes(tree: ast.AST):
    """Every node of the tree but those under `if TYPE_CHECKING:` (imported for the type checker
    alone, never when the code runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
                todo.extend(child.orelse)
            else:
                todo.append(child)


def imported(name: str, modules: dict[str, Path] = MODULES) -> set[str]:
    """The kvlab modules `name` imports (`from kvlab.x import y` counts kvlab.x.y when that is a
    module, else kvlab.x), at any depth of its source."""
    path = modules[name]
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in modules else mod)
    return {m for m in found if m in modules and m != name}


GRAPH = {name: imported(name) for name in MODULES}


def layer(name: str) -> str:
    for top in LAYERS:
        if name == top or name.startswith(top + "."):
            return top
    return "kvlab"  # the engine


def test_the_engine_imports_no_serving_workbook_or_bench_code():
    bad = {m: sorted(d for d in deps if layer(d) != "kvlab")
           for m, deps in GRAPH.items() if layer(m) == "kvlab"}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_serving_imports_only_the_engine_and_itself():
    bad = {m: sorted(d for d in deps if layer(d) not in ("kvlab", "kvlab.serve"))
           for m, deps in GRAPH.items() if layer(m) == "kvlab.serve"}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_the_import_graph_sees_lazy_and_relative_imports(tmp_path):
    """An engine module that imports the workbook inside a function, or a relative import, is
    an edge of the graph the checks above read."""
    files = {"kvlab/__init__.py": "", "kvlab/engine.py": "def f():\n    from kvlab.workbook import viz\n",
             "kvlab/workbook/__init__.py": "", "kvlab/workbook/viz.py": "from . import chapters\n",
             "kvlab/workbook/chapters.py": "import kvlab.engine\n",
             "kvlab/workbook/hints.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    import kvlab.workbook.viz\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    modules = {module_name(p, tmp_path): p for p in (tmp_path / "kvlab").rglob("*.py")}
    assert imported("kvlab.engine", modules) == {"kvlab.workbook.viz"}
    assert imported("kvlab.workbook.viz", modules) == {"kvlab.workbook.chapters"}
    assert imported("kvlab.workbook.hints", modules) == set()  # a type checker's import only
    graph = {m: imported(m, modules) for m in modules}
    assert cycles(graph) == [["kvlab.engine", "kvlab.workbook.chapters", "kvlab.workbook.viz"]]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus self-loops."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_between_kvlab_modules():
    # A package's __init__ that re-exports its own modules is not a cycle with them: the edge
    # module -> its own package comes from Python importing parents first, not from the code.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in GRAPH.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_two_files_in_kvlab_share_a_name():
    seen = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            seen[path.stem.rstrip("s")].append(str(path.relative_to(ROOT)))
    for pkg in PACKAGE.rglob("__init__.py"):
        if pkg.parent != PACKAGE:
            seen[pkg.parent.name.rstrip("s")].append(str(pkg.parent.relative_to(ROOT)) + "/")
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_function_is_a_wall_of_code(name):
    """About 100 lines at most; an argument parser (a list of add_argument calls) may be longer."""
    tree = ast.parse(MODULES[name].read_text())
    long = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            is_parser = "add_argument" in ast.unparse(node) and node.name in ("parser",
                                                                               "build_parser")
            if lines > 100 and not is_parser:
                long.append((node.name, lines))
    assert long == []
