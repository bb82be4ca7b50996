"""Pipeline benchmark: per-token latency through the Ray actors vs the in-process engine on the
same store, and expert bytes/s from the RAM tier into the decode process vs a plain memcpy.

    python bench/pipeline.py                          # tiny random Qwen3-MoE store in /tmp
    python bench/pipeline.py --store store/ --tokens 64 --loaders 2

Latency: greedy decode of --tokens tokens, median inter-token latency (ITL) over the decode
steps; the actors' figure includes the router -> decode -> client streaming hops.
Bytes/s (one expert blob, RAM-resident, copied into a private buffer of the decode process):
  memcpy          numpy copy between two private buffers (the physical limit here)
  shm direct      seqlock-validated copy out of the loader's shared memory (no actor call)
  shm via actor   ExpertFetch round trip to the loader + the copy (a device-cache miss)
  object store    ray.get of a ray.put numpy blob (zero-copy view) + the copy
  object store+   the same plus the actor round trip that hands out the ObjectRef
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_store(root: Path, hidden: int, layers: int, experts: int, inter: int) -> Path:
    from engine.quant.formats import QuantFormat
    from engine.store import convert
    from tests.engine.models.hf_tiny import make_checkpoint

    make_checkpoint("qwen3_moe", root / "hf", seed=1, hidden_size=hidden, num_hidden_layers=layers,
                    head_dim=64, num_attention_heads=hidden // 64, num_key_value_heads=2,
                    moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=2,
                    norm_topk_prob=True, intermediate_size=inter)
    convert(root / "hf", root / "store", fmt=QuantFormat("int4", 32), progress=False)
    return root / "store"


def median_itl(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else float("nan")


def in_process(store, prompt, n, device_budget, ram_budget):
    from engine.experts.runtime import load_from_store
    from engine.layers.sampler import SamplingConfig
    from engine.runner import stream_request

    sm = load_from_store(store, device_budget=device_budget, ram_budget=ram_budget, prefetch_depth=0)
    times, toks = [], []
    for out, _ in stream_request(sm.model, prompt, SamplingConfig(max_tokens=n, ignore_eos=True)):
        times += [time.perf_counter()] * len(out.new_token_ids)
        toks += out.new_token_ids
    sm.close()
    return toks, median_itl(times)


def through_actors(client, prompt, n):
    from protocol import GenerateResult, TokenChunk

    times, res = [], None
    for m in client.generate(prompt_token_ids=prompt, sampling={"temperature": 0, "max_tokens": n}):
        if isinstance(m, TokenChunk):
            times.extend([time.perf_counter()] * len(m.token_ids))
        elif isinstance(m, GenerateResult):
            res = m
        else:
            raise RuntimeError(m)
    return res, median_itl(times)


def bytes_per_s(fn, nbytes, seconds=1.0):
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    dt = time.perf_counter() - t0
    return n * nbytes / dt, dt / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--loaders", type=int, default=2)
    ap.add_argument("--device-fraction", type=float, default=0.25,
                    help="device cache size as a fraction of all experts")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import numpy as np
    import ray

    from engine.experts.tiers import align_up
    from engine.store import ExpertStore
    from services.app import deploy
    from services.client import MoestreamClient
    from services.config import DeployConfig
    from protocol import ExpertFetch, decode, encode

    tmp = tempfile.TemporaryDirectory(prefix="moestream-bench-")
    store = args.store or build_store(Path(tmp.name), args.hidden, args.layers, args.experts, args.inter)
    with ExpertStore(store) as s:
        slot, total, top_k = align_up(s.expert_nbytes), s.num_experts_total, s.config.moe.top_k
        blob = s.expert_nbytes
    dev = max(top_k, int(total * args.device_fraction)) * slot
    prompt = list(range(4, 20))

    print(f"store {store}: {total} experts of {blob / 1e6:.2f} MB, top-{top_k}; device cache "
          f"{dev // slot} slots ({args.device_fraction:.0%}), RAM tier: all experts; "
          f"{args.tokens} greedy tokens; {os.cpu_count()} CPUs; loaders {args.loaders}")
    want, itl_local = in_process(store, prompt, args.tokens, dev, total * slot)

    cfg = DeployConfig(store=store, namespace="moestream-bench", loaders=args.loaders,
                       device_budget=dev, ram_budget=total * slot, prefetch_depth=0,
                       num_cpus=os.cpu_count(), object_store_memory=512 << 20)
    app = deploy(cfg)
    try:
        client = MoestreamClient(namespace=cfg.namespace)
        through_actors(client, prompt, 4)  # warm: every expert enters the RAM tier
        rows = []
        for direct in (True, False):
            ray.get(app.decode.set_direct_reads.remote(direct))
            res, itl = through_actors(client, prompt, args.tokens)
            assert res.token_ids[: len(want)] == want[: len(res.token_ids)], "tokens differ"
            rows.append((direct, itl, res.usage))

        # ---- bytes/s into this process (stands in for the decode process: same code path)
        from services.expert_loader import MappedSegment

        loader = ray.get_actor("loader-0", namespace=cfg.namespace)
        with ExpertStore(store) as s:
            key = min(s._entries)
        reply, _ = decode(ray.get(loader.fetch.remote(encode(ExpertFetch(layer=key[0], expert=key[1], seq=1)))))
        seg = MappedSegment(reply.shm_name)
        slot_i = seg.slot_at(reply.shm_offset)
        dst = np.empty(slot, dtype=np.uint8)
        src = np.random.randint(0, 255, blob, dtype=np.uint8)
        obj = ray.put(src.copy())

        def shm_direct():
            assert seg.copy_out(slot_i, key, dst) == blob

        def shm_actor():
            r, _ = decode(ray.get(loader.fetch.remote(encode(ExpertFetch(layer=key[0], expert=key[1], seq=2)))))
            seg.copy_out(seg.slot_at(r.shm_offset), key, dst)

        def objstore():
            dst[:blob] = ray.get(obj)

        @ray.remote(num_cpus=0)
        class Holder:
            def __init__(self, ref_list):
                self.ref = ref_list[0]

            def get(self):
                return [self.ref]

        holder = Holder.remote([obj])

        def objstore_actor():
            dst[:blob] = ray.get(ray.get(holder.get.remote())[0])

        bw = {
            "memcpy": bytes_per_s(lambda: np.copyto(dst[:blob], src), blob),
            "shm direct": bytes_per_s(shm_direct, blob),
            "shm via actor": bytes_per_s(shm_actor, blob),
            "object store": bytes_per_s(objstore, blob),
            "object store+": bytes_per_s(objstore_actor, blob),
        }
    finally:
        app.shutdown()
        ray.shutdown()

    print()
    print(f"{'path':<34} {'ITL ms':>8} {'tok/s':>8} {'hit rate':>9} {'exp MB/tok':>11}")
    print(f"{'in-process engine.generate':<34} {itl_local * 1e3:8.2f} {1 / itl_local:8.1f} {'':>9} {'':>11}")
    for direct, itl, u in rows:
        name = "actors, direct shm reads" if direct else "actors, every miss via loader"
        print(f"{name:<34} {itl * 1e3:8.2f} {1 / itl:8.1f} {u.expert_hit_rate or 0:9.1%} "
              f"{(u.expert_bytes_per_token or 0) / 1e6:11.2f}")
    print()
    print(f"expert blob {blob / 1e6:.2f} MB into the decode process")
    print(f"{'path':<16} {'GB/s':>8} {'us/blob':>9}")
    for name, (bps, per) in bw.items():
        print(f"{name:<16} {bps / 1e9:8.2f} {per * 1e6:9.1f}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
