"""DeepSeek-V3 against transformers on tiny random checkpoints (group settings, dense first
layers, with and without shared experts, q LoRA or not, YaRN with mscale), MLA's absorbed form
against the expanded one, block-FP8 checkpoints, an int4 store (minimal cache vs full
residency), the batching engine, and ``info`` on the published 671B shape."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as T

from engine.generate import generate_ids
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.layers.sampler import SamplingConfig
from engine.loading import open_model_files
from engine.models.load import build_model

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
            n_shared_experts=1, routed_scaling_factor=2.5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}


def make_deepseek(out, seed: int = 0, **overrides):
    kw = {**BASE, **overrides}
    torch.manual_seed(seed)
    model = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for layer in model.model.layers:  # a selection bias that changes the picks
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(kw["n_routed_experts"]) * 0.1)
    model.save_pretrained(out)
    return model


CASES = [
    {},
    dict(n_group=1, topk_group=1, n_shared_experts=0, first_k_dense_replace=0),
    dict(n_routed_experts=16, n_group=8, topk_group=3, num_experts_per_tok=3, first_k_dense_replace=2,
         q_lora_rank=None),
    dict(rope_parameters=YARN, rope_interleave=False, norm_topk_prob=False, n_shared_experts=2),
    dict(rope_parameters=YARN, num_attention_heads=2, kv_lora_rank=12, qk_rope_head_dim=6, attention_bias=True),
]


def ours_and_logits(path, prompt):
    files = open_model_files(path)
    model = build_model(files.config, files.source)
    c = files.config
    kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim)
    return model, model(prompt, BatchLayout.single(0, len(prompt), 0), kv, all_logits=True)


@pytest.mark.parametrize("overrides", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_logits_and_greedy_tokens_match_transformers(tmp_path, overrides):
    ref = make_deepseek(tmp_path, seed=len(overrides), **overrides)
    prompt = torch.randint(3, 96, (13,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(prompt[None]).logits[0]
    ours, got = ours_and_logits(tmp_path, prompt)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)

    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        hf = ref.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=32, do_sample=False)[0, len(prompt):]
    mine = [t for t, _, _ in generate_ids(ours, prompt.tolist(), SamplingConfig(max_tokens=32, ignore_eos=True))]
    assert mine == hf.tolist()


def test_mla_absorbed_equals_expanded(tmp_path):
    make_deepseek(tmp_path, seed=9, rope_parameters=YARN)
    files = open_model_files(tmp_path)
    model = build_model(files.config, files.source)
    c = files.config
    tokens = torch.randint(0, 96, (18,), generator=torch.Generator().manual_seed(4))

    def run(mode):
        for layer in model.model.layers:
            layer.self_attn.mode = mode
        kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim)
        first = model(tokens[:10], BatchLayout.single(0, 10, 0), kv, all_logits=True)
        rest = [model(tokens[i:i + 1], BatchLayout.single(0, 1, i), kv, all_logits=True) for i in range(10, 18)]
        return torch.cat([first, *rest])

    expanded, absorbed = run("expanded"), run("absorbed")
    torch.testing.assert_close(absorbed, expanded, atol=1e-4, rtol=1e-4)
    assert not torch.equal(absorbed, expanded)  # really two computations


@torch.no_grad()
def test_routing_groups_and_correction_bias():
    """The router against a direct loop: groups scored by their two best biased scores, only
    topk_group groups eligible, weights from the unbiased sigmoid, normalised and scaled."""
    from engine.layers.routing import GroupLimitedSigmoidRouter

    g = torch.Generator().manual_seed(0)
    r = GroupLimitedSigmoidRouter(16, 12, 3, n_group=4, topk_group=2, normalize=True, scaling=2.5)
    r.weight.data = torch.randn(12, 16, generator=g)
    r.e_score_correction_bias.copy_(torch.randn(12, generator=g))
    x = torch.randn(20, 16, generator=g)
    out = r(x)
    for t in range(20):
        s = torch.sigmoid(x[t] @ r.weight.T)
        b = s + r.e_score_correction_bias
        group_score = [sorted(b[3 * i:3 * i + 3].tolist())[-2:] for i in range(4)]
        keep = sorted(range(4), key=lambda i: -sum(group_score[i]))[:2]
        cand = [e for e in range(12) if e // 3 in keep]
        picks = sorted(cand, key=lambda e: -float(b[e]))[:3]
        assert sorted(out.ids[t].tolist()) == sorted(picks)
        w = s[out.ids[t]] / s[out.ids[t]].sum() * 2.5
        torch.testing.assert_close(out.weights[t], w)


def test_block_fp8_checkpoint_is_dequantized_per_128_block(tmp_path):
    """Released DeepSeek weights are F8_E4M3 with weight_scale_inv per 128x128 block; loading
    multiplies each block by its scale (dense width 160: two row blocks, two column blocks)."""
    from safetensors.torch import load_file, save_file

    ref = make_deepseek(tmp_path, seed=2, intermediate_size=160)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    sd = ref.state_dict()
    g = torch.Generator().manual_seed(3)
    for name in list(tensors):
        if not name.endswith("proj.weight") or tensors[name].dim() != 2:
            continue
        w = tensors.pop(name)
        blocks = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        scale = torch.rand(blocks, generator=g) * 0.02 + 0.01
        full = scale.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
        fp8 = (w / full).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = fp8, scale
        meant = fp8.float() * full  # what the checkpoint means
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m is None:
            sd[name] = meant
        elif m.group(3) == "down":  # transformers holds the experts fused: down_proj [E, H, I]
            sd[m.group(1) + ".down_proj"][int(m.group(2))] = meant
        else:  # gate_up_proj [E, 2I, H]: gate rows, then up rows
            rows = meant.shape[0]
            lo = 0 if m.group(3) == "gate" else rows
            sd[m.group(1) + ".gate_up_proj"][int(m.group(2)), lo:lo + rows] = meant
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ref.load_state_dict(sd)
    files = open_model_files(tmp_path)
    assert files.source.info("model.layers.0.mlp.gate_proj.weight").dtype == "f8_e4m3"
    prompt = torch.randint(3, 96, (11,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(prompt[None]).logits[0]
    _, got = ours_and_logits(tmp_path, prompt)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------ store, engine, info

@pytest.fixture(scope="module")
def int4_store(tmp_path_factory):
    from engine.quant.formats import QuantFormat
    from engine.store.writer import convert

    d = tmp_path_factory.mktemp("deepseek_store")
    make_deepseek(d / "hf", seed=7, moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=32)
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
        assert sm.model.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0
    with ExpertStore(int4_store) as s:
        slot, top_k = align_up(s.expert_nbytes), s.config.moe.top_k
    for kw in (dict(device_budget=top_k * slot, prefetch_depth=1),
               dict(device_budget=top_k * slot, prefetch_depth=0, miss_compute="cpu")):
        with load_from_store(int4_store, **kw) as sm:
            assert [t for t, _, _ in generate_ids(sm.model, PROMPT, sampling)] == want, kw
            assert sm.cache.metrics.total().misses > 0
            sm.cache.drain()
            assert sm.cache.pins == {}


def test_eight_concurrent_requests_equal_each_alone(int4_store):
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
        kv = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 64, 4, torch.float32)
        assert kv.storage.shape[-2:] == (1, 20)  # the latent (32 + 8) in two halves, nothing else
        engine = Engine(sm.model, kv=kv, config=SchedulerConfig(max_num_batched_tokens=16))
        results = engine.generate(reqs)
        assert [r.output_ids for r in results] == alone
        assert engine.metrics().kv.blocks_used == 0


def test_info_on_the_published_deepseek_v3_config(tmp_path):
    """DeepSeek-V3's shape (transformers' DeepseekV3Config defaults: 61 layers, 256 experts top-8,
    1 shared, MLA 512 + 64): 671B total, 37B active (the model card, without the 14B MTP module)."""
    from click.testing import CliRunner

    from engine.configio.hf import config_from_hf_dir
    from engine.models.deepseek_v3.config import mla_kv_bytes_per_token
    from services.cli import main

    T.DeepseekV3Config().save_pretrained(tmp_path)
    cfg = config_from_hf_dir(tmp_path)
    counts = cfg.parameter_counts()
    assert abs(counts["total"] / 671e9 - 1) < 0.01 and abs(counts["active"] / 37e9 - 1) < 0.03
    kvb = mla_kv_bytes_per_token(cfg)
    assert kvb == {"mla": 61 * 576 * 2, "standard": 61 * 128 * (128 + 64 + 128) * 2}
    r = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "deepseek_v3" in r.output and "total 671" in r.output
    assert "kv cache      70.27KB per context token" in r.output  # 61 x 576 x 2 bytes
    assert "would cache 4997.12KB per token, 71.1x" in r.output


def test_generate_command_gives_the_greedy_tokens_of_transformers(tmp_path):
    from click.testing import CliRunner

    from services.cli import main
    from tests.engine.models.hf_tiny import add_mixtral_tokenizer

    ref = make_deepseek(tmp_path, seed=11, vocab_size=32000, rope_parameters=YARN)
    add_mixtral_tokenizer(tmp_path)
    tok = open_model_files(tmp_path).tokenizer()
    text = "The capital of France is a city that"
    ids = tok.encode(text)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    r = CliRunner().invoke(main, ["generate", "--model", str(tmp_path), "--dense", "fp32", "--max-tokens", "32", text])
    assert r.exit_code == 0, r.output
    gen = hf[:hf.index(2)] if 2 in hf else hf  # generate stops at EOS
    want = tok.decode(ids + gen)[len(tok.decode(ids)):]  # the continuation, decoded in context
    assert r.stdout.rstrip("\n") == want
    assert "generated" in r.stderr


# ------------------------------------------------------------------ GGUF (llama.cpp's layout)

def write_deepseek_gguf(ref, path, split_kv_b: bool = True, split_max_tensors: int = 0):
    """The tiny model as llama.cpp's converter writes deepseek2 (names from gguf-py's own tensor
    map for MODEL_ARCH.DEEPSEEK2; MLA as MQA; kv_b split into k_b (transposed) and v_b unless
    ``split_kv_b`` is False, as older files have it; experts stacked)."""
    import gguf

    c = ref.config
    w = gguf.GGUFWriter(path, "deepseek2", split_max_tensors=split_max_tensors)
    w.add_block_count(c.num_hidden_layers)
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    if c.q_lora_rank:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    rp = c.rope_parameters
    if rp.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, c.num_hidden_layers)

    def put(hf_name, t):
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), t.detach().float().numpy())

    nh, dn, dv = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    for name, t in ref.state_dict().items():
        if name.endswith("e_score_correction_bias"):
            put(name.replace("e_score_correction_bias", "e_score_correction.bias"), t)
        elif name.endswith("mlp.experts.gate_up_proj"):
            i = c.moe_intermediate_size
            put(name.replace("gate_up_proj", "gate_proj.weight"), t[:, :i])
            put(name.replace("gate_up_proj", "up_proj.weight"), t[:, i:])
        elif name.endswith("mlp.experts.down_proj"):
            put(name + ".weight", t)
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            k_b, v_b = t.view(nh, dn + dv, -1).split([dn, dv], dim=1)
            put(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2))
            put(name.replace("kv_b_proj", "v_b_proj"), v_b)
        else:
            put(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", [dict(), dict(split_kv_b=False, split_max_tensors=9, q_lora_rank=None,
                                                 rope_parameters=YARN)])
def test_gguf_matches_transformers(tmp_path, case):
    case = dict(case)
    split_kv_b, split = case.pop("split_kv_b", True), case.pop("split_max_tensors", 0)
    ref = make_deepseek(tmp_path / "hf", seed=8, **case)
    write_deepseek_gguf(ref, tmp_path / "m.gguf", split_kv_b, split)
    first = tmp_path / sorted(p.name for p in tmp_path.glob("*.gguf"))[0]
    files = open_model_files(first)
    assert files.config.arch == "deepseek_v3" and files.config.arch_params == open_model_files(tmp_path / "hf").config.arch_params
    prompt = torch.randint(3, 96, (13,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(prompt[None]).logits[0]
    model = build_model(files.config, files.source)
    c = files.config
    got = model(prompt, BatchLayout.single(0, len(prompt), 0),
                ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim), all_logits=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
