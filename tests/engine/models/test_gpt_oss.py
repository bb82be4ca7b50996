"""gpt-oss against transformers on tiny random checkpoints (window smaller than the prompt, sinks
non-zero, YaRN, biases everywhere), through an int4 expert store (minimal cache vs full
residency) and through the batching engine (8 concurrent requests equal to each alone)."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from engine.generate import generate_ids
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2, head_dim=8,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}


def make_gpt_oss(out, seed: int = 0, **overrides):
    """save_pretrained a random GptOssForCausalLM; every weight perturbed (sinks, biases and norms
    non-trivial), and expert weights large enough that the SwiGLU clamp at 7 is reached."""
    kw = {**BASE, "rope_parameters": YARN, **overrides}
    torch.manual_seed(seed)
    model = T.GptOssForCausalLM(T.GptOssConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if "sinks" in name else 0.05))
            if "experts.gate_up_proj" in name and "bias" not in name:
                p.mul_(12.0)  # gate/up pre-activations of several units, some beyond the limit
    model.save_pretrained(out)
    return model


CASES = [
    {},
    dict(num_key_value_heads=1, sliding_window=3, num_experts_per_tok=1),
    dict(num_hidden_layers=3, num_local_experts=6, num_experts_per_tok=3, num_attention_heads=6,
         num_key_value_heads=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=8),
]


@pytest.mark.parametrize("overrides", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_logits_and_greedy_tokens_match_transformers(tmp_path, overrides):
    ref = make_gpt_oss(tmp_path, seed=len(overrides), **overrides)
    files = open_model_files(tmp_path)
    ours = build_model(files.config, files.source)
    c = files.config
    prompt = torch.randint(3, c.vocab_size, (14,), generator=torch.Generator().manual_seed(1))
    assert c.arch_params.sliding_window < len(prompt)

    with torch.no_grad():
        want = ref(prompt[None]).logits[0]
    got = ours(prompt, BatchLayout.single(0, len(prompt), 0),
               ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim), all_logits=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)

    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        hf = ref.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=32, do_sample=False)[0, len(prompt):]
    mine = [t for t, _, _ in generate_ids(ours, prompt.tolist(), SamplingConfig(max_tokens=32, ignore_eos=True))]
    assert mine == hf.tolist()


def test_the_clamp_and_the_sinks_matter(tmp_path):
    """The parity above would not notice a missing clamp or sink if neither changed anything:
    check that both change the logits of this checkpoint."""
    make_gpt_oss(tmp_path)
    files = open_model_files(tmp_path)
    model = build_model(files.config, files.source)
    c = files.config
    prompt = torch.randint(3, c.vocab_size, (14,), generator=torch.Generator().manual_seed(1))

    def logits():
        return model(prompt, BatchLayout.single(0, 14, 0),
                     ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim), all_logits=True)

    base = logits()
    for layer in model.model.layers:
        layer.mlp.limit = 1e9
    assert (logits() - base).abs().max() > 1e-3
    for layer in model.model.layers:
        layer.mlp.limit = c.arch_params.swiglu_limit
        # a new tensor: the loaded one is a view of the read-only checkpoint mapping
        layer.self_attn.sinks = torch.nn.Parameter(torch.full((c.num_heads,), -1e4))
    assert (logits() - base).abs().max() > 1e-3


def test_window_only_reads_recent_keys_in_chunks(tmp_path):
    """Chunked prefill and decode through the cache give the one-shot logits (window < chunks)."""
    make_gpt_oss(tmp_path, seed=3)
    files = open_model_files(tmp_path)
    model = build_model(files.config, files.source)
    c = files.config
    tokens = torch.randint(0, c.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    full = model(tokens, BatchLayout.single(0, 20, 0),
                 ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim), all_logits=True)
    kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim)
    parts = [model(tokens[s:s + n], BatchLayout.single(0, n, s), kv, all_logits=True)
             for s, n in ((0, 7), (7, 1), (8, 3), (11, 9))]
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=1e-5)


def test_config_round_trips_through_the_manifest_dict(tmp_path):
    from engine.configio.plain import config_from_dict

    make_gpt_oss(tmp_path)
    cfg = open_model_files(tmp_path).config
    again = config_from_dict(cfg.to_dict())
    assert again == cfg and again.arch_params.layer_types == ("sliding_attention", "full_attention")


# ------------------------------------------------------------------ store, engine, command line

@pytest.fixture(scope="module")
def int4_store(tmp_path_factory):
    from engine.quant.formats import QuantFormat
    from engine.store.writer import convert

    d = tmp_path_factory.mktemp("gpt_oss_store")
    make_gpt_oss(d / "hf", seed=7, num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


PROMPT = [5, 17, 3, 44, 9, 81, 23, 6, 12, 60, 33, 7]


def test_int4_store_greedy_identical_minimal_cache_and_full_residency(int4_store):
    from engine.experts.runtime import load_from_store
    from engine.experts.tiers import align_up
    from engine.store.reader import ExpertStore

    sampling = SamplingConfig(max_tokens=24, ignore_eos=True)
    with load_from_store(int4_store, prefetch_depth=0) as sm:
        want = [t for t, _, _ in generate_ids(sm.model, PROMPT, sampling)]
        # the expert biases came from the store's dense file, not zeros
        assert sm.model.model.layers[0].mlp.down_proj_bias.abs().max() > 0
    with ExpertStore(int4_store) as s:
        slot, top_k = align_up(s.expert_nbytes), s.config.moe.top_k
    for kw in (dict(device_budget=top_k * slot, prefetch_depth=1),
               dict(device_budget=top_k * slot, prefetch_depth=0, miss_compute="cpu")):
        with load_from_store(int4_store, **kw) as sm:
            assert [t for t, _, _ in generate_ids(sm.model, PROMPT, sampling)] == want, kw
            assert sm.cache.metrics.total().misses > 0  # the minimal cache really streamed
            sm.cache.drain()
            assert sm.cache.pins == {}


def test_bf16_store_close_to_the_checkpoint(int4_store, tmp_path):
    """bf16 experts of the same weights (biases from the store's dense file): logits within bf16
    rounding of the fp32 checkpoint's. (int4 moves them ~40% on this random model: a 4-bit error
    flips top-2-of-8 routing decisions; bench/quant_quality.py measures real weights.)"""
    from engine.experts.runtime import load_from_store
    from engine.quant.formats import QuantFormat
    from engine.store.writer import convert

    convert(int4_store.parent / "hf", tmp_path / "bf16", fmt=QuantFormat("bf16", 32), progress=False)
    files = open_model_files(int4_store.parent / "hf")
    ref = build_model(files.config, files.source)
    c = files.config
    x = torch.tensor(PROMPT)
    want = ref(x, BatchLayout.single(0, len(x), 0), ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim),
               all_logits=True)
    with load_from_store(tmp_path / "bf16", prefetch_depth=0) as sm:
        got = sm.model(x, BatchLayout.single(0, len(x), 0),
                       ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim), all_logits=True)
    err = (got - want).norm() / want.norm()
    assert 0 < err < 0.02, float(err)


def test_eight_concurrent_requests_equal_each_alone(int4_store):
    from engine.executor import kv_dtype
    from engine.experts.runtime import load_from_store
    from engine.generate import Request
    from engine.kv.paged import PagedKVCache
    from engine.runner import Engine
    from engine.scheduler import SchedulerConfig

    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(3, 96, (n,), generator=g).tolist(), SamplingConfig(max_tokens=m, ignore_eos=True))
            for n, m in zip([1, 3, 5, 8, 13, 17, 24, 31], [1, 4, 7, 10, 12, 3, 9, 6])]
    with load_from_store(int4_store, prefetch_depth=0) as sm:
        c = sm.model.config
        alone = [[t for t, _, _ in generate_ids(sm.model, r.prompt_ids, r.sampling)] for r in reqs]
        kv = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 64, 4, kv_dtype(sm.model))  # as generate_ids's
        engine = Engine(sm.model, kv=kv, config=SchedulerConfig(max_num_batched_tokens=16))
        results = engine.generate(reqs)
        assert [r.output_ids for r in results] == alone
        assert engine.metrics().kv.blocks_used == 0


def test_generate_command_gives_the_greedy_tokens_of_transformers(tmp_path):
    from click.testing import CliRunner

    from services.cli import main
    from tests.engine.models.hf_tiny import add_mixtral_tokenizer

    ref = make_gpt_oss(tmp_path, seed=11, vocab_size=32000)
    add_mixtral_tokenizer(tmp_path)
    tok = open_model_files(tmp_path).tokenizer()
    text = "The capital of France is a city that"
    ids = tok.encode(text)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    assert len(hf) == 32
    r = CliRunner().invoke(main, ["generate", "--model", str(tmp_path), "--dense", "fp32", "--max-tokens", "32", text])
    assert r.exit_code == 0, r.output
    gen = hf[:hf.index(2)] if 2 in hf else hf  # generate stops at EOS
    want = tok.decode(ids + gen)[len(tok.decode(ids)):]  # the continuation, decoded in context
    assert r.stdout.rstrip("\n") == want
    assert "generated" in r.stderr


# ------------------------------------------------------------------ MXFP4 checkpoints (as released)

def make_mxfp4_checkpoint(out, seed: int = 5):
    """A gpt-oss checkpoint whose experts are MXFP4 ``*_blocks``/``*_scales`` (the released
    layout: [E, out, in/32, 16] and [E, out, in/32], gate/up rows interleaved), and the
    transformers model holding the same weights dequantized by transformers' own converter."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.quant.mxfp4 import MXFP4
    from engine.quant.reference import quantize

    ref = make_gpt_oss(out, seed=seed, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    tensors = load_file(str(out / "model.safetensors"))
    sd = ref.state_dict()
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):
            w = tensors.pop(p + name)  # [E, in, out]
            qs = [quantize(w[e].T.contiguous(), MXFP4) for e in range(w.shape[0])]
            blocks = torch.stack([q.parts["codes"].view(q.shape[0], -1, 16) for q in qs])
            scales = torch.stack([q.parts["scales"] for q in qs])
            tensors[p + name + "_blocks"], tensors[p + name + "_scales"] = blocks, scales
            sd[p + name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    ref.load_state_dict(sd)
    return ref


def test_mxfp4_checkpoint_loads_and_matches_transformers(tmp_path):
    ref = make_mxfp4_checkpoint(tmp_path)
    files = open_model_files(tmp_path)
    assert files.source.info("model.layers.0.mlp.experts.1.up_proj.weight").dtype == "mxfp4"
    ours = build_model(files.config, files.source)
    c = files.config
    prompt = torch.randint(3, c.vocab_size, (14,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(prompt[None]).logits[0]
    got = ours(prompt, BatchLayout.single(0, len(prompt), 0),
               ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim), all_logits=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_mxfp4_store_keeps_the_released_bytes_and_greedy_tokens(tmp_path):
    from safetensors.torch import load_file

    from engine.experts.runtime import load_from_store
    from engine.experts.tiers import align_up
    from engine.quant.formats import QuantFormat
    from engine.store.reader import ExpertStore
    from engine.store.writer import convert

    make_mxfp4_checkpoint(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "store", fmt=QuantFormat("mxfp4", 32), progress=False)
    raw = load_file(str(tmp_path / "hf" / "model.safetensors"))
    with ExpertStore(tmp_path / "store") as s:
        slot, top_k = align_up(s.expert_nbytes), s.config.moe.top_k
    files = open_model_files(tmp_path / "hf")
    model = build_model(files.config, files.source)
    sampling = SamplingConfig(max_tokens=24, ignore_eos=True)
    want = [t for t, _, _ in generate_ids(model, PROMPT, sampling)]
    for kw in (dict(), dict(device_budget=top_k * slot)):
        with load_from_store(tmp_path / "store", prefetch_depth=0, dense="fp32", **kw) as sm:
            assert [t for t, _, _ in generate_ids(sm.model, PROMPT, sampling)] == want, kw
            e = sm.cache.acquire(1, [2])[2]
            try:
                blocks = raw["model.layers.1.mlp.experts.gate_up_proj_blocks"][2]
                assert e.up.fmt.name == "mxfp4"
                assert torch.equal(e.up.parts["codes"], blocks[1::2].reshape(blocks.shape[0] // 2, -1))
                assert torch.equal(e.down.parts["scales"], raw["model.layers.1.mlp.experts.down_proj_scales"][2])
            finally:
                sm.cache.release(1, [2])


def test_info_on_the_published_gpt_oss_120b_config(tmp_path):
    """``moestream info`` on a config.json of gpt-oss-120b's shape (transformers' GptOssConfig
    defaults: 36 layers, 128 experts top-4, hidden 2880): OpenAI's model card gives 116.8B total
    and 5.1B active parameters."""
    from click.testing import CliRunner

    from engine.configio.hf import config_from_hf_dir
    from services.cli import main

    T.GptOssConfig().save_pretrained(tmp_path)
    cfg = config_from_hf_dir(tmp_path)
    counts = cfg.parameter_counts()
    assert abs(counts["total"] / 116.83e9 - 1) < 0.01 and abs(counts["active"] / 5.13e9 - 1) < 0.02
    r = CliRunner().invoke(main, ["info", str(tmp_path / "config.json")])
    assert r.exit_code == 0, r.output
    assert "gpt_oss" in r.output and "active per token 5.1" in r.output and "total 116.8" in r.output
    assert "kv cache      73.73KB per context token" in r.output  # 36 x 2 x 8 x 64 x 2 bytes


# ------------------------------------------------------------------ GGUF (llama.cpp's layout)

def write_gpt_oss_gguf(ref, path, split_max_tensors: int = 0):
    """The tiny model as llama.cpp's converter writes gpt-oss (names from gguf-py's own tensor map
    for MODEL_ARCH.GPT_OSS; experts stacked, gate/up de-interleaved, MXFP4 = GGML type 39 quantized
    by gguf-py); returns the HF state dict holding the MXFP4-dequantized expert weights."""
    import gguf
    import numpy as np

    c = ref.config
    w = gguf.GGUFWriter(path, "gpt-oss", split_max_tensors=split_max_tensors)
    w.add_block_count(c.num_hidden_layers)
    # a tiny sentencepiece-style vocabulary (the converter writes the model's own tokenizer)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, c.vocab_size)])
    w.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, c.vocab_size)])
    w.add_token_types([2, 3, 3] + [1] * (c.vocab_size - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_sliding_window(c.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(c.rope_parameters["factor"])
    w.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, c.num_hidden_layers)
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    def put(hf_name, t):
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), t.float().numpy())

    def put_mxfp4(hf_name, t):  # t [E, out, in] -> GGML MXFP4 blocks, and what they decode to
        q = gguf.quants.quantize(t.float().numpy(), gguf.GGMLQuantizationType.MXFP4)
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), q,
                     raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4)))

    for name, t in sd.items():
        if ".mlp.experts." in name:
            continue
        put(name + (".weight" if name.endswith("sinks") else ""), t)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        gu, gub = sd[p + "gate_up_proj"].transpose(1, 2), sd[p + "gate_up_proj_bias"]  # [E, 2I, H]
        gate = put_mxfp4(p + "gate_proj.weight", gu[:, 0::2])
        up = put_mxfp4(p + "up_proj.weight", gu[:, 1::2])
        down = put_mxfp4(p + "down_proj.weight", sd[p + "down_proj"].transpose(1, 2))
        put(p + "gate_proj.bias", gub[:, 0::2])
        put(p + "up_proj.bias", gub[:, 1::2])
        put(p + "down_proj.bias", sd[p + "down_proj_bias"])
        fused = torch.empty_like(gu)
        fused[:, 0::2], fused[:, 1::2] = gate, up
        sd[p + "gate_up_proj"], sd[p + "down_proj"] = fused.transpose(1, 2), down.transpose(1, 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


@pytest.mark.parametrize("split", [0, 7])
def test_gguf_with_mxfp4_experts_matches_transformers(tmp_path, split):
    ref = make_gpt_oss(tmp_path / "hf", seed=4, rope_parameters={**YARN, "factor": 32.0,
                                                                 "original_max_position_embeddings": 4096})
    sd = write_gpt_oss_gguf(ref, tmp_path / "m.gguf", split_max_tensors=split)
    ref.load_state_dict(sd)
    shards = sorted(p.name for p in tmp_path.glob("*.gguf"))
    first = tmp_path / shards[0]
    assert (len(shards) > 2) == bool(split) and (not split or first.name.endswith("-00001-of-%05d.gguf" % len(shards)))
    files = open_model_files(first)
    c = files.config
    assert c.arch == "gpt_oss" and files.source.info("model.layers.1.mlp.experts.3.up_proj.weight").dtype == "mxfp4"
    ours = build_model(c, files.source)
    prompt = torch.randint(3, c.vocab_size, (14,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(prompt[None]).logits[0]
    got = ours(prompt, BatchLayout.single(0, len(prompt), 0),
               ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim), all_logits=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_gguf_mxfp4_experts_go_into_an_mxfp4_store_unchanged(tmp_path):
    from engine.experts.runtime import load_from_store
    from engine.quant.formats import QuantFormat
    from engine.quant.reference import dequantize
    from engine.store.writer import convert

    ref = make_gpt_oss(tmp_path / "hf", seed=6)
    write_gpt_oss_gguf(ref, tmp_path / "m.gguf")
    convert(tmp_path / "m.gguf", tmp_path / "store", fmt=QuantFormat("mxfp4", 32), progress=False)
    files = open_model_files(tmp_path / "m.gguf")
    model = build_model(files.config, files.source)
    sampling = SamplingConfig(max_tokens=16, ignore_eos=True)
    want = [t for t, _, _ in generate_ids(model, PROMPT, sampling)]
    with load_from_store(tmp_path / "store", prefetch_depth=0, dense="fp32") as sm:
        assert [t for t, _, _ in generate_ids(sm.model, PROMPT, sampling)] == want
        e = sm.cache.acquire(0, [1])[1]
        try:
            assert torch.equal(dequantize(e.gate), files.source.get("model.layers.0.mlp.experts.1.gate_proj.weight"))
        finally:
            sm.cache.release(0, [1])
