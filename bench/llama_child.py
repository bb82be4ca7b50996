"""llama.cpp (llama-cpp-python) in a child process, one GGUF per child.

A wheel built for instructions this CPU lacks dies of SIGILL on some formats only (the prebuilt
0.3.36 wheel runs Q4_K_M on AVX-512 VNNI CPUs but not Q4_0 or Q8_0): each format in its own
child keeps every row that runs, and a row whose child dies says how it died.

The parent writes one JSON request per line on the child's stdin and reads one JSON answer per
line from its stdout: ``{"op": "greedy", "prompt": [...], "new": n}`` ->
``{"tokens": [...], "prefill": tok/s, "decode": tok/s, "io": [[read_bytes, major_faults] at the
start, after the prefill, at the end]}`` (:func:`io_counters`); ``{"op": "logits", "prompt": [...]}``
-> ``{"logits": [...]}``. The child prints ``{"ready": true}`` once the model is loaded.

    python bench/llama_child.py MODEL.gguf THREADS N_CTX N_BATCH repack|in-place   # the child's side
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def io_counters() -> tuple[int, int]:
    """(bytes this process has read from storage: /proc/self/io read_bytes, major page faults)."""
    import resource

    read = 0
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                read = int(line.split()[1])
    except OSError:
        pass
    return read, resource.getrusage(resource.RUSAGE_SELF).ru_majflt


class LlamaCppDied(RuntimeError):
    """The child exited or was killed; the message says how (e.g. ``killed by SIGILL``)."""


def how_it_ended(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        return f"killed by {signal.Signals(-rc).name}"
    return f"exit status {rc}"


class LlamaCppChild:
    """One GGUF in llama.cpp in a child process; the methods of bench/vs_llama_cpp.py's LlamaCpp.
    ``preexec_fn``: run in the child before exec (e.g. to join a memory cgroup). ``repack``
    False: llama.cpp's ``use_extra_bufts`` off, so weights are not repacked into anonymous
    memory for the CPU's kernels but used in place from the mmap'ed file (the page cache can
    then drop them under a memory limit: llama.cpp's bigger-than-memory mode)."""

    def __init__(self, path: Path, threads: int, n_ctx: int, n_batch: int, *, preexec_fn=None,
                 timeout: float = 1800, repack: bool = True, lib: Path | None = None) -> None:
        self.path = Path(path)
        self.timeout = timeout
        env = None
        if lib is not None:  # another build of llama.cpp's libraries under the same Python binding
            env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib)}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(path), str(threads), str(n_ctx), str(n_batch),
             "repack" if repack else "in-place"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=preexec_fn, env=env)
        self._answer()  # {"ready": true}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _answer(self) -> dict:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:  # stalled (e.g. thrashing under a memory limit): its row says so
            self.proc.kill()
            self.proc.wait()
            raise LlamaCppDied(f"llama.cpp on {self.path.name}: stalled, no answer in {self.timeout:.0f} s (killed)")
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait(timeout=60)
            err = self.proc.stderr.read().strip()[-300:]
            raise LlamaCppDied(f"llama.cpp on {self.path.name}: {how_it_ended(rc)}" + (f": {err}" if err and rc > 0 else ""))
        return json.loads(line)

    def _ask(self, req: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the child is gone: _answer says how
        return self._answer()

    def greedy(self, prompt: list[int], new: int) -> tuple[list[int], float, float]:
        a = self.greedy_io(prompt, new)
        return a["tokens"], a["prefill"], a["decode"]

    def greedy_io(self, prompt: list[int], new: int, forced: list[int] | None = None) -> dict:
        """The child's whole answer (the io counters included). ``forced``: the tokens the decode
        steps feed (teacher forcing: new - 1 of them) instead of each step's argmax."""
        return self._ask({"op": "greedy", "prompt": list(map(int, prompt)), "new": int(new),
                          "forced": None if forced is None else list(map(int, forced))})

    def prompt_logits(self, prompt: list[int]) -> np.ndarray:
        return np.asarray(self._ask({"op": "logits", "prompt": list(map(int, prompt))})["logits"], dtype=np.float32)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()


def _serve(path: str, threads: int, n_ctx: int, n_batch: int, repack: bool) -> None:
    import llama_cpp

    if not repack:
        import llama_cpp.llama_cpp as lib  # the module Llama() calls

        default = lib.llama_model_default_params

        def in_place():
            p = default()
            p.use_extra_bufts = False
            return p

        lib.llama_model_default_params = in_place  # what Llama() starts from

    # llama.cpp's own prints go to fd 1: answers go to a copy of the pipe, fd 1 to /dev/null
    out = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.stdout = sys.stderr
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                          n_threads_batch=threads, flash_attn=True, verbose=False)
    vocab = llm.n_vocab()

    def logits() -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(vocab,))

    def say(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        llm.reset()
        if req["op"] == "logits":
            llm.eval(req["prompt"])
            say({"logits": logits().tolist()})
            continue
        # counted as engine.generate counts: the first token comes out of the prefill,
        # new - 1 decode steps make the rest
        io = [io_counters()]
        t = time.perf_counter()
        llm.eval(req["prompt"])
        prefill = time.perf_counter() - t
        io.append(io_counters())
        t = time.perf_counter()
        toks = [int(logits().argmax())]
        forced = req.get("forced")
        while len(toks) < req["new"]:
            llm.eval([forced[len(toks) - 1] if forced else toks[-1]])
            toks.append(int(logits().argmax()))
        decode = time.perf_counter() - t
        io.append(io_counters())
        say({"io": io, "tokens": toks, "prefill": len(req["prompt"]) / prefill,
             "decode": (req["new"] - 1) / decode if req["new"] > 1 else 0.0})


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "repack")
