"""The numeric core never imports Ray (docs/design.md §2): every engine module imports in a fresh
interpreter without pulling ray in."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import engine


def test_engine_never_imports_ray():
    modules = sorted(m.name for m in pkgutil.walk_packages(engine.__path__, "engine."))
    assert "engine.experts.cache" in modules and "engine.runner" in modules
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
            "assert not bad, bad[:5]\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
