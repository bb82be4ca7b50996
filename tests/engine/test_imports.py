"""The module import graph, read with ``ast`` (no module is executed): no import cycle among the
modules of engine/, the layers below the models never import them, and the decode actor's
module does not reach up to the app's.

Every import statement counts, wherever it sits (module level, inside a function or a class,
under ``if TYPE_CHECKING``): a cycle closed by a function-level import is still a cycle.
``from pkg import name`` is an edge to ``pkg.name`` when that is a module of the tree, else to
``pkg`` itself; relative imports resolve against the importing module's package. An import of
``a.b.c`` is an edge to ``a.b.c`` alone, not to the packages ``a`` and ``a.b`` whose
``__init__`` Python runs first (those only re-export their submodules here).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path, root: Path = ROOT) -> str:
    """engine/models/base.py -> engine.models.base; engine/kv/__init__.py -> engine.kv."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules of ``known`` that one import statement loads (as named, not their parents)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}" if base else alias.name
        out.append(sub if sub in known else base)
    return out


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of the tree (under ``packages``) it imports anywhere in its file.
    An import of ``a.b.c`` that is not a module of the tree (``from x import A`` of a class, an
    attribute path) counts as its nearest enclosing module that is."""
    files = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(node, mod, path.name == "__init__.py", known):
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    edges.add(target)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each an import circle), each
    given as one cycle path through it (first module repeated at the end), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[set[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan; graphs here are a few hundred nodes deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(_cycle_path(graph, comp) for comp in sccs)


def _cycle_path(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside it)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in its component")  # cannot happen


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, ("engine", "services"))


# ---- the builder finds what is there -----------------------------------------------------


def test_builder_finds_known_edges(graph):
    # module level, a submodule named in ``from pkg import sub``, and a function-level import
    assert "engine.errors" in graph["engine.config"]
    assert "engine.loading.source" in graph["engine.loading"]
    assert "engine.loading.gguf" in graph["engine.loading"]  # inside open_model_files
    assert "engine.models.registry" in graph["engine.models.load"]


def test_builder_resolves_relative_imports_and_finds_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..a import thing\nimport pkg.d\n")
    (pkg / "d.py").write_text("from pkg.sub.c import x\n")
    g = import_graph(tmp_path, ("pkg",))
    assert g["pkg.a"] == {"pkg.b"} and g["pkg.b"] == {"pkg.sub.c"}
    assert g["pkg.sub.c"] == {"pkg.a", "pkg.d"}
    assert cycles(g) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


# ---- the rules ---------------------------------------------------------------------------


def test_no_import_cycle_in_engine(graph):
    engine = {m: {t for t in e if t.startswith("engine")} for m, e in graph.items()
              if m.startswith("engine")}
    found = cycles(engine)
    assert not found, "import cycles in engine/:\n" + "\n".join(" -> ".join(c) for c in found)


# What the models build on: the config dataclasses, the layers, caches and formats, and the
# architecture-free parts of loading and config reading (the parsers that dispatch on the
# architecture, engine.configio.hf / .gguf / .plain and engine.loading.hf / .gguf / .validate,
# consult the registry and so sit above it).
BELOW_MODELS = ("engine.config", "engine.layers", "engine.kv", "engine.quant", "engine.loading.source",
                "engine.loading.paths", "engine.loading.safetensors", "engine.loading.gguf_file",
                "engine.loading.gguf_quants", "engine.loading.gguf_split", "engine.loading.expected",
                "engine.configio.fields", "engine.configio.hf_decoder")


def _below_models(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in BELOW_MODELS)


def test_layers_below_the_models_never_import_them(graph):
    bad = {m: sorted(t for t in e if t == "engine.models" or t.startswith("engine.models."))
           for m, e in graph.items() if _below_models(m)}
    bad = {m: t for m, t in bad.items() if t}
    assert not bad, f"modules below engine.models import it: {bad}"
    assert _below_models("engine.layers.moe") and not _below_models("engine.loading.hf")
    assert all(any(m == p or m.startswith(p + ".") for m in graph) for p in BELOW_MODELS)  # no stale name


def test_decode_does_not_import_the_app(graph):
    assert "services.app" in graph  # the rule names a module that exists
    assert "services.app" not in graph["services.decode"], "services/decode.py imports services/app.py"
