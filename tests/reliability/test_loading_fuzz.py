"""Property-based fuzzing (hypothesis) of the GGUF and safetensors parsers.

From a small valid file, hypothesis derives byte flips, truncations and overwrites of integer
fields with boundary values (0, 2^31, 2^32-1, 2^63, 2^64-1, the file size). Every outcome must be
a successful parse (whose tensors then read back) or a typed MoestreamError, never another
exception, and no load may allocate more than ALLOC_BUDGET (Python and numpy allocations,
measured with tracemalloc): the seed files are a few KB, so anything near the budget would be
an allocation sized by a declared count. Runs are derandomized (fixed examples, reproducible in
CI) and bounded by max_examples.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import MoestreamError
from engine.loading.gguf import GGUFSource
from engine.loading.safetensors import DTYPES, SafetensorsFile
from engine.loading.validate import check_source
from tests.engine.loading.builders import BASE_DATA, BASE_KVS, T_ARR, U32, U64, build, kv, kv_str, kv_u32, tokens_kv

ALLOC_BUDGET = 64 << 20
FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=100,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BOUNDARY = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**62, 2**63, 2**64 - 1]

GGUF_SEED = build(kvs=BASE_KVS + [
    tokens_kv(32), kv_u32("tokenizer.ggml.bos_token_id", 1), kv_u32("tokenizer.ggml.eos_token_id", 2),
    kv("tokenizer.ggml.scores", T_ARR, U32(6) + U64(3) + struct.pack("<3f", 0.5, 1.5, -2.0)),
    kv_str("general.name", "seed"),
])


def _safetensors_seed() -> bytes:
    from safetensors.torch import save

    return save({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                 "b": torch.ones(4, dtype=torch.bfloat16), "c": torch.tensor(7, dtype=torch.int64)})


ST_SEED = _safetensors_seed()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _count_fields(seed: bytes, header_end: int) -> list[int]:
    """Offsets in the header where a little-endian u64 holds a plausible length, count, dim or
    offset (1..file size): where a boundary value does the most damage."""
    return [p for p in range(header_end - 7)
            if 1 <= struct.unpack_from("<Q", seed, p)[0] <= len(seed)]


def _mutations(seed: bytes, fields: list[int]) -> st.SearchStrategy[bytes]:
    """1-3 boundary integers written over 4- or 8-byte fields (mostly at ``fields``), 0-3 byte
    flips, then (one time in four) a cut."""
    n = len(seed)
    flip = st.tuples(st.just("flip"), st.integers(0, n - 1), st.integers(0, 255))
    where = st.one_of(st.sampled_from(fields), st.sampled_from(fields), st.integers(0, n - 8))
    field = st.tuples(st.sampled_from(["u64", "u64", "u32"]), where, st.sampled_from(BOUNDARY + [n]))
    edits = st.tuples(st.lists(field, min_size=1, max_size=3), st.lists(flip, max_size=3)).map(
        lambda t: t[0] + t[1])
    cut = st.one_of(st.none(), st.none(), st.none(), st.integers(0, n))

    def apply(args: tuple[list[tuple[str, int, int]], int | None]) -> bytes:
        buf = bytearray(seed)
        for kind, pos, value in args[0]:
            if kind == "flip":
                buf[pos] = value
            elif kind == "u32":
                buf[pos:pos + 4] = struct.pack("<I", value & 0xFFFFFFFF)
            else:
                buf[pos:pos + 8] = struct.pack("<Q", value)
        return bytes(buf if args[1] is None else buf[:args[1]])

    return st.tuples(edits, cut).map(apply)


def _bounded(load) -> None:
    """Run ``load``; only MoestreamError may escape, and it may not allocate ALLOC_BUDGET."""
    tracemalloc.start()
    try:
        load()
    except MoestreamError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < ALLOC_BUDGET, f"allocated {peak} bytes"


def _load_gguf(path: Path) -> None:
    with GGUFSource(path) as src:
        for name in src.names():
            t = src.get(name)
            assert tuple(t.shape) == src.info(name).shape
        check_source(src.config, src)


def _load_safetensors(path: Path) -> None:
    with SafetensorsFile(path) as f:
        for name in f.names():
            shape, _ = f.info(name)
            assert tuple(f.get(name, copy=True).shape) == shape


def test_seeds_are_valid(scratch):
    p = scratch / "seed.gguf"
    p.write_bytes(GGUF_SEED)
    with GGUFSource(p) as src:
        assert src.config.vocab_size == 32 and src.config.eos_token_ids == (2,)
        assert src.metadata["tokenizer.ggml.scores"] == [0.5, 1.5, -2.0]
    p = scratch / "seed.safetensors"
    p.write_bytes(ST_SEED)
    with SafetensorsFile(p) as f:
        assert f.names() == ["a", "b", "c"] and int(f.get("c")) == 7


@FUZZ
@given(blob=_mutations(GGUF_SEED, _count_fields(GGUF_SEED, len(GGUF_SEED) - len(BASE_DATA))))
def test_gguf_mutations_parse_or_raise_typed(scratch, blob):
    p = scratch / "m.gguf"
    p.write_bytes(blob)
    _bounded(lambda: _load_gguf(p))


@FUZZ
@given(blob=_mutations(ST_SEED, [0]))
def test_safetensors_mutations_parse_or_raise_typed(scratch, blob):
    p = scratch / "m.safetensors"
    p.write_bytes(blob)
    _bounded(lambda: _load_safetensors(p))


_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                         st.text(max_size=6))
_dim = st.one_of(st.integers(0, 4), st.sampled_from([-1, 2**32, 2**63, 2**64]), _json_scalar)
_entry = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.one_of(st.sampled_from(sorted(DTYPES) + ["F7", "f32", "Q4_K"]), _json_scalar),
        "shape": st.one_of(st.lists(_dim, max_size=4), _json_scalar),
        "data_offsets": st.one_of(st.lists(st.one_of(st.integers(-8, 64), _json_scalar), max_size=3),
                                  _json_scalar),
    },
)
_header = st.dictionaries(st.one_of(st.sampled_from(["a", "b", "__metadata__"]), st.text(max_size=4)),
                          st.one_of(_entry, _json_scalar, st.dictionaries(st.text(max_size=3), _json_scalar)),
                          max_size=4)


@FUZZ
@given(header=_header, data_len=st.integers(0, 64))
def test_safetensors_generated_headers_parse_or_raise_typed(scratch, header, data_len):
    hb = json.dumps(header).encode()
    p = scratch / "h.safetensors"
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + np.arange(data_len, dtype=np.uint8).tobytes())
    _bounded(lambda: _load_safetensors(p))
