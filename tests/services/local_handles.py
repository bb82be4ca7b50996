"""Ray actor handles' shape over local objects, so a router and a decode service (or fakes of
them) talk in one process and one event loop, without Ray."""

from __future__ import annotations

import asyncio
import inspect


class _Gen:
    """A Ray streaming generator's shape: each item an awaitable (an ObjectRef's stand-in)."""

    def __init__(self, agen) -> None:
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.agen.__anext__()
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(item)
        return fut


class Handle:
    """An actor handle's shape over a local object: ``h.method.remote(...)``."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def __getattr__(self, name):
        fn = getattr(self._obj, name)

        class _M:
            @staticmethod
            def remote(*a, **k):
                r = fn(*a, **k)
                return _Gen(r) if inspect.isasyncgen(r) else asyncio.ensure_future(r)

        return _M
