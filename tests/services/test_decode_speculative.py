"""The decode actor's class in process (no Ray: a HostTier feeds its expert cache) with each
server-side speculative mode: 8 concurrent requests give the in-process engine's plain greedy
tokens, and the usage of those that speculated reports drafts."""

from __future__ import annotations

import asyncio

import pytest

from protocol import GenerateResult
from services.step_mux import StepSubscription
from tests.services.conftest import DENSE
from tests.services.local_handles import Handle


def _service(store_path, mode: str):
    from engine.experts.tiers import HostTier
    from engine.store.reader import ExpertStore
    from services.config import DeployConfig
    from services.decode import DecodeService

    store = ExpertStore(store_path)
    cfg = DeployConfig(store=store_path, loaders=1, kv_budget="4MiB", prefetch_depth=0,
                       dense_format=DENSE, speculative=mode, max_draft=4, compute_threads=1)
    return DecodeService(cfg.model_dump_json(), source=HostTier(store, store.num_experts_total * store.expert_nbytes * 2))


@pytest.mark.parametrize("mode", ["self", "draft"])
def test_every_server_mode_is_greedy_identical_in_a_batch(store_path, reference, mode):
    spec = f"draft:{store_path.parent / 'hf'}" if mode == "draft" else mode
    svc = _service(store_path, spec)
    prompts = [([7 + i, 20, 31, 7 + i, 20, 31, 44] * 3)[: 9 + 2 * i] for i in range(8)]

    async def all_():
        sub = StepSubscription(Handle(svc), "test")  # as the router reads the decode actor

        async def one(i):
            q = sub.register(f"r{i}")
            await svc.submit(sub.name, f"r{i}", prompts[i], {"temperature": 0.0, "max_tokens": 14})
            msgs = []
            while (msg := await q.get()) is not None:
                msgs.append(msg)
            assert isinstance(msgs[-1], GenerateResult), msgs
            return msgs[-1]

        try:
            return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            sub.close()
            await svc.close()

    results = asyncio.run(all_())
    assert [r.token_ids for r in results] == [reference(p, 14) for p in prompts]
    assert sum(r.usage.draft_tokens for r in results) > 0
    assert sum(r.usage.accepted_draft_tokens for r in results) > 0
