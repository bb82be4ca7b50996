"""Our model against transformers on tiny random checkpoints: logits within fp32 tolerance and
32 greedy tokens identical, over GQA ratios, odd sizes, top-k 1/2/4, shared experts, rope types."""

from __future__ import annotations

import pytest
import torch

from engine.generate import generate_ids
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model
from tests.engine.models.hf_tiny import make_checkpoint

CASES = [
    ("llama", {}),
    ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    ("llama", dict(hidden_size=36, head_dim=12, num_attention_heads=6, num_key_value_heads=3,
                   intermediate_size=50)),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16})),
    ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0})),
    ("mixtral", dict(num_experts_per_tok=1)),
    ("mixtral", dict(num_key_value_heads=4)),
    ("mixtral", dict(num_local_experts=6, num_experts_per_tok=4, hidden_size=40, head_dim=10)),
    ("qwen2_moe", {}),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0, norm_topk_prob=True, num_experts_per_tok=1)),
    ("qwen2_moe", dict(num_hidden_layers=3, decoder_sparse_step=2, mlp_only_layers=[0])),
    ("qwen3_moe", dict(norm_topk_prob=True)),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=4, num_key_value_heads=1, head_dim=16)),
    ("qwen3_moe", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 32})),
]


@pytest.mark.parametrize("arch,overrides", CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(CASES)])
def test_logits_and_greedy_tokens_match_transformers(tmp_path, arch, overrides):
    ref = make_checkpoint(arch, tmp_path, seed=len(overrides), **overrides)
    files = open_model_files(tmp_path)
    ours = build_model(files.config, files.source)
    prompt = torch.randint(3, ref.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1))

    with torch.no_grad():
        want = ref(prompt[None]).logits[0]
    kv = ContiguousKVCache(files.config.num_layers, files.config.num_kv_heads, files.config.head_dim)
    got = ours(prompt, BatchLayout.single(0, len(prompt), 0), kv, all_logits=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)

    ref.generation_config.eos_token_id = None  # 32 tokens, EOS or not, on both sides
    with torch.no_grad():
        hf = ref.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=32, do_sample=False)[0, len(prompt):]
    assert len(hf) == 32
    sampling = SamplingConfig(max_tokens=32, ignore_eos=True)
    mine = [t for t, _, _ in generate_ids(ours, prompt.tolist(), sampling)]
    assert mine == hf.tolist()


def test_incremental_decode_equals_full_forward(tmp_path):
    """Prefill in chunks through the KV cache gives the logits of one full forward."""
    make_checkpoint("qwen3_moe", tmp_path)
    files = open_model_files(tmp_path)
    model = build_model(files.config, files.source)
    c = files.config
    tokens = torch.randint(0, c.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    full = model(tokens, BatchLayout.single(0, 20, 0),
                 ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim), all_logits=True)
    kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim)
    parts = []
    for start, n in ((0, 7), (7, 1), (8, 12)):
        parts.append(model(tokens[start:start + n], BatchLayout.single(0, n, start), kv, all_logits=True))
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=1e-5)


def test_batch_of_sequences_equals_each_alone(tmp_path):
    make_checkpoint("mixtral", tmp_path)
    files = open_model_files(tmp_path)
    model = build_model(files.config, files.source)
    c = files.config
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, c.vocab_size, (n,), generator=g) for n in (5, 9, 1)]
    alone = [model(s, BatchLayout.single(0, len(s), 0),
                   ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim))[0] for s in seqs]
    layout = BatchLayout((10, 11, 12), tuple(len(s) for s in seqs), (0, 0, 0))
    batched = model(torch.cat(seqs), layout, ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim))
    torch.testing.assert_close(batched, torch.stack(alone), atol=1e-5, rtol=1e-5)
