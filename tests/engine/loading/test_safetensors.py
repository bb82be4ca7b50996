"""engine.loading.safetensors: every malformed case is a ModelFormatError naming the file."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch
from safetensors.torch import save_file  # reference writer (tests only)

from engine.errors import ModelFormatError
from engine.loading.safetensors import SafetensorsFile, read_header


def write_raw(path, header, data: bytes = b"", header_len: int | None = None, pad_to: int = 1):
    """Write a safetensors file by hand. ``header`` is a dict (JSON-encoded) or raw bytes."""
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad_to > 1:
        hb += b" " * (-len(hb) % pad_to)
    n = len(hb) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + hb + data)
    return path


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def expect_error(path, *fragments):
    with pytest.raises(ModelFormatError) as ei:
        SafetensorsFile(path)
    err = ei.value
    assert err.path == str(path)
    assert str(path) in str(err)
    for frag in fragments:
        assert frag in err.problem, (frag, err.problem)
    return err


# ---- malformed files ------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 7])
def test_too_small(tmp_path, size):
    p = tmp_path / "t.safetensors"
    p.write_bytes(b"\x01" * size)
    expect_error(p, "too small")


def test_header_length_over_limit(tmp_path):
    # Declares a 200 MB header in a 10-byte file: rejected before any allocation.
    p = write_raw(tmp_path / "t.safetensors", b"{}", header_len=200_000_000)
    expect_error(p, "exceeds", "limit")


def test_header_length_past_eof(tmp_path):
    p = write_raw(tmp_path / "t.safetensors", b"{}", header_len=1000)
    expect_error(p, "past the end of the file")


def test_header_not_utf8(tmp_path):
    expect_error(write_raw(tmp_path / "t.safetensors", b'{"\xff\xfe": 1}'), "not valid UTF-8")


@pytest.mark.parametrize("hb", [b'{"a": ', b"", b"{'a': 1}", b'{"a": NaN}'])
def test_header_not_json(tmp_path, hb):
    expect_error(write_raw(tmp_path / "t.safetensors", hb), "not valid JSON")


@pytest.mark.parametrize("hb", [b"[1, 2]", b'"x"', b"3", b"null"])
def test_header_not_object(tmp_path, hb):
    expect_error(write_raw(tmp_path / "t.safetensors", hb), "must be a JSON object")


@pytest.mark.parametrize("key", ["dtype", "shape", "data_offsets"])
def test_entry_missing_field(tmp_path, key):
    e = entry()
    del e[key]
    p = write_raw(tmp_path / "t.safetensors", {"w": e}, b"\0" * 8)
    expect_error(p, "'w'", f"missing {key!r}")


def test_entry_not_object(tmp_path):
    expect_error(write_raw(tmp_path / "t.safetensors", {"w": [1, 2]}), "'w'", "must be a JSON object")


@pytest.mark.parametrize("dtype", ["F7", "f32", "Q4_K", 3, None])
def test_unknown_dtype(tmp_path, dtype):
    p = write_raw(tmp_path / "t.safetensors", {"w": entry(dtype=dtype)}, b"\0" * 8)
    expect_error(p, "unknown dtype")


def test_negative_dim(tmp_path):
    p = write_raw(tmp_path / "t.safetensors", {"w": entry(shape=(-2,))}, b"\0" * 8)
    expect_error(p, "negative dimension")


@pytest.mark.parametrize("dim", [2.0, "2", True, None, [2]])
def test_non_int_dim(tmp_path, dim):
    p = write_raw(tmp_path / "t.safetensors", {"w": entry(shape=(dim,))}, b"\0" * 8)
    expect_error(p, "non-integer dimension")


def test_shape_not_list(tmp_path):
    p = write_raw(tmp_path / "t.safetensors", {"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}},
                  b"\0" * 8)
    expect_error(p, "shape must be a list")


@pytest.mark.parametrize("shape", [(2**32, 2**32), (2**62, 4), (2**21,) * 3])
def test_shape_overflow(tmp_path, shape):
    # In 64-bit arithmetic these wrap (2^64 -> 0); the reader must notice instead.
    p = write_raw(tmp_path / "t.safetensors", {"w": entry(shape=shape, offsets=(0, 0))})
    expect_error(p, "overflows")


def test_byte_length_mismatch(tmp_path):
    p = write_raw(tmp_path / "t.safetensors", {"w": entry(shape=(3,), offsets=(0, 8))}, b"\0" * 8)
    expect_error(p, "byte length 8", "numel 3")


@pytest.mark.parametrize("offs", [[0], [0, 8, 16], "0-8", [0.0, 8], [0, None]])
def test_bad_offsets_type(tmp_path, offs):
    p = write_raw(tmp_path / "t.safetensors", {"w": {"dtype": "F32", "shape": [2], "data_offsets": offs}},
                  b"\0" * 8)
    expect_error(p, "data_offsets must be a list of two integers")


def test_negative_offsets(tmp_path):
    p = write_raw(tmp_path / "t.safetensors", {"w": entry(offsets=(-8, 0))}, b"\0" * 8)
    expect_error(p, "negative")


def test_end_before_start(tmp_path):
    p = write_raw(tmp_path / "t.safetensors", {"w": entry(shape=(0,), offsets=(8, 0))}, b"\0" * 8)
    expect_error(p, "end before they start")


def test_gap_at_start(tmp_path):
    p = write_raw(tmp_path / "t.safetensors", {"w": entry(offsets=(4, 12))}, b"\0" * 12)
    expect_error(p, "gap of 4 bytes", "contiguous")


def test_gap_between(tmp_path):
    h = {"a": entry(offsets=(0, 8)), "b": entry(offsets=(12, 20))}
    expect_error(write_raw(tmp_path / "t.safetensors", h, b"\0" * 20), "gap of 4 bytes", "'a'")


def test_overlap(tmp_path):
    # Overlapping tensors are the upstream-documented DoS: one byte range "reused" many times.
    h = {"a": entry(offsets=(0, 8)), "b": entry(offsets=(4, 12))}
    expect_error(write_raw(tmp_path / "t.safetensors", h, b"\0" * 12), "overlaps")


def test_same_range_twice(tmp_path):
    h = {"a": entry(offsets=(0, 8)), "b": entry(offsets=(0, 8))}
    expect_error(write_raw(tmp_path / "t.safetensors", h, b"\0" * 8), "overlaps")


def test_truncated(tmp_path):
    h = {"a": entry(offsets=(0, 8)), "b": entry(offsets=(8, 16))}
    expect_error(write_raw(tmp_path / "t.safetensors", h, b"\0" * 15), "truncated", "'b'")


def test_trailing_bytes(tmp_path):
    p = write_raw(tmp_path / "t.safetensors", {"a": entry()}, b"\0" * 8 + b"<script>")
    expect_error(p, "8 trailing bytes")


def test_duplicate_names(tmp_path):
    hb = b'{"a": ' + json.dumps(entry()).encode() + b', "a": ' + json.dumps(entry()).encode() + b"}"
    expect_error(write_raw(tmp_path / "t.safetensors", hb, b"\0" * 8), "duplicate key 'a'")


def test_bad_metadata(tmp_path):
    p = write_raw(tmp_path / "t.safetensors", {"__metadata__": {"format": 1}, "a": entry()}, b"\0" * 8)
    expect_error(p, "__metadata__")


def test_truncation_and_bitflips_never_crash(tmp_path):
    """Every prefix of a valid file, and random byte flips in its header, give either a
    loadable file or ModelFormatError: never another exception."""
    src = tmp_path / "ok.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)},
              str(src))
    blob = src.read_bytes()
    bad = tmp_path / "bad.safetensors"
    for cut in range(len(blob)):
        bad.write_bytes(blob[:cut])
        with pytest.raises(ModelFormatError):
            SafetensorsFile(bad)
    rng = random.Random(0)
    n = struct.unpack("<Q", blob[:8])[0]
    for _ in range(300):
        b = bytearray(blob)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(0, 8 + n)] = rng.randrange(256)
        bad.write_bytes(bytes(b))
        try:
            with SafetensorsFile(bad) as f:
                for name in f.names():
                    f.get(name)
        except ModelFormatError:
            pass


# ---- valid files -----------------------------------------------------------------------------

def test_round_trip_against_reference_writer(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(4, 2, generator=g).half(),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "i64": torch.arange(5, dtype=torch.int64),
        "u8": torch.arange(9, dtype=torch.uint8).reshape(3, 3),
        "bool": torch.tensor([True, False, True]),
        "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }
    p = tmp_path / "m.safetensors"
    save_file(tensors, str(p), metadata={"format": "pt"})
    with SafetensorsFile(p) as f:
        assert f.names() == sorted(tensors)
        assert f.metadata == {"format": "pt"}
        assert f.info("bf16") == ((7,), "bf16")
        assert f.info("scalar") == ((), "f32")
        assert f.info("empty") == ((0, 4), "f32")
        for name, ref in tensors.items():
            t = f.get(name)
            assert t.dtype == ref.dtype and t.shape == ref.shape, name
            assert torch.equal(t.view(torch.uint8) if name == "f8" else t,
                               ref.view(torch.uint8) if name == "f8" else ref), name
        c = f.get("f32", copy=True)
        c.add_(1)  # a copy is writable and independent of the file
        assert torch.equal(f.get("f32"), tensors["f32"])
        with pytest.raises(KeyError):
            f.get("nope")
    assert read_header(p)["f16"] == ((4, 2), "f16")


def test_writing_a_view_in_place_never_crashes_or_reaches_the_file(tmp_path):
    """A loaded weight edited in place (a DeepSeek router's correction bias zeroed, say) must not
    kill the process (a read-only mapping made that a SIGSEGV) nor change the file; run in a
    child so the old failure shows as an exit code, not a dead test run."""
    import subprocess
    import sys

    p = tmp_path / "m.safetensors"
    ref = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save_file({"w": ref}, str(p))
    before = p.read_bytes()
    code = ("import sys, torch; from engine.loading.safetensors import SafetensorsFile\n"
            f"f = SafetensorsFile({str(p)!r}); t = f.get('w'); t.zero_(); t2 = f.get('w')\n"
            "assert float(t2.abs().sum()) == 0.0; f.close(); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-500:])
    assert p.read_bytes() == before
    with SafetensorsFile(p) as f:
        assert torch.equal(f.get("w"), ref)


def test_zero_size_tensors_share_offsets(tmp_path):
    h = {"z1": entry(shape=(0,), offsets=(0, 0)), "a": entry(offsets=(0, 8)),
         "z2": entry(shape=(2, 0), offsets=(8, 8)), "z3": entry(shape=(0, 3), offsets=(8, 8))}
    p = write_raw(tmp_path / "t.safetensors", h, struct.pack("<2f", 1.5, -2.0))
    with SafetensorsFile(p) as f:
        assert f.get("z2").shape == (2, 0)
        assert f.get("a").tolist() == [1.5, -2.0]


def test_only_empty_tensors_and_metadata(tmp_path):
    p = write_raw(tmp_path / "t.safetensors", {"__metadata__": {}, "z": entry(shape=(0,), offsets=(0, 0))})
    with SafetensorsFile(p) as f:
        assert f.names() == ["z"] and f.get("z").numel() == 0
    p2 = write_raw(tmp_path / "e.safetensors", b"{}")
    assert SafetensorsFile(p2).names() == []


def test_unaligned_data_area(tmp_path):
    # A header of odd length puts the f32 data at an odd file offset: read by copying.
    h = {"a": entry(shape=(3,), offsets=(0, 12))}
    hb = json.dumps(h).encode()
    if len(hb) % 2 == 0:
        hb += b" "
    p = write_raw(tmp_path / "t.safetensors", hb, struct.pack("<3f", 1.0, 2.0, 3.0))
    with SafetensorsFile(p) as f:
        assert f.get("a").tolist() == [1.0, 2.0, 3.0]


def test_view_outlives_close(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(4.0)}, str(p))
    f = SafetensorsFile(p)
    t = f.get("w")
    f.close()  # must not raise although t still points into the mapping
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError):
        f.get("w")
