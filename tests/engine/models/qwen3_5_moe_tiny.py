"""Tiny random Qwen3.5/3.6 MoE checkpoints in the vision-language layout
(`Qwen3_5MoeForConditionalGeneration`, transformers' own class, saved with save_pretrained).

The text model lives under `model.language_model.*`, the vision tower under `model.visual.*`,
the head at `lm_head` (absent on disk when tied); the text config is nested in `text_config`."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import transformers as T
from safetensors.torch import load_file, save_file

# The smallest vision tower transformers builds: one block, width 16, 2x2 patches, no spatial
# merge. It only has to exist on disk (the engine never reads it).
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=2,
                   spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)


def text_config(vocab: int = 96, **overrides) -> dict:
    """The nested text_config of a tiny model. rope: head_dim 16, partial factor 0.5 -> rotary
    dim 8, so mrope_section sums to 4 (half the rotary dim, the reference's convention)."""
    kw = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=16, shared_expert_intermediate_size=24,
              bos_token_id=1, eos_token_id=2, pad_token_id=0,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                   partial_rotary_factor=0.5, mrope_section=[2, 1, 1],
                                   mrope_interleaved=True))
    kw.update(overrides)
    return kw


def make_qwen3_5_moe(out: Path, seed: int = 0, vocab: int = 96, *, tied: bool = False,
                     full_attention_interval: int | None = None, vision: bool = True,
                     max_shard_size: str | None = None, dtype: torch.dtype = torch.float32,
                     **text_overrides) -> T.Qwen3_5MoeForConditionalGeneration:
    """save_pretrained a random Qwen3.5-MoE VLM; returns the transformers model (fp32, eval).

    tied: lm_head shares embed_tokens (not written to disk). full_attention_interval: every n-th
    layer is full attention (else pass layer_types= in text_overrides; transformers' default is 4).
    vision=False deletes `model.visual.*` from the written shards (config keeps its
    vision_config, as transformers needs one; it loads such a checkpoint with a missing-keys
    warning). max_shard_size: write sharded safetensors with an index. dtype: on-disk dtype
    (the returned model stays fp32, holding the values as written, e.g. bf16-rounded).
    Every weight is perturbed so that a wrongly loaded norm, gate or decay changes the logits."""
    if full_attention_interval is not None:
        text_overrides.setdefault("full_attention_interval", full_attention_interval)
    tc = text_config(vocab, tie_word_embeddings=tied, **text_overrides)
    cfg = T.Qwen3_5MoeConfig(text_config=tc, vision_config=dict(TINY_VISION, out_hidden_size=tc["hidden_size"]),
                             tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = T.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if name.endswith(("A_log", "dt_bias")) else 0.05))
    save_vlm(model, out, dtype, max_shard_size, vision)
    return model


def save_vlm(model: torch.nn.Module, out: Path, dtype: torch.dtype, max_shard_size: str | None,
             vision: bool) -> None:
    """save_pretrained a VLM in ``dtype`` (the fp32 model then holds the values as written),
    sharded when ``max_shard_size`` is given, without `model.visual.*` unless ``vision``."""
    if dtype != torch.float32:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
    out = Path(out)
    kw = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
    # A copy is cast, not the model: casting would also round its rope inv_freq buffers.
    (copy.deepcopy(model).to(dtype) if dtype != torch.float32 else model).save_pretrained(out, **kw)
    if not vision:
        drop_vision(out)


def shard_files(out: Path) -> list[Path]:
    index = out / "model.safetensors.index.json"
    if index.exists():
        return sorted({out / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [out / "model.safetensors"]


def drop_vision(out: Path) -> None:
    """Rewrite every shard without `model.visual.*` (and the index without them)."""
    for f in shard_files(out):
        tensors = load_file(f)
        save_file({k: v for k, v in tensors.items() if not k.startswith("model.visual.")}, f,
                  metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items()
                              if not k.startswith("model.visual.")}
        index.write_text(json.dumps(data, indent=2))


def add_mtp(out: Path, seed: int) -> None:
    """Write a random MTP head into the checkpoint as the published ones carry it (``mtp.*``: fc,
    the two pre-fc norms, one full-attention MoE block, its final norm) and declare it in
    text_config.mtp_num_hidden_layers; transformers ignores both."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    tc = cfg["text_config"]
    tc["mtp_num_hidden_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2))
    h, hd, e = tc["hidden_size"], tc["head_dim"], tc["num_experts"]
    qh, kvh, i, si = tc["num_attention_heads"], tc["num_key_value_heads"], tc["moe_intermediate_size"], \
        tc["shared_expert_intermediate_size"]
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (h, 2 * h), "pre_fc_norm_embedding.weight": (h,), "pre_fc_norm_hidden.weight": (h,),
              "norm.weight": (h,), "layers.0.input_layernorm.weight": (h,),
              "layers.0.post_attention_layernorm.weight": (h,),
              "layers.0.self_attn.q_proj.weight": (2 * qh * hd, h), "layers.0.self_attn.k_proj.weight": (kvh * hd, h),
              "layers.0.self_attn.v_proj.weight": (kvh * hd, h), "layers.0.self_attn.o_proj.weight": (h, qh * hd),
              "layers.0.self_attn.q_norm.weight": (hd,), "layers.0.self_attn.k_norm.weight": (hd,),
              "layers.0.mlp.gate.weight": (e, h), "layers.0.mlp.shared_expert_gate.weight": (1, h),
              "layers.0.mlp.shared_expert.gate_proj.weight": (si, h),
              "layers.0.mlp.shared_expert.up_proj.weight": (si, h),
              "layers.0.mlp.shared_expert.down_proj.weight": (h, si)}
    for j in range(e):
        shapes.update({f"layers.0.mlp.experts.{j}.gate_proj.weight": (i, h),
                       f"layers.0.mlp.experts.{j}.up_proj.weight": (i, h),
                       f"layers.0.mlp.experts.{j}.down_proj.weight": (h, i)})
    tensors = load_file(out / "model.safetensors")
    tensors.update({f"mtp.{k}": torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
