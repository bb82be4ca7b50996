"""Runtime switches, resolved once at start-up and passed down, never read from the environment
inside a kernel.

Each has an environment variable (read by :func:`options` the first time it is called, i.e. at
start-up of a process) and can be changed in-process with :func:`configure` (tests, benchmarks,
the CLI). Code that caches something per setting (a bound kernel) compares :func:`generation`.

| option | variable | default | meaning |
|---|---|---|---|
| quant_kernel | MOESTREAM_QUANT_KERNEL | auto | auto, cpp, triton or torch (engine.quant.kernels) |
| int8_activations | MOESTREAM_INT8_ACTIVATIONS | 1 | where the CPU has VNNI, int4 weights take int8 and int8 weights int16 activations |
| amx | MOESTREAM_AMX | 1 | where the CPU and kernel allow AMX-INT8, int4 x int8 calls of 16+ rows (a prefill's) run on its tiles, with the VNNI kernel's bits (engine/csrc/amx.cpp) |
| decode_threads | MOESTREAM_DECODE_THREADS | 1 | intra-op torch threads of decode-sized steps (engine.threads) |
| fused_step | MOESTREAM_FUSED_STEP | 1 | decode through the native per-layer calls (engine.step) where the model allows |
| cpu_isa | MOESTREAM_CPU_ISA | auto | native kernels for avx512 or avx2 (auto: the best this CPU has) |
| native_threads | MOESTREAM_NATIVE_THREADS | 0 | threads of the native kernels' worker pool (0: every core of the process) |
| cuda_graphs | MOESTREAM_CUDA_GRAPHS | 1 | per-layer CUDA graphs (attention and feed-forward halves) on CUDA (engine.cuda_graphs; verified against the eager layers on an H200 by bench/gpu_check.py, 2026-12-04; 0 turns them off) |
| kv_bf16 | MOESTREAM_KV_BF16 | 1 | a KV cache made without a named dtype for a model whose steps run natively on the CPU is bfloat16 (engine.executor.kv_dtype; 0: the model's dtype, float32) |
| stream_nta | MOESTREAM_STREAM_NTA | 1 | the native kernels request the weight rows they stream with a non-temporal hint (prefetchnta), so a decode's once-read weights do not evict from L3 what every token reads again (the KV cache, activations, the interpreter); 0: prefetcht0. A hint: the same bits (engine/csrc/quant.h) |
| step_graph | MOESTREAM_STEP_GRAPH | 1 | with cuda_graphs: one CUDA graph per pure decode step where every layer can (engine.cuda_graphs.step_graph; needs the device expert cache, ``--device-cache``; verified on an H200, 2026-12-04) |
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping

from engine.errors import ConfigError

QUANT_KERNELS = ("auto", "cpp", "triton", "torch")
CPU_ISAS = ("auto", "avx512", "avx2")


@dataclass(frozen=True)
class RuntimeOptions:
    quant_kernel: str = "auto"
    int8_activations: bool = True
    amx: bool = True
    decode_threads: int = 1
    fused_step: bool = True
    cpu_isa: str = "auto"
    native_threads: int = 0
    cuda_graphs: bool = True
    step_graph: bool = True
    kv_bf16: bool = True
    stream_nta: bool = True

    def __post_init__(self) -> None:
        if self.cpu_isa not in CPU_ISAS:
            raise ConfigError(f"cpu_isa={self.cpu_isa!r}; allowed: {', '.join(CPU_ISAS)}")
        if self.quant_kernel not in QUANT_KERNELS:
            raise ConfigError(f"quant kernel backend {self.quant_kernel!r}; allowed: {', '.join(QUANT_KERNELS)}")
        if isinstance(self.native_threads, bool) or not isinstance(self.native_threads, int) \
                or self.native_threads < 0:
            raise ConfigError(f"native_threads={self.native_threads!r}; allowed: an integer >= 0 (0: every core)")
        if isinstance(self.decode_threads, bool) or not isinstance(self.decode_threads, int) \
                or self.decode_threads < 1:
            raise ConfigError(f"decode_threads={self.decode_threads!r}; allowed: an integer >= 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "RuntimeOptions":
        env = os.environ if env is None else env

        def flag(name: str, default: str) -> bool:
            raw = env.get(name, default)
            if raw not in ("0", "1"):
                raise ConfigError(f"{name}={raw!r}; allowed: 0 or 1")
            return raw == "1"

        def count(name: str, default: str, least: int) -> int:
            raw = env.get(name, default)
            try:
                n = int(raw)
            except ValueError:
                n = least - 1
            if n < least:
                raise ConfigError(f"{name}={raw!r}; allowed: an integer >= {least}")
            return n

        threads = count("MOESTREAM_DECODE_THREADS", "1", 1)
        kernel = env.get("MOESTREAM_QUANT_KERNEL", "auto")
        if kernel not in QUANT_KERNELS:
            raise ConfigError(f"MOESTREAM_QUANT_KERNEL={kernel!r}; allowed: {', '.join(QUANT_KERNELS)}")
        isa = env.get("MOESTREAM_CPU_ISA", "auto")
        if isa not in CPU_ISAS:
            raise ConfigError(f"MOESTREAM_CPU_ISA={isa!r}; allowed: {', '.join(CPU_ISAS)}")
        return cls(quant_kernel=kernel, int8_activations=flag("MOESTREAM_INT8_ACTIVATIONS", "1"),
                   amx=flag("MOESTREAM_AMX", "1"),
                   decode_threads=threads, fused_step=flag("MOESTREAM_FUSED_STEP", "1"), cpu_isa=isa,
                   native_threads=count("MOESTREAM_NATIVE_THREADS", "0", 0),
                   cuda_graphs=flag("MOESTREAM_CUDA_GRAPHS", "1"),
                   step_graph=flag("MOESTREAM_STEP_GRAPH", "1"),
                   kv_bf16=flag("MOESTREAM_KV_BF16", "1"),
                   stream_nta=flag("MOESTREAM_STREAM_NTA", "1"))


_state: dict = {"opts": None, "gen": 0}


def options() -> RuntimeOptions:
    """The options in force (from the environment the first time)."""
    if _state["opts"] is None:
        _state["opts"] = RuntimeOptions.from_env()
    return _state["opts"]


def configure(opts: RuntimeOptions | None = None, **changes) -> RuntimeOptions:
    """Replace the options (``opts``), or change some of them (``configure(int8_activations=False)``);
    ``configure()`` re-reads the environment. Returns the previous options, for restoring."""
    prev = options()
    base = opts if opts is not None else (RuntimeOptions.from_env() if not changes else prev)
    _state["opts"] = replace(base, **changes)
    _state["gen"] += 1
    return prev


def generation() -> int:
    """Bumped by every :func:`configure`: a cache keyed by it is never stale."""
    return _state["gen"]
