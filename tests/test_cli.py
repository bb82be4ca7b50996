"""The command line end to end on a tiny Mixtral with Mixtral's real tokenizer."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from services.cli import main
from tests.engine.models.hf_tiny import add_mixtral_tokenizer, make_checkpoint


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "hf"
    make_checkpoint("mixtral", d, vocab=32000, hidden_size=64, intermediate_size=64, head_dim=16,
                    num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=3)
    add_mixtral_tokenizer(d)
    return d


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_convert_then_generate_from_store_matches_checkpoint(tiny_mixtral, tmp_path):
    store = tmp_path / "store"
    r = run("convert", tiny_mixtral, "--out", store, "--quant", "bf16", "--no-progress")
    assert r.exit_code == 0, r.output
    assert "per expert" in r.output
    direct = run("generate", "--model", tiny_mixtral, "--max-tokens", 12, "Hello there")
    assert direct.exit_code == 0, direct.output
    for budget in ("100%", "25%"):
        streamed = run("generate", "--store", store, "--device-budget", budget, "--ram-budget", "50%",
                       "--max-tokens", 12, "Hello there")
        assert streamed.exit_code == 0, streamed.output
        assert streamed.stdout == direct.stdout  # bf16 experts of a random model: same greedy text
        assert "expert hit rate" in streamed.stderr and "/token to device" in streamed.stderr
    # admission control: declined misses run from staging slots; the text is the same
    admitted = run("generate", "--store", store, "--device-budget", "25%", "--ram-budget", "50%",
                   "--admission", "--max-tokens", 12, "Hello there")
    assert admitted.exit_code == 0, admitted.output
    assert admitted.stdout == direct.stdout
    assert re.search(r"\d+ misses staged", admitted.stderr), admitted.stderr
    bad = run("generate", "--store", store, "--device-budget", "25%", "--admission", "--policy", "lru", "hi")
    assert bad.exit_code == 2 and "admission" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_generate_with_the_device_cache_gives_the_same_text(tiny_mixtral, tmp_path):
    """--device-cache: the cache's bookkeeping as device launches (Triton's interpreter here);
    the same greedy text; a RAM tier that cannot hold every expert is one clear error."""
    store = tmp_path / "store"
    assert run("convert", tiny_mixtral, "--out", store, "--quant", "int4", "--no-progress").exit_code == 0
    host = run("generate", "--store", store, "--device-budget", "25%", "--max-tokens", 8, "Hello there")
    assert host.exit_code == 0, host.output
    dev = run("generate", "--store", store, "--device-budget", "25%", "--ram-budget", "100%", "--device-cache",
              "--max-tokens", 8, "Hello there")
    assert dev.exit_code == 0, dev.output
    assert dev.stdout == host.stdout
    m = re.search(r"expert hit rate ([\d.]+)%", dev.stderr)
    assert m and 0 < float(m.group(1)) < 100, dev.stderr
    small = run("generate", "--store", store, "--device-budget", "25%", "--ram-budget", "50%", "--device-cache", "hi")
    assert small.exit_code != 0 and "every expert in the RAM tier" in small.output
    assert run("generate", "--device-cache", "hi").exit_code == 2


def test_info_reports_parameters_and_bytes_per_token(tiny_mixtral):
    r = run("info", tiny_mixtral)
    assert r.exit_code == 0, r.output
    assert "mixtral" in r.output and "active per token" in r.output and "4-bit" in r.output


def test_bad_inputs_are_one_line_errors(tiny_mixtral, tmp_path):
    r = run("generate", "--model", tiny_mixtral, "--temperature", "nan", "hi")
    assert r.exit_code == 2 and "temperature" in r.stderr
    r = run("generate", "--model", tiny_mixtral, "--max-tokens", 100000, "hi")
    assert r.exit_code == 2 and "exceeds the model's context" in r.stderr
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    r = run("info", tmp_path)
    assert r.exit_code == 2 and "supported: " in r.stderr
    r = run("generate", "--store", tmp_path, "hi")
    assert r.exit_code == 2 and "manifest" in r.stderr
    import torch

    if not torch.cuda.is_available():
        r = run("generate", "--model", tiny_mixtral, "--device", "cuda", "hi")
        assert r.exit_code == 2 and "CUDA is not available" in r.stderr


def test_speculative_decoding_gives_the_plain_greedy_text(tiny_mixtral, tmp_path):
    plain = run("generate", "--model", tiny_mixtral, "--max-tokens", 16, "one two one two one two")
    ngram = run("generate", "--model", tiny_mixtral, "--max-tokens", 16, "--speculative", "ngram",
                "one two one two one two")
    assert ngram.exit_code == 0, ngram.output
    assert ngram.stdout == plain.stdout
    drafted = re.search(r"drafted (\d+), accepted (\d+)", ngram.stderr)
    assert drafted and int(drafted.group(1)) > 0, ngram.stderr  # it really speculated
    store = tmp_path / "store"
    assert run("convert", tiny_mixtral, "--out", store, "--quant", "bf16", "--no-progress").exit_code == 0
    base = run("generate", "--store", store, "--device-budget", "50%", "--max-tokens", 16, "hello")
    selfspec = run("generate", "--store", store, "--device-budget", "50%", "--max-tokens", 16,
                   "--speculative", "self", "hello")
    assert selfspec.exit_code == 0, selfspec.output
    assert selfspec.stdout == base.stdout
    drafted = re.search(r"drafted (\d+), accepted (\d+)", selfspec.stderr)
    assert drafted and int(drafted.group(1)) > 0, selfspec.stderr
    bad = run("generate", "--model", tiny_mixtral, "--speculative", "self", "hello")
    assert bad.exit_code == 2 and "--store" in bad.stderr
