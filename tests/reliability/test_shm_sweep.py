"""The loaders' shared-memory sweep removes only this user's segments of this deployment and
loader, skips what it cannot remove, and goes on (issue 14, class 1). Real files in /dev/shm."""

from __future__ import annotations

import logging
import os

import pytest

from engine.errors import ExpertLoadError
from services import expert_loader
from services.expert_loader import SHM_DIR, segment_name, segment_prefix, sweep_segments

NS = f"sweep-test-{os.getpid()}"


@pytest.fixture()
def made():
    """Create segment files by name; every one is removed at the end, whoever owns it."""
    names: list[str] = []

    def make(name: str, uid: int | None = None) -> str:
        path = os.path.join(SHM_DIR, name)
        with open(path, "xb") as f:
            f.write(b"MOESHM01")
        if uid is not None:
            os.chown(path, uid, uid)
        names.append(name)
        return name

    yield make
    for n in names:
        try:
            os.unlink(os.path.join(SHM_DIR, n))
        except FileNotFoundError:
            pass


def present(names):
    return {n for n in names if os.path.lexists(os.path.join(SHM_DIR, n))}


def test_name_format_separates_users_namespaces_and_loaders():
    p1, p10 = segment_prefix(NS, "loader-1"), segment_prefix(NS, "loader-10")
    assert p1.startswith(f"moestream.u{os.getuid()}.") and p1 == segment_prefix(NS) + "loader-1."
    assert not p10.startswith(p1) and p1.startswith(segment_prefix(NS))
    assert not segment_prefix(NS + "-other").startswith(segment_prefix(NS))
    assert not segment_prefix(NS).startswith(segment_prefix(NS[:-1]))
    assert segment_name(p1).startswith(p1 + f"{os.getpid()}.")
    with pytest.raises(ExpertLoadError, match="may not contain"):
        segment_prefix(NS, "a.b")
    with pytest.raises(ExpertLoadError, match="not a segment prefix of this user"):
        sweep_segments("moestream-")  # the old, user-blind format is refused, not swept


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's file needs root (chown)")
def test_sweep_removes_only_own_segments_of_this_deployment_and_loader(made):
    mine = made(segment_name(segment_prefix(NS, "loader-1")))
    mine2 = made(segment_name(segment_prefix(NS, "loader-1")))
    other_loader = made(segment_name(segment_prefix(NS, "loader-10")))
    other_ns = made(segment_name(segment_prefix(NS + "x", "loader-1")))
    foreign_user = made(segment_name(segment_prefix(NS, "loader-1")), uid=4242)
    # another user's file named as if it were ours (same uid part): the owner is what counts
    squatter = made(segment_prefix(NS, "loader-1") + "999.deadbeef", uid=4243)
    old_format = made(f"moestream-{NS}-loader-1-1-abcd")  # a name the old code would match
    everything = [mine, mine2, other_loader, other_ns, foreign_user, squatter, old_format]

    gone = sweep_segments(segment_prefix(NS, "loader-1"))
    assert gone == sorted([mine, mine2])
    assert present(everything) == {other_loader, other_ns, foreign_user, squatter, old_format}
    # the whole deployment: the other loader goes too, nothing else
    assert sweep_segments(segment_prefix(NS)) == [other_loader]
    assert present(everything) == {other_ns, foreign_user, squatter, old_format}


def test_sweep_skips_what_it_cannot_remove_and_goes_on(made, monkeypatch, caplog):
    names = sorted(made(segment_name(segment_prefix(NS, "loader-2"))) for _ in range(3))
    locked = names[0]  # sorted first: a sweep that stops at the first failure removes nothing
    real_unlink = os.unlink

    def unlink(path, *a, **k):
        if os.path.basename(path) == locked:
            raise PermissionError(1, "Operation not permitted", path)
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(expert_loader.os, "unlink", unlink)
    with caplog.at_level(logging.WARNING, logger=expert_loader.__name__):
        gone = sweep_segments(segment_prefix(NS, "loader-2"))
    assert gone == names[1:]
    assert present(names) == {locked}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and locked in warnings[0] and "Operation not permitted" in warnings[0]


def test_sweep_leaves_a_directory_or_symlink_with_a_matching_name(made):
    prefix = segment_prefix(NS, "loader-3")
    target = made(segment_name(segment_prefix(NS + "t", "loader-3")))
    link = prefix + "1.link"
    d = prefix + "1.dir"
    os.symlink(os.path.join(SHM_DIR, target), os.path.join(SHM_DIR, link))
    os.mkdir(os.path.join(SHM_DIR, d))
    try:
        assert sweep_segments(prefix) == []
        assert os.path.islink(os.path.join(SHM_DIR, link)) and os.path.isdir(os.path.join(SHM_DIR, d))
        assert present([target]) == {target}
    finally:
        os.unlink(os.path.join(SHM_DIR, link))
        os.rmdir(os.path.join(SHM_DIR, d))
