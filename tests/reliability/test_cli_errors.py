"""Careless command lines get one line `error: ...` and exit status 2, never a traceback
(issue 14, class 4): a missing draft model, a prompt that is not UTF-8, budgets larger than the
machine (refused before anything is allocated), output paths under a regular file, on a
read-only or a full file system."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from engine.units import format_bytes
from services import cli_serve
from services.cli import main
from services.cli_checks import device_memory, host_memory
from tests.engine.models.hf_tiny import add_mixtral_tokenizer, make_checkpoint

BAD = "caf\udce9 \udcff"  # what Python makes of the argv bytes b"caf\xe9 \xff" (surrogateescape)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("clierr")
    make_checkpoint("mixtral", d / "hf", vocab=32000, hidden_size=64, intermediate_size=64,
                    head_dim=16, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2)
    add_mixtral_tokenizer(d / "hf")
    r = CliRunner().invoke(main, ["convert", str(d / "hf"), "--out", str(d / "store"), "--quant",
                                  "bf16", "--no-progress"])
    assert r.exit_code == 0, r.output
    return d / "hf", d / "store"


@pytest.fixture()
def a_file(tmp_path) -> Path:
    f = tmp_path / "plain.txt"
    f.write_bytes(b"user data\n")
    return f


def run(*args, cli=main):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line_error(r, *needles: str) -> str:
    """Exit 2, no traceback, exactly one stderr line `error: ...` containing every needle."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit), r.exception
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_missing_draft_model_is_named_before_any_model_loads(tiny, tmp_path, monkeypatch):
    import engine.loading

    hf, _ = tiny
    missing = tmp_path / "missing.gguf"
    monkeypatch.setattr(engine.loading, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    r = run("generate", "--model", hf, "--speculative", f"draft:{missing}", "hi")
    one_line_error(r, f"--speculative draft:{missing}: no such draft model file")


@pytest.mark.parametrize("args, what", [
    (["generate", "--model", "{hf}", BAD], "PROMPT"),
    (["generate", "--model", "{hf}", "--chat", BAD], "PROMPT"),
    (["generate", "--model", "{hf}", "--stop", BAD, "hi"], "--stop"),
    (["generate", "--address", "auto", BAD], "PROMPT"),  # refused before connecting to Ray
    (["trace", "--model", "{hf}", "--out", "{tmp}/t.npz", "--generate", BAD], "--generate PROMPT"),
])
def test_a_prompt_that_is_not_utf8_is_named(tiny, tmp_path, args, what):
    args = [a.format(hf=tiny[0], tmp=tmp_path) for a in args]
    one_line_error(run(*args), f"{what} is not valid UTF-8: byte 0xe9 at character 3")
    assert not (tmp_path / "t.npz").exists()


def test_remote_generate_command_refuses_bad_prompts_and_ids():
    one_line_error(run("generate", BAD, cli=cli_serve.main), "PROMPT is not valid UTF-8")
    one_line_error(run("generate", "--prompt-ids", "1,x", cli=cli_serve.main),
                   "--prompt-ids '1,x': expected comma-separated integers")


def test_the_real_argv_bytes_path(tiny):
    """The same through a real process: bytes on the command line, decoded by Python itself."""
    exe = Path(sys.executable).with_name("moestream")
    r = subprocess.run([os.fsencode(exe), b"generate", b"--model", os.fsencode(tiny[0]),
                        b"caf\xe9 \xff"], capture_output=True, timeout=120)
    assert r.returncode == 2 and b"Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip() == b"error: PROMPT is not valid UTF-8: byte 0xe9 at character 3"


@pytest.mark.parametrize("option", ["--device-budget", "--ram-budget"])
def test_budgets_larger_than_the_machine_are_refused_before_allocating(tiny, option, monkeypatch):
    import engine.experts.runtime
    import services.app

    _, store = tiny
    monkeypatch.setattr(engine.experts.runtime, "load_from_store",
                        lambda *a, **k: pytest.fail("allocated before checking the budget"))
    monkeypatch.setattr(services.app, "deploy", lambda *a, **k: pytest.fail("deployed"))
    for cmd in (["generate", "--store", store, "--device", "cpu"], ["serve", store]):
        avail = host_memory()  # RAM, and the device tier of a CPU generate
        if option == "--device-budget" and cmd[0] == "serve":  # the decode actor's device
            avail = device_memory("cuda" if torch.cuda.is_available() else "cpu")[0]
        line = one_line_error(run(*cmd, option, "10TiB", "hi" if cmd[0] == "generate" else "--"),
                              f"{option} 10TiB = 10.00 TiB is more than this machine's")
        assert line.endswith(f": {format_bytes(avail)}")


def test_budgets_within_the_machine_still_run(tiny):
    _, store = tiny
    r = run("generate", "--store", store, "--device", "cpu", "--ram-budget", "1MiB",
            "--device-budget", "50%", "--max-tokens", 2, "hi")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("cmd", [
    ["trace", "--model", "{hf}", "--out", "{f}/t.npz"],
    ["trace", "--model", "{hf}", "--out", "{f}/deeper/t.npz"],
    ["moefy", "{hf}", "--out", "{f}/sub"],
    ["simulate", "{f}", "--plot", "{f}/p.png"],
    ["demo", "--cache-dir", "{f}/cache"],
])
def test_output_under_a_regular_file_is_refused(tiny, a_file, cmd):
    args = [a.format(hf=tiny[0], f=a_file) for a in cmd]
    option, out = next((a, b) for a, b in zip(args, args[1:]) if b.startswith(str(a_file) + "/"))
    one_line_error(run(*args), f"error: {option} {out}: {a_file} is a file, not a directory")
    assert a_file.read_bytes() == b"user data\n"


@contextmanager
def tmpfs(path: Path, *opts: str):
    """A small tmpfs at ``path`` (root ignores file modes, so read-only and full file systems
    are made as mounts); skipped where mounting is not allowed."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(opts), "tmpfs", str(path)],
                       capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_output_on_a_read_only_file_system(tiny, tmp_path):
    with tmpfs(tmp_path / "ro", "size=64k", "ro") as ro:
        one_line_error(run("trace", "--model", tiny[0], "--out", ro / "t.npz"),
                       f"--out {ro}/t.npz: {ro} is not writable (read-only file system")


def test_output_on_a_full_file_system(tiny, tmp_path):
    with tmpfs(tmp_path / "full", "size=64k") as full:
        (full / "filler").write_bytes(b"\0" * (64 << 10))  # the tmpfs is now full
        r = run("trace", "--model", tiny[0], "--out", full / "t.npz", "--tokens", 16, "--window", 8)
        one_line_error(r, f"--out {full}/t.npz: No space left on device")
        assert sorted(p.name for p in full.iterdir()) == ["filler"]  # no temporary file left


def test_generate_from_a_store_without_tokenizer(tmp_path):
    make_checkpoint("mixtral", tmp_path / "hf", hidden_size=64, intermediate_size=64, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2)
    r = run("convert", tmp_path / "hf", "--out", tmp_path / "store", "--quant", "bf16", "--no-progress")
    assert r.exit_code == 0, r.output
    r = run("generate", "--store", tmp_path / "store", "--max-tokens", 2, "Hello")
    one_line_error(r, "no tokenizer", str(tmp_path / "store"))
