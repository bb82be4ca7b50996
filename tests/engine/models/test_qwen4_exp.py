"""Qwen4-Exp (Qwen4ExpForConditionalGeneration / Qwen4ExpForCausalLM) against transformers on tiny
random checkpoints: logits within 1e-4 over 120 positions and 32 greedy tokens identical on the
three CASES (PLE on 0/1/2 layers, n-gram 2/3, hc 2/4, three budgets and ratios, contexts far past
the budgets: selection checked to drop blocks); the n-gram hashing; chunked prefill, decode and
batches equal one forward; speculative keep and snapshot/restore of every per-sequence state;
sharded bf16 and block-FP8 checkpoints; each malformed config or tensor refused with a typed
error (and each config refused by transformers too)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from engine.configio.hf import config_from_hf_dict
from engine.configio.plain import config_from_dict
from engine.errors import ModelFormatError
from engine.executor import executor_for
from engine.kv.base import BatchLayout, ContiguousKVCache
from engine.kv.state import HybridKVCache
from engine.loading import open_model_files
from engine.models.load import build_model
from engine.models.qwen4_exp.ngram import ngram_hash, ngram_row_ids
from engine.models.qwen4_exp.qsa_reference import QSAIndexer
from tests.engine.models.qwen4_exp_tiny import CASES, make_qwen4_exp, make_qwen4_exp_text, prompt, text_config
from tests.engine.models.test_qwen3_5_moe import write_fp8_and_dequantized
from tests.engine.models.test_qwen3_next import check_against_transformers


def _kv(cfg) -> ContiguousKVCache:
    return ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def _load(path):
    files = open_model_files(path)
    return build_model(files.config, files.source)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, case, monkeypatch):
    ref = make_qwen4_exp(tmp_path, seed=len(case), case=case)
    ours = _load(tmp_path)
    cfg, a = ours.config, ours.config.arch_params
    tc = ref.config.text_config
    assert cfg.arch == "qwen4_exp" and a.hc_count == tc.hc_count and a.ngram_size == tc.ngram_size
    assert [i + 1 for i in a.ple_layers] == tc.ple_layer_ids
    assert (a.indexer_budget, a.indexer_ratio) == (tc.indexer_budget, tc.indexer_compress_ratio)
    dropped = []
    real_select = QSAIndexer.select

    def spy(self, q, raw, ctx, cos_of):
        mask = real_select(self, q, raw, ctx, cos_of)
        seen = torch.arange(ctx + 1, ctx + 1 + q.shape[0])
        blocks = seen // self.ratio
        want = torch.where(blocks > self.block_topk, self.block_topk * self.ratio + seen - blocks * self.ratio, seen)
        assert torch.equal(mask.sum(-1), want)  # top-k whole blocks plus the tail, or everything
        dropped.append(int((want < seen).sum()))
        return mask

    monkeypatch.setattr(QSAIndexer, "select", spy)
    check_against_transformers(ref, ours, torch.tensor(prompt(cfg.vocab_size, 120)), atol=1e-4)
    assert sum(dropped) > 100  # selection really left blocks out


def test_text_only_causal_lm_matches_transformers(tmp_path):
    ref = make_qwen4_exp_text(tmp_path, seed=5, case="ple2_ng3_hc2", tie_word_embeddings=True)
    ours = _load(tmp_path)
    assert ours.config.tie_word_embeddings
    check_against_transformers(ref, ours, torch.tensor(prompt(96, 110, seed=4)), atol=1e-4)


@pytest.mark.parametrize("n,heads,layer", [(3, 2, 0), (3, 2, 1), (2, 3, 1), (4, 2, 2)])
def test_ngram_rows_equal_transformers_whole_and_incremental(n, heads, layer):
    """Row ids (hash, primes, offsets, eos cuts) equal what transformers' embedding looks up,
    for the whole sequence and fed 7 tokens at a time with the carried context."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    tc = T.Qwen4ExpTextConfig(**text_config(ple_layer_ids=[1, 2, 3], ngram_size=n, heads_per_ngram=heads,
                                            ple_embed_dim=12 * heads * (n - 1)))
    emb = Qwen4ExpTextNGramEmbedding(tc, 12 * heads * (n - 1), layer, layer)
    looked_up = {}
    emb.ngram_embedding.register_forward_hook(lambda m, i, o: looked_up.setdefault("ids", i[0]))
    ids = torch.randint(0, 6, (1, 60), generator=torch.Generator().manual_seed(n + layer))  # many eos (2)
    emb(ids, None)
    h = ngram_hash(vocab_size=96, ngram_size=n, heads_per_ngram=heads, vocab_base=50, divisor=8, seed=1234,
                   ple_layer_index=layer, eos=2)
    assert h.num_rows == emb.ngram_embedding.num_embeddings
    whole = ngram_row_ids(torch.full((n - 1,), 2), ids[0], h)
    assert torch.equal(whole, looked_up["ids"][0])
    ctx, parts = torch.full((n - 1,), 2), []
    for a in range(0, 60, 7):
        parts.append(ngram_row_ids(ctx, ids[0, a:a + 7], h))
        ctx = torch.cat((ctx, ids[0, a:a + 7]))[-(n - 1):]
    assert torch.equal(torch.cat(parts), whole)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen4_exp")
    make_qwen4_exp(path, seed=11, case="ple2_ng3_hc2")
    return _load(path)


def test_chunked_prefill_decode_and_batches_equal_one_forward(tiny):
    """Prefill in pieces and single tokens (PLE windows, n-gram context, DeltaNet state and index
    keys carried), and three sequences in one batch: the logits of one full forward."""
    model, cfg = tiny, tiny.config
    tokens = torch.tensor(prompt(96, 100, seed=8))
    full = model(tokens, BatchLayout.single(0, 100, 0), _kv(cfg), all_logits=True)
    kv, parts = _kv(cfg), []
    for start, n in ((0, 2), (2, 1), (3, 50), (53, 1), (54, 46)):
        parts.append(model(tokens[start:start + n], BatchLayout.single(0, n, start), kv, all_logits=True))
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=1e-5)
    seqs = [torch.tensor(prompt(96, n, seed=n)) for n in (5, 70, 1)]
    alone = [model(s, BatchLayout.single(0, len(s), 0), _kv(cfg))[0] for s in seqs]
    layout = BatchLayout((10, 11, 12), tuple(len(s) for s in seqs), (0, 0, 0))
    torch.testing.assert_close(model(torch.cat(seqs), layout, _kv(cfg)), torch.stack(alone), atol=1e-5, rtol=1e-5)


def test_speculative_keep_and_snapshot_restore_every_state(tiny):
    """A verify forward of [last, d1..d4] then keep(ctx + 2): the next step's logits equal those of
    a sequence fed the accepted tokens directly (DeltaNet, PLE conv and n-gram context all back
    at that position); a snapshot restored after more tokens gives the same again."""
    model, cfg = tiny, tiny.config
    toks = torch.tensor(prompt(96, 40, seed=2))
    drafts = torch.tensor([2, 7, 9, 11, 13])  # starts with eos: the n-gram cut must roll back too
    kv = HybridKVCache(cfg, 64, 2, 4, torch.float32)
    model(toks, BatchLayout.single(0, 40, 0), kv)
    model(drafts, BatchLayout.single(0, 5, 40), kv, rows=[0, 1, 2, 3, 4])
    kv.keep(0, 42)
    nxt = torch.tensor([17])
    got = model(nxt, BatchLayout.single(0, 1, 42), kv)
    direct = HybridKVCache(cfg, 64, 2, 4, torch.float32)
    want = model(torch.cat((toks, drafts[:2], nxt)), BatchLayout.single(1, 43, 0), direct)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    snap = kv.snapshot(0)
    model(torch.tensor([5, 6]), BatchLayout.single(0, 2, 43), kv)
    kv.restore(0, snap)
    again = model(torch.tensor([21]), BatchLayout.single(0, 1, 43), kv)
    want2 = model(torch.tensor([21]), BatchLayout.single(1, 1, 43), direct)
    torch.testing.assert_close(again, want2, atol=1e-5, rtol=1e-5)


def test_executor_runs_the_torch_layers_explicitly(tiny):
    """No native step is built (hyper-connections replace the residual the native blocks fuse):
    the executor runs the torch layers, with the model's own logits."""
    ex = executor_for(tiny)
    assert ex.native() is None
    toks = torch.tensor(prompt(96, 30, seed=6))
    want = tiny(toks, BatchLayout.single(0, 30, 0), _kv(tiny.config), all_logits=True)
    got = ex(toks, BatchLayout.single(0, 30, 0), _kv(tiny.config), all_logits=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_config_round_trips_through_the_manifest_dict(tiny):
    assert config_from_dict(json.loads(json.dumps(tiny.config.to_dict()))) == tiny.config


def test_sharded_bf16_checkpoint_without_vision_tower(tmp_path):
    """bf16 shards with an index (the PLE shards spread over files), no vision tower: equal to
    transformers holding the same bf16-rounded values."""
    ref = make_qwen4_exp(tmp_path, seed=4, case="ple1_ng2_hc4", vision=False, max_shard_size="20KB",
                         dtype=torch.bfloat16)
    files = open_model_files(tmp_path)
    assert len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    assert "model.layers.1.ple.ngram.shard_3" in files.source.names()
    ours = build_model(files.config, files.source)
    toks = torch.tensor(prompt(96, 100))
    with torch.no_grad():
        want = ref(toks[None]).logits[0]
    got = ours(toks, BatchLayout.single(0, 100, 0), _kv(files.config), all_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_block_fp8_checkpoint_loads_as_its_dequantized_values(tmp_path):
    """Block-FP8 (F8_E4M3 + weight_scale_inv per 128 x 128) projections and PLE shards: each
    canonical tensor equals its dequantized values and the logits equal a fp32 copy of them."""
    make_qwen4_exp(tmp_path / "fp32", seed=6, case="ple2_ng3_hc2")
    write_fp8_and_dequantized(tmp_path, lambda n: ("_proj" in n or "ngram_embedding" in n) and "visual" not in n)
    a, b = open_model_files(tmp_path / "fp8"), open_model_files(tmp_path / "deq")
    assert a.source.names() == b.source.names()
    assert a.source.info("model.layers.0.ple.ngram.shard_0").dtype == "f8_e4m3"
    for n in a.source.names():
        torch.testing.assert_close(a.source.get(n).float(), b.source.get(n).float(), atol=0, rtol=0)
    toks = torch.tensor(prompt(96, 60))
    la, lb = (build_model(f.config, f.source)(toks, BatchLayout.single(0, 60, 0), _kv(f.config), all_logits=True)
              for f in (a, b))
    torch.testing.assert_close(la, lb, atol=0, rtol=0)


# text_config changes -> the message of the ModelFormatError (transformers refuses each as well)
BAD_CONFIGS = {
    "layer type": (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "unsupported Qwen4-Exp layer"),
    "output gate": (dict(output_gate_type="gelu"), "output gate activation"),
    "one stream": (dict(hc_count=1), "hc_count > 1"),
    "partial QSA": (dict(indexer_budget=None), "QSA config is missing"),
    "zero QSA value": (dict(indexer_head_dim=0), "must be positive"),
    "two index key heads": (dict(indexer_kv_heads=2), "indexer_kv_heads=1"),
    "budget not divisible": (dict(indexer_budget=10), "divisible by indexer_compress_ratio"),
    "rope wider than index head": (dict(indexer_head_dim=4), "must fit the QSA index head"),
    "ple dim not divisible": (dict(ple_embed_dim=15), "divisible by the"),
    "ple layer out of range": (dict(ple_layer_ids=[9]), "1-based ids"),
    "ple on attention": (dict(ple_layer_ids=[4]), "linear_attention layers only"),
    "ple without eos": (dict(eos_token_id=None), "eos_token_id must be set"),
}


@pytest.mark.parametrize("bad", list(BAD_CONFIGS))
def test_malformed_config_is_refused(bad):
    change, message = BAD_CONFIGS[bad]
    tc = text_config(**change)
    with pytest.raises(Exception):  # the reference's config class refuses it too
        T.Qwen4ExpTextConfig(**tc)
    raw = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp", "text_config": tc}
    with pytest.raises(ModelFormatError, match=message):
        config_from_hf_dict(raw, source="config.json")


@pytest.mark.parametrize("tensor,shape,message", [
    ("model.language_model.layers.1.attn_hyper_connection.input_mix_weight_down.weight", (8, 63), "shape"),
    ("model.language_model.hyper_connection_mixer.input_mix_weight_up.weight", (32, 8), "shape"),
    ("model.language_model.layers.0.ple.ple_embedding.ngram_embedding.shard_3.weight", (59, 4), "shape"),
])
def test_tensor_of_the_wrong_shape_is_refused(tmp_path, tensor, shape, message):
    """hc weights of the wrong width, a PLE table shorter than its declared vocabulary."""
    make_qwen4_exp(tmp_path, seed=1, case="ple2_ng3_hc2")
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    assert tensor in tensors
    tensors[tensor] = torch.zeros(shape)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=message):
        open_model_files(tmp_path)


def test_missing_ple_shard_is_refused(tmp_path):
    make_qwen4_exp(tmp_path, seed=1, case="ple2_ng3_hc2")
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match="ngram.shard_3"):
        open_model_files(tmp_path)


def test_mtp_drafter_is_refused(tiny, tmp_path):
    """No MTP drafter for Qwen4-Exp (no reference to check one against): a typed error, before
    the checkpoint is read."""
    from engine.errors import ConfigError
    from engine.models.qwen3_5_moe.mtp_draft import mtp_speculative_config

    make_qwen4_exp(tmp_path, seed=1, case="ple0_ng3_hc4")
    with pytest.raises(ConfigError, match="speculative mtp` is not supported"):
        mtp_speculative_config(tiny, tmp_path)


def test_table_in_twelve_shards_of_unequal_rows(tmp_path):
    """12 shards (names sort shard_10 before shard_2; the last shard shorter): the rows come in
    numeric shard order, as transformers writes and reads them."""
    ref = make_qwen4_exp(tmp_path, seed=2, case="ple2_ng3_hc2", split_ngram_parts=12,
                         make_ngram_vocab_size_divisible_by=7)
    files = open_model_files(tmp_path)
    shapes = [files.source.info(f"model.layers.0.ple.ngram.shard_{k}").shape[0] for k in range(12)]
    assert len(set(shapes)) == 2 and shapes[-1] < shapes[0]
    ours = build_model(files.config, files.source)
    toks = torch.tensor(prompt(96, 80))
    with torch.no_grad():
        want = ref(toks[None]).logits[0]
    got = ours(toks, BatchLayout.single(0, 80, 0), _kv(files.config), all_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
