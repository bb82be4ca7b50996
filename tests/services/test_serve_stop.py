"""How `moestream serve` stops (services/cli_serve.stop_on_signal, services/app.App.drain), without
Ray: a stop signal lets the requests in flight run for the grace period, then the deployment is
shut down; the drain ends as soon as nothing is in flight, or at the deadline, and never waits on
a router that does not answer. The whole command under real signals:
tests/services/test_serve_lifecycle.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from services import app as app_module
from services.app import App
from services.cli_serve import STOP_GRACE_S, STOP_SIGNALS, stop_on_signal


@pytest.fixture()
def saved_handlers():
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


class FakeApp:
    def __init__(self, left: int) -> None:
        self.left, self.calls = left, []

    def drain(self, grace_s: float) -> int:
        self.calls.append(("drain", grace_s))
        return self.left

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))


@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_a_stop_signal_drains_for_the_grace_period_then_shuts_down(saved_handlers, capsys, sig):
    assert STOP_GRACE_S <= 10
    app = FakeApp(left=2)
    threading.Timer(0.2, os.kill, (os.getpid(), sig)).start()
    stop_on_signal(app, poll_s=0.05, grace_s=3.5)
    assert app.calls == [("drain", 3.5), ("shutdown",)]
    err = capsys.readouterr().err
    assert "2 request(s) still in flight after 3.5 s: aborted" in err and "stopped:" in err


class FakeRouter:
    """``stats.remote()`` -> the active set, which empties at ``done_at`` (None: never)."""

    def __init__(self, done_at: float | None, fail: bool = False) -> None:
        self.done_at, self.fail, self.asked = done_at, fail, 0
        router = self

        class Stats:
            @staticmethod
            def remote():
                router.asked += 1
                if router.fail:
                    raise ConnectionError("router gone")
                done = router.done_at is not None and time.monotonic() >= router.done_at
                return {"active": [] if done else ["r1", "r2"]}

        self.stats = Stats


class FakeRay:
    @staticmethod
    def get(ref, timeout=None):
        return ref


@pytest.mark.parametrize("done_after,grace,want_left,max_s", [
    (0.3, 5.0, 0, 2.0),     # the requests finish: the drain ends then, not at the deadline
    (None, 0.6, 2, 2.0),    # they do not: the drain ends at the deadline with 2 in flight
    (0.0, 5.0, 0, 1.0),     # nothing in flight: no wait
])
def test_drain_waits_for_the_requests_in_flight_up_to_the_grace(monkeypatch, done_after, grace, want_left, max_s):
    t0 = time.monotonic()
    router = FakeRouter(None if done_after is None else t0 + done_after)
    monkeypatch.setattr(app_module, "_ray", lambda: FakeRay)
    monkeypatch.setattr(App, "router", property(lambda self: router))
    left = App("ns", config=None).drain(grace)
    took = time.monotonic() - t0
    assert left == want_left and took < max_s
    if done_after is None:
        assert took >= grace
    elif done_after > 0:
        assert took >= done_after and router.asked > 1


def test_drain_does_not_wait_on_a_router_that_does_not_answer(monkeypatch):
    monkeypatch.setattr(app_module, "_ray", lambda: FakeRay)
    router = FakeRouter(None, fail=True)
    monkeypatch.setattr(App, "router", property(lambda self: router))
    t0 = time.monotonic()
    assert App("ns", config=None).drain(5.0) == -1 and time.monotonic() - t0 < 1.0
