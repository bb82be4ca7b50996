"""The HTTP actor's bind on a fixed port: a restart by Ray can start the new server while the
killed process's listening socket still exists; "address in use" is retried, not fatal."""

from __future__ import annotations

import asyncio
import socket

import pytest


def _listening_socket() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("release_after_s, ok", [(0.6, True), (None, False)])
def test_a_port_still_in_use_is_retried(monkeypatch, release_after_s, ok):
    import services.http.server as server
    from services.http.server import HttpService, HttpSettings

    monkeypatch.setattr(server, "BIND_RETRY_S", 2.0)
    held = _listening_socket()  # the killed predecessor's socket
    port = held.getsockname()[1]

    async def main():
        svc = HttpService(HttpSettings(host="127.0.0.1", port=port, model_name="m").model_dump_json(),
                          router=object(), decode=object(), autostart=False)
        if release_after_s is not None:
            asyncio.get_running_loop().call_later(release_after_s, held.close)
        try:
            return await svc.start()
        finally:
            await svc.close()

    try:
        if ok:
            assert asyncio.run(main()) == ["127.0.0.1", port]
        else:
            with pytest.raises(OSError):
                asyncio.run(main())
    finally:
        held.close()
