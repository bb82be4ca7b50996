"""Issue #14 classes 3-5 on the model-loading side.

* class 3 (silent wrong answers): a GGUF whose tokenizer and embedding disagree on the number
  of tokens is refused, naming the file and both numbers;
* class 4 (tracebacks): special-token ids outside the vocabulary or of the wrong JSON/GGUF type,
  wrongly typed config.json fields, a prompt that is not valid UTF-8: each a typed error naming
  the file and field (or, for the prompt, a RequestValidationError);
* class 5 (escapes): every file a checkpoint directory names or holds must resolve inside it;
  error messages never carry more than a bounded excerpt of what a file holds.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from engine.errors import ModelFormatError, RequestValidationError
from engine.loading.gguf import GGUFSource
from engine.loading.hf import HFSource
from engine.loading.safetensors import SafetensorsFile
from engine.tokenizer import Tokenizer
from tests.engine.loading.builders import (
    BASE_KVS, HF_QWEN2_MOE_CONFIG, HF_TENSORS, T_ARR, T_I32, U32, U64, build, kv, kv_str, kv_u32,
    tokens_kv, with_kv, write, write_hf_dir,
)

SECRET = "TOP-SECRET-0123456789"
T_F32 = 6


def refused(make, blamed: Path, *fragments: str) -> ModelFormatError:
    with pytest.raises(ModelFormatError) as ei:
        make()
    assert ei.value.path == str(blamed), ei.value
    for frag in fragments:
        assert frag in ei.value.problem, (frag, ei.value.problem)
    return ei.value


# ================================================================================================
# class 3: tokenizer vs embedding (GGUF)
# ================================================================================================
@pytest.mark.parametrize("n_tokens", [31, 1, 33])
def test_gguf_token_count_must_equal_embedding_rows(tmp_path, n_tokens):
    path = write(tmp_path, build(kvs=BASE_KVS + [tokens_kv(n_tokens)]))
    refused(lambda: GGUFSource(path), path, f"the tokenizer has {n_tokens} tokens", "has 32 rows")


def test_gguf_token_count_equal_to_embedding_rows_is_accepted(tmp_path):
    with GGUFSource(write(tmp_path, build(kvs=BASE_KVS + [tokens_kv(32)]))) as src:
        assert src.config.vocab_size == 32


def test_gguf_tokens_must_be_strings(tmp_path):
    ints = kv("tokenizer.ggml.tokens", T_ARR, U32(T_I32) + U64(32) + bytes(4 * 32))
    path = write(tmp_path, build(kvs=BASE_KVS + [ints]))
    refused(lambda: GGUFSource(path), path, "tokenizer.ggml.tokens must be an array of strings")


# ================================================================================================
# class 4: special-token ids, typed fields, prompts
# ================================================================================================
@pytest.mark.parametrize("with_tokens", [True, False])
@pytest.mark.parametrize("key", ["bos", "eos", "eot", "padding", "unknown"])
@pytest.mark.parametrize("value", [32, 10**6])
def test_gguf_special_token_outside_vocabulary(tmp_path, key, value, with_tokens):
    full = f"tokenizer.ggml.{key}_token_id"
    kvs = BASE_KVS + ([tokens_kv(32)] if with_tokens else []) + [kv_u32(full, value)]
    path = write(tmp_path, build(kvs=kvs))
    refused(lambda: GGUFSource(path), path, f"{full} {value} is outside the vocabulary (32 tokens)")


@pytest.mark.parametrize("record,kind", [
    (lambda k: kv_str(k, "2"), "string"),
    (lambda k: kv(k, T_F32, struct.pack("<f", 2.0)), "float32"),
    (lambda k: kv(k, T_ARR, U32(4) + U64(1) + U32(2)), "array"),
])
def test_gguf_special_token_of_wrong_type(tmp_path, record, kind):
    key = "tokenizer.ggml.eos_token_id"
    path = write(tmp_path, build(kvs=BASE_KVS + [record(key)]))
    refused(lambda: GGUFSource(path), path, f"{key} must be an integer, got a {kind}")


def test_gguf_special_tokens_inside_vocabulary_reach_the_config(tmp_path):
    kvs = BASE_KVS + [tokens_kv(32), kv_u32("tokenizer.ggml.bos_token_id", 0),
                      kv_u32("tokenizer.ggml.eos_token_id", 31)]
    with GGUFSource(write(tmp_path, build(kvs=kvs))) as src:
        assert src.config.bos_token_id == 0 and src.config.eos_token_ids == (31,)


HF_BAD_IDS = [
    ("eos_token_id", "2", "eos_token_id must be an integer or a list of integers, got a string"),
    ("eos_token_id", 2.0, "got a number with a fraction"),
    ("eos_token_id", 2.5, "got a number with a fraction"),
    ("eos_token_id", [[2]], "got a list inside the list"),
    ("eos_token_id", True, "got a boolean"),
    ("eos_token_id", [1, False], "got a boolean inside the list"),
    ("eos_token_id", {"id": 2}, "got an object"),
    ("eos_token_id", 8, "eos_token_id 8 is outside the vocabulary (vocab_size 8)"),
    ("eos_token_id", [1, -1], "eos_token_id -1 is outside the vocabulary"),
    ("bos_token_id", "1", "bos_token_id must be an integer, got a string"),
    ("bos_token_id", [1], "bos_token_id must be an integer, got a list"),
    ("bos_token_id", 10**6, "bos_token_id 1000000 is outside the vocabulary"),
    ("pad_token_id", 1.5, "pad_token_id must be an integer, got a number with a fraction"),
    ("pad_token_id", 99, "pad_token_id 99 is outside the vocabulary"),
]


@pytest.mark.parametrize("field,value,fragment", HF_BAD_IDS,
                         ids=[f"{f}={v!r}" for f, v, _ in HF_BAD_IDS])
def test_hf_special_token_ids_are_typed_and_in_range(tmp_path, field, value, fragment):
    d = write_hf_dir(tmp_path / "ckpt", **{field: value})
    refused(lambda: HFSource(d), d / "config.json", fragment)


def test_hf_valid_special_token_ids(tmp_path):
    d = write_hf_dir(tmp_path / "ckpt", bos_token_id=None, eos_token_id=[7, None, 3, 7], pad_token_id=0)
    with HFSource(d) as src:
        assert src.config.bos_token_id is None and src.config.eos_token_ids == (7, 3)


@pytest.mark.parametrize("changes,fragment", [
    ({"num_hidden_layers": "2"}, "num_hidden_layers must be an integer, got a string"),
    ({"hidden_size": [4]}, "hidden_size must be an integer, got a list"),
    ({"vocab_size": True}, "vocab_size must be an integer, got a boolean"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of strings"),
    ({"architectures": [["LlamaForCausalLM"]]}, "architectures must be a list of strings"),
    ({"architectures": [], "model_type": {"x": 1}}, "model_type must be a string"),
    ({"rms_norm_eps": SECRET * 10}, "rms_norm_eps must be a number, got a string"),
    ({"rope_scaling": {"factor": [2]}}, "factor must be a number, got a list"),
    ({"rope_scaling": {"type": [SECRET]}}, "rope_type must be a string, got a list"),
    ({"rope_scaling": [SECRET * 10]}, "bad value (ValueError)"),
    ({"num_attention_heads": 3, "num_key_value_heads": 2, "head_dim": 2},
     "num_heads (3) must be a multiple of num_kv_heads"),
])
def test_hf_config_fields_are_typed(tmp_path, changes, fragment):
    d = write_hf_dir(tmp_path / "ckpt", **changes)
    err = refused(lambda: HFSource(d), d / "config.json", fragment)
    assert SECRET * 2 not in str(err)


def test_hf_moe_config_out_of_range_names_the_file(tmp_path):
    d = write_hf_dir(tmp_path / "ckpt", HF_QWEN2_MOE_CONFIG, num_experts_per_tok=3)
    refused(lambda: HFSource(d), d / "config.json", "top_k must be in [1, num_experts=2], got 3")


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer.json (tokenizers library) that AutoTokenizer loads offline."""
    from tokenizers import Tokenizer as RustTokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tok")
    tok = RustTokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2, "</s>": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>"}))
    return d


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_tokenizer_dir)


@pytest.mark.parametrize("text", ["a \udcff b", b"a \xff".decode("utf-8", "surrogateescape"), "\ud800"])
def test_prompt_that_is_not_valid_utf8_is_a_validation_error(tiny_tokenizer, text):
    with pytest.raises(RequestValidationError, match="not valid UTF-8"):
        tiny_tokenizer.encode(text)
    assert tiny_tokenizer.encode("a b") == [1, 2]
    assert tiny_tokenizer.encode("a é") == [1, 0]  # non-ASCII but valid: unknown, no error


def test_generation_config_eos_is_typed(tiny_tokenizer_dir, tmp_path):
    import shutil

    d = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, "2"]}))
    refused(lambda: Tokenizer.from_hf_dir(d), d / "generation_config.json",
            "eos_token_id must be an integer or a list of integers, got a string inside the list")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    assert Tokenizer.from_hf_dir(d).eos_token_ids == frozenset({2, 3})


# ================================================================================================
# class 5: paths confined to the checkpoint directory; no file contents in messages
# ================================================================================================
@pytest.fixture
def outside(tmp_path) -> Path:
    """A file outside every checkpoint directory; its contents must never be read or shown."""
    p = tmp_path / "elsewhere" / "secret.txt"
    p.parent.mkdir()
    p.write_text(f"{SECRET}\n" * 10)
    return p


def _index_dir(root: Path, shard: str) -> Path:
    """A checkpoint whose index maps both HF_TENSORS to ``shard``."""
    write_hf_dir(root)
    os.rename(root / "model.safetensors", root / "real.safetensors")
    index = {"weight_map": {name: shard for name in HF_TENSORS}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def _assert_escape_refused(make, blamed: Path, outside: Path) -> None:
    err = refused(make, blamed, "outside the checkpoint directory", "refusing to open it")
    assert SECRET not in str(err) and str(outside) not in str(err)


def test_index_shard_symlinked_outside_is_refused(tmp_path, outside):
    d = _index_dir(tmp_path / "ckpt", "shard.safetensors")
    (d / "shard.safetensors").symlink_to(outside)
    _assert_escape_refused(lambda: HFSource(d), d / "model.safetensors.index.json", outside)


def test_index_shard_symlinked_through_a_relative_dotdot_link_is_refused(tmp_path, outside):
    d = _index_dir(tmp_path / "ckpt", "shard.safetensors")
    (d / "shard.safetensors").symlink_to(Path("..") / "elsewhere" / "secret.txt")
    _assert_escape_refused(lambda: HFSource(d), d / "model.safetensors.index.json", outside)


def test_index_shard_symlink_loop_is_refused(tmp_path):
    d = _index_dir(tmp_path / "ckpt", "shard.safetensors")
    (d / "loop").symlink_to(d / "shard.safetensors")
    (d / "shard.safetensors").symlink_to(d / "loop")
    refused(lambda: HFSource(d), d / "model.safetensors.index.json", "symlink loop")


@pytest.mark.parametrize("shard", ["x" * 300, "a\x00b"])
def test_index_shard_names_the_os_cannot_look_up(tmp_path, shard):
    d = _index_dir(tmp_path / "ckpt", shard)
    refused(lambda: HFSource(d), d / "model.safetensors.index.json", "x" * 20 if "x" in shard else "NUL")


def test_index_shard_symlinked_inside_the_directory_is_accepted(tmp_path):
    d = _index_dir(tmp_path / "ckpt", "shard.safetensors")
    (d / "shard.safetensors").symlink_to("real.safetensors")
    with HFSource(d) as src:
        assert src.names() == sorted(HF_TENSORS)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "model.safetensors.index.json"])
def test_checkpoint_files_symlinked_outside_are_refused(tmp_path, outside, name):
    d = write_hf_dir(tmp_path / "ckpt")
    if (d / name).exists():
        (d / name).unlink()
    (d / name).symlink_to(outside)
    _assert_escape_refused(lambda: HFSource(d), d / name, outside)


def test_tokenizer_file_symlinked_outside_is_refused(tiny_tokenizer_dir, tmp_path, outside):
    import shutil

    d = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, d)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(outside)
    _assert_escape_refused(lambda: Tokenizer.from_hf_dir(d), d / "tokenizer.json", outside)


def test_hugging_face_cache_layout_is_accepted(tmp_path):
    """snapshots/<rev>/* are symlinks into ../../blobs: the hub cache's own layout."""
    repo = tmp_path / "models--org--tiny"
    src = write_hf_dir(tmp_path / "src")
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, name in enumerate(("config.json", "model.safetensors")):
        os.rename(src / name, repo / "blobs" / f"blob{i}")
        (snap / name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    with HFSource(snap) as s:
        assert s.names() == sorted(HF_TENSORS)
    # ...but only into its own blobs folder
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(tmp_path / "src" / "nothing")
    (tmp_path / "src" / "nothing").write_bytes(b"")
    refused(lambda: HFSource(snap), snap / "model.safetensors", "outside the checkpoint directory")


def test_gguf_bad_magic_does_not_echo_bytes(tmp_path):
    path = write(tmp_path, SECRET.encode() * 4, "x.gguf")
    err = refused(lambda: GGUFSource(path), path, "bad magic")
    assert "TOP-" not in str(err)


def test_gguf_huge_key_is_quoted_bounded(tmp_path):
    key = "k" * 100_000
    path = write(tmp_path, build(kvs=with_kv(key, kv(key, 99, b""))))
    err = refused(lambda: GGUFSource(path), path, "unknown value type 99")
    assert len(str(err)) < 400


def _safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize("header,fragment", [
    (json.dumps({SECRET * 500: {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}).encode(),
     "byte length 8"),
    (json.dumps({"w": {"dtype": SECRET * 500, "shape": [1], "data_offsets": [0, 4]}}).encode(),
     "unknown dtype"),
    (json.dumps({"w": {"dtype": "F32", "shape": [SECRET * 500], "data_offsets": [0, 4]}}).encode(),
     "non-integer dimension"),
    (json.dumps({"w": {"dtype": "F32", "shape": [1] * 100_000, "data_offsets": [0, 4]}}).encode(),
     "100000 dimensions"),
    (b'{"' + SECRET.encode() * 500 + b'\xff": 1}', "not valid UTF-8"),
    (b'{"' + (SECRET * 500).encode() + b'": 1, "' + (SECRET * 500).encode() + b'": 2}', "duplicate key"),
])
def test_safetensors_errors_quote_at_most_an_excerpt(tmp_path, header, fragment):
    path = _safetensors(tmp_path / "t.safetensors", header, bytes(4))
    err = refused(lambda: SafetensorsFile(path), path, fragment)
    assert len(err.problem) < 400 and SECRET * 3 not in str(err)
