"""Expert store: convert -> ExpertStore round trips, corruption, malformed manifests, resume."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine.errors import ChecksumError, ConfigError, ExpertLoadError, ModelFormatError
from engine.loading import open_model_files
from engine.loading.source import expert_name
from engine.quant.formats import QuantFormat
from engine.quant.expert_blob import pack_expert, unpack_expert
from engine.quant.reference import dequantize
from engine.store import ExpertStore, convert
from engine.store.manifest import MANIFEST_NAME
from engine.store.writer import PROGRESS_NAME
from tests.engine.models.hf_tiny import make_checkpoint

INT4 = QuantFormat("int4", 32)
BF16 = QuantFormat("bf16", 32)
PROJ = ("gate_proj", "up_proj", "down_proj")

# Expert widths divisible by 32 so every format/group size of the tests applies.
CKPTS = {
    "mixtral": dict(intermediate_size=64),
    "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=32),
}


def _add_tokenizer(root: Path) -> None:
    """A small word-level fast tokenizer, saved the transformers way."""
    from tokenizers import Tokenizer as TkTokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in "the capital of france is paris hello world".split():
        vocab[w] = len(vocab)
    tk = TkTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(str(root))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for arch, kw in CKPTS.items():
        make_checkpoint(arch, root / arch, **kw)
        out[arch] = root / arch
    _add_tokenizer(out["qwen2_moe"])
    return out


@pytest.fixture(scope="module")
def stores(ckpts, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("stores")
    out = {}
    for arch, src in ckpts.items():
        for fmt in (INT4, BF16):
            dst = root / f"{arch}-{fmt.name}"
            convert(src, dst, fmt=fmt, progress=False)
            out[(arch, fmt.name)] = dst
    return out


def _copy_store(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("arch", list(CKPTS))
@pytest.mark.parametrize("fmt", [INT4, BF16], ids=["int4g32", "bf16"])
def test_every_expert_round_trips_exactly(ckpts, stores, arch, fmt):
    files = open_model_files(ckpts[arch])
    src, cfg = files.source, files.config
    with ExpertStore(stores[(arch, fmt.name)]) as store:
        assert store.config == cfg
        assert store.fmt == fmt
        assert store.num_experts_total == len(cfg.moe_layers) * cfg.moe.num_experts == 8
        for layer in cfg.moe_layers:
            for j in range(cfg.moe.num_experts):
                w = [src.get(expert_name(layer, j, p)).float() for p in PROJ]
                want_blob, want_layout = pack_expert(*w, fmt)
                got = store.read_expert(layer, j)
                assert bytes(got) == want_blob
                assert store.entry(layer, j).layout == want_layout
                for q, ref, wt in zip(store.expert_tensors(layer, j, got),
                                      unpack_expert(want_blob, want_layout), w):
                    deq = dequantize(q).float()
                    assert torch.equal(deq, dequantize(ref).float())
                    if fmt.name == "bf16":
                        torch.testing.assert_close(deq, wt, rtol=1e-2, atol=1e-3)
                    else:  # at most half a step of the widest group, and much better on average
                        step = float(wt.max() - wt.min()) / 15
                        assert float((deq - wt).abs().max()) <= step / 2 + 1e-3
                        assert float((deq - wt).abs().mean()) < step / 4
        assert store.reads == 8
        assert store.bytes_read == sum(e.nbytes for e in store.manifest.experts)
        # Dense tensors (attention, norms, router, shared expert): everything else, unchanged.
        with store.dense_source() as dense:
            names = [n for n in src.names() if ".mlp.experts." not in n]
            assert dense.names() == names
            if arch == "qwen2_moe":
                assert "model.layers.0.mlp.shared_expert.down_proj.weight" in names
                assert "model.layers.0.mlp.shared_expert_gate.weight" in names
            for n in names:
                assert torch.equal(dense.get(n), src.get(n)), n
    files.source.close()


def test_read_into_out_buffers_and_threads(stores):
    with ExpertStore(stores[("mixtral", "int4")]) as store:
        keys = [(e.layer, e.expert) for e in store.manifest.experts]
        want = {k: bytes(store.read_expert(*k)) for k in keys}
        aligned = store.empty_buffer()  # 4 KiB aligned: O_DIRECT where the filesystem allows
        assert aligned.data_ptr() % 4096 == 0 and aligned.numel() >= store.expert_nbytes
        odd = bytearray(store.expert_nbytes + 3)
        slots = torch.zeros(2, store.read_nbytes + 64, dtype=torch.uint8)
        for k in keys:
            n = store.entry(*k).nbytes
            assert bytes(store.read_expert(*k, out=aligned)) == want[k]
            assert bytes(aligned[:n].numpy()) == want[k]  # read in place, no copy
            assert bytes(store.read_expert(*k, out=memoryview(odd)[3:])) == want[k]
            assert bytes(store.read_expert(*k, out=slots[1])) == want[k]
            g, u, d = store.expert_tensors(*k, slots[1])
            assert slots[1].data_ptr() <= g.parts["codes"].data_ptr() < slots[1].data_ptr() + n
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda k: bytes(store.read_expert(*k)), keys * 8))
        assert got == [want[k] for k in keys * 8]
        # Views of a non-CPU buffer (a CUDA slot in production; "meta" here) match the CPU views.
        cpu = store.expert_tensors(*keys[0], store.read_expert(*keys[0]))
        meta = store.expert_tensors(*keys[0], torch.empty(store.read_nbytes, dtype=torch.uint8, device="meta"))
        for a, b in zip(cpu, meta):
            assert a.shape == b.shape and a.fmt == b.fmt
            assert {n: (t.dtype, t.shape) for n, t in a.parts.items()} == \
                   {n: (t.dtype, t.shape) for n, t in b.parts.items()}
        with pytest.raises(KeyError, match="layer 7"):
            store.entry(7, 0)


def test_dense_only_llama(tmp_path):
    make_checkpoint("llama", tmp_path / "src")
    s = convert(tmp_path / "src", tmp_path / "store", fmt=INT4, progress=False)
    assert s.num_experts == 0 and s.expert_file_bytes == 0 and s.dense_nbytes > 0
    files = open_model_files(tmp_path / "src")
    with ExpertStore(tmp_path / "store") as store:
        assert store.num_experts_total == 0 and store.manifest.data_files == {}
        assert store.config == files.config
        with store.dense_source() as dense:
            assert dense.names() == files.source.names()
            for n in dense.names():
                assert torch.equal(dense.get(n), files.source.get(n))
    files.source.close()
    assert sorted(p.name for p in (tmp_path / "store").iterdir() if not p.name.startswith(".")) == \
        ["dense.safetensors", "manifest.json"]


def test_dense_dtype_policy(ckpts, tmp_path):
    convert(ckpts["mixtral"], tmp_path / "s", fmt=INT4, dense_dtype="bf16", progress=False)
    with ExpertStore(tmp_path / "s") as store, store.dense_source() as dense:
        assert store.manifest.dense.dtype == "bf16"
        assert {dense.get(n).dtype for n in dense.names()} == {torch.bfloat16}


def test_tokenizer_is_saved(ckpts, stores):
    src_tok = open_model_files(ckpts["qwen2_moe"]).tokenizer()
    with ExpertStore(stores[("qwen2_moe", "int4")]) as store:
        tok = store.tokenizer()
        text = "the capital of france is paris"
        assert tok.encode(text) == src_tok.encode(text)
        assert set(store.config.eos_token_ids) <= tok.eos_token_ids
    with ExpertStore(stores[("mixtral", "int4")]) as store:  # its source had no tokenizer
        assert store.manifest.tokenizer_dir is None
        with pytest.raises(FileNotFoundError, match="no tokenizer"):
            store.tokenizer()


# ----------------------------------------------------------------------------- faults

@pytest.mark.parametrize("kind", ["xxh3", "sha256"])
def test_flipped_byte_is_a_checksum_error_naming_the_expert(stores, tmp_path, kind):
    """A read checks the blob's xxh3; a store written before the check (no xxh3 in its manifest)
    is checked by the sha256 instead, as thoroughly."""
    root = _copy_store(stores[("mixtral", "int4")], tmp_path / "s")
    if kind == "sha256":
        _edit_manifest(root, lambda m: [e.pop("xxh3") for e in m["experts"]])
    with ExpertStore(root) as store:
        e = store.entry(1, 2)
        assert (e.xxh3 is None) == (kind == "sha256")
        good = bytes(store.read_expert(1, 2))
    with open(root / e.file, "r+b") as f:
        f.seek(e.offset + e.nbytes // 2)
        b = f.read(1)
        f.seek(e.offset + e.nbytes // 2)
        f.write(bytes([b[0] ^ 0x01]))
    with ExpertStore(root) as store:
        with pytest.raises(ChecksumError, match=rf"layer 1 expert 2 in .*experts-L001\.bin: manifest says {kind} ") as ei:
            store.read_expert(1, 2)
        assert (ei.value.layer, ei.value.expert) == (1, 2)
        for k in [(e.layer, e.expert) for e in store.manifest.experts if (e.layer, e.expert) != (1, 2)]:
            store.read_expert(*k)
        bad = bytes(store.read_expert(1, 2, verify=False))
        assert bad != good and sum(x != y for x, y in zip(bad, good)) == 1


def test_a_blob_at_another_experts_place_fails_its_check(stores, tmp_path):
    """The check covers the blob's identity: a manifest that swaps two experts' places, digests
    and checks reads each blob as the other expert and fails, where a check over the bytes alone
    would pass."""
    root = _copy_store(stores[("mixtral", "int4")], tmp_path / "s")

    def swap(m):
        a, b = _exp(m, 1, 2), _exp(m, 1, 3)
        for f in ("offset", "nbytes", "sha256", "xxh3"):
            a[f], b[f] = b[f], a[f]
    _edit_manifest(root, swap)
    with ExpertStore(root) as store:
        for expert in (2, 3):
            with pytest.raises(ChecksumError, match=rf"layer 1 expert {expert} .*manifest says xxh3"):
                store.read_expert(1, expert)
        store.read_expert(1, 0)


def test_blob_check_is_xxh3_of_identity_and_bytes():
    """The check's definition is part of the store format: stores on disk depend on it."""
    from engine.store.manifest import blob_check, blob_identity

    assert blob_check(3, 7, "int4", 64, b"moestream") == "eace40d5e08c33c7"
    assert blob_identity(3, 7, "int4", 64).startswith(b"moestream expert blob v2\n")
    assert len({blob_check(3, 7, "int4", 64, b"x"), blob_check(3, 8, "int4", 64, b"x"),
                blob_check(4, 7, "int4", 64, b"x"), blob_check(3, 7, "int8", 64, b"x"),
                blob_check(3, 7, "int4", 32, b"x"), blob_check(3, 7, "int4", 64, b"y")}) == 6


def test_truncated_data_file(stores, tmp_path):
    root = _copy_store(stores[("mixtral", "int4")], tmp_path / "s")
    # Truncated after opening: a short read, not a crash (pread, not mmap: no SIGBUS).
    with ExpertStore(root) as store:
        e = store.entry(1, 3)
        os.truncate(root / e.file, e.offset + 10)
        with pytest.raises(ExpertLoadError, match=r"experts-L001\.bin.*short read for layer 1 expert 3"):
            store.read_expert(1, 3)
        store.read_expert(1, 0)
    # ... and refused at open.
    with pytest.raises(ExpertLoadError, match=r"experts-L001\.bin: truncated"):
        ExpertStore(root)
    os.unlink(root / e.file)
    with pytest.raises(ExpertLoadError, match=r"experts-L001\.bin: expert data file missing"):
        ExpertStore(root)


def _edit_manifest(root: Path, edit) -> None:
    path = root / MANIFEST_NAME
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def _exp(m, layer, expert):
    return next(e for e in m["experts"] if (e["layer"], e["expert"]) == (layer, expert))


MALFORMED = {
    "unaligned offset": (lambda m: _exp(m, 0, 1).update(offset=_exp(m, 0, 1)["offset"] + 512),
                         r"\(layer 0, expert 1\): offset \d+ is not a multiple of 4096"),
    "overlap": (lambda m: _exp(m, 0, 1).update(offset=_exp(m, 0, 0)["offset"]),
                r"experts-L000\.bin: blob of \(layer 0, expert \d\) .* overlaps"),
    "out of range": (lambda m: _exp(m, 1, 3).update(offset=1 << 40),
                     r"\(layer 1, expert 3\): blob .* lies beyond the end of experts-L001\.bin"),
    "huge length": (lambda m: _exp(m, 1, 3).update(nbytes=1 << 62),
                    r"\(layer 1, expert 3\): blob .* lies beyond the end"),
    "missing expert": (lambda m: m["experts"].remove(_exp(m, 1, 2)),
                       r"missing expert entry \(layer 1, expert 2\)"),
    "duplicate": (lambda m: m["experts"].append(dict(_exp(m, 1, 2))), r"duplicate expert entry \(layer 1, expert 2\)"),
    "extra expert": (lambda m: m["experts"].append(dict(_exp(m, 1, 2), expert=9)),
                     r"\(layer 1, expert 9\)"),
    "dotdot file": (lambda m: _exp(m, 0, 0).update(file="../experts-L000.bin"),
                    r"file '\.\./experts-L000\.bin' must be a plain file name"),
    "dotdot data file": (lambda m: m["data_files"].update({"../x.bin": {"nbytes": 1}}),
                         r"data file '\.\./x\.bin' must be a plain file name"),
    "absolute dense": (lambda m: m["dense"].update(file="/etc/passwd"), r"dense file '/etc/passwd'"),
    "schema version": (lambda m: m.update(schema_version=3), r"schema_version 3 is not supported"),
    "schema version 1": (lambda m: m.update(schema_version=1),
                         r"older moestream \(schema_version 1.*re-convert it: moestream convert"),
    "string offset": (lambda m: _exp(m, 0, 0).update(offset="0"), r"experts\.0\.offset"),
    "unknown field": (lambda m: m.update(extra_field=1), r"extra_field"),
    "wrong layout format": (lambda m: _exp(m, 0, 0)["layout"].update(format={"name": "nf4", "group_size": 32}),
                            r"layout format .* is not the store's quant"),
    "bad quant": (lambda m: m["quant"].update(format="int3"), r"quant format 'int3' is not supported"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_manifest_is_refused(stores, tmp_path, case):
    root = _copy_store(stores[("mixtral", "int4")], tmp_path / "s")
    edit, msg = MALFORMED[case]
    _edit_manifest(root, edit)
    with pytest.raises(ModelFormatError, match=msg):
        ExpertStore(root)


def test_manifest_not_json_and_missing(stores, tmp_path):
    root = _copy_store(stores[("mixtral", "int4")], tmp_path / "s")
    (root / MANIFEST_NAME).write_text('{"schema_version": 1, ')
    with pytest.raises(ModelFormatError, match="invalid manifest"):
        ExpertStore(root)
    (root / MANIFEST_NAME).unlink()
    with pytest.raises(ModelFormatError, match="incomplete store: manifest.json missing; re-run moestream convert"):
        ExpertStore(root)


def test_equal_layouts_are_one_object_and_the_manifest_the_same(stores):
    """The manifest's equal nested objects are parsed once (engine.store.manifest._load_shared):
    every expert of a store with one layout shares that layout's tensors, the parsed manifest is
    the one plain JSON parsing validates to, and NaN (not JSON) is refused."""
    from engine.store.manifest import StoreManifest, parse_manifest

    root = stores[("mixtral", "int4")]
    text = (root / MANIFEST_NAME).read_text()
    m = parse_manifest(text, root / MANIFEST_NAME)
    assert m == StoreManifest.model_validate_json(text)
    assert len(m.experts) > 1 and len({id(e.layout["tensors"]) for e in m.experts}) == 1
    with pytest.raises(ModelFormatError, match="NaN is not JSON"):
        parse_manifest(re.sub(r'"offset":\s*0', '"offset": NaN', text, count=1), root / MANIFEST_NAME)


def test_shared_parsing_keeps_distinct_values_apart():
    """1, 1.0 and true are equal in Python but not as JSON: objects holding them stay distinct, and
    arbitrary JSON parses to what json.loads gives."""
    import random

    from engine.store.manifest import _load_shared

    doc = {"a": [{"x": 1}, {"x": 1.0}, {"x": True}, {"x": [1, 2]}, {"x": [1, 2]}, {"x": {"y": None}}]}
    out = _load_shared(json.dumps(doc))
    xs = [o["x"] for o in out["a"]]
    assert [type(x) for x in xs[:3]] == [int, float, bool] and out["a"][3] is out["a"][4]
    rng = random.Random(11)

    def value(depth):
        pick = rng.randrange(6 if depth < 4 else 4)
        if pick == 0:
            return rng.choice([0, 1, -7, 2**40])
        if pick == 1:
            return rng.choice([0.5, 1.0, -2.25])
        if pick == 2:
            return rng.choice(["", "a", "layout"])
        if pick == 3:
            return rng.choice([True, False, None])
        if pick == 4:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice("abcd"): value(depth + 1) for _ in range(rng.randrange(4))}

    for _ in range(200):
        text = json.dumps(value(0))
        assert _load_shared(text) == json.loads(text)


# ----------------------------------------------------------------------------- convert runs

def test_rerun_is_a_noop_and_other_parameters_need_overwrite(ckpts, tmp_path):
    out = tmp_path / "s"
    first = convert(ckpts["mixtral"], out, fmt=INT4, progress=False)
    assert first.layers_converted == 2 and not first.already_done
    before = _mtimes(out)
    again = convert(ckpts["mixtral"], out, fmt=INT4, progress=False)
    assert again.already_done and again.total_nbytes == first.total_nbytes
    assert _mtimes(out) == before
    with pytest.raises(ConfigError, match="already holds a store converted with quant int4 g32.*--overwrite"):
        convert(ckpts["mixtral"], out, fmt=QuantFormat("nf4", 32), progress=False)
    assert _mtimes(out) == before
    s = convert(ckpts["mixtral"], out, fmt=QuantFormat("nf4", 32), progress=False, overwrite=True)
    assert s.layers_converted == 2 and s.quant == "nf4 g32"
    with pytest.raises(ConfigError, match="cannot be stored as int4 g128"):  # refused before touching it
        convert(ckpts["mixtral"], out, fmt=QuantFormat("int4", 128), progress=False, overwrite=True)
    with ExpertStore(out) as store:
        assert store.fmt == QuantFormat("nf4", 32)
        store.read_expert(0, 0)


def test_convert_refuses_bad_shapes_and_foreign_dirs(ckpts, tmp_path):
    make_checkpoint("mixtral", tmp_path / "odd")  # expert width 48: not a multiple of 32
    with pytest.raises(ConfigError, match=r"cannot be stored as int4 g32"):
        convert(tmp_path / "odd", tmp_path / "s1", fmt=INT4, progress=False)
    assert not (tmp_path / "s1").exists()
    (tmp_path / "s2").mkdir()
    (tmp_path / "s2" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty and is not a moestream store"):
        convert(ckpts["mixtral"], tmp_path / "s2", fmt=INT4, progress=False)


def test_interrupted_convert_resumes_to_the_same_store(ckpts, tmp_path):
    src = ckpts["mixtral"]
    straight = tmp_path / "straight"
    convert(src, straight, fmt=INT4, progress=False)

    out = tmp_path / "resumed"
    with pytest.raises(RuntimeError, match="simulated interruption after 1 layers"):
        convert(src, out, fmt=INT4, progress=False, _fail_after_layers=1)
    assert not (out / MANIFEST_NAME).exists()
    assert (out / PROGRESS_NAME).exists() and (out / "experts-L000.bin").exists()
    assert not (out / "experts-L001.bin").exists()
    with pytest.raises(ModelFormatError, match="incomplete store: manifest.json missing; re-run moestream convert"):
        ExpertStore(out)
    l0 = (out / "experts-L000.bin").stat().st_mtime_ns

    s = convert(src, out, fmt=INT4, progress=False)
    assert (s.layers_reused, s.layers_converted) == (1, 1)
    assert (out / "experts-L000.bin").stat().st_mtime_ns == l0  # reused, not rewritten
    assert not (out / PROGRESS_NAME).exists()

    def norm(p: Path) -> dict:
        m = json.loads((p / MANIFEST_NAME).read_text())
        m["conversion"].pop("created_at")
        return m

    assert norm(out) == norm(straight)
    for name in ("dense.safetensors", "experts-L000.bin", "experts-L001.bin"):
        assert (out / name).read_bytes() == (straight / name).read_bytes()


def test_resume_redoes_a_layer_whose_file_changed(ckpts, tmp_path):
    out = tmp_path / "s"
    with pytest.raises(RuntimeError):
        convert(ckpts["mixtral"], out, fmt=INT4, progress=False, _fail_after_layers=1)
    with open(out / "experts-L000.bin", "r+b") as f:
        f.write(b"\xff")
    s = convert(ckpts["mixtral"], out, fmt=INT4, progress=False)
    assert (s.layers_reused, s.layers_converted) == (0, 2)
    with ExpertStore(out) as store:
        for e in store.manifest.experts:
            store.read_expert(e.layer, e.expert)


def test_summary_agrees_with_the_store(ckpts, tmp_path):
    s = convert(ckpts["qwen2_moe"], tmp_path / "s", fmt=INT4, progress=False)
    with ExpertStore(tmp_path / "s") as store:
        files = {n: (tmp_path / "s" / n).stat().st_size for n in store.manifest.data_files}
        assert s.expert_nbytes == store.expert_nbytes == max(e.nbytes for e in store.manifest.experts)
        assert s.layer_nbytes == max(files.values()) and s.layer_nbytes % 4096 == 0
        assert s.expert_file_bytes == sum(files.values())
        assert s.dense_nbytes == (tmp_path / "s" / "dense.safetensors").stat().st_size
        assert s.total_nbytes == s.dense_nbytes + s.expert_file_bytes
        assert s.bits_per_weight == INT4.bits_per_weight == 5.0
        assert s.num_experts == store.num_experts_total == 8 and s.num_moe_layers == 2
    text = str(s)
    for row in ("store", "model", "quant", "per expert", "per layer", "experts", "dense", "total", "elapsed"):
        assert any(line.startswith(row) for line in text.splitlines()), row


# ----------------------------------------------------------------------------- CLI

def test_cli_convert(ckpts, tmp_path):
    from click.testing import CliRunner

    from services.cli_store import convert as convert_cmd

    runner = CliRunner()
    res = runner.invoke(convert_cmd, [str(ckpts["qwen2_moe"]), "--out", str(tmp_path / "s"),
                                      "--quant", "int4", "--group-size", "32", "--no-progress"])
    assert res.exit_code == 0, res.output
    for row in ("per expert", "per layer", "dense", "total", "5.00 bits/weight", "2 layers converted"):
        assert row in res.output
    res = runner.invoke(convert_cmd, [str(ckpts["qwen2_moe"]), "--out", str(tmp_path / "s"),
                                      "--quant", "int8", "--group-size", "32", "--no-progress"])
    assert res.exit_code == 2
    assert res.output.count("\n") == 1 and res.output.startswith("error: ") and "--overwrite" in res.output
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"x")
    res = runner.invoke(convert_cmd, [str(bad), "--out", str(tmp_path / "s3"), "--no-progress"])
    assert res.exit_code == 2 and res.output.startswith("error: ")
