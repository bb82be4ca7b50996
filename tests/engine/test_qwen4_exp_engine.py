"""Qwen4-Exp in the serving engine and through the store, with the checks of Qwen3-Next's engine
tests (tests/engine/test_qwen3_next_engine.py): concurrent requests equal each alone (chunked
prefill; forced preemption with fewer state slots than requests: PLE windows, n-gram contexts
and index keys rebuilt), an int4 store greedy-identical between a minimal expert cache and full
residency (alone and batched), and `generate --model` printing transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from engine.loading import open_model_files
from engine.models.load import build_model
from tests.engine.models.qwen4_exp_tiny import make_qwen4_exp
from tests.engine.test_qwen3_next_engine import SHAPE, alone, check_concurrent, check_generate_cli, \
    check_int4_store, requests


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen4_exp")
    make_qwen4_exp(path, seed=7, case="ple2_ng3_hc2", **SHAPE)
    return path


@pytest.fixture(scope="module")
def model(hf_dir):
    files = open_model_files(hf_dir)
    assert files.config.arch == "qwen4_exp"
    return build_model(files.config, files.source)


@pytest.fixture(scope="module")
def reference(model):
    reqs = requests(model.config.vocab_size)
    return reqs, [alone(model, r) for r in reqs]


@pytest.mark.parametrize("blocks,slots,budget", [
    (256, 8, 16),  # chunked prefill: the 130-token prompt takes 9 steps, every state carried across
    (40, 3, 24),  # forced preemption and fewer state slots than requests
])
def test_concurrent_requests_equal_each_alone(model, reference, blocks, slots, budget):
    check_concurrent(model, reference, blocks, slots, budget)


def test_int4_store_minimal_cache_equals_full_residency(hf_dir, model, tmp_path):
    check_int4_store(hf_dir, model, tmp_path / "store")


@pytest.mark.parametrize("case", ["ple1_ng2_hc4", "ple0_ng3_hc4"])
def test_generate_cli_matches_transformers(tmp_path, case):
    d = tmp_path / "hf"
    ref = make_qwen4_exp(d, seed=3, vocab=32000, case=case, **SHAPE)
    assert check_generate_cli(ref, d) >= 9


def test_generate_cli_prints_32_greedy_tokens_of_transformers(tmp_path):
    """`generate --model` prints the text of transformers' 32 greedy tokens (PLE on 2 layers,
    3-grams, hc 2, a 31-token prompt past the indexer budget of 8: selection drops blocks); neither
    side may stop early (--ignore-eos, eos_token_id=None)."""
    from click.testing import CliRunner

    from engine.loading import load_model
    from services.cli import main
    from tests.engine.models.hf_tiny import add_mixtral_tokenizer

    d = tmp_path / "hf"
    ref = make_qwen4_exp(d, seed=3, vocab=32000, case="ple2_ng3_hc2", **SHAPE)
    add_mixtral_tokenizer(d)
    _, tok, _ = load_model(d)
    text = "Hello there, tell me about recurrent state " * 3
    ids = tok.encode(text)
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    assert len(hf) == 32
    r = CliRunner().invoke(main, ["generate", "--model", str(d), "--dense", "fp32", "--max-tokens", "32",
                                  "--ignore-eos", text])
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip("\n") == tok.decode(hf)


def test_ignore_eos_against_a_deployment_is_a_usage_error():
    from click.testing import CliRunner

    from services.cli import main

    r = CliRunner().invoke(main, ["generate", "--address", "auto", "--ignore-eos", "hi"])
    assert r.exit_code == 2 and "--ignore-eos runs in this process only" in r.output
