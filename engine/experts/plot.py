"""Plots of simulator results (matplotlib's Agg canvas; never opens a display)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["plot_hit_rates"]


def _points(table) -> dict[str, list[tuple[float, float]]]:
    """policy -> [(budget_fraction, hit_rate)] from a SweepTable, SimResults or row dicts."""
    items: Iterable = table.results if hasattr(table, "results") else table
    out: dict[str, list[tuple[float, float]]] = {}
    for r in items:
        if isinstance(r, Mapping):
            pol, frac, hr = r["policy"], float(r["budget_fraction"]), float(r["hit_rate"])
        else:
            pol, frac, hr = r.policy, float(r.budget_fraction), float(r.hit_rate)
        out.setdefault(pol, []).append((frac, hr))
    for pts in out.values():
        pts.sort()
    return out


def plot_hit_rates(table, path_png: str | os.PathLike, title: str = "expert cache hit rate") -> Path:
    """Hit rate (%) against budget (% of all experts resident), one line per policy.

    ``table``: a :class:`~engine.experts.simulate.SweepTable`, a list of SimResult, or a list of
    dicts with ``policy``, ``budget_fraction`` and ``hit_rate``. Returns the written path.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = _points(table)
    if not series:
        raise ValueError("plot_hit_rates: the table has no results")
    fig = Figure(figsize=(6.4, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for pol, pts in series.items():
        xs = [100 * f for f, _ in pts]
        ys = [100 * h for _, h in pts]
        style = "--" if pol == "belady" else "-"
        ax.plot(xs, ys, style, marker="o", label=pol)
    ax.set_xlabel("cache budget (% of all experts resident)")
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = Path(path_png)
    fig.savefig(path, format="png")
    return path
