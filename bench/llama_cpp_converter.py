"""llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py), fetched from the llama-cpp-python
source distribution with pip and run on a checkpoint directory; for the GGUF tests and benches.

    script = fetch_converter(cache_dir)        # ConverterUnavailable says why not (no network)
    convert(script, hf_dir, out_gguf, "--outtype", "f32", "--no-mtp")

Only the converter's files are unpacked (convert_hf_to_gguf.py, conversion/, gguf-py/); the
76 MB sdist is deleted. ``MOESTREAM_LLAMA_CPP_DIR`` may point at a llama.cpp checkout instead.

The converter names the tokenizer's pre-tokenizer by hashing what ``AutoTokenizer`` makes of a
test string. transformers 5 builds any ``qwen3_5_moe`` checkpoint's tokenizer as Qwen3.5's own
(Qwen3_5Tokenizer: its regex and normalizer over the saved vocabulary) whatever tokenizer.json
says, so the tiny checkpoints' SmolLM2 vocabulary would hash as an unknown pre-tokenizer and the
converter would stop. ``convert`` runs the unmodified script with that one mapping pointed at
the tokenizer.json as written (transformers' TokenizersBackend), as it already is for
``qwen3_next``; nothing else in the conversion changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # its vendor/llama.cpp knows qwen3next and qwen35moe
_KEEP = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/",
         "vendor/llama.cpp/gguf-py/")
# Run as `python -c _RUN script args...`: the converter as its own __main__, its directory first
# on sys.path (its conversion/ and gguf-py/ packages), tokenizer.json read as written.
_RUN = """
import os, runpy, sys
from transformers.models.auto import tokenization_auto
for model_type in ("qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "qwen4_exp_text"):
    tokenization_auto.TOKENIZER_MAPPING_NAMES[model_type] = "TokenizersBackend"
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[:0] = [os.path.dirname(script), os.path.join(os.path.dirname(script), "gguf-py")]
from conversion.base import ModelBase
_load_hparams = ModelBase.load_hparams
def load_hparams(dir_model, is_mistral_format):
    config = _load_hparams(dir_model, is_mistral_format)
    for c in (config, config.get("text_config") or {}):
        if "indexed_attention" in (c.get("layer_types") or ()):
            c["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in c["layer_types"]]
    return config
ModelBase.load_hparams = staticmethod(load_hparams)
runpy.run_path(script, run_name="__main__")
"""


class ConverterUnavailable(RuntimeError):
    """The converter cannot be fetched here (no network, no such file); the message says why."""


def unpack_converter(sdist: Path, out: Path) -> None:
    """convert_hf_to_gguf.py with its conversion/ and gguf-py/ packages, nothing else."""
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name.split("/", 1)[-1]
            if m.isfile() and rel.startswith(_KEEP):
                m.name = rel[len("vendor/llama.cpp/"):]
                members.append(m)
        # regular files under three known prefixes only; the "data" filter where this Python has
        # it (3.11.4+; Debian's 3.11.2 lacks the argument)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(out, members=members, **safe)


def fetch_converter(root: Path) -> Path:
    """convert_hf_to_gguf.py: ``$MOESTREAM_LLAMA_CPP_DIR``'s, else the one unpacked under ``root``
    (fetched with pip the first time)."""
    env = os.environ.get("MOESTREAM_LLAMA_CPP_DIR")
    if env:
        script = Path(env) / "convert_hf_to_gguf.py"
        if not script.is_file():
            raise ConverterUnavailable(f"MOESTREAM_LLAMA_CPP_DIR={env} has no convert_hf_to_gguf.py")
        return script
    script = Path(root) / "llama.cpp" / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    dl = Path(root) / "download"
    dl.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "-d", str(dl), LLAMA_CPP_PYTHON], capture_output=True, text=True, timeout=600)
    sdists = sorted(dl.glob("llama_cpp_python-*.tar.gz"))
    if r.returncode != 0 or not sdists:
        raise ConverterUnavailable(f"cannot fetch {LLAMA_CPP_PYTHON} with pip: {r.stderr.strip()[-300:]}")
    unpack_converter(sdists[-1], Path(root) / "llama.cpp")
    for f in sdists:
        f.unlink()
    if not script.is_file():
        raise ConverterUnavailable(f"{LLAMA_CPP_PYTHON} has no vendor/llama.cpp/convert_hf_to_gguf.py")
    return script


def convert(script: Path, hf_dir: Path, out: Path, *args: str) -> Path:
    """``hf_dir`` converted to ``out`` by ``script`` (extra converter ``args``, e.g. --outtype f32);
    RuntimeError with the converter's last output when it fails."""
    r = subprocess.run([sys.executable, "-c", _RUN, str(script), str(hf_dir), "--outfile", str(out), *args],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({r.returncode}): {r.stderr[-2000:]}")
    return out
