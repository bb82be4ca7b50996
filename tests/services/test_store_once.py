"""Each process opens the expert store once and passes it down: the router and the decode actor
each open it once however many parts read it (tokenizer, model config; loader source, budgets,
model), `moestream generate --store` once, and the budgets read a store they are given."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.services.conftest import DENSE


@pytest.fixture
def opens(monkeypatch) -> list[Path]:
    """The directory of every ExpertStore opened from here on."""
    from engine.store.reader import ExpertStore

    calls: list[Path] = []
    real = ExpertStore.__init__

    def counting(self, path, **kw):
        calls.append(Path(path))
        real(self, path, **kw)

    monkeypatch.setattr(ExpertStore, "__init__", counting)
    return calls


def _config(store_path, **kw):
    from services.config import DeployConfig

    return DeployConfig(store=store_path, loaders=1, kv_budget="4MiB", prefetch_depth=0,
                        dense_format=DENSE, compute_threads=1, **kw)


def test_the_router_opens_the_store_once(store_path, opens):
    from services.tokenizer_router import TokenizerRouter

    r = TokenizerRouter(_config(store_path).model_dump_json(), decode_handle=object())
    assert opens == [store_path.resolve()]
    assert r.tokenizer is not None and r.context is not None and r.eos_ids


def test_the_decode_actor_opens_the_store_once(store_path, opens):
    import asyncio

    from engine.experts.tiers import HostTier
    from engine.store.reader import ExpertStore
    from services.decode import DecodeService

    with ExpertStore(store_path) as given:  # the injected source's own (a loader's, in a deployment)
        source = HostTier(given, given.num_experts_total * given.expert_nbytes * 2)
        del opens[:]
        # device budget auto: the budgets read the store's tensor headers too
        svc = DecodeService(_config(store_path, ram_budget=None).model_dump_json(), source=source)
        try:
            assert opens == [store_path.resolve()]
            assert svc.budgets.auto and svc.sm.store.path == store_path.resolve()
        finally:
            asyncio.run(svc.close())
    assert svc.sm.store._closed  # the actor's store closes with it


def test_generate_with_a_store_opens_it_once(store_path, opens):
    from services.cli import main

    r = CliRunner().invoke(main, ["generate", "--store", str(store_path), "--device", "cpu",
                                  "--max-tokens", "2", "hello"])
    assert r.exit_code == 0, r.output
    assert opens == [store_path]


def test_generate_sizes_its_budgets_for_its_request(store_path, monkeypatch):
    """`moestream generate --store` loads the tokenizer and encodes the prompt before it sizes its
    budgets (issue 27): under a memory limit the tokenizer is then part of what the group holds
    (measured, not allowed for), the margin covers this prompt's one step and the KV kept beside
    the tiers this request's context, where they were a 512-token step and 4,096 tokens; the
    tokenizer is loaded once, and the model's run uses it."""
    import engine.experts.runtime as rt
    from engine.store.reader import ExpertStore
    from services.cli import main

    seen, loads = [], []
    real_budgets, real_tok = rt.store_budgets, ExpertStore.tokenizer
    monkeypatch.setattr(rt, "store_budgets", lambda *a, **kw: seen.append(kw) or real_budgets(*a, **kw))
    monkeypatch.setattr(ExpertStore, "tokenizer", lambda self: loads.append(1) or real_tok(self))
    r = CliRunner().invoke(main, ["generate", "--store", str(store_path), "--device", "cpu", "--max-tokens", "3",
                                  "hello hello hello"])
    assert r.exit_code == 0, r.output
    with ExpertStore(store_path) as st:
        n = len(real_tok(st).encode("hello hello hello"))
    assert loads == [1] and len(seen) == 1
    assert (seen[0]["step_tokens"], seen[0]["context"], seen[0]["tokenizer"]) == (n, n + 3, False)
    assert "[length]" in r.output  # three tokens decoded and detokenized with that tokenizer


def test_the_budgets_read_a_store_they_are_given(store_path, opens):
    from engine.store.reader import ExpertStore
    from services.budgets import decode_budgets, deployer_budgets

    cfg = _config(store_path)
    with ExpertStore(store_path) as store:
        del opens[:]
        told_cfg, told = deployer_budgets(cfg, gpu=False, host_available=64 << 30, store=store)
        b = decode_budgets(told_cfg, "cpu", told, store=store)
        assert opens == [] and not store._closed  # read, not opened again, left open
    assert (b.device, b.ram) == (told_cfg.device_budget, told_cfg.ram_budget)
    # without one, each call opens config.store once for all it reads
    deployer_budgets(cfg, gpu=False, host_available=64 << 30)
    assert opens == [store_path.resolve()]


def test_a_token_id_caller_loads_no_tokenizer(store_path, monkeypatch):
    """load_from_store(tokenizer=False): the store's tokenizer is never read (issue 27: 48 MB of
    RSS beside a model fed token ids); the default loads it."""
    from engine.experts.runtime import load_from_store
    from engine.store.reader import ExpertStore

    calls = []
    real = ExpertStore.tokenizer
    monkeypatch.setattr(ExpertStore, "tokenizer", lambda self: calls.append(1) or real(self))
    with load_from_store(store_path, dense=DENSE, tokenizer=False) as sm:
        assert sm.tokenizer is None and calls == []
    with load_from_store(store_path, dense=DENSE) as sm:
        assert sm.tokenizer is not None and calls == [1]
