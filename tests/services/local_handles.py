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


class InProcessServer:
    """The real router and HTTP server on a private event loop, in front of a fake decode actor
    ``dec`` (its ``eos`` set to the router's end-of-sequence ids): ``with InProcessServer(store,
    namespace, model, dec) as (url, router): ...``; ``settings``: more HttpSettings (a key);
    ``loop``: the event loop they run on."""

    def __init__(self, store, namespace: str, model: str, dec, **settings) -> None:
        self.store, self.namespace, self.model, self.dec = store, namespace, model, dec
        self.settings = settings

    def __enter__(self):
        import threading

        from services.config import DeployConfig
        from services.http.server import HttpService, HttpSettings
        from services.tokenizer_router import TokenizerRouter

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def build():
            cfg = DeployConfig(store=self.store, namespace=self.namespace)
            router = TokenizerRouter(cfg.model_dump_json(), decode_handle=Handle(self.dec))
            self.dec.eos = set(router.tokenizer.eos_token_ids)
            http = HttpService(HttpSettings(host="127.0.0.1", port=0, model_name=self.model,
                                            **self.settings).model_dump_json(),
                               router=Handle(router), decode=Handle(self.dec), autostart=False)
            host, port = await http.start()
            return router, http, f"http://{host}:{port}"

        router, self.http, url = asyncio.run_coroutine_threadsafe(build(), self.loop).result(120)
        return url, router

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.http.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
