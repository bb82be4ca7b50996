"""bench/decode_ab.py: two settings of the runtime options A/B on one decode, rounds paired."""

from __future__ import annotations

import pytest

from engine.errors import ConfigError
from engine.options import options
from tests.bench.side_by_side import bench_module


@pytest.fixture(scope="module")
def D():
    with bench_module("decode_ab") as m:
        yield m


def test_changes_are_parsed_to_the_options_types(D):
    assert D.parse_changes("") == {}
    assert D.parse_changes("kv_bf16=0, native_threads=1,cpu_isa=avx2") == {
        "kv_bf16": False, "native_threads": 1, "cpu_isa": "avx2"}


@pytest.mark.parametrize("text,says", [("bogus=1", "option one of"), ("kv_bf16", "option one of"),
                                       ("kv_bf16=yes", "allowed: 0 or 1"), ("native_threads=two", "an integer"),
                                       ("cpu_isa=avx3", "allowed: auto, avx512, avx2"),
                                       ("native_threads=-1", "integer >= 0")])
def test_bad_changes_are_typed_errors(D, text, says):
    with pytest.raises(ConfigError, match=says):
        D.parse_changes(text)


def test_rounds_are_paired_not_pooled(D):
    """B's lead is the median of its round-by-round leads: a round where the machine was slow for
    both counts once, as a tie, and does not decide the verdict."""
    lead, faster = D.paired([10.0, 10.0, 20.0], [9.0, 11.0, 18.0])
    assert lead == pytest.approx(0.1) and faster == 2
    assert D.paired([10.0], [10.0]) == (0.0, 0)


def test_the_bench_runs_end_to_end_on_a_tiny_model(D, capsys):
    before = options()
    D.main(["--shape", "tiny", "--prompt", "16", "--tokens", "2", "--rounds", "2", "--b", "native_threads=1"])
    out = capsys.readouterr().out
    assert "B: native_threads=1; 2 rounds of 2 tokens" in out
    assert "| A | " in out and "| B | " in out
    assert out.strip().splitlines()[-1].startswith("decode A/B: B ")
    assert "faster in" in out.strip().splitlines()[-1]
    assert options() == before  # the options in force are restored


def test_bad_arguments_stop_with_a_message(D):
    with pytest.raises(SystemExit, match="decode_ab: 'bogus=1'"):
        D.main(["--b", "bogus=1"])
    with pytest.raises(SystemExit, match="--rounds and --tokens must be >= 1"):
        D.main(["--rounds", "0"])
