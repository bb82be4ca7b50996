"""Host-memory pinning for the RAM tier: registered in bounded chunks, staged copies when it fails.

The RAM tier's slot block is ordinary (pageable) memory that :func:`pin_buffer` page-locks with
``cudaHostRegister``, one chunk of at most :attr:`PinLimits.chunk_bytes` at a time, and never more
than :attr:`PinLimits.max_total_bytes` for the whole process. When a chunk fails (or the total
would pass its limit) the chunks already registered for that buffer are unregistered again and
the bank is returned unpinned, with the reason; host->device copies out of it then go through a
:class:`StagedCopier` (one small pinned buffer). The first such fallback in a process logs one
warning, later ones log at debug level.

The registrar is a seam: :class:`CudaRegistrar` calls the CUDA runtime through
``torch.cuda.cudart()``; tests pass a fake one and run without a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.errors import ConfigError
from engine.units import format_bytes

log = logging.getLogger(__name__)

PAGE = 4096
GiB = 1 << 30


@dataclass(frozen=True)
class PinLimits:
    """How much host memory one registration, and the whole process, may page-lock."""

    # Users of other engines report a single pinned allocation or registration above ~4 GB
    # failing; 1 GiB chunks stay well clear of that, and a registration costs microseconds per
    # chunk next to the seconds page-locking takes.
    chunk_bytes: int = 1 * GiB
    # They also report cudaHostRegister stopping near ~512 GiB registered in total; 480 GiB keeps a
    # margin below it for the pinned buffers torch and the loaders allocate themselves.
    max_total_bytes: int = 480 * GiB

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes <= 0 or self.chunk_bytes % PAGE:
            raise ConfigError(f"PinLimits.chunk_bytes must be a positive multiple of {PAGE} bytes, "
                              f"got {self.chunk_bytes!r}")
        if not isinstance(self.max_total_bytes, int) or self.max_total_bytes <= 0:
            raise ConfigError(f"PinLimits.max_total_bytes must be a positive number of bytes, "
                              f"got {self.max_total_bytes!r}")


class Registrar(Protocol):
    """Page-locks host memory ranges. Neither method raises."""

    def register(self, ptr: int, nbytes: int) -> bool:
        """Register ``nbytes`` at ``ptr``; False when that failed (nothing is registered then)."""

    def unregister(self, ptr: int) -> None:
        """Unregister the range registered at ``ptr``."""


class CudaRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through ``torch.cuda.cudart()``.

    Flags: portable (every CUDA context sees the range as pinned) | mapped (the range gets a
    device address, UVA: the GPU step's copy kernels read the bank through it). A failure is
    reported as False and the CUDA runtime's last-error state is cleared, so that the next
    kernel launch check in this thread does not raise it."""

    FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped

    def __init__(self) -> None:
        self.last_error: str | None = None

    def register(self, ptr: int, nbytes: int) -> bool:
        try:
            code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, self.FLAGS))
        except Exception as e:  # noqa: BLE001 - a binding missing or failing is a failed pin
            self.last_error = f"{type(e).__name__}: {e}"
            clear_cuda_error()
            return False
        if code != 0:
            self.last_error = f"cudaError {code}"
            clear_cuda_error()
            return False
        return True

    def unregister(self, ptr: int) -> None:
        try:
            code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        except Exception as e:  # noqa: BLE001
            code, detail = -1, f"{type(e).__name__}: {e}"
        else:
            detail = f"cudaError {code}"
        if code != 0:
            log.debug("cudaHostUnregister(%#x) failed: %s", ptr, detail)
            clear_cuda_error()


_get_last_error = None  # resolved on first use: a callable, or False when none could be found


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error in this thread (``cudaGetLastError``). torch's cudart
    bindings do not all include it, so it is looked up in the libcudart torch loaded."""
    global _get_last_error
    if _get_last_error is None:
        _get_last_error = _find_get_last_error() or False
    if _get_last_error:
        try:
            _get_last_error()
        except Exception:  # noqa: BLE001 - clearing is best effort
            pass


def _find_get_last_error():
    fn = getattr(torch.cuda.cudart(), "cudaGetLastError", None) if torch.cuda.is_available() else None
    if fn is not None:
        return fn
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libcudart.so.{major}"] if major else []
    for name in names + ["libcudart.so"]:
        try:  # only a library already loaded by torch: never a second runtime
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).cudaGetLastError
        except (OSError, AttributeError):
            continue
    return None


_lock = threading.Lock()
_total = 0  # bytes registered through pin_buffer in this process, under _lock
_warned = False  # the one warning of a failed pin was logged, under _lock


def registered_bytes() -> int:
    """Bytes this process has registered through :func:`pin_buffer` and not yet unregistered."""
    with _lock:
        return _total


def reset_warning() -> None:
    """Let the next failed pin warn again (for tests)."""
    global _warned
    with _lock:
        _warned = False


def _reserve(nbytes: int, limit: int) -> bool:
    global _total
    with _lock:
        if _total + nbytes > limit:
            return False
        _total += nbytes
        return True


def _release(nbytes: int) -> None:
    global _total
    with _lock:
        _total -= nbytes


@dataclass
class PinnedBank:
    """A host buffer's registration: ``chunks`` (offset, bytes) registered now, ``pinned`` whether
    the whole buffer is, ``reason`` why not when it is not."""

    ptr: int
    nbytes: int
    registrar: Registrar | None = field(repr=False)
    chunks: list[tuple[int, int]] = field(default_factory=list)
    pinned: bool = False
    reason: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def close(self) -> None:
        """Unregister every chunk and give its bytes back to the process's total. Idempotent; the
        buffer itself stays usable, as pageable memory."""
        with self._lock:
            chunks, self.chunks, self.pinned = self.chunks, [], False
        for off, n in chunks:
            try:
                self.registrar.unregister(self.ptr + off)
            except Exception as e:  # noqa: BLE001 - a registrar must not raise; a fake might
                log.debug("unregistering %d bytes at offset %d failed: %s", n, off, e)
            _release(n)


def pin_buffer(buf: torch.Tensor, limits: PinLimits | None = None, registrar: Registrar | None = None,
               *, granule: int = PAGE) -> PinnedBank:
    """Register ``buf`` (a contiguous uint8 CPU tensor) in chunks of at most ``limits.chunk_bytes``
    whose boundaries are multiples of ``granule`` from its start (a multiple of 4 KiB; the RAM
    tier passes its slot size, so that no slot spans two registrations; a granule larger than a
    chunk falls back to chunk-sized steps). ``registrar`` None: :class:`CudaRegistrar` when CUDA is
    available. Never raises for a failed pin: the bank comes back with ``pinned=False``."""
    limits = limits or PinLimits()
    if buf.device.type != "cpu" or buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise ValueError(f"pin_buffer needs a contiguous uint8 CPU tensor, got {buf.dtype} on {buf.device}")
    if granule <= 0 or granule % PAGE:
        raise ValueError(f"granule must be a positive multiple of {PAGE}, got {granule}")
    if registrar is None and torch.cuda.is_available():
        registrar = CudaRegistrar()
    bank = PinnedBank(buf.data_ptr(), buf.numel(), registrar)
    step = limits.chunk_bytes // granule * granule or limits.chunk_bytes
    reason = "CUDA is not available" if registrar is None else _register_chunks(bank, step, limits)
    if reason is None:
        bank.pinned = True
        return bank
    bank.close()
    bank.reason = reason
    _report(reason, step)
    return bank


def _register_chunks(bank: PinnedBank, step: int, limits: PinLimits) -> str | None:
    """Register ``bank``'s buffer ``step`` bytes at a time, recording each chunk in the bank;
    None when all of it is registered, else why it stopped."""
    for off in range(0, bank.nbytes, step):
        n = min(step, bank.nbytes - off)
        if not _reserve(n, limits.max_total_bytes):
            return (f"registering {format_bytes(n)} more would pass the process's limit of "
                    f"{format_bytes(limits.max_total_bytes)} (PinLimits.max_total_bytes)")
        if not _register(bank.registrar, bank.ptr + off, n):
            _release(n)
            detail = getattr(bank.registrar, "last_error", None)
            return (f"cudaHostRegister of {format_bytes(n)} at offset {off} failed"
                    + (f" ({detail})" if detail else ""))
        bank.chunks.append((off, n))
    return None


def _register(registrar: Registrar, ptr: int, nbytes: int) -> bool:
    try:
        return bool(registrar.register(ptr, nbytes))
    except Exception as e:  # noqa: BLE001 - a registrar must not raise; count it as a failure
        log.debug("registering %d bytes at %#x raised %s", nbytes, ptr, e)
        return False


def _report(reason: str, chunk: int) -> None:
    global _warned
    with _lock:
        first, _warned = not _warned, True
    (log.warning if first else log.debug)(
        "pinning host memory failed: %s (chunks of %s); copies to the GPU are staged through a "
        "small pinned buffer instead", reason, format_bytes(chunk))


class StagedCopier:
    """Copies blobs out of unpinned host memory to the GPU through one pinned staging buffer of
    ``stage_bytes`` (allocated on the first copy to a GPU), piece by piece; plain copies when even
    that buffer cannot be pinned, and for CPU destinations. Thread-safe: copies take turns on
    the one buffer."""

    def __init__(self, stage_bytes: int) -> None:
        if stage_bytes <= 0:
            raise ValueError(f"stage_bytes must be positive, got {stage_bytes}")
        self.stage_bytes = stage_bytes
        self._stage: torch.Tensor | None = None
        self._unpinnable = False
        self._lock = threading.Lock()

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst[:len(src)] = src`` (``src``: a 1-D uint8 CPU view); returns when ``src`` may be
        reused."""
        n = src.numel()
        if not dst.is_cuda:
            dst[:n].copy_(src)
            return
        with self._lock:
            stage = self._staging()
            if stage is None:
                dst[:n].copy_(src)  # from pageable memory: the driver stages it, synchronously
            else:
                copy_through(stage, src, dst)

    def _staging(self) -> torch.Tensor | None:
        if self._stage is None and not self._unpinnable:
            try:
                self._stage = torch.empty(self.stage_bytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:
                self._unpinnable = True
                clear_cuda_error()
                log.debug("the %s staging buffer could not be pinned (%s); plain copies",
                          format_bytes(self.stage_bytes), e)
        return self._stage


def copy_through(stage: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy ``src`` into ``dst[:len(src)]`` in pieces of ``len(stage)`` bytes through ``stage``;
    with a GPU destination each piece is finished before the next overwrites the stage."""
    n, size = src.numel(), stage.numel()
    for off in range(0, n, size):
        k = min(size, n - off)
        stage[:k].copy_(src[off:off + k])
        dst[off:off + k].copy_(stage[:k], non_blocking=dst.is_cuda)
        if dst.is_cuda:
            torch.cuda.current_stream(dst.device).synchronize()
