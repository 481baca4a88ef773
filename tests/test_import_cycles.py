"""No import cycles in `kvflow/`: the imports between kvflow's modules form a DAG.

Every import counts, those inside function bodies too: a deferred import that closes a cycle is the same cycle,
only hidden (the modules still depend on each other, and which one loads first decides what works). An import kept
inside a function for start-up time is allowed where it closes no cycle. Only imports under `if TYPE_CHECKING:` are
not edges (they never run). `from package import name` is an edge to `package.name` when that is a module, else to
`package`.
"""

from __future__ import annotations

import ast
from collections.abc import Container
from pathlib import Path

import kvflow

PACKAGE_ROOT = Path(kvflow.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE_ROOT.rglob("*.py")}


def is_type_checking_block(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_that_run(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree` that may run: at module level, in functions, classes, branches and
    handlers alike; only the bodies of `if TYPE_CHECKING:` blocks are left out (their `else:` counts)."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and is_type_checking_block(node):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))
    return found


def resolve_from(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def module_edges(name: str, tree: ast.AST, is_package: bool, modules: Container[str]) -> set[str]:
    """The modules among `modules` that module `name` (parsed as `tree`) imports, itself left out."""
    edges: set[str] = set()
    for node in imports_that_run(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            package = resolve_from(node, name, is_package)
            targets = [
                f"{package}.{alias.name}" if f"{package}.{alias.name}" in modules else package
                for alias in node.names
            ]
        edges.update(target for target in targets if target in modules and target != name)
    return edges


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {
        name: module_edges(
            name, ast.parse(path.read_text(), str(path)), path.name == "__init__.py", modules
        )
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index_of: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index_of:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index_of[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index_of:
                    index_of[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index_of[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index_of[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_finds_a_cycle_and_accepts_a_dag() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_checker_counts_function_body_imports_but_not_type_checking_ones() -> None:
    source = """
from typing import TYPE_CHECKING
from pkg import top
if TYPE_CHECKING:
    from pkg import typing_only
else:
    from pkg import fallback
def build():
    from pkg import deferred
    class Inner:
        def method(self):
            import pkg.nested
    return deferred
"""
    modules = {
        f"pkg.{name}" for name in ("top", "typing_only", "fallback", "deferred", "nested", "me")
    }
    edges = module_edges("pkg.me", ast.parse(source), False, modules)
    assert edges == {"pkg.top", "pkg.fallback", "pkg.deferred", "pkg.nested"}
    graph = {"pkg.me": edges, "pkg.deferred": {"pkg.me"}}
    graph.update({name: set() for name in modules - graph.keys()})
    assert cycles(graph) == [
        ["pkg.deferred", "pkg.me"]
    ]  # a deferred import that closes a cycle is a cycle


def test_the_graph_sees_kvflow_edges() -> None:
    graph = import_graph()
    assert "kvflow.engine.loop" in graph["kvflow.engine.core_client"]
    assert "kvflow.registry" in graph["kvflow.executor"]
    # imported inside `start_engine_core_client`, kept lazy for start-up time (it closes no cycle)
    assert "kvflow.engine.mp_client" in graph["kvflow.engine.builder"]


def test_kvflow_has_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (function-body imports included):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )
