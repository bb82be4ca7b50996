"""Prefix caching through the served path (DecodeService, TokenizerRouter, HttpService in one
process): the OpenAI usage reports ``prompt_tokens_details.cached_tokens`` and /metrics the
prefix-cache hit rate."""

from __future__ import annotations

import asyncio
import re

from tests.services.test_step_stream import local_pipeline  # noqa: F401 (the fixture)

BS = 16  # DeployConfig's kv_block_size


def test_usage_cached_tokens_and_metrics_hit_rate(local_pipeline):  # noqa: F811
    import aiohttp

    p = local_pipeline
    first = [(5 * k + 3) % 90 + 4 for k in range(40)]
    second = first + [7, 8, 9, 10, 11]

    async def complete(session, prompt):
        body = {"model": "m", "prompt": prompt, "max_tokens": 5, "temperature": 0}
        async with session.post(f"{p.url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["usage"]

    async def run():
        async with aiohttp.ClientSession() as session:
            u1 = await complete(session, first)
            u2 = await complete(session, second)
            async with session.get(f"{p.url}/metrics") as r:
                return u1, u2, await r.text()

    u1, u2, metrics = asyncio.run_coroutine_threadsafe(run(), p.loop).result(600)
    assert u1["prompt_tokens_details"] == {"cached_tokens": 0}  # the pipeline's first request
    # the first request computed its 40 prompt tokens + 4 fed outputs: 2 full blocks of 16
    assert u2["prompt_tokens_details"] == {"cached_tokens": 44 // BS * BS}
    assert u2["prompt_tokens"] == len(second)
    hits = float(re.search(r"^moestream_engine_prefix_hit_tokens_total (\S+)$", metrics, re.M).group(1))
    queries = float(re.search(r"^moestream_engine_prefix_query_tokens_total (\S+)$", metrics, re.M).group(1))
    rate = float(re.search(r"^moestream_prefix_cache_hit_rate (\S+)$", metrics, re.M).group(1))
    assert (hits, queries) == (32, len(first) + len(second))
    assert abs(rate - 32 / (len(first) + len(second))) < 1e-9
