"""DeployConfig: sizes with units, a description on every field, errors naming the value."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.config import DeployConfig, parse_bytes


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("512MB") == 512_000_000
    assert parse_bytes("1.5 KiB") == 1536
    assert parse_bytes(4096) == 4096 and parse_bytes(None) is None
    for bad in ("2 parsecs", "-1", "GiB", True, -5):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_every_field_is_described():
    missing = [n for n, f in DeployConfig.model_fields.items() if not f.description]
    assert not missing


def test_config_validation(store_path):
    cfg = DeployConfig(store=store_path, ram_budget="1MiB", device_budget=65536)
    assert cfg.ram_budget == 1 << 20 and cfg.host == "127.0.0.1" and cfg.namespace == "moestream"
    assert cfg.kv_budget == 256 << 20 and cfg.object_store_memory == 512 << 20
    with pytest.raises(ValidationError, match="no manifest.json"):
        DeployConfig(store=store_path.parent)
    with pytest.raises(ValidationError, match="is not a size"):
        DeployConfig(store=store_path, ram_budget="lots")
    with pytest.raises(ValidationError):
        DeployConfig(store=store_path, loaders=0)
    with pytest.raises(ValidationError):
        DeployConfig(store=store_path, surprise=1)


def test_admission_needs_a_policy_that_declines(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    assert DeployConfig(store=tmp_path, admission=True).admission  # sweep, the default policy
    with pytest.raises(ValidationError, match="never declines"):
        DeployConfig(store=tmp_path, admission=True, policy="lru")
