"""The shape of the package, checked: no import cycles between modules (function-level and type-only
imports included) nor between packages, graphs know nothing of layouts, models know nothing of graphs,
a model family is named only in its folder, the registry, its attention ops and kernels (and the tools
that measure its work), kernels live in one folder, the runner and the engine core know no PD branch,
no module reads another object's private attributes, and no module grows past 400 lines."""
from __future__ import annotations

import ast
import os
import re

from testkit.paths import REPO

ROOT = os.path.join(REPO, "graphcp")


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
    """graphcp modules ``name`` imports anywhere in its body (TYPE_CHECKING blocks included: a type-only
    cycle is still two modules that cannot be understood apart)."""
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
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


def _package(name: str) -> str:
    """graphcp's first-level package of a module (a top-level module is its own)."""
    return ".".join(name.split(".")[:2])


def test_no_package_cycles():
    """Packages form layers: no two reach each other, even through others (the distributed / models
    and distributed / profiling loops included)."""
    modules = _modules()
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        for dep in _imports(path, name, modules):
            if _package(dep) != _package(name):
                edges.setdefault(_package(name), set()).add(_package(dep))

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(edges.get(node, ()))
        return False

    for a, deps in edges.items():
        for b in deps:
            assert not reaches(b, a), f"package cycle: {a} -> {b} -> ... -> {a}"


def test_layers_know_only_their_own_concerns():
    modules = _modules()
    for name, path in modules.items():
        deps = _imports(path, name, modules)
        if name.startswith("graphcp.graph"):
            assert not any(d.startswith("graphcp.cp") for d in deps), (name, deps)
        if name.startswith("graphcp.models"):
            assert not any(d.startswith(("graphcp.graph", "graphcp.cp")) for d in deps), (name, deps)
            assert "capturing" not in open(path).read(), f"{name} checks for graph capture"


def _sources(*folders: str) -> dict[str, str]:
    out = {}
    for folder in folders:
        for dirpath, _, files in os.walk(os.path.join(REPO, folder)):
            out.update({os.path.relpath(os.path.join(dirpath, f), REPO): os.path.join(dirpath, f)
                        for f in files if f.endswith(".py")})
    return out


def test_module_line_budget():
    sizes = {name: sum(1 for _ in open(path)) for name, path in _sources("graphcp", "capture", "profiles").items()}
    assert max(sizes.values()) <= 400, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


# The engine core: what a new model family must not touch (it adds a model file, its attention op and its
# cache layout: models/, attention/, kv/).
CORE = ("runner.py", "planner.py", "engine.py", "worker.py", "commands.py", "calibrate.py", "forward_batch.py",
        "forward_context.py", "graph/", "cp/")
FAMILY_WORDS = re.compile(r"\b(dsa|mla|llama|qwen\w*|deepseek\w*|glm\w*|mistral|indexer|gpt_oss)\b",
                          re.IGNORECASE)
PD_WORDS = re.compile(r"disaggregation|layer_split|kv_sender|mooncake", re.IGNORECASE)


def _code(path: str) -> str:
    """The source without comments and docstrings (prose may name families; code may not)."""
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree)


# Where a family may be named: its folder (models/<family>/), the one registration line, the attention
# ops and kernels it brings, the tools that measure its work, the PD formats its cache travels in,
# and two files that describe releases:
# GGUF's own architecture names and the demo's random checkpoints.
FAMILY_PLACES = ("models/llama/", "models/deepseek/", "models/deepseek_v4/", "models/qwen3_next/",
                 "models/glm4_moe/", "models/gpt_oss/",
                 "models/registry.py", "attention/", "kernels/", "tools/", "pd/",
                 "checkpoint/gguf.py", "checkpoint/random.py")


def test_a_family_is_named_only_in_its_places():
    for rel, path in _sources("graphcp").items():
        inner = rel[len("graphcp/"):]
        if not inner.startswith(FAMILY_PLACES):
            code = re.sub(r"--[a-z0-9-]+", "", _code(path))     # SGLang's flag names are theirs
            found = FAMILY_WORDS.findall(code)
            assert not found, (f"{rel} names a model family ({found[:3]}): that belongs in the "
                               "family's folder, its attention op or its kernels")
        if inner.startswith("models/") and inner.count("/") == 2:       # inside a family's folder
            family = inner.split("/")[1]
            others = [f.split("/")[1] for f in FAMILY_PLACES[:6] if f.split("/")[1] != family]
            deps = _imports(path, "graphcp." + inner[:-3].replace("/", "."), _modules())
            assert not any(d.startswith("graphcp.models.") and d.split(".")[2] in others
                           for d in deps), \
                f"{rel} imports another family: shared layers belong in models/common/"


def test_shared_layers_import_no_family():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith(("graphcp.models.common", "graphcp.models.config", "graphcp.models.family",
                            "graphcp.checkpoint")):
            deps = _imports(path, name, modules)
            families = [d for d in deps if d.startswith("graphcp.models.")
                        and d.split(".")[2] in ("llama", "deepseek", "deepseek_v4", "qwen3_next",
                                                "glm4_moe", "gpt_oss")]
            assert not families, f"{name} imports a family ({families[:2]}): go through the registry"


def test_the_engine_core_knows_no_model_family():
    for rel, path in _sources("graphcp").items():
        inner = rel[len("graphcp/"):]
        if inner.startswith(CORE) or inner in CORE:
            found = FAMILY_WORDS.findall(_code(path))
            assert not found, f"{rel} names a model family ({found[:3]}): that belongs in models/ or attention/"


def test_the_runner_holds_no_pd_branch():
    found = PD_WORDS.findall(_code(os.path.join(ROOT, "runner.py")))
    assert not found, f"runner.py branches on PD ({found[:3]}): kv/ and pd/ own that"


def test_kernels_live_in_one_folder():
    for rel, path in _sources("graphcp").items():
        if rel.startswith("graphcp/kernels/"):
            continue
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "triton" or n.startswith("triton.") for n in names), f"{rel} imports triton"
        assert "TRITON_INTERPRET" not in _code(path), f"{rel} sets Triton's interpreter"


def test_no_module_reads_another_objects_private_attributes():
    """``obj._name`` where ``_name`` is an attribute some graphcp class keeps for itself (``self._name``)
    and ``obj`` is not ``self``/``cls``: one object reaching into another."""
    trees = {rel: ast.parse(open(path).read()) for rel, path in _sources("graphcp").items()}
    private = {node.attr for tree in trees.values() for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
               and node.value.id == "self" and node.attr.startswith("_") and not node.attr.startswith("__")}
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private:
                base = node.value.id if isinstance(node.value, ast.Name) else None
                assert base in ("self", "cls", "super"), \
                    f"{rel}:{node.lineno} reads {ast.unparse(node)}, another object's private attribute"
