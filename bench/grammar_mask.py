"""Grammar mask cost per token on a 248,320-token vocabulary (Qwen3.5's size): xgrammar (the one
moestream uses, engine/agent/grammar.py) next to llguidance, on the same vocabulary, schema and
token stream; plus the cost of applying a mask to one logits row, and of a step's sampling
without any mask (the budget a mask has to fit in).

    python bench/grammar_mask.py                     # both libraries when installed
    python bench/grammar_mask.py --vocab 248320 --tokens 200

No Qwen3.5 tokenizer can be downloaded here, so the vocabulary is built: the largest offline
byte-level BPE vocabulary (SmolLM2's 49,152 tokens, from the demo asset) extended with
concatenations of pairs of its tokens (what BPE merges make) until it has --vocab distinct
entries; the seed is fixed. Both libraries get these token byte strings. The token stream is
a tool-call-shaped JSON document tokenized greedily (longest match) with that vocabulary.
Each figure is the median over the stream of one "fill the next-token mask" call (the work a
constrained row adds to a decode step), with the matcher advanced by the true token after it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llama_cpp import _byte_chars  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["path", "old", "new", "replace_all"],
          "properties": {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"},
                         "replace_all": {"type": "boolean"}, "context_lines": {"type": "integer"}}}
DOC = {"path": "services/http/server.py", "old": "def h_chat(self, request):\n    return None",
       "new": "def h_chat(self, request: web.Request) -> web.StreamResponse:\n    return await "
              "self._generate(request, \"chat\")", "replace_all": False, "context_lines": 3}


def base_vocab() -> tuple[list[bytes], Path]:
    """The largest offline byte-level BPE vocabulary (SmolLM2's) as byte strings, by id."""
    from tokenizers import Tokenizer

    found = sorted(Path.home().glob(".cache/moestream/demo/*/hf/tokenizer.json"))
    if not found:
        sys.exit("no offline byte-level tokenizer found (build the demo asset: moestream demo)")
    tk = Tokenizer.from_file(str(found[0]))
    to_byte = {ch: b for b, ch in enumerate(_byte_chars())}  # GPT-2's byte-level alphabet, inverted
    vocab = tk.get_vocab()
    out = [b""] * len(vocab)
    for piece, i in vocab.items():
        out[i] = bytes(to_byte[ch] for ch in piece) if all(ch in to_byte for ch in piece) else piece.encode()
    return out, found[0]


def big_vocab(size: int, seed: int = 0) -> list[bytes]:
    base, _ = base_vocab()
    rng = random.Random(seed)
    seen = set(base)
    out = list(base)
    words = [t for t in base if 2 <= len(t) <= 8]
    while len(out) < size:
        t = rng.choice(words) + rng.choice(words)
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out[:size]


def greedy_tokenize(vocab: list[bytes], data: bytes) -> list[int]:
    index = {t: i for i, t in enumerate(vocab) if t}
    longest = max(len(t) for t in vocab)
    out, k = [], 0
    while k < len(data):
        for n in range(min(longest, len(data) - k), 0, -1):
            i = index.get(data[k:k + n])
            if i is not None:
                out.append(i)
                k += n
                break
        else:
            raise ValueError(f"byte {data[k]} not in the vocabulary")
    return out


def bench_xgrammar(vocab, eos, ids) -> dict:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos])
    t1 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=2).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    t2 = time.perf_counter()
    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    times = []
    for t in ids:
        a = time.perf_counter()
        m.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - a)
        if not m.accept_token(t):
            raise RuntimeError(f"xgrammar rejected token {t} ({vocab[t]!r})")
    logits = torch.randn(1, len(vocab))
    apply = []
    for _ in range(50):
        a = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        apply.append(time.perf_counter() - a)
    return {"tokenizer_info_s": t1 - t0, "compile_s": t2 - t1, "mask_us": times, "apply_us": apply}


def bench_llguidance(vocab, eos, ids) -> dict | None:
    try:
        import llguidance
    except ImportError:
        return None

    class Tok:
        eos_token_id, bos_token_id, special_token_ids = eos, None, [eos]
        tokens = vocab

        def __call__(self, s):
            return greedy_tokenize(vocab, s if isinstance(s, bytes) else s.encode())

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tok()))
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    m = llguidance.LLMatcher(lt, grammar)
    t2 = time.perf_counter()
    if m.is_error():
        raise RuntimeError(m.get_error())
    times = []
    for t in ids:
        a = time.perf_counter()
        m.compute_bitmask()
        times.append(time.perf_counter() - a)
        if not m.consume_token(t):
            raise RuntimeError(f"llguidance rejected token {t}: {m.get_error()}")
    return {"tokenizer_info_s": t1 - t0, "compile_s": t2 - t1, "mask_us": times}


def sampling_cost(vocab_size: int) -> float:
    """The unconstrained sampler's own per-row work at temperature 1 (engine.layers.sampler)."""
    import torch

    from engine.layers.sampler import SamplerState, SamplingConfig, sample

    st = SamplerState(SamplingConfig(temperature=1.0, top_p=0.95, seed=0))
    logits = torch.randn(vocab_size)
    ts = []
    for _ in range(30):
        a = time.perf_counter()
        sample(logits, st)
        ts.append(time.perf_counter() - a)
    return statistics.median(ts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # one row's cost, steady on a shared machine
    vocab = big_vocab(a.vocab, a.seed)
    eos = len(vocab) - 1
    vocab[eos] = b"<|im_end|>"
    doc = json.dumps(DOC, ensure_ascii=False).encode()
    ids = greedy_tokenize(vocab, doc)
    _, src = base_vocab()
    print(f"config: vocabulary {len(vocab)} tokens ({src.parent.parent.name}'s byte-level BPE + pair merges, "
          f"seed {a.seed}); JSON schema of an edit tool ({len(SCHEMA['properties'])} properties); "
          f"a {len(doc)}-byte document = {len(ids)} tokens")
    rows = []
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        r = fn(vocab, eos, ids)
        if r is None:
            print(f"{name}: not installed")
            continue
        us = [t * 1e6 for t in r["mask_us"]]
        line = (f"{name}: mask per token mean {statistics.mean(us):.1f} us, median {statistics.median(us):.1f} us, p90 "
                f"{sorted(us)[int(0.9 * len(us))]:.1f} us, max {max(us):.1f} us; vocabulary preprocessing "
                f"{r['tokenizer_info_s']:.2f} s, grammar compile {r['compile_s'] * 1e3:.1f} ms")
        if "apply_us" in r:
            line += f"; applying a mask to one row {statistics.median(r['apply_us']) * 1e6:.1f} us"
        print(line)
        rows.append((name, statistics.mean(us)))
    print(f"budget: the sampler's own work per row at temperature 1, top_p 0.95: "
          f"{sampling_cost(len(vocab)) * 1e6:.0f} us")
    if len(rows) == 2:
        (n0, t0), (n1, t1) = rows
        print(f"achieved: {n0} {t0:.1f} us/token mean; peer: {n1} {t1:.1f} us/token mean (same vocabulary "
              f"and stream)")


if __name__ == "__main__":
    main()
