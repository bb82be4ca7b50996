"""Class 2 for the store manifest (declared counts never size an allocation) and property-based
fuzzing of the manifest parser: any mutation of a valid manifest either loads or raises
ModelFormatError naming the manifest; nothing else escapes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import ModelFormatError
from engine.store import ExpertStore
from engine.store.manifest import MANIFEST_NAME, StoreManifest, parse_manifest
from tests.reliability.store_helpers import copy_store, edit_manifest, entry, make_source, make_store

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    src = make_source(tmp_path_factory.mktemp("src") / "ckpt")
    return make_store(src, tmp_path_factory.mktemp("store") / "s")


@pytest.fixture(scope="module")
def manifest_text(store) -> str:
    return (store / MANIFEST_NAME).read_text()


# ------------------------------------------------------------------------ declared counts

def _moe(**kw):
    return lambda m: m["model_config"]["moe"].update(**kw)


def _add_entries(root: Path, n: int) -> None:
    """``n`` more expert entries (~180 bytes of JSON each), spliced into the manifest's text."""
    m = json.loads((root / MANIFEST_NAME).read_text())
    one = json.dumps(dict(entry(m, 0, 0), expert=-1, layout={})).replace('"expert": -1', '"expert": %d')
    text = json.dumps(dict(m, experts=[]))
    extra = ", ".join(one % (4 + i) for i in range(n))
    old = ", ".join(json.dumps(e) for e in m["experts"])
    (root / MANIFEST_NAME).write_text(text.replace('"experts": []', f'"experts": [{old}, {extra}]'))


COUNT_CASES = {
    "1e9 experts": (_moe(num_experts=10**9), r"model_config declares 2000000000 routed experts "
                                             r"\(1000000000 in each of 2 MoE layers\), but the data "
                                             r"files can hold at most 8 blobs of 4096 bytes"),
    "1e9 layers": (lambda m: m["model_config"].update(num_layers=10**9),
                   r"model_config declares 1000000000 layers, but dense\.safetensors \(\d+ bytes\) "
                   r"can hold at most \d+"),
    "1e9 layers, one sparse": (lambda m: (m["model_config"].update(num_layers=10**9),
                                          _moe(decoder_sparse_step=10**9)(m)),
                               r"declares 1000000000 layers"),
    "declared fits the data, not the list": (
        lambda m: (_moe(num_experts=8)(m), m["data_files"]["experts-L000.bin"].update(nbytes=1 << 40)),
        r"missing expert entry \(layer 0, expert 4\) and 7 more; the model config declares 16 "
        r"routed experts"),
    "200,000 extra experts": (lambda root: _add_entries(root, 200_000),
                              r"manifest is \d+ bytes, more than the store's files can justify"),
}


def _peak_rss_of_refusals(roots: list[Path]) -> list[dict]:
    """Open each store in a fresh process; its peak RSS over the baseline after imports."""
    code = r"""
import json, resource, sys
from engine.errors import ModelFormatError
from engine.store import ExpertStore
import engine.config, engine.quant.formats, engine.loading.validate  # imported before the baseline
out = []
for root in sys.argv[1:]:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        ExpertStore(root).close()
        out.append({"error": None})
    except ModelFormatError as e:
        out.append({"error": str(e)})
    out[-1]["rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", code, *map(str, roots)], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.splitlines()[-1])


def test_declared_counts_are_refused_before_any_allocation(store, tmp_path):
    roots = []
    for i, (name, (edit, _)) in enumerate(COUNT_CASES.items()):
        roots.append(copy_store(store, tmp_path / f"s{i}"))
        if name.startswith("200,000"):
            edit(roots[-1])
        else:
            edit_manifest(roots[-1], edit)
    assert (roots[-1] / MANIFEST_NAME).stat().st_size > 30 << 20  # the list really is long
    for (name, (_, msg)), got in zip(COUNT_CASES.items(), _peak_rss_of_refusals(roots)):
        assert got["error"] is not None, name
        assert re.search(msg, got["error"]), (name, got["error"])
        assert got["error"].startswith(str(tmp_path)) and MANIFEST_NAME in got["error"], name
        assert got["rss_kib"] < 512 * 1024, (name, got["rss_kib"])


def test_extra_entries_are_named_when_the_manifest_is_small(store, tmp_path):
    root = copy_store(store, tmp_path / "s")
    edit_manifest(root, lambda m: m["experts"].append(dict(entry(m, 1, 3), expert=10**9)))
    with pytest.raises(ModelFormatError, match=r"expert entry \(layer 1, expert 1000000000\) is not a "
                                               r"routed expert of the model \(2 layers, 4 experts"):
        ExpertStore(root)


def test_wrongly_typed_model_config_fields(store, tmp_path):
    root = copy_store(store, tmp_path / "s")
    for edit, msg in [
        (_moe(num_experts=4.0), r"model_config: moe: num_experts: 4\.0 is not an integer"),
        (lambda m: m["model_config"].update(num_layers=True), r"num_layers: True is not an integer"),
        (lambda m: m["model_config"].update(rms_norm_eps="1e-5"), r"model_config: TypeError"),
        (lambda m: m["model_config"].update(eos_token_ids=[2.5]), r"eos_token_ids: 2\.5 is not an integer"),
        (lambda m: m["model_config"]["rope"].update(theta=None), r"model_config: TypeError"),
    ]:
        (root / MANIFEST_NAME).write_text((store / MANIFEST_NAME).read_text())
        edit_manifest(root, edit)
        with pytest.raises(ModelFormatError, match=msg):
            ExpertStore(root)


# ----------------------------------------------------------------------------------- fuzzing

def _parse(text: str | bytes) -> StoreManifest | None:
    """parse_manifest, asserting that any failure is a ModelFormatError naming the manifest."""
    try:
        return parse_manifest(text, "fuzz/manifest.json")
    except ModelFormatError as e:
        assert str(e).startswith("fuzz/manifest.json: ") and len(str(e)) < 2000
        return None


FUZZ = settings(derandomize=True, max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

_byte_edits = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from(["flip", "insert", "delete"]),
                                 st.sampled_from(list(b'{}[]",:0123456789-.eE tfn\\a'))), min_size=1, max_size=6)


@FUZZ
@given(edits=_byte_edits)
def test_fuzz_byte_mutations(manifest_text, edits):
    data = bytearray(manifest_text.encode())
    for where, op, byte in edits:
        i = int(where * len(data))
        if op == "flip":
            data[i] = byte
        elif op == "insert":
            data.insert(i, byte)
        else:
            del data[i]
    _parse(bytes(data))


_json_values = st.recursive(
    st.none() | st.booleans() | st.sampled_from([0, -1, 1, 2, 4095, 4096, 10**9, 2**63, 10**30, -(2**63)])
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
    | st.sampled_from(["experts-L000.bin", "../x", "/etc/passwd", "tokenizer", "dense.safetensors", "a" * 64]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def _paths(node, prefix=()):
    """Every path to a value in a JSON tree."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):  # the entries are alike: the first three stand for all
            yield from _paths(v, prefix + (i,))


@FUZZ
@given(data=st.data())
def test_fuzz_structural_mutations(manifest_text, data):
    doc = json.loads(manifest_text)
    paths = [p for p in _paths(doc) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            op = data.draw(st.sampled_from(["replace", "delete", "duplicate"]))
            if op == "replace":
                parent[path[-1]] = data.draw(_json_values)
            elif op == "delete":
                del parent[path[-1]]
            elif isinstance(parent, list):
                parent.append(parent[path[-1]])
            else:
                parent[path[-1] + "_"] = parent[path[-1]] if isinstance(path[-1], str) else None
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or replaced the way there
    _parse(json.dumps(doc))


def test_fuzz_targets_can_fail(manifest_text):
    """The fuzz helper is not vacuous: a valid manifest parses, an invalid one is refused."""
    assert isinstance(_parse(manifest_text), StoreManifest)
    assert _parse(json.dumps(dict(json.loads(manifest_text), schema_version=7))) is None
