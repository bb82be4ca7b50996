"""services/ imports in one direction: the module import graph of services/, read with ``ast``
(imports inside functions included, the ones that used to close circles), has no cycle, and the
decode actor never imports the wiring (services/app.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports anywhere in its file (top level, inside
    functions and classes), each import resolved to the longest module name that exists
    (``from services.http import server`` -> services.http.server)."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: up level-1 packages from this module's package
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                found |= {resolve(f"{base}.{a.name}") or resolve(base) for a in node.names}
        graph[mod] = found - {None, mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (c := visit(n)) is not None:
                return c
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)) is not None:
            return c
    return None


def test_the_graph_builder_sees_imports_at_every_depth(tmp_path):
    """On a package written here: top-level, function-level, relative and from-package imports
    become edges, and a cycle closed inside a function is found (so the checks below can fail)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import pkg.b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.sub import c\n")
    (pkg / "sub" / "c.py").write_text("class K:\n    def g(self):\n        from .. import a\n")
    (pkg / "d.py").write_text("import os\nfrom pkg import sub\n")
    g = import_graph(tmp_path, "pkg")
    assert g["pkg.a"] == {"pkg.b"} and g["pkg.b"] == {"pkg.sub.c"}
    assert g["pkg.sub.c"] == {"pkg.a"} and g["pkg.d"] == {"pkg.sub"}
    assert find_cycle(g) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    assert find_cycle({**g, "pkg.sub.c": set()}) is None


def test_the_graph_of_services_has_its_known_edges():
    g = import_graph(ROOT, "services")
    assert "services.handles" in g["services.app"]  # top level
    assert "services.decode" in g["services.app"]  # inside deploy()
    assert "services.http.server" in g["services.cli_serve"]  # inside http_settings()
    assert g["services.handles"] == set()  # the bottom: names and handles import nothing here


def test_services_import_in_one_direction():
    cycle = find_cycle(import_graph(ROOT, "services"))
    assert cycle is None, "import cycle among services/ modules: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", ["services.decode", "services.tokenizer_router",
                                    "services.expert_loader", "services.budgets"])
def test_the_actors_do_not_import_the_wiring(module):
    g = import_graph(ROOT, "services")
    assert "services.app" not in g[module], f"{module} imports services/app.py"
