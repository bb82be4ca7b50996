"""A tiny source checkpoint and its store, made once per test module that asks for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.store_helpers import make_source, make_store


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("src") / "ckpt")


@pytest.fixture(scope="module")
def store(src, tmp_path_factory) -> Path:
    return make_store(src, tmp_path_factory.mktemp("store") / "s")
