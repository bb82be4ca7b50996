"""Qwen3.5-MoE (Qwen3_5MoeForConditionalGeneration) against transformers on tiny random
checkpoints of the vision-language layout: logits within fp32 tolerance over a prompt longer than
two DeltaNet chunks and 32 greedy tokens identical (tied and untied head, three full-attention
layouts); sharded bf16 and block-FP8 checkpoints; the text positions' multimodal RoPE equal to
the plain partial RoPE the model runs; the vision tower and MTP head never read; malformed
configs refused."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import ModelConfig
from engine.configio.hf import config_from_hf_dict
from engine.configio.plain import config_from_dict
from engine.errors import ModelFormatError
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.loading import open_model_files
from engine.loading.safetensors import SafetensorsFile
from engine.models.load import build_model
from engine.models.qwen3_5_moe.names import merge_ba, merge_qkvz
from tests.engine.models.qwen3_5_moe_tiny import make_qwen3_5_moe, shard_files
from tests.engine.models.test_qwen3_next import check_against_transformers

CASES = {
    # untied head, full attention every 4th layer (transformers' default), top-2 of 4
    "untied-interval4": dict(),
    # tied head, full attention every 2nd layer, 1 value head per key head, top-1, 1 kv head
    "tied-interval2": dict(tied=True, full_attention_interval=2, linear_num_value_heads=2,
                           num_key_value_heads=1, num_experts_per_tok=1),
    # untied, explicit layer_types starting with full attention, 4 value heads per key head,
    # 8 experts top-4, conv kernel 3, rotary on a quarter of the head (mrope sections sum to 2)
    "untied-layer-types": dict(layer_types=["full_attention", "linear_attention", "linear_attention",
                                            "full_attention", "linear_attention"],
                               num_hidden_layers=5, linear_num_key_heads=1, linear_num_value_heads=4,
                               linear_key_head_dim=16, num_experts=8, num_experts_per_tok=4,
                               linear_conv_kernel_dim=3,
                               rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                                    partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
                                                    mrope_interleaved=True)),
}


def _kv(cfg: ModelConfig) -> ContiguousKVCache:
    return ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def _prompt(vocab: int, n: int = 150) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, case):
    kw = CASES[case]
    ref = make_qwen3_5_moe(tmp_path, seed=len(case), **kw)
    files = open_model_files(tmp_path)
    cfg = files.config
    assert cfg.arch == "qwen3_5_moe" and cfg.tie_word_embeddings == kw.get("tied", False)
    assert [cfg.is_linear_attention_layer(i) for i in range(cfg.num_layers)] == [
        t == "linear_attention" for t in ref.config.text_config.layer_types]
    ours = build_model(cfg, files.source)
    # 150 positions: two full DeltaNet chunks and a part
    check_against_transformers(ref, ours, _prompt(cfg.vocab_size), atol=1e-4)


def test_sharded_bf16_checkpoint_without_vision_tower(tmp_path):
    """bf16 shards with an index, no model.visual.* (the tower dropped): the model in fp32 equals
    transformers holding the same (bf16-rounded) values."""
    ref = make_qwen3_5_moe(tmp_path, seed=4, vision=False, max_shard_size="20KB", dtype=torch.bfloat16)
    assert len(shard_files(tmp_path)) > 2
    files = open_model_files(tmp_path)
    assert {files.source.info(n).dtype for n in files.source.names()} == {"bf16"}
    ours = build_model(files.config, files.source)
    prompt = _prompt(files.config.vocab_size, 100)
    with torch.no_grad():
        want = ref(prompt[None]).logits[0]
    got = ours(prompt, BatchLayout.single(0, 100, 0), _kv(files.config), all_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn weight, float32 scale_inv per block x block tile)."""
    out, inp = w.shape
    bo, bi = -(-out // block), -(-inp // block)
    pad = torch.zeros(bo * block, bi * block)
    pad[:out, :inp] = w
    tiles = pad.view(bo, block, bi, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(bo * block, bi * block)
    return q[:out, :inp].contiguous(), scale


def write_fp8_and_dequantized(root, selected) -> dict[str, torch.Tensor]:
    """From the checkpoint root/fp32: root/fp8 with every 2-D tensor whose name ``selected`` block-FP8
    (+ weight_scale_inv, and quantization_config in config.json), root/deq with those tensors'
    dequantized values in fp32 and the rest as they were; returns the fp8 tensors."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(root / "fp32" / "model.safetensors")
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if t.ndim == 2 and selected(name):
            q, s = _fp8_block(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = q.float() * s.repeat_interleave(128, 0)[:t.shape[0]].repeat_interleave(128, 1)[:, :t.shape[1]]
        else:
            fp8[name] = deq[name] = t
    for d, ts in (("fp8", fp8), ("deq", deq)):
        (root / d).mkdir()
        save_file(ts, root / d / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((root / "fp32" / "config.json").read_text())
        if d == "fp8":
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
        (root / d / "config.json").write_text(json.dumps(cfg))
    return fp8


def test_block_fp8_checkpoint_loads_as_its_dequantized_values(tmp_path):
    """The published FP8 layout (every 2-D projection F8_E4M3 + weight_scale_inv per 128 x 128
    block, the split DeltaNet projections included): each canonical tensor equals the dequantized
    values, and the model equals one loaded from those values written in fp32."""
    make_qwen3_5_moe(tmp_path / "fp32", seed=6, hidden_size=160)  # 160: a partial 128-block
    fp8 = write_fp8_and_dequantized(tmp_path, lambda name: "_proj" in name and name.startswith("model.language_model."))
    assert sum(n.endswith("_scale_inv") for n in fp8) > 20
    a, b = open_model_files(tmp_path / "fp8"), open_model_files(tmp_path / "deq")
    assert a.source.names() == b.source.names()
    assert a.source.info("model.layers.0.linear_attn.in_proj_qkvz.weight").dtype == "f8_e4m3"
    for n in a.source.names():
        torch.testing.assert_close(a.source.get(n).float(), b.source.get(n).float(), atol=0, rtol=0)
    prompt = _prompt(a.config.vocab_size, 70)
    la, lb = (build_model(f.config, f.source)(prompt, BatchLayout.single(0, 70, 0), _kv(f.config), all_logits=True)
              for f in (a, b))
    # the weights are bitwise equal (above); the logits to float rounding (the two builds' tensors
    # differ in storage: a matmul may split its sums differently on them)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-4)


def test_split_projections_fuse_into_qwen3_next_grouping():
    """merge_qkvz / merge_ba put key head i's q, k and its r value heads' v, z (b, a) together."""
    nk, dk, nv, dv, h = 2, 3, 6, 2, 5
    r = nv // nk
    rows = lambda n, tag: torch.stack([torch.full((h,), tag + i, dtype=torch.float32) for i in range(n)])  # noqa: E731
    qkv = torch.cat((rows(nk * dk, 100), rows(nk * dk, 200), rows(nv * dv, 300)))
    fused = merge_qkvz(qkv, rows(nv * dv, 400), nk, dk, nv, dv)[:, 0].long().tolist()
    want = []
    for i in range(nk):
        want += [100 + i * dk + j for j in range(dk)] + [200 + i * dk + j for j in range(dk)]
        want += [300 + i * r * dv + j for j in range(r * dv)] + [400 + i * r * dv + j for j in range(r * dv)]
    assert fused == want
    ba = merge_ba(rows(nv, 10), rows(nv, 20), nk, nv)[:, 0].long().tolist()
    assert ba == [10, 11, 12, 20, 21, 22, 13, 14, 15, 23, 24, 25]


def test_text_positions_multimodal_rope_equals_plain_partial_rope(tmp_path):
    """transformers' rotary of the text model, fed text positions (three equal grids, as its
    generate builds them), gives our partial RoPE tables; unequal grids (vision tokens) would not."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    ref = make_qwen3_5_moe(tmp_path, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                         partial_rotary_factor=0.75,
                                                         mrope_section=[2, 2, 2], mrope_interleaved=True))
    files = open_model_files(tmp_path)
    ours = build_model(files.config, files.source)
    assert files.config.rotary_dim == 12
    rot = Qwen3_5MoeTextRotaryEmbedding(ref.config.text_config)
    pos = torch.arange(0, 300)
    x = torch.zeros(1, 300, 16)
    cos, sin = rot(x, pos.view(1, 1, -1).expand(3, 1, -1))
    c, s = ours.rotary.cos_sin(pos)
    torch.testing.assert_close(c, cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(s, sin[0], atol=1e-6, rtol=0)
    grids = torch.stack((pos, pos // 2, pos % 7)).view(3, 1, -1)
    assert not torch.allclose(rot(x, grids)[0][0], cos[0])


def _record_reads(monkeypatch) -> dict[str, int]:
    """stored tensor name -> bytes, for every tensor a SafetensorsFile hands out."""
    read: dict[str, int] = {}
    real = SafetensorsFile.get

    def get(self, name, **kw):
        read[name] = self.nbytes(name)
        return real(self, name, **kw)
    monkeypatch.setattr(SafetensorsFile, "get", get)
    return read


def test_vision_tower_and_mtp_head_are_never_read(tmp_path, monkeypatch):
    """A checkpoint with model.visual.* and mtp.* tensors: loading, running and converting to an
    int4 store read every text tensor and no byte of the others."""
    from safetensors.torch import load_file, save_file

    from engine.quant.formats import QuantFormat
    from engine.store import convert

    make_qwen3_5_moe(tmp_path / "hf", seed=2, moe_intermediate_size=32)
    f = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(f)
    tensors["mtp.fc.weight"] = torch.randn(32, 64)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.randn(32)
    save_file(tensors, f, metadata={"format": "pt"})
    vision = {n: t.numel() * t.element_size() for n, t in tensors.items() if n.startswith(("model.visual.", "mtp."))}
    assert len(vision) > 15 and sum(vision.values()) > 4000
    read = _record_reads(monkeypatch)
    files = open_model_files(tmp_path / "hf")
    model = build_model(files.config, files.source)
    model(torch.arange(3, 20), BatchLayout.single(0, 17, 0), _kv(files.config))
    convert(tmp_path / "hf", tmp_path / "store", fmt=QuantFormat("int4", 32), progress=False)
    text = {n for n in tensors if n.startswith(("model.language_model.", "lm_head."))}
    assert set(read) == text
    assert not set(read) & set(vision)
    assert sum(read.values()) == sum(tensors[n].numel() * tensors[n].element_size() for n in text)


def _config(tmp_path) -> dict:
    make_qwen3_5_moe(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_malformed_configs_are_refused(tmp_path):
    raw = _config(tmp_path)
    text = raw.pop("text_config")
    with pytest.raises(ModelFormatError, match="'text_config' is missing"):
        config_from_hf_dict(raw)
    with pytest.raises(ModelFormatError, match="'text_config' is a list"):
        config_from_hf_dict({**raw, "text_config": [text]})
    # rotary width 8 (head_dim 16 x 0.5): 4 frequencies, [2, 1, 1] sums to them, [2, 2, 1] does not
    bad = json.loads(json.dumps(text))
    bad["rope_parameters"]["mrope_section"] = [2, 2, 1]
    with pytest.raises(ModelFormatError, match=r"mrope_section \[2, 2, 1\] sums to 5; it must cover the 4 "
                                               r"rotary frequencies \(half the rotary width 8\)"):
        config_from_hf_dict({**raw, "text_config": bad})
    bad["rope_parameters"]["mrope_section"] = [4, 0]
    with pytest.raises(ModelFormatError, match="three non-negative integers"):
        config_from_hf_dict({**raw, "text_config": bad})
    del bad["rope_parameters"]["mrope_section"]  # the reference's default [11, 11, 10] sums to 32
    with pytest.raises(ModelFormatError, match="absent: transformers' default"):
        config_from_hf_dict({**raw, "text_config": bad})
    bad["rope_parameters"].update(mrope_section=[2, 1, 1], mrope_interleaved="yes")
    with pytest.raises(ModelFormatError, match="mrope_interleaved must be a boolean"):
        config_from_hf_dict({**raw, "text_config": bad})
    # through the checkpoint directory: the error names config.json
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFormatError, match=r"config\.json: .*'text_config' is missing"):
        open_model_files(tmp_path)


def test_config_of_the_published_35b_a3b_shape():
    """transformers' Qwen3_5MoeConfig defaults are the 35B-A3B: 40 layers (every 4th full
    attention), hidden 2048, 256 experts of 512 top-8 + shared 512, mrope [11, 11, 10] over the 64
    rotary dims of 256."""
    import transformers as T

    raw = T.Qwen3_5MoeConfig().to_dict()
    raw["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    cfg = config_from_hf_dict(raw)
    assert cfg.arch == "qwen3_5_moe" and cfg.attention_layers == tuple(range(3, 40, 4))
    assert cfg.rotary_dim == 64 and cfg.arch_params.mrope_section == (11, 11, 10)
    assert cfg.moe.num_experts == 256 and cfg.moe.top_k == 8 and cfg.moe.norm_topk_prob
    assert cfg.moe.shared_expert_gate and not cfg.tie_word_embeddings and cfg.vocab_size == 248320
    assert config_from_dict(cfg.to_dict()) == cfg  # the store manifest's round trip


def test_parameter_counts_equal_the_reference_text_model(tmp_path):
    ref = make_qwen3_5_moe(tmp_path, full_attention_interval=2)
    cfg = open_model_files(tmp_path).config
    text = sum(p.numel() for n, p in ref.named_parameters() if not n.startswith("model.visual."))
    assert cfg.parameter_counts()["total"] == text
