"""Qwen4-Exp through the Ray pipeline: an int4 store converted from a tiny random vision-language
checkpoint (PLE on two layers, QSA budget below the context), served with a minimal device expert
cache and n-gram speculation on by default (verify rows roll back the PLE windows and n-gram
contexts), gives the greedy tokens of the in-process engine with the same minimal cache. Its
own deployment in its own namespace, shut down at the end."""

from __future__ import annotations

import pytest

from tests.services.test_qwen3_next_pipeline import (SHAPE, check_pipeline, deploy_minimal, in_process_tokens,
                                                    top_k_budget)

pytestmark = pytest.mark.ray

NAMESPACE = "moestream-qwen4exp-test"


@pytest.fixture(scope="module")
def q4_store(tmp_path_factory):
    from engine.quant.formats import QuantFormat
    from engine.store import convert
    from tests.engine.models.qwen4_exp_tiny import make_qwen4_exp
    from tests.services.conftest import _add_tokenizer

    d = tmp_path_factory.mktemp("qwen4exp_svc")
    make_qwen4_exp(d / "hf", seed=9, case="ple2_ng3_hc2", **SHAPE)
    _add_tokenizer(d / "hf", 96)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


@pytest.fixture(scope="module")
def q4_app(ray_cluster, q4_store):
    app = deploy_minimal(q4_store, NAMESPACE, top_k_budget(q4_store))
    yield app
    app.shutdown()


def test_pipeline_matches_the_in_process_engine(q4_app, q4_store):
    from engine.store import ExpertStore

    with ExpertStore(q4_store) as s:
        assert s.config.arch == "qwen4_exp" and s.config.arch_params.ple_layers == (0, 1)
    max_tokens = 40
    want = in_process_tokens(q4_store, top_k_budget(q4_store), max_tokens)
    check_pipeline(q4_app, NAMESPACE, want, max_tokens)
