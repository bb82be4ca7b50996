"""Build a model whose routed experts stream from an expert store through the tiered cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import TokenizerNotFoundError
from engine.experts.cache import CacheConfig, ExpertCache
from engine.experts.host_memory import STEP_TOKENS, growth_allowance, process_footprint
from engine.experts.tiers import ExpertSource, HostTier
from engine.hugepages import return_freed_heap
from engine.layers.embedding import StoredEmbedding
from engine.models.base import CausalLM
from engine.models.load import build_model
from engine.quant.linear import DEFAULT_DENSE, quantize_dense, resolve_dense


@dataclass
class StoreModel:
    model: CausalLM
    tokenizer: object
    cache: ExpertCache | None
    store: object
    ple: object = None  # engine.store.ple_disk.PLETier of a store with PLE row files

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            if isinstance(self.cache.source, HostTier):  # its pinned block unregistered
                self.cache.source.close()

        if self.ple is not None:
            self.ple.close()
        emb = getattr(getattr(self.model, "model", None), "embed_tokens", None)
        if isinstance(emb, StoredEmbedding) and emb.rows is not None:  # its pread descriptor
            emb.rows.close()
        self.store.close()

    def __enter__(self) -> "StoreModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(store):
    """``store`` as a context manager giving an open ExpertStore: an open one is used as it is
    (its owner closes it; a process opens its store once and passes it down), a directory is
    opened here and closed on exit."""
    from contextlib import nullcontext

    from engine.store.reader import ExpertStore

    return nullcontext(store) if isinstance(store, ExpertStore) else ExpertStore(store)


def load_from_store(store, *, device_budget: int | None = None, ram_budget: int | None = None,
                    policy: str = "sweep", prefetch_depth: int | None = None, miss_compute: str = "transfer",
                    pinned=frozenset(), dtype: torch.dtype = torch.float32,
                    source: ExpertSource | None = None, device: str = "cpu",
                    dense: str = DEFAULT_DENSE, io_threads: int = 8, head: str | None = None,
                    admission: bool = False, ple_budget: int | None = None,
                    device_cache: bool = False, warm: bool = False, tokenizer: bool = True) -> StoreModel:
    """Budgets default to "everything fits" (every expert resident after first use). ``dense``:
    format of the dense linears (engine.quant.linear: fp32 as stored, bf16 or int8; default
    DEFAULT_DENSE, auto: int8 on a CPU with VNNI, else bf16, resolve_dense;
    docs/quantization.md#the-default-dense-format), ``head``
    the LM head's (None: as ``dense``; int4 too). ``ple_budget``: bytes of the PLE row cache
    (engine.store.ple_disk; None: DEFAULT_PLE_BUDGET) of a store with PLE row files. ``device``:
    where the dense model and the expert slots live ("cuda" on a GPU: experts then run on the
    fused Triton kernels, engine.quant.triton_kernels; the RAM tier is pinned host memory).
    ``prefetch_depth`` None: :func:`default_prefetch_depth` for the device. ``store``: the
    store's directory, or an open ExpertStore, which the StoreModel then owns (closes).
    ``io_threads``: a layer's expert misses read from the store at once (each one O_DIRECT
    read of one aligned extent; 8: the queue depth at which NVMe and virtual disks give their
    bandwidth, bench/beyond_ram.py's disk measure: 4 KiB QD16 ~6x QD1). ``device_cache``: the
    cache's bookkeeping and miss copies on the device (engine.experts.device_cache: no host
    synchronisation in a decode step; needs a RAM budget that holds every expert, all read at
    load). ``warm``: fill the free expert slots at load (ExpertCache.warm: each layer's experts
    in turn), as llama.cpp's load fills the page cache, so the first tokens do not pay a miss for
    every expert's first use (`moestream generate`'s default; off here and in serve, so a cache
    starts empty). ``tokenizer`` False: no tokenizer loaded (``StoreModel.tokenizer`` None) for
    a caller that feeds token ids: transformers' import and the tokenizer's tables are ~48 MB of
    RSS (issue 27's bench; docs/expert-cache.md#budgets-under-a-memory-limit)."""
    if prefetch_depth is None:
        prefetch_depth = default_prefetch_depth(device)
    dense = resolve_dense(dense, device)
    from engine.store.reader import ExpertStore

    store = store if isinstance(store, ExpertStore) else ExpertStore(store)
    cfg = store.config
    cache = None
    dense_source = store.dense_source()
    if cfg.moe is not None:
        total = store.num_experts_total
        slot = _slot_bytes(store)
        ram = ram_budget if ram_budget is not None else total * slot
        device_bytes = device_budget if device_budget is not None else total * slot
        # on a CPU the device tier is host memory: a RAM tier smaller than it can only hold a
        # second copy of what it holds, so misses are read around it, straight into their slots
        source = source or HostTier(store, ram, read_around=torch.device(device).type == "cpu" and ram < device_bytes)
        cache_cfg = CacheConfig(device_budget=device_bytes,
                                policy=policy, prefetch_depth=prefetch_depth,
                                miss_compute=miss_compute, pinned=frozenset(pinned), io_threads=io_threads,
                                admission=admission)
        # as stored (mapped file pages, no copy) until the model's own routers replace them
        routers = {l: dense_source.get(f"model.layers.{l}.mlp.gate.weight") for l in cfg.moe_layers}
        if device_cache:
            from engine.experts.device_cache import DeviceExpertCache

            cache = DeviceExpertCache(store, source, cache_cfg, routers=routers, device=device)
        else:
            cache = ExpertCache(store, source, cache_cfg, routers=routers, device=device)
    # the weights quantize_dense replaces stay as the store holds them (mapped file pages) until
    # it converts them one by one: the model never exists in full precision (issue 27)
    stored = quantized_names(dense_source, dense, head)
    embed = stored_embedding_name(dense_source, cfg, dense, head, dtype)
    model = build_model(cfg, dense_source, dtype=dtype, provider=cache,
                        as_stored=lambda n: n in stored or n == embed)
    model = quantize_dense(model, dense, head=head, release=getattr(dense_source, "release", None))
    for name, p in model.named_parameters():  # any the quantizer left (none today): as dtype
        if name in stored and p.dtype != dtype:
            p.data = p.data.to(dtype)
    if embed is not None:  # rows read from the mapped file, converted as looked up
        table = model.model.embed_tokens.weight.detach()
        reader = getattr(dense_source, "rows", None)  # rows by pread: none of the file mapped in
        rows = reader(embed) if reader is not None else None
        model.model.embed_tokens = StoredEmbedding(table, dtype, rows=rows)
    ple = _attach_ple(model, store, cache, ple_budget) if store.manifest.ple_tables else None
    model.to(device)  # the dense weights run where the expert slots live
    if cache is not None:
        _share_routers(cache, model)
    return_freed_heap()  # what the model's build left, before the slots are filled
    if warm and cache is not None and not device_cache:
        try:
            cache.warm()
        except BaseException:  # a blob that fails its read or digest: nothing of this load survives
            StoreModel(model, None, cache, store, ple).close()
            raise
    tok = None
    if tokenizer:
        try:
            tok = store.tokenizer()
        except TokenizerNotFoundError:
            pass  # a store converted without one: token-id level use only
    return StoreModel(model, tok, cache, store, ple)


def _attach_ple(model, store, cache, budget: int | None):
    """The store's PLE row files as the model's tables (engine.store.ple_store), counted in the
    expert cache's ledger."""
    from engine.store.ple_disk import DEFAULT_PLE_BUDGET, PLETier
    from engine.store.ple_store import attach_disk_tables

    tier = PLETier(DEFAULT_PLE_BUDGET if budget is None else budget)
    try:
        attach_disk_tables(model, store.path, store.manifest.ple_tables, tier)
    except BaseException:
        tier.close()
        raise
    if cache is not None:
        cache.metrics.ple = tier.counters
    return tier


def _share_routers(cache, model: CausalLM) -> None:
    """The prefetch predictor's router weights become the model's own tensors: one copy of each
    router, not two (24 MiB on a 24-layer, 128-expert, 2048-wide model). A router the model
    holds in another shape (or none) keeps the stored tensor the cache was given."""
    for block in model.moe_blocks:
        w = getattr(getattr(block, "gate", None), "weight", None)
        given = cache.routers.get(block.layer)
        if isinstance(w, torch.Tensor) and given is not None and w.shape == given.shape:
            cache.routers[block.layer] = w.detach()


def stored_embedding_name(source, cfg, dense: str, head: str | None, dtype: torch.dtype) -> str | None:
    """The embedding table's name when it stays as the store holds it (engine.layers.embedding):
    whenever the dense linears are not fp32 (the exact reference keeps a float copy) and the table
    is stored in another dtype than ``dtype``; not when a tied LM head stays fp32 (it would share
    the stored table)."""
    name = "model.embed_tokens.weight"
    if dense == "fp32" or name not in source or (cfg.tie_word_embeddings and (head or dense) == "fp32"):
        return None
    stored = source.get(name).dtype
    return name if stored != dtype and stored.is_floating_point else None


def quantized_names(source, dense: str, head: str | None = None) -> frozenset[str]:
    """The dense 2-D weights quantize_dense converts to ``dense`` (the LM head to ``head``; None:
    as ``dense``): every 2-D weight but embeddings and routers; none in fp32. Read from the
    tensor headers, nothing loaded (the same rule :func:`dense_resident_bytes` counts by)."""
    from engine.loading.source import parse_expert_name

    out = set()
    for n in source.names():
        fmt = (head or dense) if n == "lm_head.weight" else dense
        if (fmt != "fp32" and parse_expert_name(n) is None and len(source.info(n).shape) == 2
                and "embed_tokens" not in n and not n.endswith("mlp.gate.weight")):
            out.add(n)
    return frozenset(out)


def default_prefetch_depth(device) -> int:
    """1 on a GPU, where prefetch copies run on a copy stream beside compute; 0 when the device
    tier is CPU memory: there a "transfer" is a memcpy on the same cores, prefetch competes with
    compute for cores and the GIL, and measured slower (demo store, 60% budget, 48 tokens: 30.5
    tok/s with prefetch, 36.7 without, despite a hit rate of 89% vs 69%)."""
    return 1 if torch.device(device).type == "cuda" else 0


def store_expert_bytes(store) -> int:
    """Device/RAM bytes that hold every routed expert of a store (the 100% budget); ``store``:
    an open ExpertStore or its directory (:func:`open_store`)."""
    with open_store(store) as store:
        return store.num_experts_total * _slot_bytes(store) if store.config.moe else 0


def _slot_bytes(store) -> int:
    from engine.experts.tiers import align_up

    return align_up(store.expert_nbytes)


def dense_resident_bytes(store, *, dense: str, head: str | None = None,
                         dtype: torch.dtype = torch.float32) -> int:
    """Bytes the dense (non-expert) weights of ``store`` (an open ExpertStore) take where the
    model runs: the 2-D weights quantize_dense swaps in ``dense`` format (fp32: left in
    ``dtype``), the LM head in ``head`` (None: as ``dense``), routers, norms and other vectors in
    ``dtype``, the embedding table in ``dtype`` unless it stays file pages of the store
    (:func:`stored_embedding_name`). Read from the tensor headers, nothing loaded."""
    import math

    from engine.loading.source import parse_expert_name
    from engine.quant.formats import QuantFormat
    from engine.quant.linear import DENSE_GROUP

    as_dtype = torch.empty((), dtype=dtype).element_size()

    def per_param(fmt: str) -> float:  # as quantize_dense stores it
        return as_dtype if fmt == "fp32" else QuantFormat(fmt, DENSE_GROUP).bits_per_weight / 8

    dense = resolve_dense(dense)
    src = store.dense_source(verify=False)
    try:
        shapes = {n: src.info(n).shape for n in src.names() if parse_expert_name(n) is None}
        embed = stored_embedding_name(src, store.config, dense, head, dtype)
    finally:
        src.close()
    table = next((s for n, s in shapes.items() if "embed_tokens" in n), ())
    if embed is not None:  # file pages read row by row (reclaimable), not memory of ours
        shapes.pop(embed)
    total = 0.0
    for name, shape in shapes.items():
        kept = len(shape) != 2 or "embed_tokens" in name or name.endswith("mlp.gate.weight")
        fmt = (head or dense) if name == "lm_head.weight" else dense
        total += math.prod(shape) * (as_dtype if kept else per_param(fmt))
    if "lm_head.weight" not in shapes and store.config.tie_word_embeddings and (head or dense) != "fp32":
        total += math.prod(table) * per_param(head or dense)  # a quantized head is its own copy
    return int(total)


def store_budgets(store, *, device: str = "cpu", dense: str = DEFAULT_DENSE, head: str | None = None,
                  dtype: torch.dtype = torch.float32, kv_bytes: int | None = None, context: int = 4096,
                  headroom: int | None = None, device_budget: int | None = None, ram_budget: int | None = None,
                  ram_from: str = "given", device_free: int | None = None,
                  host_available: int | None = None, step_tokens: int = STEP_TOKENS, tokenizer: bool = True,
                  processes: int = 0):
    """Budgets ``auto`` for a store (engine.experts.device_budget.resolve_budgets) for the tiers
    not given: the memory kept beside the expert slots is the dense weights
    (:func:`dense_resident_bytes`) plus ``kv_bytes`` (a deployment's KV budget, which holds the
    recurrent state of linear-attention layers too), or when None an fp32 KV cache of
    ``context`` tokens in every layer. Under a cgroup limit the margin beside them is what the
    group holds now plus what the run will add (host_memory.growth_allowance: one step of
    ``step_tokens`` tokens, and a tokenizer when ``tokenizer``, as load_from_store loads it after
    the budgets), plus ``processes`` processes the run will start beside this one in the same
    group (a deployment's actors), each counted at this process's own anonymous memory
    (host_memory.process_footprint). ``store``: an open ExpertStore or its directory
    (:func:`open_store`). Returns a ``Budgets``."""
    from engine.experts.device_budget import SMALLER_DENSE, resolve_budgets
    from engine.units import format_bytes

    dense = resolve_dense(dense, device)
    with open_store(store) as store:
        cfg = store.config
        dense_bytes = dense_resident_bytes(store, dense=dense, head=head, dtype=dtype)
        total = store.num_experts_total * _slot_bytes(store) if cfg.moe else 0
        least = (cfg.moe.top_k + 1) * _slot_bytes(store) if cfg.moe else 0  # top_k slots + one RAM slot
        # on a CPU the RAM tier "auto" leaves beside the slots is smaller than them, so a miss is
        # read straight into its slot (HostTier.read_around): the tier needs only the one slot it
        # is built with, never written (no memory used); reads in flight land in the slots they
        # fill. (It kept 2 x top_k slots once: 13.5 MiB of the 1.3B bench store's 107 at 600 MB.)
        staging = _slot_bytes(store) if cfg.moe else 0
    if kv_bytes is None:
        kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context * 4
        kv_note = f"KV({context} tokens)"
    else:
        kv_note = f"KV budget {format_bytes(kv_bytes)}"
    head_note = f", head {head}" if head else ""
    return resolve_budgets(max(total, 1), device=device, resident=dense_bytes + kv_bytes,
                           headroom=headroom, min_tiers=least, staging=staging,
                           device_free=device_free, host_available=host_available,
                           device_budget=device_budget, ram_budget=ram_budget, ram_from=ram_from,
                           growth=growth_allowance(cfg.hidden_size, step_tokens, tokenizer)
                           + (processes * process_footprint() if processes else 0),
                           remedy="raise the limit" + (SMALLER_DENSE if dense != "int8" else ""),
                           resident_note=f"dense {dense}{head_note} + {kv_note} counted as resident")
