"""What load_from_store holds beyond the expert tiers (issue 27): the dense weights are converted
tensor by tensor from the store's own tensors (never a full-precision copy of the model), by
blocks of rows, and give the same model as the full-precision path."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.quant.formats import QuantFormat, QuantizedTensor, bytes_for, layout_for
from engine.quant.reference import quantize, quantize_by_rows


@pytest.mark.parametrize("name,group", [("int8", 32), ("int4", 32), ("bf16", 32), ("nf4", 32), ("mxfp4", 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_by_rows_is_quantize_bit_for_bit(name, group, dtype):
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(50, 128, generator=g) * 0.05).to(dtype)
    fmt = QuantFormat(name, group)
    released = []  # each block of w's rows is handed back once quantized, in order
    whole, blocks = quantize(w.float(), fmt), quantize_by_rows(w, fmt, rows=7, release=released.append)
    assert blocks.shape == whole.shape and blocks.parts.keys() == whole.parts.keys()
    for k in whole.parts:
        assert torch.equal(blocks.parts[k], whole.parts[k]), k
    assert [b.shape[0] for b in released] == [7] * 7 + [1]
    assert [(b.data_ptr() - w.data_ptr()) // w.stride(0) // w.element_size() for b in released] == list(range(0, 50, 7))


@pytest.mark.parametrize("name", ["int8", "int4", "bf16", "mxfp4"])
@pytest.mark.parametrize("rows", [7, 64])  # blocks with a short last one; the whole weight in one
def test_quantize_by_rows_writes_into_a_given_place(name, rows):
    """``out``: the blocks go straight into views of a buffer (a DenseArena's), bit for bit what
    quantize gives, and that very object comes back; a place of another shape or format is refused."""
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(50, 128, generator=g) * 0.05).to(torch.bfloat16)
    fmt = QuantFormat(name, 32)
    buf = torch.full((bytes_for(w.shape, fmt) + 64,), 0xAB, dtype=torch.uint8)
    place = QuantizedTensor.from_buffer(buf, layout_for(w.shape, fmt), offset=64)
    got = quantize_by_rows(w, fmt, rows=rows, out=place)
    assert got is place
    whole = quantize(w.float(), fmt)
    for k in whole.parts:
        assert torch.equal(place.parts[k], whole.parts[k]), k
    assert (buf[:64] == 0xAB).all()  # nothing written before its place
    with pytest.raises(ConfigError, match="out is"):
        quantize_by_rows(w[:40], fmt, rows=rows, out=place)
    with pytest.raises(ConfigError, match="out is"):
        quantize_by_rows(w, QuantFormat("int8" if name != "int8" else "int4", 32), rows=rows, out=place)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from engine.store import convert
    from tests.engine.models.hf_tiny import make_checkpoint

    d = tmp_path_factory.mktemp("footprint")
    make_checkpoint("qwen3_moe", d / "hf", seed=5, hidden_size=64, num_hidden_layers=2, head_dim=16,
                    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), dense_dtype="bf16", progress=False)
    return d / "store"


def test_dense_weights_reach_the_quantizer_as_stored_not_in_float32(store, monkeypatch):
    """The quantizer sees the store's bf16 tensors themselves: a float32 copy of the model made
    before quantizing (the 1.4 GB peak of issue 27) would show up here as float32 weights."""
    from engine.experts.runtime import load_from_store, quantized_names
    from engine.quant import linear

    seen: list[torch.dtype] = []
    real = linear.QuantLinear.from_linear.__func__

    def spy(cls, lin, fmt, release=None, out=None):
        seen.append(lin.weight.dtype)
        return real(cls, lin, fmt, release, out)

    monkeypatch.setattr(linear.QuantLinear, "from_linear", classmethod(spy))
    with load_from_store(store, dense="int8", prefetch_depth=0) as sm:
        src = sm.store.dense_source(verify=False)
        names = quantized_names(src, "int8")
        src.close()
        assert len(seen) == len(names) > 0 and set(seen) == {torch.bfloat16}
        # after the load: no 2-D float weight is left but the embedding and the routers
        left = {n for n, p in sm.model.named_parameters() if p.dim() == 2}
        assert all("embed_tokens" in n or n.endswith("mlp.gate.weight") for n in left), left
    assert quantized_names(src, "fp32") == frozenset()


def test_the_as_stored_model_equals_the_full_precision_path(store):
    """Reference: the whole model built in float32, then quantized; the same logits."""
    from engine.executor import executor_for
    from engine.experts.runtime import load_from_store
    from engine.kv.base import BatchLayout, ContiguousKVCache
    from engine.models.load import build_model
    from engine.quant.linear import quantize_dense

    ids = torch.tensor([3, 17, 5, 60, 2, 9])

    def logits(model):
        cfg = model.config
        kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        with torch.inference_mode():
            return executor_for(model)(ids, BatchLayout.single(0, len(ids), 0), kv)

    with load_from_store(store, dense="int8", prefetch_depth=0) as sm:
        fast = logits(sm.model)
        src = sm.store.dense_source()
        ref = quantize_dense(build_model(sm.model.config, src, provider=sm.cache), "int8")
        slow = logits(ref)
        src.close()
    assert torch.equal(fast, slow)


def _rss_file_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_a_converted_weights_file_pages_leave_the_process(tmp_path):
    """SafetensorsFile.release drops a view's pages from RSS (they were all touched), the view
    still reads the file's bytes afterwards, and a tensor that is not a view of the mapping is
    left alone (False)."""
    from safetensors.torch import save_file

    from engine.loading.safetensors import SafetensorsFile

    g = torch.Generator().manual_seed(3)
    w = torch.randn(4096, 1024, generator=g).to(torch.bfloat16)  # 8 MiB
    save_file({"w": w, "small": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    f = SafetensorsFile(tmp_path / "m.safetensors")
    view = f.get("w")
    assert torch.equal(view, w)  # every page touched
    before = _rss_file_kib()
    assert f.release(view)
    assert before - _rss_file_kib() >= 7 * 1024  # the 8 MiB (less partial pages at the ends)
    assert torch.equal(view, w)  # faulted back from the file
    assert not f.release(w.clone()) and not f.release(torch.empty(0))


def test_load_releases_each_converted_weight_and_imports_no_compiler(store):
    """load_from_store hands each weight quantize_dense replaced to the dense file's release, the
    model is still right (the as-stored test above), and building its skeleton on the meta device
    imports neither torch._dynamo nor sympy (~150 MB of RSS): checked in a fresh process."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from engine.experts.runtime import load_from_store\n"
        "from engine.store.reader import StoreDenseSource\n"
        "released = []\n"
        "real = StoreDenseSource.release\n"
        "StoreDenseSource.release = lambda self, t: released.append(real(self, t)) or released[-1]\n"
        f"sm = load_from_store({str(store)!r}, dense='int8', prefetch_depth=0)\n"
        "print(len(released), sum(released), 'torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n"
        "sm.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=__import__("pathlib").Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr
    n, mapped, dynamo, sympy = out.stdout.split()
    from engine.experts.runtime import quantized_names
    from engine.store.reader import ExpertStore

    with ExpertStore(store) as s:
        src = s.dense_source(verify=False)
        names = quantized_names(src, "int8")
        # one release per weight, and one per 1024-row block of a taller one (quantize_by_rows)
        rows = [src.get(name).shape[0] for name in names]
        want = sum(1 + (-(-r // 1024) if r > 1024 else 0) for r in rows)
        src.close()
    assert int(n) == int(mapped) == want >= len(names) > 0  # every release was of a view of the file
    assert (dynamo, sympy) == ("False", "False")


def test_the_prefetch_predictor_reads_the_models_own_routers(store):
    """One copy of each router: the cache's prefetch predictor and the model's routing read the
    same tensor (a float32 copy of every router beside the model's was 24 MiB on the 8 GB bench
    model), and its predictions are the experts the model's own router picks."""
    from engine.experts.runtime import load_from_store

    with load_from_store(store, dense="int8", prefetch_depth=1) as sm:
        blocks = sm.model.moe_blocks
        assert blocks and set(sm.cache.routers) == {b.layer for b in blocks}
        for b in blocks:
            w = sm.cache.routers[b.layer]
            assert w.data_ptr() == b.gate.weight.data_ptr() and w.dtype == b.gate.weight.dtype
        x = torch.randn(5, sm.model.config.hidden_size, generator=torch.Generator().manual_seed(3))
        first, second = blocks[0], blocks[1]
        [(nxt, ids)] = list(sm.cache.predictions(first.layer, x))
        assert nxt == second.layer
        want = second.gate(x).ids
        assert torch.equal(ids.sort(dim=-1).values, want.sort(dim=-1).values)


def test_freed_heap_goes_back_to_the_os():
    """engine.hugepages.return_freed_heap: 4 MB temporaries freed after glibc's mmap threshold has
    risen stay in the heap (they counted against a memory limit: the 1.3B bench store's load was
    OOM-killed at 600 MB in one run of several); the trim hands their pages back. A fresh process:
    the heap's state is the process's."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's heap: Linux only")
    code = (
        "import torch\n"
        "from engine.hugepages import return_freed_heap\n"
        "def anon():\n"
        "    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('RssAnon'))\n"
        "torch.set_num_threads(1)\n"
        "big = torch.empty(8 << 20, dtype=torch.uint8); del big\n"  # raises the mmap threshold
        "keep, tmp = [], []\n"
        "for i in range(40):\n"
        "    tmp.append(torch.ones(1 << 20)); keep.append(torch.ones(1024))\n"  # 4 MB each, small ones between
        "del tmp\n"
        "before = anon(); return_freed_heap(); print(before - anon())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=__import__("pathlib").Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 120e6  # of the 168 MB freed (without the trim: 0)


def test_quantize_dense_trims_the_heap_after_each_weight(monkeypatch):
    """Each weight's conversion temporaries go back before the next weight is converted: one trim
    per converted linear, each after that linear's replacement (not one at the end: the peak of a
    load was the sum of every weight's leftovers)."""
    from torch import nn

    import engine.quant.linear as linear_mod

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64), nn.Linear(64, 64))
    converted = []
    monkeypatch.setattr(linear_mod, "dense_linears",
                        lambda m: [(m, str(i)) for i, x in enumerate(m) if isinstance(x, nn.Linear)])
    model.modules_changed = lambda: None
    monkeypatch.setattr(linear_mod, "return_freed_heap",
                        lambda: converted.append(sum(isinstance(x, linear_mod.QuantLinear) for x in model)))
    linear_mod.quantize_dense(model, "int8", group_size=32)
    assert converted == [1, 2, 3]


def test_cpu_auto_budgets_keep_one_unwritten_ram_slot_and_give_the_rest_to_the_slots(store):
    """On a CPU both tiers are host memory: a miss is read straight into its slot (the RAM tier
    is read around), so "auto" keeps the RAM tier at the one slot it is built with, never written,
    and every other byte of the limit goes to the slots experts are computed from."""
    from engine.experts.runtime import _slot_bytes, dense_resident_bytes, load_from_store, store_budgets
    from engine.store.reader import ExpertStore

    with ExpertStore(store) as st:
        slot, total = _slot_bytes(st), st.num_experts_total * _slot_bytes(st)
        resident = dense_resident_bytes(st, dense="int8") + 4096
    usable = 5 * slot  # well under every expert (the store has 16)
    b = store_budgets(store, device="cpu", dense="int8", kv_bytes=4096, headroom=0,
                      host_available=resident + usable)
    assert usable < total and (b.device, b.ram) == (usable - slot, slot)
    sm = load_from_store(store, device_budget=b.device, ram_budget=b.ram, dense="int8", prefetch_depth=0)
    try:
        src = sm.cache.source
        assert src.read_around and src.num_slots == 1
        from engine.layers.sampler import SamplingConfig
        from engine.runner import stream_request

        with torch.inference_mode():
            list(stream_request(sm.model, [1, 2, 3, 4, 5], SamplingConfig(max_tokens=4, temperature=0.0,
                                                                            ignore_eos=True)))
        assert src.ram.misses > 0 and not src.table.slot_of  # every miss read around it: nothing kept
    finally:
        sm.close()
