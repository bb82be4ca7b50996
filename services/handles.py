"""Names and handles of a deployment's actors: what each actor is called, the namespace they
live in, and how a process gets a handle to the router, the decode actor or the loaders.

    router (ROUTER) --> decode (DECODE) --> loader-0 .. loader-{N-1} (LOADER_PREFIX + index)
    http (HTTP): the OpenAI-compatible front end, in front of the router, when started

Every services/ module that names or looks up an actor imports it from here. This module imports
no other services/ module, so the dependencies among services/ go one way only (the actors and
the wiring above it; tests/services/test_imports.py checks the graph has no cycle).
"""

from __future__ import annotations

import re
from typing import Any

NAMESPACE = "moestream"  # the default Ray namespace of a deployment
ROUTER, DECODE, HTTP, LOADER_PREFIX = "router", "decode", "http", "loader-"
LOADER_RE = re.compile(r"^loader-(\d+)$")


def ray_module():
    """``ray``, imported on first use (the CLI and the tests without Ray never import it)."""
    import ray

    return ray


def actor(name: str, namespace: str = NAMESPACE) -> Any:
    """The handle of the named actor; ValueError when it does not exist."""
    return ray_module().get_actor(name, namespace=namespace)


def router(namespace: str = NAMESPACE) -> Any:
    return actor(ROUTER, namespace)


def decode(namespace: str = NAMESPACE) -> Any:
    return actor(DECODE, namespace)


def has_actor(name: str, namespace: str = NAMESPACE) -> bool:
    try:
        actor(name, namespace)
        return True
    except ValueError:
        return False


def loader_name(index: int) -> str:
    return f"{LOADER_PREFIX}{index}"


def loader_index(name: str) -> int:
    """The index in a loader's name (``loader-3`` -> 3); ValueError for any other name."""
    m = LOADER_RE.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a loader's name; expected {LOADER_PREFIX}N")
    return int(m.group(1))


def loader_names(namespace: str = NAMESPACE) -> list[str]:
    """Names of the loader actors registered in ``namespace``, by index."""
    found = []
    for a in ray_module().util.list_named_actors(all_namespaces=True):
        m = LOADER_RE.match(a["name"]) if a.get("namespace") == namespace else None
        if m:
            found.append((int(m.group(1)), a["name"]))
    return [n for _, n in sorted(found)]


def loader_handles(namespace: str = NAMESPACE, names: list[str] | None = None) -> dict[str, Any]:
    """Handles of the named loaders (default: every loader of the namespace), by name."""
    names = loader_names(namespace) if names is None else names
    return {n: actor(n, namespace) for n in names}
