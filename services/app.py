"""Wiring: start or join a Ray cluster and lay the pipeline out as named, detached actors.

    router (TokenizerRouter) --> decode (DecodeService) --> loader-0 .. loader-{N-1} (ExpertLoader)

All actors live in ``config.namespace`` with ``lifetime="detached"`` and ``max_restarts=-1``, so
they outlive the process that deployed them and come back after a crash. Loader fetches are
idempotent (``max_task_retries=-1``); generation calls are not (0). Service actors ask for
``num_cpus=0`` (a 2-core node would otherwise be exhausted) and the decode actor for one GPU
where the cluster has one. Loaders are placed on the decode actor's node: their RAM tier is
node-local shared memory.

    app = deploy(DeployConfig(store="store/", loaders=2))   # or connect("auto")
    app.scale(3); app.status(); app.shutdown()
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from services import handles
from services.config import DeployConfig
from services.handles import DECODE, HTTP, NAMESPACE, ROUTER, loader_index, loader_name, loader_names
from services.handles import ray_module as _ray

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0


def init_ray(config: DeployConfig | None = None, *, address: str | None = None,
             namespace: str = NAMESPACE) -> bool:
    """Connect this process to Ray; returns True when it started a new local cluster (which
    then lives only as long as this process). Joins when ``address`` (or config.address) is
    given; otherwise starts a local cluster with explicit CPUs, object store size and loopback
    binds. A process already connected is left as it is."""
    from services.ray_env import apply_client_env

    ray = _ray()
    if ray.is_initialized():
        return False
    # token mode (a local cluster gets a token), per-account temp dir, loopback binds
    apply_client_env(create_token=not (address or (config and config.address)))
    ns = config.namespace if config else namespace
    address = address or (config.address if config else None)
    if address:
        ray.init(address=address, namespace=ns, log_to_driver=False)
        return False
    cfg = config or DeployConfig.model_construct(host="127.0.0.1", include_dashboard=False,
                                                 num_cpus=None, object_store_memory=512 << 20)
    import os

    with cluster_in_own_session():
        ray.init(namespace=ns, num_cpus=cfg.num_cpus or os.cpu_count(),
                 object_store_memory=cfg.object_store_memory, include_dashboard=cfg.include_dashboard,
                 dashboard_host=cfg.host, _node_ip_address=cfg.host, log_to_driver=False)
    return True


@contextlib.contextmanager
def cluster_in_own_session():
    """Start the local cluster's processes (GCS, raylet, dashboard, monitors; the raylet's
    workers follow it) in a session and process group of their own. A SIGTERM to this
    process's group (systemd's KillMode=control-group stops by cgroup, ``kill -TERM -PGID``,
    a terminal's hangup) then reaches this process only, which stops the cluster in order
    (services/cli_serve.stop_on_signal); before, it also killed the GCS and the raylet, and the
    shutdown waited 60 s for the dead GCS. Ray starts them all through
    ``ray._private.services.ConsolePopen``, which is swapped for the duration."""
    from ray._private import services as ray_services

    base = ray_services.ConsolePopen

    class OwnSession(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    ray_services.ConsolePopen = OwnSession
    try:
        yield
    finally:
        ray_services.ConsolePopen = base


def _node_for_decode(num_gpus: int) -> str | None:
    """The node the decode actor (and so the loaders) go on: a GPU node when asked for one,
    else the head node."""
    ray = _ray()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if num_gpus:
        alive = [n for n in alive if n.get("Resources", {}).get("GPU", 0) >= num_gpus] or alive
    for n in alive:
        if "node:__internal_head__" in n.get("Resources", {}):
            return n["NodeID"]
    return alive[0]["NodeID"] if alive else None


@dataclass
class App:
    """Handles to a running deployment."""

    namespace: str
    config: DeployConfig
    owns_cluster: bool = False
    # (slot bytes, experts) of the store: what a loader's RAM budget is cut from; read from the
    # store once per process (deploy passes its figures; scale after connect opens it)
    expert_slots: tuple[int, int] | None = None

    # ---- handles -----------------------------------------------------------------------------
    @property
    def router(self):
        return handles.router(self.namespace)

    @property
    def decode(self):
        return handles.decode(self.namespace)

    def loaders(self) -> dict[str, Any]:
        return handles.loader_handles(self.namespace)

    # ---- operations --------------------------------------------------------------------------
    def scale(self, n: int, timeout_s: float = STARTUP_TIMEOUT_S) -> list[str]:
        """Run exactly ``n`` loaders. Ownership re-shards (rendezvous hashing: only the keys a
        joining/leaving loader gains/loses move); fetches in flight on a removed loader are
        retried on the new owner, so no request is lost and no token changes."""
        ray = _ray()
        if not 1 <= n <= 64:
            raise ValueError(f"loaders={n}; allowed: 1..64")
        names = loader_names(self.namespace)
        if n > len(names):
            taken = {loader_index(x) for x in names}
            new, i = [], 0
            while len(names) + len(new) < n:
                if i not in taken:
                    new.append(loader_name(i))
                i += 1
            started = [self._start_loader(name, n) for name in new]
            ray.get([h.check_health.remote() for h in started], timeout=timeout_s)
            names = sorted(names + new, key=loader_index)
            ray.get(self.decode.set_loaders.remote(names), timeout=timeout_s)
        elif n < len(names):
            keep, drop = names[:n], names[n:]
            ray.get(self.decode.set_loaders.remote(keep), timeout=timeout_s)
            for name in drop:
                self._stop_actor(name)
            names = keep
        return names

    def health(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """HealthReply of every actor (or the error reaching it), by actor name."""
        from protocol import decode as decode_frames

        ray = _ray()
        actors = {ROUTER: None, DECODE: None, **{n: None for n in loader_names(self.namespace)}}
        if handles.has_actor(HTTP, self.namespace):
            actors[HTTP] = None
        refs = {}
        for name in actors:
            try:
                refs[name] = handles.actor(name, self.namespace).health.remote()
            except Exception as e:
                actors[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        for name, ref in refs.items():
            try:
                reply, _ = decode_frames(ray.get(ref, timeout=timeout_s))
                actors[name] = reply.model_dump()
            except Exception as e:
                actors[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        return actors

    def status(self) -> dict[str, Any]:
        """Namespace, store, loaders, cluster resources, the expert-tier budgets in effect
        (``budgets``: device and RAM bytes and the line saying how budgets auto resolved them,
        as the decode actor reports them) and every actor's health."""
        ray = _ray()
        actors = self.health()
        detail = actors.get(DECODE, {}).get("detail") or {}
        return {"namespace": self.namespace, "store": str(self.config.store),
                "loaders": loader_names(self.namespace),
                "budgets": {"device": detail.get("device_budget"), "ram": detail.get("ram_budget"),
                            "line": detail.get("budgets")},
                "cluster": {k: v for k, v in ray.cluster_resources().items()
                            if not k.startswith("node:")},
                "actors": actors}

    def drain(self, grace_s: float) -> int:
        """Wait up to ``grace_s`` for the requests in flight to finish (the router's active set
        empties); returns how many are still in flight then (shutdown aborts them), -1 when the
        router cannot be asked."""
        ray = _ray()
        deadline = time.monotonic() + grace_s
        while True:
            left = deadline - time.monotonic()
            try:
                active = ray.get(self.router.stats.remote(), timeout=max(0.5, min(2.0, left)))["active"]
            except Exception as e:
                log.warning("drain: the router does not answer: %s", e)
                return -1
            if not active or left <= 0:
                return len(active)
            time.sleep(0.1)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop every actor of the deployment and unlink the loaders' shared memory; a local
        cluster this process started is shut down too."""
        from services.expert_loader import segment_prefix, sweep_segments

        for name in [HTTP, ROUTER, DECODE, *loader_names(self.namespace)]:
            self._stop_actor(name, timeout_s)
        sweep_segments(segment_prefix(self.namespace))
        if self.owns_cluster:
            _ray().shutdown()

    def start_http(self, settings, timeout_s: float = STARTUP_TIMEOUT_S) -> tuple[str, int]:
        """Start the HTTP actor (services.http.server.HttpService, detached, restarted on
        failure, on this process's node so a loopback bind is reachable here) and return the
        (host, port) it listens on. One already running in the namespace is kept: its address
        is returned."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from services.http.server import HttpService

        ray = _ray()
        if not handles.has_actor(HTTP, self.namespace):
            node = ray.get_runtime_context().get_node_id()
            ray.remote(HttpService).options(
                name=HTTP, namespace=self.namespace, lifetime="detached", max_restarts=-1,
                max_task_retries=0, num_cpus=0, get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(settings.model_dump_json())
        h = handles.actor(HTTP, self.namespace)
        host, port = ray.get(h.address.remote(), timeout=timeout_s)
        return host, int(port)

    def stop_http(self, timeout_s: float = 30.0) -> None:
        self._stop_actor(HTTP, timeout_s)

    # ---- internals ---------------------------------------------------------------------------
    def _start_loader(self, name: str, count: int):
        from engine.experts.runtime import open_store
        from services.expert_loader import ExpertLoader

        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self.expert_slots is None:
            with open_store(self.config.store) as store:
                self.expert_slots = expert_slots(store)
        cfg = self.config.model_copy(update={"loaders": count})
        budget = cfg.loader_ram_budget(*self.expert_slots)
        opts: dict[str, Any] = dict(name=name, namespace=self.namespace, lifetime="detached",
                                    max_restarts=-1, max_task_retries=-1, num_cpus=0)
        try:  # co-locate with the decode actor: the RAM tier is node-local shared memory
            node = ray.get(self.decode.node_id.remote(), timeout=60)
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        except Exception:
            node = _node_for_decode(0)
            if node:
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        return ray.remote(ExpertLoader).options(**opts).remote(
            name, str(self.config.store), budget, self.namespace, self.config.ram_policy)

    def _stop_actor(self, name: str, timeout_s: float = 30.0) -> None:
        ray = _ray()
        try:
            h = handles.actor(name, self.namespace)
        except ValueError:
            return
        try:
            ray.get(h.close.remote(), timeout=timeout_s)
        except Exception as e:
            log.warning("closing %s: %s", name, e)
        ray.kill(h, no_restart=True)


def expert_slots(store) -> tuple[int, int]:
    """(bytes of one expert slot, number of experts) of an open ExpertStore."""
    from engine.experts.tiers import align_up

    return align_up(store.expert_nbytes), store.num_experts_total


def deploy(config: DeployConfig, timeout_s: float = STARTUP_TIMEOUT_S, *, store=None) -> App:
    """Start (or join) the cluster and create the actors; returns when all are healthy.
    An existing deployment in the namespace is joined, not duplicated. ``store``: this process's
    open ExpertStore of ``config.store`` (None: opened here for the budgets, then closed)."""
    from engine.experts.runtime import open_store

    with open_store(config.store if store is None else store) as store:
        return _deploy(config, store, timeout_s)


def _deploy(config: DeployConfig, store, timeout_s: float) -> App:
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from services.budgets import deployer_budgets, node_available_memory
    from services.decode import DecodeService
    from services.expert_loader import ExpertLoader, segment_prefix, sweep_segments
    from services.tokenizer_router import TokenizerRouter

    owns = init_ray(config)
    ns = config.namespace
    existing = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a.get("namespace") == ns}
    if ROUTER in existing:
        log.info("namespace %s already has a deployment; joining it", ns)
        return connect(namespace=ns)
    num_gpus = config.num_gpus
    if num_gpus is None:
        num_gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    node = _node_for_decode(num_gpus)
    affinity = NodeAffinitySchedulingStrategy(node, soft=False) if node else "DEFAULT"
    # budgets "auto": the RAM tier (and on a CPU node the device tier) from the decode node's
    # memory, before any actor starts; a GPU's slots are resolved by the decode actor
    config, told = deployer_budgets(config, gpu=num_gpus > 0, host_available=node_available_memory(node),
                                    store=store)
    slots = expert_slots(store)
    budget = config.loader_ram_budget(*slots)
    sweep_segments(segment_prefix(ns, ""))  # leftovers of a crashed deployment
    common = dict(namespace=ns, lifetime="detached", max_restarts=-1, num_cpus=0)
    names = [loader_name(i) for i in range(config.loaders)]
    started: list[Any] = []
    try:
        started += [ray.remote(ExpertLoader).options(name=n, max_task_retries=-1,
                                                     scheduling_strategy=affinity, **common)
                    .remote(n, str(config.store), budget, ns, config.ram_policy) for n in names]
        ray.get([h.check_health.remote() for h in started], timeout=timeout_s)
        cfg_json = config.model_dump_json()
        decode = ray.remote(DecodeService).options(name=DECODE, num_gpus=num_gpus, max_task_retries=0,
                                                  scheduling_strategy=affinity, **common
                                                  ).remote(cfg_json, names, told=told)
        started.append(decode)
        ray.get(decode.check_health.remote(), timeout=timeout_s)
        router = ray.remote(TokenizerRouter).options(name=ROUTER, max_task_retries=0, **common
                                                     ).remote(cfg_json)
        started.append(router)
        ray.get(router.check_health.remote(), timeout=timeout_s)
    except BaseException as e:  # nothing of a failed start keeps running (or restarting)
        for h in started:
            ray.kill(h, no_restart=True)
        sweep_segments(segment_prefix(ns, ""))
        typed = startup_error(e)
        if typed is not None:
            raise typed from None
        raise
    return App(ns, config, owns_cluster=owns, expert_slots=slots)


def startup_error(exc: BaseException) -> Exception | None:
    """The moestream error an actor's constructor raised (a budget that cannot be met, a KV
    budget that holds no block, ...), rebuilt from Ray's report of its death (which keeps only
    the traceback text) so the caller gets the typed error with its one-line message; None for
    any other failure."""
    from ray.exceptions import RayActorError

    import engine.errors as errors

    if not isinstance(exc, RayActorError) or not exc.actor_init_failed:
        return None
    found = None
    for m in re.finditer(r"^(?:[\w.]+\.)?(\w+): (.+)$", str(exc), re.M):
        cls = getattr(errors, m.group(1), None)
        if isinstance(cls, type) and issubclass(cls, errors.MoestreamError):
            found = (cls, m.group(2))
    if found is None:
        return None
    cls, message = found
    try:  # the classes whose constructor takes the message alone
        typed = cls(message)
    except TypeError:
        typed = None
    return typed if typed is not None and str(typed) == message else errors.MoestreamError(
        f"{cls.__name__}: {message}")


def connect(address: str | None = None, namespace: str = NAMESPACE) -> App:
    """Attach to a running deployment (address: None = already connected or 'auto')."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=namespace, log_to_driver=False)
    router = handles.router(namespace)
    config = DeployConfig.model_validate_json(ray.get(router.deploy_config.remote(), timeout=60))
    return App(namespace, config)
