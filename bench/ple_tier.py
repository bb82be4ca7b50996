"""The PLE tier at table sizes no host should pin: host RSS while reading tokens' rows from disk.

    python bench/ple_tier.py --table-gib 2 --tokens 3000              # writes DIR/ple.rows, reads, removes
    python bench/ple_tier.py --dir /nvme/x --keep --table-gib 48      # the full table's size

Writes one row file of random rows directly (chunk by chunk: the writer never holds more than
a chunk), then, in a fresh process (so its RSS is the reader's alone), opens it as a
DiskPLETable under ``--budget`` and, per token, prefetches then gathers ``--heads`` rows in each
of ``--layers`` passes (the qwen4_exp model calls prefetch for every PLE layer before layer 1,
then gathers inside each). Rows follow a Zipf-like skew (``--zipf``; hashed n-grams of real text
repeat) so the row cache has something to hit. Prints the configuration, rows and bytes read per
token, the row-cache hit rate, reads/s, and host RSS: before opening the table, at the peak
while reading, and the table's size for scale (the physical limit: what an engine that pins
the table needs). One JSON line at the end (``--json``) for tests.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.store.ple_rows import RowLayout, write_row_file  # noqa: E402
from engine.units import format_bytes, parse_bytes  # noqa: E402


def _rss_kib(field: str) -> int:
    from engine.experts.host_memory import proc_status_bytes

    return proc_status_bytes(field) // 1024


def write_random(path: Path, rows: int, row_dim: int, dtype: str, seed: int) -> RowLayout:
    g = torch.Generator().manual_seed(seed)
    chunk = 1 << 18

    def chunks():
        for start in range(0, rows, chunk):
            yield torch.randn(min(chunk, rows - start), row_dim, generator=g)

    return write_row_file(path, chunks(), rows, row_dim, dtype)


def read_tokens(path: Path, args) -> dict:
    from engine.store.ple_disk import PLETier

    before = _rss_kib("VmRSS")
    tier = PLETier(budget_bytes=parse_bytes(args.budget, name="--budget"))
    (table,) = tier.open_tables([path])
    g = torch.Generator().manual_seed(args.seed + 1)
    n = table.num_rows

    def skewed(k: int) -> torch.Tensor:
        """k row ids: ranks from a continuous power law (inverse CDF, no per-row table in RAM),
        scattered over the file by a multiplicative hash."""
        u = torch.rand(k, generator=g, dtype=torch.float64)
        if abs(args.zipf - 1.0) < 1e-9:
            rank = torch.exp(u * torch.log(torch.tensor(float(n))))
        else:
            a = 1.0 - args.zipf
            rank = ((float(n) ** a - 1.0) * u + 1.0) ** (1.0 / a)
        return ((rank.long() - 1).clamp(0, n - 1) * 2654435761) % n

    t0 = time.perf_counter()
    checksum = 0.0
    for _ in range(args.tokens):
        ids = [skewed(args.heads) for _ in range(args.layers)]
        for i in ids:
            table.prefetch(i)
        for i in ids:
            checksum += float(table.gather(i).sum())
    elapsed = time.perf_counter() - t0
    s = tier.counters.summary(args.tokens)
    out = {"table_bytes": table.num_rows * table.layout.row_bytes, "file_bytes": table.layout.file_bytes,
           "direct_io": table.direct_io, "budget": tier.budget_bytes, "tokens": args.tokens,
           "rss_before_kib": before, "rss_peak_kib": _rss_kib("VmHWM"), "rss_end_kib": _rss_kib("VmRSS"),
           "seconds": elapsed, "checksum": checksum, **s}
    tier.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table-gib", type=float, default=2.0, help="table size (rows x row bytes), GiB")
    ap.add_argument("--row-dim", type=int, default=256)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8_e4m3", "int8"])
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--heads", type=int, default=8, help="rows per token per layer (n-gram heads)")
    ap.add_argument("--layers", type=int, default=1, help="gathers per token from the table")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--budget", default="64MiB", help="RAM row cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where to write the row file (default: a temporary dir)")
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) DIR/ple.rows")
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    ap.add_argument("--read-only", help=argparse.SUPPRESS)  # the child process: read this file
    args = ap.parse_args(argv)
    if args.read_only:
        print(json.dumps(read_tokens(Path(args.read_only), args)))
        return 0
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ple-tier-"))
    work.mkdir(parents=True, exist_ok=True)
    path = work / "ple.rows"
    try:
        t0 = time.perf_counter()
        probe = RowLayout(1, args.row_dim, args.dtype)
        rows = int(args.table_gib * 2**30) // probe.row_bytes
        if not (args.keep and path.exists()):
            write_random(path, rows, args.row_dim, args.dtype, args.seed)
        wrote = time.perf_counter() - t0
        child = subprocess.run([sys.executable, __file__, "--read-only", str(path)] + (argv or sys.argv[1:]),
                               check=True, capture_output=True, text=True)
        r = json.loads(child.stdout.strip().splitlines()[-1])
        r["write_seconds"] = wrote
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True) if not args.dir else path.unlink(missing_ok=True)
    if args.json:
        print(json.dumps(r))
        return 0
    kib = 1024
    print(f"PLE tier: table {format_bytes(r['table_bytes'])} ({args.dtype}, rows of {args.row_dim}; file "
          f"{format_bytes(r['file_bytes'])}), RAM row cache {format_bytes(r['budget'])}, "
          f"{'O_DIRECT' if r['direct_io'] else 'pread + fadvise(DONTNEED)'}, {args.tokens} tokens x "
          f"{args.layers} layers x {args.heads} rows, zipf {args.zipf}")
    print(f"  rows per token {r['ple_rows_per_token']:.1f} looked up, {r['ple_rows_read_per_token']:.1f} read; "
          f"{format_bytes(r['ple_bytes_per_token'])}/token from disk; row-cache hit rate {r['ple_hit_rate']:.1%}; "
          f"{r['ple_pages_read'] / r['seconds']:.0f} page reads/s")
    print(f"  host RSS: {format_bytes(r['rss_before_kib'] * kib)} before opening the table, peak "
          f"{format_bytes(r['rss_peak_kib'] * kib)} while reading (+{format_bytes((r['rss_peak_kib'] - r['rss_before_kib']) * kib)}); "
          f"an engine pinning the table needs {format_bytes(r['table_bytes'])} (limit here: table / 10 = "
          f"{format_bytes(r['table_bytes'] // 10)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
