"""engine.loading.hf + engine.loading.validate on tiny random transformers checkpoints."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file  # reference reader/writer (tests only)

from engine.errors import ModelFormatError
from engine.loading.hf import HFSource
from engine.loading.source import expert_name
from engine.loading.validate import check_source, expected_shapes

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16))


def _qwen2_moe():
    # Layer 0 dense (decoder_sparse_step=2), layer 1 sparse with a gated shared expert; qkv bias.
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, intermediate_size=40, decoder_sparse_step=2))


def _qwen3_moe():
    # Layer 0 dense via mlp_only_layers; q/k norm. transformers 5 writes the expert count as
    # ``num_local_experts`` (Hub checkpoints say ``num_experts``); engine.config takes both.
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        intermediate_size=40, mlp_only_layers=[0]))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, intermediate_size=48, tie_word_embeddings=True))


MAKERS = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "llama": _llama}


def canonical_params(model) -> dict[str, torch.Tensor]:
    """The model's parameters under canonical names; fused [E, 2I, H] / [E, H, I] expert
    parameters split per expert (gate = rows [0, I), up = rows [I, 2I))."""
    out = {}
    for name, p in model.named_parameters():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m is None:
            out[name] = p.detach()
            continue
        layer = int(m.group(1))
        for j in range(p.shape[0]):
            if m.group(2) == "down_proj":
                out[expert_name(layer, j, "down_proj")] = p.detach()[j]
            else:
                half = p.shape[1] // 2
                out[expert_name(layer, j, "gate_proj")] = p.detach()[j, :half]
                out[expert_name(layer, j, "up_proj")] = p.detach()[j, half:]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{arch: (dir, model)} saved sharded (20 KB shards); qwen2_moe saved in bf16."""
    torch.manual_seed(0)
    out = {}
    for arch, make in MAKERS.items():
        model = make().eval()
        if arch == "qwen2_moe":
            model = model.to(torch.bfloat16)
        d = tmp_path_factory.mktemp(arch)
        model.save_pretrained(d, max_shard_size="20KB")
        out[arch] = (d, model)
    return out


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


# ---- round trips -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", list(MAKERS))
def test_sharded_round_trip(checkpoints, arch):
    d, model = checkpoints[arch]
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("model-*.safetensors"))) > 1
    ref = canonical_params(model)
    with HFSource(d) as src:
        assert src.config.arch == arch
        assert src.path == str(d)
        expected = expected_shapes(src.config)
        assert set(src.names()) == set(ref) == set(expected)
        check_source(src.config, src)
        for name in src.names():
            t = src.get(name)
            info = src.info(name)
            assert tuple(t.shape) == info.shape == expected[name], name
            assert t.dtype == ref[name].dtype, name
            assert info.dtype == {torch.float32: "f32", torch.bfloat16: "bf16"}[t.dtype]
            assert torch.equal(t, ref[name]), name


def test_tied_embeddings_have_no_lm_head(checkpoints):
    d, _ = checkpoints["llama"]
    with HFSource(d) as src:
        assert src.config.tie_word_embeddings
        assert "lm_head.weight" not in expected_shapes(src.config)


def test_expected_shapes_structure(checkpoints):
    with HFSource(checkpoints["qwen2_moe"][0]) as src:
        s = expected_shapes(src.config)
    assert s["model.layers.0.mlp.gate_proj.weight"] == (40, 32)  # dense layer 0
    assert "model.layers.0.mlp.gate.weight" not in s
    assert s["model.layers.1.mlp.gate.weight"] == (4, 32)
    assert s["model.layers.1.mlp.shared_expert.down_proj.weight"] == (32, 24)
    assert s["model.layers.1.mlp.shared_expert_gate.weight"] == (1, 32)
    assert s["model.layers.1.self_attn.k_proj.bias"] == (16,)
    assert s[expert_name(1, 3, "down_proj")] == (32, 16)
    with HFSource(checkpoints["qwen3_moe"][0]) as src:
        s = expected_shapes(src.config)
    assert s["model.layers.1.self_attn.q_norm.weight"] == (8,)
    assert "model.layers.1.self_attn.q_proj.bias" not in s
    assert "model.layers.1.mlp.shared_expert_gate.weight" not in s


@pytest.mark.parametrize("arch,legacy_prefix", [("mixtral", False), ("mixtral", True), ("qwen3_moe", False)])
def test_fused_expert_layout(checkpoints, tmp_path, arch, legacy_prefix):
    """A checkpoint holding transformers 5's in-memory fused layout (one [E, 2I, H] gate_up and
    one [E, H, I] down tensor per layer) is split into per-expert canonical tensors."""
    d, model = checkpoints[arch]
    dst = tmp_path / "fused"
    dst.mkdir()
    shutil.copy(d / "config.json", dst / "config.json")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if legacy_prefix:  # Mixtral's older module name
        sd = {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in sd.items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    save_file(sd, str(dst / "model.safetensors"))
    ref = canonical_params(model)
    with HFSource(dst) as src:
        assert set(src.names()) == set(ref)
        check_source(src.config, src)
        for name, r in ref.items():
            t = src.get(name)
            assert torch.equal(t, r), name
            assert t.is_contiguous(), name  # zero-copy slices of whole rows


def test_fused_and_per_expert_both_present_is_an_error(checkpoints, tmp_path):
    d, model = checkpoints["mixtral"]
    dst = _copy(d, tmp_path)
    # Add a fused tensor for layer 0 next to the per-expert ones already in the shards.
    extra = {"model.layers.0.mlp.experts.down_proj": model.state_dict()["model.layers.0.mlp.experts.down_proj"]}
    save_file(extra, str(dst / "extra.safetensors"))
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.0.mlp.experts.down_proj"] = "extra.safetensors"
    (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ModelFormatError, match="both map to"):
        HFSource(dst)


# ---- directory / index errors -------------------------------------------------------------

def _edit_index(dst, fn):
    p = dst / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    fn(idx["weight_map"])
    p.write_text(json.dumps(idx))


def test_index_names_missing_shard(checkpoints, tmp_path):
    dst = _copy(checkpoints["llama"][0], tmp_path)
    _edit_index(dst, lambda w: w.update({"model.norm.weight": "model-99999-of-99999.safetensors"}))
    with pytest.raises(ModelFormatError, match="does not exist") as ei:
        HFSource(dst)
    assert ei.value.path.endswith("model.safetensors.index.json")


def test_index_names_tensor_not_in_shard(checkpoints, tmp_path):
    dst = _copy(checkpoints["llama"][0], tmp_path)
    shard = sorted(dst.glob("model-*.safetensors"))[0].name
    _edit_index(dst, lambda w: w.update({"model.layers.7.mlp.up_proj.weight": shard}))
    with pytest.raises(ModelFormatError, match="not there") as ei:
        HFSource(dst)
    assert ei.value.path.endswith(shard)


@pytest.mark.parametrize("bad", ["../model.safetensors", "/etc/passwd", "", "sub/x.safetensors", 3])
def test_index_shard_name_must_be_plain(checkpoints, tmp_path, bad):
    dst = _copy(checkpoints["llama"][0], tmp_path)
    _edit_index(dst, lambda w: w.update({"model.norm.weight": bad}))
    with pytest.raises(ModelFormatError, match="invalid shard name"):
        HFSource(dst)


@pytest.mark.parametrize("text", ["{", "[]", '{"weight_map": {}}', '{"weight_map": [1]}'])
def test_bad_index_json(checkpoints, tmp_path, text):
    dst = _copy(checkpoints["llama"][0], tmp_path)
    (dst / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ModelFormatError):
        HFSource(dst)


def test_corrupt_shard_names_shard(checkpoints, tmp_path):
    dst = _copy(checkpoints["llama"][0], tmp_path)
    shard = sorted(dst.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(ModelFormatError, match="truncated") as ei:
        HFSource(dst)
    assert ei.value.path == str(shard)


@pytest.mark.parametrize("fname", ["pytorch_model.bin", "model.pt", "consolidated.00.pth"])
def test_pickle_checkpoint_refused(checkpoints, tmp_path, fname):
    dst = tmp_path / "pickled"
    dst.mkdir()
    shutil.copy(checkpoints["llama"][0] / "config.json", dst / "config.json")
    (dst / fname).write_bytes(b"\x80\x04not really a pickle")  # never opened
    with pytest.raises(ModelFormatError, match="pickle checkpoints .* refused") as ei:
        HFSource(dst)
    assert ei.value.path.endswith(fname)


def test_no_weights(checkpoints, tmp_path):
    dst = tmp_path / "empty"
    dst.mkdir()
    shutil.copy(checkpoints["llama"][0] / "config.json", dst / "config.json")
    with pytest.raises(ModelFormatError, match="no model.safetensors"):
        HFSource(dst)


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelFormatError, match="not a directory"):
        HFSource(tmp_path / "nope")


# ---- check_source --------------------------------------------------------------------------

def _set_config(dst, **changes):
    p = dst / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


def test_check_source_intermediate_size_disagrees(checkpoints, tmp_path):
    dst = _copy(checkpoints["mixtral"][0], tmp_path)
    _set_config(dst, intermediate_size=24)  # Mixtral: the experts' width; files have 16
    with HFSource(dst) as src:
        with pytest.raises(ModelFormatError) as ei:
            check_source(src.config, src)
    msg = str(ei.value)
    assert re.search(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight", msg)
    assert "24" in msg
    assert re.search(r"model-\d+-of-\d+\.safetensors", ei.value.path)  # the shard, not the dir


def test_check_source_hidden_size_disagrees(checkpoints, tmp_path):
    dst = _copy(checkpoints["qwen3_moe"][0], tmp_path)
    _set_config(dst, hidden_size=64, head_dim=8)
    with HFSource(dst) as src:
        with pytest.raises(ModelFormatError, match=r"'model\.embed_tokens\.weight' has shape \[64, 32\] "
                                                   r"but the config implies \[64, 64\]"):
            check_source(src.config, src)


def _single_file(model, dst, drop=(), change=None):
    sd = {k: v.contiguous() for k, v in canonical_params(model).items() if k not in drop}
    if change:
        sd.update(change)
    save_file(sd, str(dst / "model.safetensors"))


def test_check_source_missing_tensor(checkpoints, tmp_path):
    d, model = checkpoints["qwen2_moe"]
    dst = tmp_path / "single"
    dst.mkdir()
    shutil.copy(d / "config.json", dst / "config.json")
    _single_file(model, dst, drop={"model.layers.1.mlp.shared_expert_gate.weight"})
    with HFSource(dst) as src:
        assert "model.layers.1.mlp.shared_expert_gate.weight" not in src
        with pytest.raises(ModelFormatError, match=r"'model\.layers\.1\.mlp\.shared_expert_gate\.weight' "
                                                   r"is missing.*\[1, 32\]") as ei:
            check_source(src.config, src)
    assert ei.value.path == str(dst)


def test_check_source_unsupported_dtype_and_extra_tensors(checkpoints, tmp_path, caplog):
    d, model = checkpoints["llama"]
    dst = tmp_path / "single"
    dst.mkdir()
    shutil.copy(d / "config.json", dst / "config.json")
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}
    _single_file(model, dst, change=extra)
    with HFSource(dst) as src:
        with caplog.at_level(logging.DEBUG, logger="engine.loading.validate"):
            check_source(src.config, src)  # the extra buffer is ignored
        assert "inv_freq" in caplog.text
    _single_file(model, dst, change={"model.norm.weight": torch.ones(32, dtype=torch.float64)})
    with HFSource(dst) as src:
        with pytest.raises(ModelFormatError, match=r"'model\.norm\.weight' has unsupported dtype 'f64'") as ei:
            check_source(src.config, src)
        assert ei.value.path == str(dst / "model.safetensors")


def test_sharded_matches_reference_reader(checkpoints):
    """Cross-check our reader against the safetensors package on every shard."""
    d, _ = checkpoints["qwen3_moe"]
    from engine.loading.safetensors import SafetensorsFile

    for shard in sorted(d.glob("*.safetensors")):
        ref = load_file(str(shard))
        with SafetensorsFile(shard) as f:
            assert f.names() == sorted(ref)
            for n, t in ref.items():
                assert torch.equal(f.get(n), t)
