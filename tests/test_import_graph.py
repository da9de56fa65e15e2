"""The architecture as the source shows it: `protocol/` and `api/` never import `node/`, no module
is part of an import circle, and no file of the three packages is longer than the house limit.
Read from the source (ast), so a circle that happens to import fine today still fails here."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("node", "api", "protocol")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path, *, module_level: bool) -> Iterator[str]:
    """The project modules `name` imports (`from pkg import submodule` names the submodule);
    `module_level`: only what runs at import (not in functions, nor under TYPE_CHECKING)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(nodes: list[ast.stmt]) -> Iterator[str]:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if module_level and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
                yield from subs
                if len(subs) < len(node.names):
                    yield base
            yield from visit(_nested(node))

    for imported in visit(ast.parse(path.read_text(encoding="utf-8")).body):
        if imported in MODULES and imported != name:
            yield imported


def _nested(node: ast.stmt) -> list[ast.stmt]:
    """The statements inside `node`: its bodies, else and finally blocks and except handlers."""
    nested: list[ast.stmt] = []
    for field in ("body", "orelse", "finalbody"):
        value = getattr(node, field, None)
        if isinstance(value, list):
            nested.extend(item for item in value if isinstance(item, ast.stmt))
    for handler in getattr(node, "handlers", None) or ():
        nested.extend(handler.body)
    return nested


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def test_no_module_is_part_of_an_import_circle() -> None:
    graph = {name: set(_imports(name, path, module_level=True)) for name, path in MODULES.items()}
    assert _circles(graph) == []


def test_the_packages_of_node_stand_in_floors() -> None:
    """Between the packages of `node/` (and its top-level modules), imports go one way: the request
    path and the layers read downwards (see the README's Layout)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if name.startswith("node."):
            mine = ".".join(name.split(".")[:2])
            theirs = {".".join(i.split(".")[:2]) for i in _imports(name, path, module_level=True)}
            graph.setdefault(mine, set()).update(t for t in theirs if t.startswith("node.") and t != mine)
    for deps in list(graph.values()):
        for dep in deps:
            graph.setdefault(dep, set())
    assert _circles(graph) == []


def test_protocol_and_api_import_nothing_of_node() -> None:
    wrong = [
        f"{name} imports {imported}"
        for name, path in MODULES.items()
        if name.split(".")[0] in ("api", "protocol")
        for imported in _imports(name, path, module_level=False)
        if imported.split(".")[0] == "node"
    ]
    assert wrong == []


def test_protocol_imports_nothing_of_api() -> None:
    wrong = [
        f"{name} imports {imported}"
        for name, path in MODULES.items()
        if name.split(".")[0] == "protocol"
        for imported in _imports(name, path, module_level=False)
        if imported.split(".")[0] == "api"
    ]
    assert wrong == []


def test_no_file_is_over_the_line_limit() -> None:
    long = {
        str(path.relative_to(ROOT)): count
        for path in MODULES.values()
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_checks_see_a_circle_and_a_wrong_import() -> None:
    """The reader itself: a made-up circle is found, and `from pkg import sub` names the submodule."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
    mesh = set(_imports("node.net.mesh", MODULES["node.net.mesh"], module_level=True))
    assert {"node.net.auth", "node.net.quirks"} <= mesh and "node.net" not in mesh
