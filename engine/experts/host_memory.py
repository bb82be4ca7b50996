"""The host memory a process may use: physical RAM, MemAvailable, and the limit of the cgroup the
process is in (its own group's and every ancestor's, v1 or v2), with what that group holds now.
engine.experts.device_budget divides it into expert tiers beside the dense weights and KV."""

from __future__ import annotations

__all__ = ["CGROUP_GROWTH", "CGROUP_MARGIN", "HOST_HEADROOM", "available_host_memory", "cgroup_memory_limit",
           "cgroup_working_set", "growth_allowance", "host_limit", "host_memory", "proc_status_bytes",
           "process_footprint"]

MiB, GiB = 2**20, 2**30
HOST_HEADROOM = 4 * GiB  # host RAM left free beside the tiers by "auto" (the OS, the page cache, Python)
CGROUP_ROOT = "/sys/fs/cgroup"
# What a process adds under a cgroup limit after its budgets are set, beyond the dense weights, KV
# and expert tiers they count (growth_allowance; RssAnon growth measured on the beyond-RAM bench's
# 1.3B and 8 GB models, issue 27, 2026-12-05):
GROWTH_BASE = 32 * MiB  # the load, the native kernels' first use, allocator slack (measured 6 and 17 MiB)
GROWTH_PER_TOKEN = 160  # bytes per hidden unit per token of one step: its activations (measured 105-136)
TOKENIZER_GROWTH = 48 * MiB  # transformers' import and a tokenizer's tables, loaded after the budgets (36 MiB)
STEP_TOKENS = 512  # the tokens of one step the allowance covers unless told (the scheduler's chunk)
# The allowance when the model is not known (a caller without a store; unchanged since issue 27's first
# look, where 75 MiB was measured with a 64-token prompt and the tokenizer)
CGROUP_GROWTH = 128 * MiB
# The margin when the group's usage cannot be read: Python + torch (~230 MB RSS at import) and
# the growth above (issue 27: 256 MiB was OOM-killed)
CGROUP_MARGIN = 384 * MiB
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as ~2^63 rounded to a page


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT) -> tuple[int | None, str]:
    """The memory limit of the cgroup this process is in: ``(bytes, the file it came from)``, or
    ``(None, "")`` when no group on the way up has one. Reads ``proc_cgroup`` for the process's
    group (v2: the ``0::/path`` line; v1: the line whose controllers include ``memory``), then
    that group's ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1) and every ancestor's up
    to the root (a child may not raise its parent's limit): the smallest wins. A path that is
    not mounted here (another cgroup namespace) is skipped, so the root files still count."""
    from pathlib import Path

    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    groups: list[tuple[Path, str]] = []  # (directory of the process's group, limit file name)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip().lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            groups.append((Path(root) / rel, "memory.max"))
        elif "memory" in controllers.split(","):
            groups.append((Path(root) / "memory" / rel, "memory.limit_in_bytes"))
    groups += [(Path(root), "memory.max"), (Path(root) / "memory", "memory.limit_in_bytes")]
    best: tuple[int | None, str] = (None, "")
    for start, name in groups:
        top = Path(root) if name == "memory.max" else Path(root) / "memory"
        d = start
        while True:
            f = d / name
            try:
                text = f.read_text().strip()
            except OSError:
                text = ""
            if text.isdigit() and int(text) < _NO_LIMIT and (best[0] is None or int(text) < best[0]):
                best = (int(text), str(f))
            if d == top or top not in d.parents:
                break
            d = d.parent
    return best


def host_memory(available: bool = False) -> int:
    """Bytes of RAM this process may use: physical memory (``available``: MemAvailable from
    /proc/meminfo, else physical memory), or the limit of the cgroup the process is in
    (:func:`cgroup_memory_limit`: its own group's and its ancestors') when lower."""
    import os
    from pathlib import Path

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if available:
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    mem = int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError, IndexError):
            pass
    limit, _ = cgroup_memory_limit()
    return mem if limit is None else min(mem, limit)


def cgroup_working_set(limit_file: str) -> int | None:
    """Bytes the cgroup whose limit is ``limit_file`` (from :func:`cgroup_memory_limit`) holds
    now, less the inactive file pages the kernel reclaims first (what ``kubectl top`` calls the
    working set): v2 ``memory.current`` less ``inactive_file`` of ``memory.stat``, v1
    ``memory.usage_in_bytes`` less ``total_inactive_file``. Every process of the group counts:
    they share the limit. None when the files cannot be read."""
    from pathlib import Path

    f = Path(limit_file)
    v2 = f.name == "memory.max"
    try:
        usage = int(f.with_name("memory.current" if v2 else "memory.usage_in_bytes").read_text())
        stat = dict(line.split() for line in f.with_name("memory.stat").read_text().splitlines()
                    if len(line.split()) == 2)
        inactive = int(stat.get("inactive_file" if v2 else "total_inactive_file", 0))
    except (OSError, ValueError):
        return None
    return max(usage - inactive, 0)


def growth_allowance(hidden: int, step_tokens: int = STEP_TOKENS, tokenizer: bool = True) -> int:
    """What a run adds under a cgroup limit after its budgets are set, beyond what they count
    (dense weights, KV, expert tiers): :data:`GROWTH_BASE`, one step's activations
    (:data:`GROWTH_PER_TOKEN` bytes per hidden unit per token, ``step_tokens`` tokens of a model
    of width ``hidden``) and, when a tokenizer is loaded after the budgets, :data:`TOKENIZER_GROWTH`.
    A prompt fed as one step longer than ``step_tokens`` needs more (give explicit budgets)."""
    return GROWTH_BASE + GROWTH_PER_TOKEN * hidden * step_tokens + (TOKENIZER_GROWTH if tokenizer else 0)


def proc_status_bytes(field: str, status: str = "/proc/self/status") -> int:
    """A kB field of ``status`` (``RssAnon``, ``VmRSS``, ``VmHWM``, ...) in bytes; 0 when unreadable."""
    from pathlib import Path

    try:
        for line in Path(status).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def process_footprint(status: str = "/proc/self/status") -> int:
    """This process's anonymous memory (RssAnon, bytes; 0 when unreadable): what another Python
    process importing the same modules (a deployment's actors: torch, the engine) will hold
    before it loads anything, ~150 MiB with torch imported (issue 27)."""
    return proc_status_bytes("RssAnon", status)


def host_limit(growth: int = CGROUP_GROWTH) -> tuple[int, int, str]:
    """What CPU budgets ``auto`` divide: ``(bytes, headroom, where)``. Under a cgroup limit
    below the available RAM the limit is the whole allowance (the process's page cache and its
    tiers are charged to it) and the headroom what the group holds now
    (:func:`cgroup_working_set`: Python, torch, whatever is loaded) plus ``growth`` (what the
    run adds beyond what its budgets count: :func:`growth_allowance` of the model, or
    :data:`CGROUP_GROWTH` where it is not known), or :data:`CGROUP_MARGIN` when the group's
    usage cannot be read; else the available RAM and :data:`HOST_HEADROOM` (the OS and other
    processes share it)."""
    from engine.units import format_bytes

    avail = host_memory(available=True)
    limit, where = cgroup_memory_limit()
    if limit is not None and limit <= avail:
        what = f"cgroup limit {format_bytes(limit)} ({where})"
        held = cgroup_working_set(where)
        if held is None:
            return limit, CGROUP_MARGIN, f"{what}, its usage unreadable: fixed margin"
        # the headroom the budget line then prints is held + growth
        return limit, held + growth, f"{what}, of which the group holds {format_bytes(held)} now"
    return avail, HOST_HEADROOM, f"available RAM {format_bytes(avail)}"


def available_host_memory() -> int:
    """MemAvailable (bytes), else physical memory; the cgroup limit when lower."""
    return host_memory(available=True)
