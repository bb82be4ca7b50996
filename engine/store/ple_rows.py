"""The PLE row file: one PLE layer's n-gram table as 4 KiB-aligned, self-checking pages of rows.

A Per-Layer Embedding table is tens of GiB for the full qwen4_exp shape, and a token reads only
``ngram_heads`` rows of it per PLE layer, so the store keeps each layer's table as its own file
that is written row chunk by row chunk (never the whole table in RAM) and read page by page.

Layout (every offset a multiple of ``PAGE_ALIGN``, so a page is one O_DIRECT read)::

    [header page: MAGIC, u32 json length, json {num_rows, row_dim, dtype, row_bytes,
                  rows_per_page, page_bytes, num_pages}, zeros]       PAGE_ALIGN bytes
    [page 0: rows 0 .. rows_per_page-1, zeros, u32 crc32, PAGE_MAGIC] page_bytes
    [page 1: ...]

A row is ``row_dim`` values in the file's dtype: ``bf16``/``fp16``/``fp32``/``fp8_e4m3`` (the
checkpoint's precision, bit for bit), or ``int8``: ``row_dim`` int8 then one fp32 scale
(symmetric, per row: ``x ~= q * scale``, ``|x - q * scale| <= max|x_row| / 254``). Each page
ends with a crc32 seeded with its page index (a page read from the wrong place fails too), so
every page is checked when it enters RAM, as expert blobs are.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import torch

from engine.errors import ChecksumError, ModelFormatError

PAGE_ALIGN = 4096
MAGIC = b"MSPLEROW"
PAGE_MAGIC = b"PLEp"
TRAILER = 8  # u32 crc32 + PAGE_MAGIC
VERSION = 1

# store dtype -> (torch dtype of one value, bytes per value)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2), "fp16": (torch.float16, 2),
    "fp8_e4m3": (torch.float8_e4m3fn, 1), "int8": (torch.int8, 1),
}
_CHECKPOINT_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                      torch.float8_e4m3fn: "fp8_e4m3"}
_MAX_ROW_DIM = 1 << 20
_MAX_ROWS = 1 << 40


class PLERowChecksumError(ChecksumError):
    """A page of a PLE row file does not match its crc32 (a corrupt or misplaced page)."""

    def __init__(self, path: object, page: int, expected: int, actual: int) -> None:
        self.page = page
        Exception.__init__(self, f"PLE row file {path}: page {page} crc32 {actual:08x} does not match "
                                 f"the stored {expected:08x} (corrupt file; re-convert the store)")


def checkpoint_dtype(dtype: torch.dtype) -> str:
    """The row-file dtype that keeps a checkpoint tensor of ``dtype`` bit for bit."""
    try:
        return _CHECKPOINT_DTYPES[dtype]
    except KeyError:
        raise ModelFormatError("PLE table", f"dtype {dtype} has no row-file format; "
                                            f"allowed: {sorted(map(str, _CHECKPOINT_DTYPES))}") from None


@dataclass(frozen=True)
class RowLayout:
    num_rows: int
    row_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ModelFormatError("PLE table", f"dtype {self.dtype!r}; allowed: {sorted(DTYPES)}")
        if not (0 < self.row_dim <= _MAX_ROW_DIM) or not (0 < self.num_rows <= _MAX_ROWS):
            raise ModelFormatError("PLE table", f"shape [{self.num_rows}, {self.row_dim}] out of range")

    @property
    def row_bytes(self) -> int:
        return self.row_dim * DTYPES[self.dtype][1] + (4 if self.dtype == "int8" else 0)

    @property
    def rows_per_page(self) -> int:
        return max(1, (PAGE_ALIGN - TRAILER) // self.row_bytes)

    @property
    def page_bytes(self) -> int:
        return -(-(self.rows_per_page * self.row_bytes + TRAILER) // PAGE_ALIGN) * PAGE_ALIGN

    @property
    def num_pages(self) -> int:
        return -(-self.num_rows // self.rows_per_page)

    @property
    def file_bytes(self) -> int:
        return PAGE_ALIGN + self.num_pages * self.page_bytes

    def page_offset(self, page: int) -> int:
        return PAGE_ALIGN + page * self.page_bytes

    def header(self) -> bytes:
        meta = dict(asdict(self), version=VERSION, row_bytes=self.row_bytes, rows_per_page=self.rows_per_page,
                    page_bytes=self.page_bytes, num_pages=self.num_pages)
        body = json.dumps(meta, sort_keys=True).encode()
        raw = MAGIC + struct.pack("<I", len(body)) + body
        return raw + bytes(PAGE_ALIGN - len(raw))


def page_crc(page: int, data) -> int:
    return zlib.crc32(data, zlib.crc32(struct.pack("<Q", page)))


def check_page(layout: RowLayout, page: int, buf, path: object) -> None:
    """Raise PLERowChecksumError unless ``buf`` (page_bytes) is page ``page`` intact."""
    mv = memoryview(buf)
    end = layout.page_bytes - TRAILER
    stored, magic = struct.unpack_from("<I4s", mv, end)
    actual = page_crc(page, mv[:end])
    if magic != PAGE_MAGIC or stored != actual:
        raise PLERowChecksumError(path, page, stored, actual)


def read_layout(path: str | os.PathLike[str]) -> RowLayout:
    """The layout a row file declares, checked against the file's size (ModelFormatError)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(PAGE_ALIGN)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise ModelFormatError(path, f"cannot read PLE row file: {e.strerror or e}") from None
    if len(head) < PAGE_ALIGN or head[:8] != MAGIC:
        raise ModelFormatError(path, "not a PLE row file (bad magic or header shorter than 4096 bytes)")
    (n,) = struct.unpack_from("<I", head, 8)
    if n > PAGE_ALIGN - 12:
        raise ModelFormatError(path, f"header length {n} exceeds the header page")
    try:
        meta = json.loads(head[12:12 + n])
        layout = RowLayout(int(meta["num_rows"]), int(meta["row_dim"]), str(meta["dtype"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ModelFormatError(path, f"malformed PLE row header: {e}") from None
    derived = {"row_bytes": layout.row_bytes, "rows_per_page": layout.rows_per_page,
               "page_bytes": layout.page_bytes, "num_pages": layout.num_pages, "version": VERSION}
    bad = {k: meta.get(k) for k, v in derived.items() if meta.get(k) != v}
    if bad:
        raise ModelFormatError(path, f"PLE row header fields {bad} disagree with its shape ({derived})")
    if size < layout.file_bytes:
        whole = max(0, (size - PAGE_ALIGN) // layout.page_bytes) * layout.rows_per_page
        raise ModelFormatError(path, f"PLE row file is {size} bytes, shorter than its declared "
                                     f"{layout.num_rows} rows x {layout.row_dim} ({layout.file_bytes} bytes; "
                                     f"it holds {min(whole, layout.num_rows)} whole rows): truncated, re-convert")
    return layout


def expect_layout(path, layout: RowLayout, want: RowLayout) -> None:
    """The file's layout must be the one the manifest / model config declares."""
    if layout != want:
        raise ModelFormatError(path, f"PLE row file holds [{layout.num_rows}, {layout.row_dim}] {layout.dtype}; "
                                     f"the model declares [{want.num_rows}, {want.row_dim}] {want.dtype}"
                                     + (" (shorter than its declared vocab)" if layout.num_rows < want.num_rows else ""))


def encode_rows(rows: torch.Tensor, dtype: str) -> torch.Tensor:
    """[n, row_dim] values -> [n, row_bytes] uint8 in the file's encoding."""
    if dtype == "int8":
        x = rows.float()
        scale = (x.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(x / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return torch.cat([q.view(torch.uint8), scale[:, None].contiguous().view(torch.uint8)], dim=1)
    tdt = DTYPES[dtype][0]
    return rows.to(tdt).contiguous().view(torch.uint8).reshape(rows.shape[0], -1)


def decode_rows(raw: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """[n, row_bytes] uint8 -> [n, row_dim] fp32 (the reference decoding of a row)."""
    d = layout.row_dim
    if layout.dtype == "int8":
        q = raw[:, :d].contiguous().view(torch.int8).float()
        return q * raw[:, d:].contiguous().view(torch.float32)
    return raw.contiguous().view(DTYPES[layout.dtype][0]).float()


class RowFileWriter:
    """Appends rows chunk by chunk; only one page group is held at a time.

    ``write(chunk)`` takes [n, row_dim] rows in order; ``close()`` checks that exactly
    ``num_rows`` came, fsyncs, and renames the ``.tmp`` file into place (atomic, as the store's
    other files)."""

    def __init__(self, path: str | os.PathLike[str], layout: RowLayout, pages_per_write: int = 256) -> None:
        self.path, self.layout = Path(path), layout
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self._f = open(self.tmp, "wb")
        self._f.write(layout.header())
        self._pending = torch.empty(0, layout.row_bytes, dtype=torch.uint8)
        self._page = 0
        self._rows = 0
        self._chunk_rows = layout.rows_per_page * pages_per_write

    def write(self, rows: torch.Tensor) -> None:
        if rows.dim() != 2 or rows.shape[1] != self.layout.row_dim:
            raise ModelFormatError(self.path, f"PLE rows of shape {tuple(rows.shape)}; expected [n, {self.layout.row_dim}]")
        if self._rows + rows.shape[0] > self.layout.num_rows:
            raise ModelFormatError(self.path, f"more than the declared {self.layout.num_rows} PLE rows")
        self._rows += rows.shape[0]
        for start in range(0, rows.shape[0], self._chunk_rows):
            enc = encode_rows(rows[start:start + self._chunk_rows], self.layout.dtype)
            self._pending = torch.cat([self._pending, enc]) if self._pending.numel() else enc
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        lay = self.layout
        rpp = lay.rows_per_page
        full = self._pending.shape[0] // rpp if not final else -(-self._pending.shape[0] // rpp)
        if full == 0:
            return
        n = min(full * rpp, self._pending.shape[0])
        rows, self._pending = self._pending[:n], self._pending[n:]
        pages = torch.zeros(full, lay.page_bytes, dtype=torch.uint8)
        padded = torch.zeros(full * rpp, lay.row_bytes, dtype=torch.uint8)
        padded[:n] = rows
        pages[:, :rpp * lay.row_bytes] = padded.reshape(full, -1)
        arr = pages.numpy()
        end = lay.page_bytes - TRAILER
        for i in range(full):
            struct.pack_into("<I4s", arr[i], end, page_crc(self._page + i, arr[i, :end]), PAGE_MAGIC)
        self._f.write(arr.tobytes())
        self._page += full

    def close(self) -> None:
        if self._rows != self.layout.num_rows:
            self.abort()
            raise ModelFormatError(self.path, f"PLE table has {self._rows} rows; declared {self.layout.num_rows}")
        self._flush(final=True)
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)


def write_row_file(path: str | os.PathLike[str], chunks: Iterable[torch.Tensor], num_rows: int, row_dim: int,
                   dtype: str) -> RowLayout:
    """Write ``chunks`` ([n_i, row_dim] each, in row order, summing to ``num_rows``) as a row file.
    The chunks may be views of a memory-mapped checkpoint: each is encoded and written before the
    next is touched."""
    layout = RowLayout(num_rows, row_dim, dtype)
    w = RowFileWriter(path, layout)
    try:
        for c in chunks:
            w.write(c)
    except BaseException:
        w.abort()
        raise
    w.close()
    return layout


def row_chunks(table: torch.Tensor, rows_per_chunk: int = 65536) -> Iterable[torch.Tensor]:
    """[num_rows, row_dim] (e.g. a zero-copy mmap view of a checkpoint tensor) as row slices."""
    for start in range(0, table.shape[0], rows_per_chunk):
        yield table[start:start + rows_per_chunk]


def load_row_file(path: str | os.PathLike[str]) -> torch.Tensor:
    """The whole table as [num_rows, row_dim] fp32, every page checked: the in-memory reference
    the disk tier is tested against (small tables only: it holds the table)."""
    layout = read_layout(path)
    with open(path, "rb") as f:
        f.seek(PAGE_ALIGN)
        data = f.read(layout.num_pages * layout.page_bytes)
    pages = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(layout.num_pages, layout.page_bytes)
    for p in range(layout.num_pages):
        check_page(layout, p, pages[p].numpy(), path)
    rows = pages[:, :layout.rows_per_page * layout.row_bytes].reshape(-1, layout.row_bytes)[:layout.num_rows]
    return decode_rows(rows, layout)
