"""The shape of the package, checked: no import cycles (function-level imports included), graphs know
nothing of layouts, models know nothing of graphs, and no module grows past 400 lines."""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "graphcp")


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _imports(path: str, name: str, modules: dict[str, str]) -> set[str]:
    """graphcp modules ``name`` imports anywhere in its body (TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(open(path).read())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_layers_know_only_their_own_concerns():
    modules = _modules()
    for name, path in modules.items():
        deps = _imports(path, name, modules)
        if name.startswith("graphcp.graph"):
            assert not any(d.startswith("graphcp.cp") for d in deps), (name, deps)
        if name.startswith("graphcp.models"):
            assert not any(d.startswith(("graphcp.graph", "graphcp.cp")) for d in deps), (name, deps)
            assert "capturing" not in open(path).read(), f"{name} checks for graph capture"


def test_module_line_budget():
    sizes = {name: sum(1 for _ in open(path)) for name, path in _modules().items()}
    assert max(sizes.values()) <= 400, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
