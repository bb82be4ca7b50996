"""Fast CPU paths for quantized linear layers and SwiGLU experts, with automatic fallback.

Shape legend: ``x`` ``[T, K]`` (float32 or bf16; leading dims are flattened), weight ``[N, K]``
(out, in), ``out`` ``[T, N]`` float32. Expert: gate/up ``[I, H]``, down ``[H, I]``, ``x`` ``[T, H]``.

Backends (the ``quant_kernel`` runtime option, engine.options: ``auto`` | ``cpp`` | ``triton`` | ``torch``,
or :func:`set_backend`); the weight's device decides what ``auto`` means:

- ``cpp`` (auto when available): our native kernels (``engine/csrc``: AVX-512, or AVX2 on a CPU
  without it, the ``cpu_isa`` option), built once with
  ``torch.utils.cpp_extension.load`` into ``~/.cache/moestream/torch_extensions``, keyed by a hash
  of the sources, torch's version, the compiler flags and the CPU's flags (``-march=native``, with a
  portable fallback); the setup command and the decode actor build them before any request
  (``python -m engine.quant.build``); ``MOESTREAM_CACHE`` moves the root. Used when the CPU has
  AVX-512 or AVX2 and the build succeeds; any failure (no compiler, no ninja, neither ISA) is
  logged once and the torch backend is used instead. They release the GIL while they run and
  split rows over the native worker pool (``engine/csrc/pool.cpp``, ``native_threads`` option).
- ``triton`` (auto for weights on a CUDA device when triton is installed): the fused
  dequantize-and-multiply kernels of ``triton_kernels.py``, which read the packed codes and never
  write a dequantized expert to global memory; used for up to ``triton_kernels.MAX_T`` token rows,
  dequantize + matmul on the device above that. Forced on CPU weights it runs in Triton's
  interpreter (how the tests check it without a GPU).
- ``torch``: the reference-derived fallback, dequantize to float32 + ``F.linear`` (on any device).

Measured (bench/quant_kernels.py, 1 thread, cold weights, shapes 512x1024 .. 1536x576): ``cpp``
is the fastest candidate that is exact to fp32 for every format and T. At T=1 it beats
dequantize+matmul by 10-100x and torch.compile(dequant+matmul) by ~7x, and matches or beats
torch's int4 kernel in its fast bf16 mode (which is not exact, ~3e-3). At T=16-64 (compute-bound,
fp32 FMA) it ties that bf16 int4 kernel; for int8/bf16 at T=64 a bf16 GEMM on dequantized weights
is ~1.3x faster but rounds to bf16, so it is not used.

int4 weights, and int8 weights whose in-dim is a multiple of 64, take integer activations on a
CPU with AVX512-VNNI or AVX2 (see :func:`int8_activations`, ``reference.takes_int8_activations``); they are
checked against ``reference.linear_ref_int8_act`` with the bound below, everything else against
``reference.linear_ref``.

Tolerance against ``reference.linear_ref`` (checked by tests): the kernels accumulate in float32
in a different order and dequantize with one fused multiply-add, so they agree to
``|err| <= 1e-4 * (|x| @ |w|.T) + 1e-5`` elementwise (a bound on float32 reordering error for
K <= 16384); bf16 input is converted to float32 first.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from engine.errors import ConfigError
from engine.options import RuntimeOptions, configure, generation, options
from engine.quant.formats import QuantizedTensor
from engine.quant.reference import dequantize, unpack_codes

log = logging.getLogger(__name__)

FORMAT_IDS = {"int4": 0, "nf4": 1, "int8": 2, "bf16": 3, "mxfp4": 4}
# Token counts up to DIRECT_MAX_T use the register-tiled direct loop; more use the dequantize-to-
# scratch loop (measured crossover: see bench/quant_kernels.py).
DIRECT_MAX_T = 3

_exts: dict[str, Any] = {}  # ISA -> built module (None: unavailable, see _errors)
_errors: dict[str, str] = {}
_ext_lock = threading.Lock()

CSRC = Path(__file__).resolve().parent.parent / "csrc"  # engine/csrc: the native sources
HEADERS = ("quant.h", "i8a.h", "i16a_halves.h", "step.h", "simd.h", "pool.h", "phases.h", "deltanet.h", "rows.h", "deepseek.h")
# Per instruction set: the kernel file, and the compiler flags (first choice, then a fallback).
# AVX-512: -march=native where the compiler takes it (tuned for this CPU; its flags are in the
# cache key), else the explicit set the kernels need. AVX2: x86-64-v3 (AVX2, FMA, F16C), also
# on an AVX-512 CPU when forced (how the tests run it here).
VARIANTS = {
    "avx512": ("quant.cpp", [["-O3", "-march=native", "-fopenmp-simd"],
                             ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                              "-fopenmp-simd"]]),
    "avx2": ("quant_avx2.cpp", [["-O3", "-march=x86-64-v3", "-fopenmp-simd"],
                                ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp-simd"]]),
}
COMMON_SOURCES = ("entry.cpp", "jobs.cpp", "step.cpp", "pool.cpp", "module.cpp", "deltanet_block.cpp", "mla.cpp",
                  "mla_kvb.cpp", "route_grouped.cpp", "layers.cpp", "amx.cpp")


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def _sources(isa: str) -> list[Path]:
    return [CSRC / VARIANTS[isa][0], *(CSRC / n for n in COMMON_SOURCES)]


def _cache_dir(isa: str, flags: list[str]) -> Path:
    h = hashlib.sha256()
    for f in [*_sources(isa), *(CSRC / n for n in HEADERS)]:
        h.update(f.read_bytes())
    # the sources' directory too: two checkouts would otherwise rebuild in each other's directory
    # (torch's build file names the sources by path), in turn, on every switch
    h.update(" ".join([torch.__version__, *flags, _cpu_flags(), str(CSRC.resolve())]).encode())
    return extension_dir(f"moestream_{isa}_{h.hexdigest()[:12]}")


def extension_dir(name: str) -> Path:
    """Where a native extension is built and cached: ``~/.cache/moestream/torch_extensions/NAME``
    (``MOESTREAM_CACHE`` moves the root). Names carry a hash of the sources, torch's version, the
    flags and the CPU, so a change builds anew beside the old."""
    root = Path(os.environ.get("MOESTREAM_CACHE", Path.home() / ".cache" / "moestream"))
    return root / "torch_extensions" / name


@functools.lru_cache(maxsize=1)
def cpu_has_avx512() -> bool:
    return "avx512f" in _cpu_flags().split() or "AVX512" in torch.backends.cpu.get_cpu_capability().upper()


@functools.lru_cache(maxsize=1)
def cpu_has_avx2() -> bool:
    flags = _cpu_flags().split()
    return ("avx2" in flags and "fma" in flags and "f16c" in flags) or cpu_has_avx512()


_isa_cache: list = [None, None]  # (options generation, ISA): asked on every kernel call


def native_isa() -> str | None:
    """The instruction set the native kernels are built for here: the ``cpu_isa`` runtime option,
    ``auto`` meaning the best this CPU has; None when it has neither AVX-512 nor AVX2."""
    if _isa_cache[0] == generation():
        return _isa_cache[1]
    want = options().cpu_isa
    if want == "auto":
        want = "avx512" if cpu_has_avx512() else "avx2" if cpu_has_avx2() else None
    _isa_cache[:] = [generation(), want]
    return want


def _build(isa: str, flags: list[str], verbose: bool) -> Any:
    from torch.utils.cpp_extension import load

    d = _cache_dir(isa, flags)
    d.mkdir(parents=True, exist_ok=True)
    with build_lock(d):
        built = _load_built(d)
        if built is not None:
            return built
        return load(name=d.name, sources=[str(p) for p in _sources(isa)], extra_cflags=flags,
                    extra_include_paths=[str(CSRC)], build_directory=str(d), verbose=verbose)


def _load_built(d: Path) -> Any:
    """The module already built in ``d``, or None. The directory's name is a hash of the sources'
    bytes, so its library is theirs whatever their timestamps say: torch's ``load`` asks ninja,
    which rebuilds when a source's mtime is newer than its object (a checkout or an editor that
    rewrote a file with the same bytes), and a rebuild inside a memory-limited child (the
    bigger-than-memory bench's cgroups) was OOM-killed, taking the run with it. A library that
    does not load (a link killed half-way) is built again."""
    so = d / f"{d.name}.so"
    if not so.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(d.name, so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        log.info("%s does not load (%s); building it again", so, e)
        return None
    return module


@contextlib.contextmanager
def build_lock(d: Path) -> Iterator[None]:
    """The build directory ``d`` to this process alone: an ``flock``, which the kernel drops when
    its holder dies. torch's own lock is a file that a build killed half-way (OOM-killed in a
    memory-limited cgroup, Ctrl-C) leaves behind, and every later process then waits on it
    forever; whoever holds this lock removes such a file, since no build can be running."""
    with open(d / ".moestream-build.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = d / "lock"
            if stale.exists():
                log.warning("removing %s, left by a native build that did not finish; building again", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_extension(verbose: bool = False) -> Any:
    """Build (or load from cache) the native kernels of ``engine/csrc`` for :func:`native_isa`;
    returns the module or None if unavailable (the torch fallback is used, with one warning).
    Built by the setup command and at the decode actor's start, so a request never waits for a
    compiler (~30 s on 2 cores the first time, a cache hit afterwards)."""
    isa = native_isa()
    if isa in _exts:
        return _exts[isa]
    with _ext_lock:
        if isa in _exts:
            return _exts[isa]
        ext = None
        try:
            if isa is None:
                raise RuntimeError(f"CPU capability {torch.backends.cpu.get_cpu_capability()} has neither "
                                   "AVX-512 nor AVX2")
            if isa == "avx512" and not cpu_has_avx512():
                raise RuntimeError("cpu_isa=avx512 but this CPU lacks AVX-512")
            if isa == "avx2" and not cpu_has_avx2():
                raise RuntimeError("cpu_isa=avx2 but this CPU lacks AVX2, FMA or F16C")
            first, fallback = VARIANTS[isa][1]
            try:
                ext = _build(isa, first, verbose)
            except Exception as e:  # e.g. a compiler that does not know this CPU for -march=native
                log.info("native build with %s failed (%s); retrying with %s", first, e, fallback)
                ext = _build(isa, fallback, verbose)
        except Exception as e:  # no compiler / ninja, or a build error: fall back
            _errors[isa or "none"] = f"{type(e).__name__}: {e}"
            log.warning("moestream native kernels unavailable, using the torch fallback: %s",
                        _errors[isa or "none"].splitlines()[0][:300])
        if ext is not None:
            ext.set_threads(native_threads())
            _sync_switches(ext)
        _exts[isa] = ext
        return ext


def native_threads() -> int:
    """Threads of the native worker pool: the ``native_threads`` runtime option, 0 = every core
    this process may run on."""
    n = options().native_threads
    return n if n > 0 else len(os.sched_getaffinity(0))


def extension_error() -> str | None:
    return _errors.get(native_isa() or "none")


_vnni: dict[str, bool] = {}
_switch_gen: dict[int, int] = {}  # id(extension) -> options generation its switches were set at


def _sync_switches(ext: Any) -> None:
    """The runtime options that are process-wide flags of the extension, which its kernels read:
    ``amx`` (the tiles run only where the CPU and kernel allow them: ``ext.amx_usable()``) and
    ``stream_nta`` (how streamed weight rows are requested: engine/csrc/quant.h), again after
    every :func:`engine.options.configure`."""
    g = generation()
    if _switch_gen.get(id(ext)) != g:
        ext.set_amx(options().amx)
        ext.set_stream_nta(options().stream_nta)
        _switch_gen[id(ext)] = g


def int8_activations() -> bool:
    """Whether the C++ int4 kernels quantize activations to int8 (and int8 ones to int16: integer
    dot products for every row count, so a row's result never depends on the batch:
    tests/engine/quant/test_batch_invariance.py): the ``int8_activations`` runtime option
    (engine.options; default on) and a build with integer kernels on this CPU (AVX512-VNNI, or
    AVX2's vpmaddubsw/vpmaddwd: the same bits, engine/csrc/i8a.h). Measured on VNNI (512x1024 int4 g32/g64, cold, 1 thread): T=1 1.3-1.6x, T=3
    2.4x faster, none where the float kernel is already memory-bound; adds ~1% relative error
    to W·x (int4 weights alone: ~6.5%). ``reference.linear_ref_int8_act`` is the same math in
    torch; off gives the exact float path. Numbers in docs/quantization.md."""
    isa = native_isa()
    if _exts.get(isa) is not None:  # each step asks: the switches follow configure()
        _sync_switches(_exts[isa])
    if not options().int8_activations:
        return False
    if isa not in _vnni:
        ext = load_extension()
        _vnni[isa] = bool(ext is not None and ext.has_int8_dots())
    return _vnni[isa]


def set_backend(mode: str | None) -> None:
    """Force a backend (``auto``/``cpp``/``triton``/``torch``; a ConfigError names any other);
    None goes back to ``MOESTREAM_QUANT_KERNEL``."""
    configure(quant_kernel=mode or RuntimeOptions.from_env().quant_kernel)


def _mode() -> str:
    return options().quant_kernel


def _cpp_ok(q: QuantizedTensor) -> bool:
    return q.in_features % 32 == 0 and q.device.type == "cpu" and q.fmt.name in FORMAT_IDS


def _triton_ok(device: torch.device) -> bool:
    from engine.quant import triton_kernels  # imports triton: only when a weight may use it
    return triton_kernels.supports(device)


def backend_for(q: QuantizedTensor) -> str:
    """Which backend ``qlinear`` uses for ``q``: ``cpp``, ``triton`` or ``torch``."""
    mode, dev = _mode(), q.device
    if mode == "torch":
        return "torch"
    if mode == "triton" or (mode == "auto" and dev.type == "cuda"):
        if _triton_ok(dev):
            return "triton"
        if mode == "triton":
            from engine.quant.triton_kernels import why_not
            raise ConfigError(f"MOESTREAM_QUANT_KERNEL=triton but the Triton kernels cannot run on {dev} "
                              f"here: {why_not(dev)}")
        return "torch"
    if dev.type == "cpu" and _cpp_ok(q) and load_extension() is not None:
        return "cpp"
    if mode == "cpp":
        why = f"weight is on {dev}" if dev.type != "cpu" else extension_error() or f"in-dim {q.in_features} % 32 != 0"
        raise ConfigError(f"MOESTREAM_QUANT_KERNEL=cpp but the C++ kernels are unavailable for this weight: {why}")
    return "torch"


def _linear_fn(q: QuantizedTensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The 2-D ``x -> x @ w.T`` for q (C++ or Triton), cached on q per backend setting; None: use torch.

    The closure holds q's tensors, not q, so q's cache makes no reference cycle and views of a
    store buffer are released as soon as q is dropped.
    """
    c = q.cache.get("linear_fn")
    if c is not None and c[0] == generation():
        return c[1]
    fn = None
    backend = backend_for(q)
    if backend == "cpp":
        ext, args = load_extension(), _kargs(q)

        def fn(x: torch.Tensor) -> torch.Tensor:
            return ext.qlinear(x, *args, DIRECT_MAX_T, int8_activations())
    elif backend == "triton":
        from engine.quant.triton_kernels import MAX_T, qlinear_triton

        bare = QuantizedTensor.trusted(q.fmt, q.shape, dict(q.parts))  # q's tensors without q's cache

        def fn(x: torch.Tensor) -> torch.Tensor:
            return qlinear_triton(x, bare) if x.shape[0] <= MAX_T else qlinear_torch(x, bare)
    elif q.fmt.name == "mxfp4":  # the torch backend's MXFP4 kernel (byte table, engine.quant.mxfp4)
        from engine.quant.mxfp4 import qlinear_mxfp4_cpu

        bare = QuantizedTensor.trusted(q.fmt, q.shape, dict(q.parts))

        def fn(x: torch.Tensor) -> torch.Tensor:
            return qlinear_mxfp4_cpu(x, bare)
    q.cache["linear_fn"] = (generation(), fn)
    return fn


def _kargs(q: QuantizedTensor) -> tuple:
    """(fmt id, G, N, K, codes, scales, mins) for the C++ entry points, cached on q."""
    a = q.cache.get("cpp_args")
    if a is None:
        p, e = q.parts, torch.empty(0, dtype=torch.float16)
        codes = p["weight"] if q.fmt.name == "bf16" else p["codes"]
        # -1: a format the native kernels do not decode (their entry points reject it)
        a = (FORMAT_IDS.get(q.fmt.name, -1), q.fmt.group_size, q.shape[0], q.shape[1], codes,
             p.get("scales", e), p.get("mins", e))
        q.cache["cpp_args"] = a
    return a


def native_linear(ext: Any, q: QuantizedTensor, bias: torch.Tensor | None = None) -> Any:
    """``q`` (and an optional bias) as the fused step's ``Linear`` handle (engine/csrc/step.h)."""
    fmt, g, n, k, codes, scales, mins = _kargs(q)
    b = torch.empty(0) if bias is None else bias.detach().float().contiguous()
    return ext.Linear(fmt, g, n, k, codes, scales, mins, b)


SLOT_ROW = 13  # engine/csrc/step.h: fmt, G, I, H, then codes/scales/mins addresses of gate, up, down


def slot_row(gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor) -> list[int]:
    """The slot-table row of an expert whose parts live in one slot (engine/csrc/step.cpp reads the
    expert straight from these addresses; the slot must outlive every step that uses the row)."""
    if gate.fmt.name not in FORMAT_IDS:
        raise ConfigError(f"the native kernels do not decode {gate.fmt.name} experts")
    row = [FORMAT_IDS[gate.fmt.name], gate.fmt.group_size, gate.shape[0], gate.shape[1]]
    for q in (gate, up, down):
        _, _, _, _, codes, scales, mins = _kargs(q)
        row += [codes.data_ptr(), scales.data_ptr() if scales.numel() else 0,
                mins.data_ptr() if mins.numel() else 0]
    return row


# ------------------------------------------------------------------------------ candidates

def qlinear_cpp(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    ext = load_extension()
    return ext.qlinear(x, *_kargs(q), DIRECT_MAX_T, int8_activations())


# Repacked copies for the torch int4 candidates. They depend on the weight's values, so they are
# kept here, not in q.cache, which holds only what depends on where the parts live (the expert
# cache reuses one slot's views for every expert that lands in the slot).
_REPACKED: "weakref.WeakKeyDictionary[QuantizedTensor, dict]" = weakref.WeakKeyDictionary()


def _int4pack(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 layout: w = (c - 8) * s + z, so z = min + 8 * s; cached per q."""
    d = _REPACKED.setdefault(q, {})
    c = d.get("int4pack")
    if c is None:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_codes(q).to(torch.int32), 1)
        s, m = q.parts["scales"].float(), q.parts["mins"].float()
        sz = torch.stack([s.T, (m + 8 * s).T], dim=-1).contiguous()  # [K/G, N, 2]
        c = d["int4pack"] = (packed, sz)
    return c


def qlinear_torch_int4(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    packed, sz = _int4pack(q)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.float().contiguous(), packed, q.fmt.group_size, sz)


def _int4pack_bf16(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = _REPACKED.setdefault(q, {})
    c = d.get("int4pack_bf16")
    if c is None:
        packed, sz = _int4pack(q)
        c = d["int4pack_bf16"] = (packed, sz.to(torch.bfloat16))
    return c


def qlinear_torch_int4_bf16(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """torch's int4 kernel in its fast mode: bf16 activations and bf16 scales/zeros (not exact)."""
    packed, sz = _int4pack_bf16(q)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed,
                                                      q.fmt.group_size, sz).float()


def qlinear_dequant_f32(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    return F.linear(x.float(), dequantize(q))


def qlinear_dequant_bf16(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    return F.linear(x.to(torch.bfloat16), dequantize(q).to(torch.bfloat16)).float()


def int4pack_supported(q: QuantizedTensor) -> bool:
    """torch's CPU int4 kernel (a bench candidate) exists here and takes this weight (out % 16 == 0)."""
    return (q.fmt.name == "int4" and q.shape[0] % 16 == 0
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


def qlinear_torch(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """Reference-derived fallback: dequantize to float32 and F.linear (exact).

    torch's own int4 kernel is not used here: with fp32 activations it runs a slow generic
    path (~30x slower than dequantize + F.linear at T=16), and its fast mode rounds activations
    and scales to bf16 (rel. error ~3e-3); see bench/quant_kernels.py.
    """
    return qlinear_dequant_f32(x, q)


# ------------------------------------------------------------------------------ public API

def qlinear(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """``x @ dequantize(q).T`` in float32 on the fastest available backend; x ``[..., K]``."""
    k = q.shape[1]
    if x.shape[-1] != k:
        raise ConfigError(f"input of shape {list(x.shape)} does not match weight in-dim {k}")
    fn = _linear_fn(q)
    if fn is None:
        return qlinear_torch(x.reshape(-1, k), q).reshape(*x.shape[:-1], q.shape[0])
    if x.dim() == 2:
        return fn(x)
    return fn(x.reshape(-1, k)).reshape(*x.shape[:-1], q.shape[0])


def expert_forward(x: torch.Tensor, gate: QuantizedTensor, up: QuantizedTensor,
                   down: QuantizedTensor) -> torch.Tensor:
    """SwiGLU expert ``(silu(x @ gate.T) * (x @ up.T)) @ down.T`` in float32; x ``[..., H]``.

    On the C++ backend the whole expert is one call (gate and up share a pass over x and form
    the hidden activation in the same thread; then down).
    """
    i, h = gate.shape
    if up.shape != (i, h) or down.shape != (h, i) or not (gate.fmt == up.fmt == down.fmt):
        raise ConfigError(f"expert weights must be gate [I, H], up [I, H], down [H, I] in one format; got "
                          f"{gate.fmt.name} {list(gate.shape)}, {up.fmt.name} {list(up.shape)}, "
                          f"{down.fmt.name} {list(down.shape)}")
    if x.shape[-1] != h:
        raise ConfigError(f"input of shape {list(x.shape)} does not match expert hidden size {h}")
    c = gate.cache.get("expert_fn")
    if c is None or c[0] is not up or c[1] is not down or c[2] != generation():
        c = (up, down, generation(), _expert_fn(gate, up, down))
        gate.cache["expert_fn"] = c
    fn = c[3]
    if fn is None:
        return qlinear(F.silu(qlinear(x, gate)) * qlinear(x, up), down)
    if x.dim() == 2:
        return fn(x)
    return fn(x.reshape(-1, h)).reshape(*x.shape[:-1], h)


def _expert_fn(gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor) -> Callable | None:
    """The fused C++ expert for these weights (closure over their tensors); None: use torch."""
    i, h = gate.shape
    if all(backend_for(q) == "cpp" for q in (gate, up, down)):
        ext, ag, au, ad = load_extension(), _kargs(gate), _kargs(up), _kargs(down)
        args = (ag[0], ag[1], i, h, *ag[4:], *au[4:], *ad[4:], DIRECT_MAX_T)

        def fn(x: torch.Tensor) -> torch.Tensor:
            return ext.expert_forward(x, *args, int8_activations())
        return fn
    return None


CANDIDATES: dict[str, Callable[[torch.Tensor, QuantizedTensor], torch.Tensor]] = {
    "cpp": qlinear_cpp,
    "torch_int4pack": qlinear_torch_int4,
    "torch_int4_bf16": qlinear_torch_int4_bf16,
    "dequant_f32": qlinear_dequant_f32,
    "dequant_bf16": qlinear_dequant_bf16,
}
