"""Classes 3 and 4 for the expert store: no silent wrong answer, no traceback.

A blob's digest binds (layer, expert, quant format), so swapping two experts in the manifest is
caught like a flipped byte; ``moestream verify`` checks a store whole; re-running convert on a
damaged store repairs it instead of saying "nothing to do"; stores of schema 1 get a
"re-convert" error; a model config that disagrees with the dense tensors and a store without its
tokenizer are typed errors naming the tensor or directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine.errors import ChecksumError, ConfigError, ModelFormatError
from engine.store import ExpertStore, convert, verify_store
from engine.store.manifest import MANIFEST_NAME
from tests.reliability.store_helpers import (
    INT4, copy_store, edit_manifest, entry, leftovers,
)


@pytest.fixture
def copy(store, tmp_path) -> Path:
    return copy_store(store, tmp_path / "s")


def _verify_cli(root: Path, *extra: str):
    from services.cli import main

    res = CliRunner().invoke(main, ["verify", str(root), *extra])
    assert "Traceback" not in res.output
    return res


def _errors(res) -> list[str]:
    return [line for line in res.output.splitlines() if line.startswith("error: ")]


def _flip_byte(root: Path, layer: int, expert: int) -> None:
    with ExpertStore(root) as st:
        e = st.entry(layer, expert)
    with open(root / e.file, "r+b") as f:
        f.seek(e.offset + e.nbytes // 2)
        b = f.read(1)
        f.seek(e.offset + e.nbytes // 2)
        f.write(bytes([b[0] ^ 0x10]))


# ------------------------------------------------------------------------------------ verify

def test_verify_passes_an_intact_store(store):
    res = _verify_cli(store)
    assert res.exit_code == 0, res.output
    assert _errors(res) == []
    assert res.output.strip() == (f"{store}: schema 2, mixtral, quant int4 g32; checked 8/8 expert "
                                  f"blobs in 2/2 data files, dense yes, tokenizer 3 files: ok")


def test_verify_finds_a_flipped_byte(copy):
    _flip_byte(copy, 1, 2)
    res = _verify_cli(copy)
    assert res.exit_code == 2
    assert _errors(res) == ["error: experts-L001.bin: layer 1 expert 2 (offset 8192, 3840 bytes): "
                            "digest mismatch: the bytes are corrupted or are another expert's"]
    assert "checked 7/8 expert blobs" in res.output and "1 problem" in res.output


def test_swapped_experts_are_caught_at_load_and_by_verify(copy):
    with ExpertStore(copy) as st:
        blob2 = bytes(st.read_expert(0, 2))

    def swap(m):
        a, b = entry(m, 0, 1), entry(m, 0, 2)
        for key in ("offset", "sha256", "layout"):
            a[key], b[key] = b[key], a[key]

    edit_manifest(copy, swap)
    with ExpertStore(copy) as st:  # structurally valid: only the identity tells
        assert bytes(st.read_expert(0, 1, verify=False)) == blob2  # intact bytes, wrong expert
        with pytest.raises(ChecksumError, match=r"layer 0 expert 1 in .*experts-L000\.bin") as ei:
            st.read_expert(0, 1)
        assert (ei.value.layer, ei.value.expert) == (0, 1)
        with pytest.raises(ChecksumError, match=r"layer 0 expert 2 in "):
            st.read_expert(0, 2)
        st.read_expert(0, 0)
    res = _verify_cli(copy)
    assert res.exit_code == 2
    assert sorted(re.sub(r" \(offset.*", "", e) for e in _errors(res)) == [
        "error: experts-L000.bin: layer 0 expert 1", "error: experts-L000.bin: layer 0 expert 2"]


def test_verify_finds_a_truncated_file_and_caps_its_errors(copy):
    os.truncate(copy / "experts-L001.bin", 4096 + 100)
    res = _verify_cli(copy)
    assert res.exit_code == 2
    errs = _errors(res)
    assert errs[0] == f"error: {copy / 'experts-L001.bin'}: truncated: 4196 bytes, the manifest says 16384"
    assert errs[1:] == [f"error: experts-L001.bin: layer 1 expert {j} (offset {4096 * j}, 3840 bytes): "
                        f"only {max(0, 4196 - 4096 * j)} bytes there (file truncated)" for j in (1, 2, 3)]
    capped = _verify_cli(copy, "--max-errors", "2")
    assert len(_errors(capped)) == 3 and _errors(capped)[-1] == "error: ... and 2 more problems"


def test_verify_checks_dense_tokenizer_and_manifest(copy, tmp_path):
    with open(copy / "dense.safetensors", "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\xff")
    (copy / "tokenizer" / "tokenizer_config.json").write_text("{}")
    assert [e.split(": ", 2)[1:] for e in _errors(_verify_cli(copy))] == [
        [str(copy / "dense.safetensors"), "sha256 differs from the manifest's (corrupted or replaced)"],
        [str(copy / "tokenizer" / "tokenizer_config.json"),
         "sha256 differs from the manifest's (corrupted or replaced)"],
    ]
    shutil.rmtree(copy / "tokenizer")
    assert any("records a tokenizer in tokenizer/ but the directory is missing" in e
               for e in _errors(_verify_cli(copy)))
    (copy / MANIFEST_NAME).write_text("{")
    res = _verify_cli(copy)
    assert res.exit_code == 2 and len(_errors(res)) == 1 and "invalid manifest" in _errors(res)[0]
    assert "manifest unusable" in res.output
    res = _verify_cli(tmp_path / "nowhere")
    assert res.exit_code == 2 and "not a store directory" in _errors(res)[0]


# ----------------------------------------------------------------------------- convert re-run

def test_rerun_on_a_damaged_store_repairs_it(src, copy):
    _flip_byte(copy, 1, 2)
    s = convert(src, copy, fmt=INT4, progress=False)
    assert not s.already_done
    assert re.fullmatch(r"experts-L001\.bin: layer 1 expert 2 .*digest mismatch.*", s.repaired)
    assert (s.layers_reused, s.layers_converted) == (1, 1)
    assert "damaged store repaired (experts-L001.bin: layer 1 expert 2" in str(s)
    assert verify_store(copy).ok and leftovers(copy) == []
    again = convert(src, copy, fmt=INT4, progress=False)
    assert again.already_done and "verified intact; nothing to do" in str(again)


def test_rerun_on_a_store_missing_a_file_repairs_it(src, copy):
    os.unlink(copy / "dense.safetensors")
    s = convert(src, copy, fmt=INT4, progress=False)
    assert s.repaired == f"{copy / 'dense.safetensors'}: missing"
    assert (s.layers_reused, s.layers_converted) == (2, 0) and verify_store(copy).ok


# ---------------------------------------------------------------------------- older stores

def _as_schema_1(root: Path) -> None:
    """What an older moestream wrote: schema 1, digests over the bytes alone, no tokenizer list."""
    def edit(m):
        m["schema_version"] = 1
        del m["tokenizer_files"]
        for e in m["experts"]:
            with open(root / e["file"], "rb") as f:
                f.seek(e["offset"])
                e["sha256"] = hashlib.sha256(f.read(e["nbytes"])).hexdigest()
    edit_manifest(root, edit)


def test_schema_1_store_gets_a_reconvert_error_and_is_replaced_with_overwrite(src, copy):
    _as_schema_1(copy)
    hint = r"older moestream \(schema_version 1.*re-convert it: moestream convert SRC --out STORE --overwrite"
    with pytest.raises(ModelFormatError, match=hint):
        ExpertStore(copy)
    res = _verify_cli(copy)
    assert res.exit_code == 2 and re.search(hint, _errors(res)[0])
    with pytest.raises(ConfigError, match=r"already holds a store converted with an unusable manifest "
                                          r"\(.*older moestream.*\).*Pass --overwrite"):
        convert(src, copy, fmt=INT4, progress=False)
    (copy / "notes.txt").write_text("mine")
    s = convert(src, copy, fmt=INT4, progress=False, overwrite=True)
    assert s.layers_converted == 2 and verify_store(copy).ok
    assert (copy / "notes.txt").read_text() == "mine" and leftovers(copy) == []


# ------------------------------------------------------------------------ class 4: typed errors

def test_model_config_disagreeing_with_dense_names_the_tensor(copy):
    edit_manifest(copy, lambda m: m["model_config"].update(vocab_size=128))
    with ExpertStore(copy) as st:
        with pytest.raises(ModelFormatError, match=r"dense\.safetensors: tensor 'model\.embed_tokens\.weight' "
                                                   r"has shape \[96, 32\] but the manifest's model config "
                                                   r"implies \[128, 32\]"):
            st.dense_source()
    from engine.experts.runtime import load_from_store

    with pytest.raises(ModelFormatError, match=r"model\.embed_tokens\.weight"):
        load_from_store(copy)
    assert any("model.embed_tokens.weight" in e for e in _errors(_verify_cli(copy)))


def test_store_without_its_tokenizer_is_a_typed_error(copy):
    shutil.rmtree(copy / "tokenizer")
    msg = r"tokenizer: the manifest records a tokenizer in tokenizer/ but the directory is missing; re-convert"
    with ExpertStore(copy) as st:
        with pytest.raises(ModelFormatError, match=msg):
            st.tokenizer()
    from engine.experts.runtime import load_from_store

    with pytest.raises(ModelFormatError, match=msg):  # not swallowed as "no tokenizer"
        load_from_store(copy)


def test_store_missing_one_tokenizer_file_is_a_typed_error(copy):
    os.unlink(copy / "tokenizer" / "tokenizer.json")
    with ExpertStore(copy) as st:
        with pytest.raises(ModelFormatError, match=r"tokenizer file tokenizer\.json is missing; re-convert"):
            st.tokenizer()


def test_manifest_lists_tokenizer_files(store):
    m = json.loads((store / MANIFEST_NAME).read_text())
    assert m["tokenizer_dir"] == "tokenizer"
    assert m["tokenizer_files"] == {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (store / "tokenizer").iterdir()}
