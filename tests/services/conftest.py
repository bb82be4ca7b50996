"""Fixtures for the Ray pipeline tests: a tiny MoE store with a tokenizer, ONE local Ray cluster
per test session (loopback only, auth disabled, explicit CPUs and object store), and one
deployment on it shared by the tests (they leave it as they found it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

NAMESPACE = "moestream-test"
WORDS = ("the capital of france is paris hello world a an and or but if then else when where "
         "who what why how many much more most less least very too so such this that these "
         "those here there now then soon later today tomorrow yesterday always never often "
         "sometimes user assistant system say tell ask answer question yes no maybe good bad "
         "new old big small long short high low first last next other same").split()


DENSE = "bf16"  # dense format of the deployment and of the in-process reference alike

def _add_tokenizer(root: Path, vocab_size: int) -> None:
    """A word-level fast tokenizer filling the model's vocabulary, with a chat template."""
    from tokenizers import Tokenizer as TkTokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in dict.fromkeys(WORDS):
        if len(vocab) < vocab_size:
            vocab[w] = len(vocab)
    i = 0
    while len(vocab) < vocab_size:
        vocab[f"w{i}"] = len(vocab)
        i += 1
    tk = TkTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}")
    fast.save_pretrained(str(root))


@pytest.fixture(scope="session")
def store_path(tmp_path_factory) -> Path:
    from engine.quant.formats import QuantFormat
    from engine.store import convert
    from tests.engine.models.hf_tiny import make_checkpoint

    d = tmp_path_factory.mktemp("svc_store")
    make_checkpoint("qwen3_moe", d / "hf", seed=3, hidden_size=64, num_hidden_layers=3,
                    head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                    norm_topk_prob=True)
    _add_tokenizer(d / "hf", 96)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


@pytest.fixture(scope="session")
def reference(store_path):
    """The in-process engine (engine.runner.Engine, the decode actor's) on the same store, one
    request alone and without speculation: greedy tokens and text to compare."""
    from engine.experts.runtime import load_from_store
    from engine.generate import Request
    from engine.layers.sampler import SamplingConfig
    from engine.runner import Engine

    sm = load_from_store(store_path, prefetch_depth=0, dense=DENSE)  # as the decode actor runs it

    def alone(prompt_ids, max_tokens):
        engine = Engine.for_requests(sm.model, sm.tokenizer, len(prompt_ids) + max_tokens)
        return engine.generate([Request(list(prompt_ids), SamplingConfig(max_tokens=max_tokens))])[0]

    def greedy(prompt_ids, max_tokens):
        return alone(prompt_ids, max_tokens).output_ids

    def text(prompt_ids, max_tokens):
        return alone(prompt_ids, max_tokens).text

    greedy.tokenizer = sm.tokenizer
    greedy.text = text
    # a prompt whose greedy continuation runs to max_tokens (long runs for kill/scale tests)
    best = None
    for seed in range(40):
        p = [(seed * 7 + 11 * k) % 90 + 4 for k in range(5 + seed % 4)]
        out = greedy(p, 120)
        if best is None or len(out) > len(best[1]):
            best = (p, out)
        if len(out) == 120:
            break
    greedy.long_prompt = best[0]
    yield greedy
    sm.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _selected(session, marker: str, name_part: str) -> bool:
    return any(item.get_closest_marker(marker) and name_part in item.name for item in session.items)


@pytest.fixture(scope="session")
def ray_cluster(request):
    """One local cluster for the whole session: 2 logical CPUs, 300 MB object store, every bind
    on 127.0.0.1, token auth off (so nothing is written to ~/.ray). The dashboard (Jobs API)
    and the Ray client server start only when a test that needs them is selected."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    jobs = _selected(request.session, "slow", "job")
    client = _selected(request.session, "ray", "ray_client")
    dash_port = _free_port()
    ctx = ray.init(num_cpus=2, object_store_memory=300 * 1024 * 1024, include_dashboard=jobs,
                   dashboard_host="127.0.0.1", dashboard_port=dash_port,
                   _node_ip_address="127.0.0.1", namespace=NAMESPACE, log_to_driver=False)
    info = {"gcs": ctx.address_info["gcs_address"], "dashboard": None, "client": None}
    if jobs:
        info["dashboard"] = f"http://127.0.0.1:{dash_port}"
    proc = None
    if client:
        port = _free_port()
        log = open(Path(ctx.address_info["session_dir"]) / "logs" / "test_client_server.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "ray.util.client.server", f"--address={info['gcs']}",
             "--host=127.0.0.1", f"--port={port}", "--mode=legacy"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        info["client"] = f"ray://127.0.0.1:{port}"
        info["client_proc"] = proc
    yield info
    if proc is not None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
    ray.shutdown()


@pytest.fixture(scope="session")
def slot_info(store_path):
    from engine.experts.tiers import align_up
    from engine.store import ExpertStore

    with ExpertStore(store_path) as s:
        return align_up(s.expert_nbytes), s.config.moe.top_k, s.num_experts_total


@pytest.fixture(scope="session")
def deploy_config(store_path, slot_info):
    from services.config import DeployConfig

    slot, top_k, total = slot_info
    # minimal device cache (every layer refetches) and a small RAM tier (loaders evict and
    # re-read from the store): the loaders are on the hot path of every token
    return DeployConfig(store=store_path, namespace=NAMESPACE, loaders=2,
                        device_budget=top_k * slot, ram_budget=8 * slot, kv_budget="4MiB",
                        prefetch_depth=0, fetch_timeout_s=3.0, fetch_attempts=10,
                        request_timeout_s=120, dense_format=DENSE,
                        # every request speculates unless it opts out: each token-identity test
                        # of the pipeline also checks that speculation is lossless there
                        speculative="ngram", max_draft=4)


@pytest.fixture(scope="session")
def app(ray_cluster, deploy_config):
    from services.app import deploy

    a = deploy(deploy_config)
    yield a
    a.shutdown()
