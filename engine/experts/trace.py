"""Routing traces: which experts the router picked, token by token and layer by layer.

A :class:`RoutingTrace` is an ordered table of records ``(sequence, token_index, layer,
experts[top_k])``. Record order *is* execution order: the access stream the expert cache sees
is the records in order, each record's experts in routing order (:meth:`RoutingTrace.accesses`).
Several generations can be concatenated (:func:`concat`); ``sequence`` tells them apart and
``token_index`` restarts per generation.

Shapes (R = number of records, K = top_k):
    sequence     int32 [R]      generation id
    token_index  int32 [R]      position of the token within its generation
    layer        int32 [R]      MoE layer, 0 <= layer < num_layers
    experts      int32 [R, K]   distinct expert ids per record, 0 <= e < num_experts

Files: ``.npz`` (compact integer arrays + metadata, :meth:`save`/:meth:`load`) and a JSON-lines
export (header line, then one record per line; :meth:`to_jsonl`/:meth:`from_jsonl`).

Routing statistics: :func:`expert_counts`, :func:`usage_entropy`, :func:`top_share`,
:func:`reuse_fraction`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "RoutingTrace",
    "TraceRecorder",
    "concat",
    "expert_counts",
    "usage_entropy",
    "top_share",
    "reuse_fraction",
]

TRACE_FORMAT = "moestream-routing-trace"
TRACE_VERSION = 1


def _small_uint(maxval: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if maxval <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


@contextmanager
def replaced_atomically(path: Path):
    """A file open for writing next to ``path`` that replaces it when the block succeeds and is
    removed when it fails (a full disk leaves nothing behind)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """Routing decisions in execution order; see the module docstring for shapes."""

    num_layers: int
    num_experts: int
    top_k: int
    token_index: np.ndarray
    layer: np.ndarray
    experts: np.ndarray
    sequence: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"RoutingTrace {name} must be a positive integer, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.top_k > self.num_experts:
            raise ValueError(f"RoutingTrace top_k={self.top_k} exceeds num_experts={self.num_experts}")
        tok = np.asarray(self.token_index, dtype=np.int64).reshape(-1)
        lay = np.asarray(self.layer, dtype=np.int64).reshape(-1)
        R = tok.shape[0]
        seq = np.zeros(R, np.int64) if self.sequence is None else np.asarray(self.sequence, np.int64).reshape(-1)
        ex = np.asarray(self.experts)
        if ex.size == 0 and R == 0:
            ex = np.zeros((0, self.top_k), np.int64)
        if ex.ndim != 2:
            raise ValueError(f"RoutingTrace experts must be 2-D [records, top_k], got shape {ex.shape}")
        if lay.shape[0] != R or seq.shape[0] != R or ex.shape[0] != R:
            raise ValueError(
                f"RoutingTrace columns disagree on the record count: token_index {R}, layer "
                f"{lay.shape[0]}, sequence {seq.shape[0]}, experts {ex.shape[0]}"
            )
        if ex.shape[1] != self.top_k:
            raise ValueError(
                f"RoutingTrace record 0 has {ex.shape[1]} experts, expected top_k={self.top_k}"
            )
        ex = ex.astype(np.int64)
        _validate(R, seq, tok, lay, ex, self.num_layers, self.num_experts, self.top_k)
        for name, arr in (("token_index", tok), ("layer", lay), ("sequence", seq), ("experts", ex)):
            a = arr.astype(np.int32)
            a.setflags(write=False)
            object.__setattr__(self, name, a)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_records(
        cls,
        records: Sequence[tuple[int, int, Sequence[int]]],
        *,
        num_layers: int,
        num_experts: int,
        top_k: int,
        sequence: Sequence[int] | None = None,
    ) -> "RoutingTrace":
        """Build from ``(token_index, layer, experts)`` tuples; a record whose expert list has
        the wrong width raises ValueError naming it."""
        for i, rec in enumerate(records):
            if len(rec) != 3:
                raise ValueError(f"record {i}: expected (token_index, layer, experts), got {rec!r}")
            if len(rec[2]) != top_k:
                raise ValueError(
                    f"record {i} (token {rec[0]}, layer {rec[1]}): {len(rec[2])} experts "
                    f"{list(rec[2])}, expected top_k={top_k}"
                )
        R = len(records)
        experts = np.array([list(r[2]) for r in records], dtype=np.int64).reshape(R, top_k)
        return cls(
            num_layers=num_layers,
            num_experts=num_experts,
            top_k=top_k,
            token_index=np.array([r[0] for r in records], dtype=np.int64),
            layer=np.array([r[1] for r in records], dtype=np.int64),
            experts=experts,
            sequence=None if sequence is None else np.asarray(sequence, np.int64),
        )

    # ---- views --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.token_index.shape[0])

    @property
    def num_records(self) -> int:
        return len(self)

    @property
    def num_accesses(self) -> int:
        return len(self) * self.top_k

    @property
    def num_tokens(self) -> int:
        """Distinct (sequence, token_index) pairs."""
        if len(self) == 0:
            return 0
        pairs = self.sequence.astype(np.int64) << 32 | self.token_index.astype(np.int64)
        return int(np.unique(pairs).shape[0])

    @property
    def num_keys(self) -> int:
        """Size of the expert universe, num_layers * num_experts."""
        return self.num_layers * self.num_experts

    def records(self) -> Iterator[tuple[int, int, tuple[int, ...]]]:
        """``(token_index, layer, experts)`` in execution order."""
        toks, lays, exs = self.token_index.tolist(), self.layer.tolist(), self.experts.tolist()
        for t, l, e in zip(toks, lays, exs):
            yield t, l, tuple(e)

    def accesses(self) -> Iterator[tuple[int, int]]:
        """The flat access stream: ``(layer, expert)`` keys, record by record, experts in
        routing order."""
        for l, row in zip(self.layer.tolist(), self.experts.tolist()):
            for e in row:
                yield (l, e)

    def access_list(self) -> list[tuple[int, int]]:
        """:meth:`accesses` as a list whose equal keys are the same tuple object (fast hashing
        and little memory for replays of ~10^6 accesses)."""
        E = self.num_experts
        keys = [[(l, e) for e in range(E)] for l in range(self.num_layers)]
        out: list[tuple[int, int]] = []
        for l, row in zip(self.layer.tolist(), self.experts.tolist()):
            kl = keys[l]
            out.extend(kl[e] for e in row)
        return out

    def __getitem__(self, idx: slice) -> "RoutingTrace":
        if not isinstance(idx, slice):
            raise TypeError("RoutingTrace supports slicing by records only, e.g. trace[:100]")
        return RoutingTrace(
            self.num_layers, self.num_experts, self.top_k,
            self.token_index[idx], self.layer[idx], self.experts[idx], self.sequence[idx],
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingTrace):
            return NotImplemented
        return (
            (self.num_layers, self.num_experts, self.top_k)
            == (other.num_layers, other.num_experts, other.top_k)
            and np.array_equal(self.token_index, other.token_index)
            and np.array_equal(self.layer, other.layer)
            and np.array_equal(self.experts, other.experts)
            and np.array_equal(self.sequence, other.sequence)
        )

    def __repr__(self) -> str:
        return (
            f"RoutingTrace(records={len(self)}, tokens={self.num_tokens}, layers={self.num_layers}, "
            f"experts={self.num_experts}, top_k={self.top_k})"
        )

    # ---- files --------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write a compressed ``.npz`` (smallest unsigned dtypes that fit). Returns the path."""
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        meta = np.array(
            [TRACE_VERSION, self.num_layers, self.num_experts, self.top_k], dtype=np.int64
        )
        with replaced_atomically(path) as f:
            np.savez_compressed(
                f,
                meta=meta,
                token_index=self.token_index.astype(_small_uint(int(self.token_index.max(initial=0)))),
                layer=self.layer.astype(_small_uint(self.num_layers - 1)),
                experts=self.experts.astype(_small_uint(self.num_experts - 1)),
                sequence=self.sequence.astype(_small_uint(int(self.sequence.max(initial=0)))),
            )
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RoutingTrace":
        """Read a file written by :meth:`save`; a malformed file raises ValueError naming it."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                missing = {"meta", "token_index", "layer", "experts", "sequence"} - set(z.files)
                if missing:
                    raise ValueError(f"{path}: not a routing trace, missing arrays {sorted(missing)}")
                meta = z["meta"]
                if meta.shape != (4,) or int(meta[0]) != TRACE_VERSION:
                    raise ValueError(f"{path}: unsupported trace metadata {meta.tolist()}")
                arrays = {k: z[k] for k in ("token_index", "layer", "experts", "sequence")}
        except FileNotFoundError:
            raise
        except ValueError as e:
            if str(e).startswith(str(path)):
                raise
            raise ValueError(f"{path}: cannot read routing trace: {e}") from e
        except (OSError, EOFError, KeyError) as e:
            raise ValueError(f"{path}: cannot read routing trace: {e}") from e
        try:
            return cls(int(meta[1]), int(meta[2]), int(meta[3]), **arrays)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    def to_jsonl(self, path: str | os.PathLike) -> Path:
        """Export as JSON lines: a header object, then ``{"seq", "token", "layer", "experts"}``
        per record."""
        path = Path(path)
        header = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_records": len(self),
        }
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(header) + "\n")
            for s, t, l, e in zip(
                self.sequence.tolist(), self.token_index.tolist(), self.layer.tolist(), self.experts.tolist()
            ):
                f.write(json.dumps({"seq": s, "token": t, "layer": l, "experts": e}, separators=(",", ":")) + "\n")
        return path

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike) -> "RoutingTrace":
        path = Path(path)
        with open(path, encoding="utf-8") as f:
            lines = [ln for ln in f if ln.strip()]
        if not lines:
            raise ValueError(f"{path}: empty routing trace file")
        try:
            header = json.loads(lines[0])
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line 1 is not JSON: {e}") from e
        if header.get("format") != TRACE_FORMAT or header.get("version") != TRACE_VERSION:
            raise ValueError(f"{path}: not a {TRACE_FORMAT} v{TRACE_VERSION} file (header {header})")
        recs, seqs = [], []
        for n, ln in enumerate(lines[1:], start=2):
            try:
                d = json.loads(ln)
                recs.append((int(d["token"]), int(d["layer"]), [int(x) for x in d["experts"]]))
                seqs.append(int(d.get("seq", 0)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}: line {n} is not a trace record: {e}") from e
        try:
            return cls.from_records(
                recs, num_layers=header["num_layers"], num_experts=header["num_experts"],
                top_k=header["top_k"], sequence=seqs,
            )
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from e


def _validate(R, seq, tok, lay, ex, L, E, K) -> None:
    """Raise ValueError naming the first bad record."""

    def where(i: int) -> str:
        return f"record {i} (sequence {seq[i]}, token {tok[i]}, layer {lay[i]})"

    if R == 0:
        return
    bad = np.flatnonzero((lay < 0) | (lay >= L))
    if bad.size:
        raise ValueError(f"{where(bad[0])}: layer out of range, allowed 0..{L - 1}")
    bad = np.flatnonzero(tok < 0)
    if bad.size:
        raise ValueError(f"{where(bad[0])}: negative token_index")
    bad = np.flatnonzero(seq < 0)
    if bad.size:
        raise ValueError(f"{where(bad[0])}: negative sequence id")
    out = (ex < 0) | (ex >= E)
    bad = np.flatnonzero(out.any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{where(i)}: experts {ex[i].tolist()} out of range, allowed 0..{E - 1}"
        )
    if K > 1:
        s = np.sort(ex, axis=1)
        bad = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{where(i)}: duplicate experts {ex[i].tolist()}")


def concat(traces: Sequence[RoutingTrace]) -> RoutingTrace:
    """Concatenate generations in order; sequence ids are renumbered so they stay distinct."""
    if not traces:
        raise ValueError("concat needs at least one trace")
    first = traces[0]
    for i, t in enumerate(traces):
        if (t.num_layers, t.num_experts, t.top_k) != (first.num_layers, first.num_experts, first.top_k):
            raise ValueError(
                f"trace {i} has (layers, experts, top_k) = {(t.num_layers, t.num_experts, t.top_k)}, "
                f"trace 0 has {(first.num_layers, first.num_experts, first.top_k)}"
            )
    seqs, offset = [], 0
    for t in traces:
        if len(t):
            _, inv = np.unique(t.sequence, return_inverse=True)
            seqs.append(inv.astype(np.int64) + offset)
            offset += int(inv.max()) + 1
        else:
            seqs.append(np.zeros(0, np.int64))
    return RoutingTrace(
        first.num_layers, first.num_experts, first.top_k,
        np.concatenate([t.token_index for t in traces]),
        np.concatenate([t.layer for t in traces]),
        np.concatenate([t.experts for t in traces]),
        np.concatenate(seqs),
    )


class TraceRecorder:
    """Collects routing decisions from the engine; :meth:`trace` freezes them.

    ``record`` validates each record as it arrives (ValueError naming it) so a bad router output
    is caught where it happens. ``experts`` may be a list, tuple, numpy array or torch tensor.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        # validate metadata through an empty trace
        RoutingTrace(num_layers, num_experts, top_k, [], [], np.zeros((0, top_k), np.int64))
        self.num_layers, self.num_experts, self.top_k = int(num_layers), int(num_experts), int(top_k)
        self._seq: list[int] = []
        self._tok: list[int] = []
        self._lay: list[int] = []
        self._ex: list[list[int]] = []
        self.sequence = 0

    def new_sequence(self) -> int:
        """Start a new generation (token indices restart); returns its id."""
        if self._seq and self._seq[-1] == self.sequence:
            self.sequence += 1
        return self.sequence

    def record(self, token_index: int, layer: int, experts) -> None:
        if hasattr(experts, "tolist"):
            experts = experts.tolist()
        experts = [int(e) for e in experts]
        i = len(self._tok)
        where = f"record {i} (token {token_index}, layer {layer})"
        if len(experts) != self.top_k:
            raise ValueError(f"{where}: {len(experts)} experts {experts}, expected top_k={self.top_k}")
        if not (0 <= layer < self.num_layers):
            raise ValueError(f"{where}: layer out of range, allowed 0..{self.num_layers - 1}")
        if token_index < 0:
            raise ValueError(f"{where}: negative token_index")
        for e in experts:
            if not (0 <= e < self.num_experts):
                raise ValueError(f"{where}: experts {experts} out of range, allowed 0..{self.num_experts - 1}")
        if len(set(experts)) != len(experts):
            raise ValueError(f"{where}: duplicate experts {experts}")
        self._seq.append(self.sequence)
        self._tok.append(int(token_index))
        self._lay.append(int(layer))
        self._ex.append(experts)

    def __len__(self) -> int:
        return len(self._tok)

    def trace(self) -> RoutingTrace:
        R = len(self._tok)
        return RoutingTrace(
            self.num_layers, self.num_experts, self.top_k,
            np.array(self._tok, np.int64), np.array(self._lay, np.int64),
            np.array(self._ex, np.int64).reshape(R, self.top_k), np.array(self._seq, np.int64),
        )


# ---- routing statistics ---------------------------------------------------------------------


def expert_counts(trace: RoutingTrace) -> np.ndarray:
    """``[num_layers, num_experts]`` int64: how often each expert was picked."""
    counts = np.zeros((trace.num_layers, trace.num_experts), np.int64)
    if len(trace):
        lay = np.repeat(trace.layer.astype(np.int64), trace.top_k)
        np.add.at(counts, (lay, trace.experts.reshape(-1).astype(np.int64)), 1)
    return counts


def usage_entropy(trace: RoutingTrace) -> np.ndarray:
    """Per-layer normalised entropy of expert usage, in [0, 1] (1 = uniform); NaN for a layer
    with no records or when num_experts == 1."""
    counts = expert_counts(trace).astype(np.float64)
    tot = counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = counts / tot
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
        out = h / np.log(trace.num_experts) if trace.num_experts > 1 else np.full(trace.num_layers, np.nan)
    out[tot[:, 0] == 0] = np.nan
    return out


def top_share(trace: RoutingTrace, fraction: float = 0.1) -> np.ndarray:
    """Per-layer share of picks taken by the top ``ceil(fraction * num_experts)`` experts."""
    if not (0.0 < fraction <= 1.0):
        raise ValueError(f"top_share fraction must be in (0, 1], got {fraction!r}")
    counts = expert_counts(trace)
    n = max(1, int(np.ceil(fraction * trace.num_experts - 1e-9)))
    top = -np.sort(-counts, axis=1)[:, :n].sum(axis=1)
    tot = counts.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(tot > 0, top / np.maximum(tot, 1), np.nan)


def reuse_fraction(trace: RoutingTrace) -> float:
    """Fraction of picks (after each layer's first record in a sequence) that repeat an expert
    the same layer picked for the previous record of that layer and sequence."""
    prev: dict[tuple[int, int], set[int]] = {}
    reused = total = 0
    for s, l, row in zip(trace.sequence.tolist(), trace.layer.tolist(), trace.experts.tolist()):
        p = prev.get((s, l))
        if p is not None:
            total += len(row)
            reused += sum(1 for e in row if e in p)
        prev[(s, l)] = set(row)
    return reused / total if total else float("nan")
