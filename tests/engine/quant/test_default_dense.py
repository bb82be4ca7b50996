"""One default dense format everywhere a user can start a model: the CLI's generate, serve and demo,
a deployment's config and the Python API (which gave fp32, 0.23x llama.cpp, before) all give
"auto" (engine.quant.linear.DEFAULT_DENSE: docs/quantization.md#the-default-dense-format): int8
dense linears where the CPU kernels take int16 activations (AVX512-VNNI), bf16 elsewhere; the flag
takes the others."""

from __future__ import annotations

import inspect

import click
import pytest

from engine.experts.runtime import load_from_store
from engine.quant.formats import QuantFormat
from engine.errors import ConfigError
from engine.quant import kernels as K
from engine.quant.linear import DEFAULT_DENSE, QuantLinear, resolve_dense
from engine.store import convert
from tests.engine.models.hf_tiny import make_checkpoint


def _option_default(command: click.Command, name: str):
    return next(p.default for p in command.params if p.name == name)


def test_every_entry_point_defaults_to_the_same_dense_format():
    from services.cli import generate
    from services.cli_serve import serve
    from services.config import DeployConfig
    from services.demo import demo

    assert DEFAULT_DENSE == "auto"
    assert _option_default(generate, "dense") == DEFAULT_DENSE
    assert _option_default(serve, "dense_format") == DEFAULT_DENSE
    assert _option_default(demo, "dense") == DEFAULT_DENSE
    assert DeployConfig.model_fields["dense_format"].default == DEFAULT_DENSE
    assert inspect.signature(load_from_store).parameters["dense"].default == DEFAULT_DENSE


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_moe")
    make_checkpoint("qwen3_moe", d / "hf", hidden_size=64, num_hidden_layers=2, head_dim=16,
                    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    convert(d / "hf", d / "store", fmt=QuantFormat("int4", 32), progress=False)
    return d / "store"


def test_auto_is_int8_only_where_the_kernels_take_integer_activations():
    from engine.options import configure

    assert resolve_dense("auto", "cpu") == ("int8" if K.int8_activations() else "bf16")
    assert resolve_dense("auto", "cuda") == "bf16"
    assert resolve_dense("int8", "cuda") == "int8" and resolve_dense("fp32") == "fp32"
    prev = configure(int8_activations=False)  # float activations: int8 weights are slower than bf16
    try:
        assert resolve_dense("auto", "cpu") == "bf16"
    finally:
        configure(prev)
    with pytest.raises(ConfigError, match="allowed: auto, fp32, bf16, int8"):
        resolve_dense("int4")


@pytest.mark.parametrize("dense,want", [(None, "auto"), ("bf16", "bf16"), ("int8", "int8"), ("fp32", None)])
def test_load_from_store_converts_the_dense_linears(store, dense, want):
    if want == "auto":  # the default: int8 where the kernels take integer activations
        want = "int8" if K.int8_activations() else "bf16"
    kw = {} if dense is None else {"dense": dense}
    with load_from_store(store, prefetch_depth=0, **kw) as sm:
        fmts = {m.q.fmt.name for m in sm.model.modules() if isinstance(m, QuantLinear)}
    assert fmts == ({want} if want else set())
