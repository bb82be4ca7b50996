"""Budgets ``auto`` of a deployment (``moestream serve``), each resolved where its memory lives.

- The deployer (services.app.deploy), before any actor starts, reads the available RAM of the
  node the decode actor and the loaders go on and resolves the RAM tier: that RAM less
  ``HOST_HEADROOM``. On a node without a GPU both tiers are host memory, so it resolves both
  from that one reading, split as ``engine.experts.device_budget.resolve_budgets`` does (the
  device slots first, the RAM tier the rest, after the dense weights and the KV budget): neither
  is counted twice. Under a cgroup limit the margin also counts the actors it is about to start
  in that group (loaders, decode, router), each at this process's own anonymous memory.
- The decode actor (services.decode) resolves a GPU's expert slots: its device's free memory
  less the dense weights in the deployment's format and dtype, the deployment's KV budget (the
  recurrent state of linear-attention layers is part of it) and a workspace.

A budget that cannot be met raises DeviceBudgetError with the figures, before the actors of
the deployment are left running. Given budgets (bytes; None = every expert) stay as they are.
Both take the process's open ExpertStore (``store``; None: ``config.store`` is opened for the
call) and read its manifest and tensor headers, nothing more.
"""

from __future__ import annotations

from typing import Any

from engine.experts.device_budget import Budgets
from services.config import DeployConfig


def _explicit(value: int | str | None, total: int) -> int | None:
    """A budget as resolve_budgets takes it: None when auto, every expert's bytes for None."""
    if value == "auto":
        return None
    return total if value is None else int(value)


def _store_budgets(config: DeployConfig, store, device: str, **kw) -> Budgets:
    from engine.experts.runtime import store_budgets

    return store_budgets(store, device=device, dense=config.dense_format, head=config.head_format,
                         dtype=config.torch_dtype, kv_bytes=config.kv_budget,
                         step_tokens=config.max_batched_tokens, **kw)


def deployer_budgets(config: DeployConfig, *, gpu: bool, host_available: int | None = None,
                     store=None) -> tuple[DeployConfig, dict[str, Any]]:
    """What the deployer resolves, from the decode node's available RAM (``host_available``;
    default this process's node): the RAM tier, and without a GPU (``gpu`` False) the device
    tier too. Returns the config with those as bytes (a GPU's device budget stays 'auto' for the
    decode actor) and what the decode actor is told about them (``DecodeService(told=...)``)."""
    from engine.experts.device_budget import auto_ram_budget
    from engine.experts.runtime import open_store, store_expert_bytes

    auto_dev, auto_ram = config.device_budget == "auto", config.ram_budget == "auto"
    if not auto_ram and (gpu or not auto_dev):
        return config, {}
    with open_store(config.store if store is None else store) as store:
        total = max(store_expert_bytes(store), 1)
        if gpu:
            ram, how = auto_ram_budget(total, host_available=host_available)
            return config.model_copy(update={"ram_budget": ram}), {"ram_from": how}
        # the actors this deployment starts (loaders, decode, router) are processes of their own,
        # each holding about what this one does (Python, torch, the engine) in the same memory
        b = _store_budgets(config, store, "cpu", device_budget=_explicit(config.device_budget, total),
                           ram_budget=_explicit(config.ram_budget, total), host_available=host_available,
                           processes=config.loaders + 2)
    told = {"device_from": b.device_from, "ram_from": b.ram_from, "resident": b.resident}
    return config.model_copy(update={"device_budget": b.device, "ram_budget": b.ram}), told


def decode_budgets(config: DeployConfig, device: str, told: dict[str, Any] | None = None, *,
                   device_free: int | None = None, host_available: int | None = None,
                   store=None) -> Budgets:
    """The decode actor's budgets: a device budget still 'auto' resolved on ``device`` (its free
    memory: ``device_free``, default torch.cuda.mem_get_info; on a CPU host memory beside the
    RAM tier), the rest as the deployer resolved it (``told``: its account of them)."""
    from engine.experts.runtime import open_store, store_expert_bytes

    told = told or {}
    with open_store(config.store if store is None else store) as store:
        total = max(store_expert_bytes(store), 1)
        dev, ram = _explicit(config.device_budget, total), _explicit(config.ram_budget, total)
        ram_from = told.get("ram_from", "given")
        if dev is None or ram is None:
            return _store_budgets(config, store, device, device_budget=dev, ram_budget=ram,
                                  ram_from=ram_from, device_free=device_free,
                                  host_available=host_available)
    return Budgets(dev, ram, total, told.get("device_from", "given"), ram_from, told.get("resident", ""))


def node_available_memory(node_id: str | None) -> int | None:
    """Available RAM of a Ray node (MemAvailable, or its cgroup limit): read here when the node
    is this process's own (None: it is, or unknown), else by a small task placed on it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from engine.experts.device_budget import available_host_memory

    if node_id is None or node_id == ray.get_runtime_context().get_node_id():
        return None  # resolve_budgets reads this process's host
    task = ray.remote(num_cpus=0, max_retries=0)(available_host_memory)
    return ray.get(task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
                   .remote(), timeout=120)
