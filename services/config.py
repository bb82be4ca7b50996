"""Deploy configuration of the Ray pipeline: one pydantic model, a description on every field.

Sizes are bytes, given as an int or a string with a unit ("2GiB", "512MB", "64KiB"). Errors name
the bad value and what is allowed (DESIGN §7.8).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from engine.errors import ConfigError
from engine.units import parse_bytes as _parse_bytes
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from services.handles import NAMESPACE

def parse_bytes(value: int | str | None) -> int | None:
    """``2GiB`` -> 2147483648; ints pass through; None stays None (engine.units.parse_bytes)."""
    if value is None:
        return None
    return _parse_bytes(value, name="size")


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # name -> torch attribute


def torch_dtype(name: str):
    """A compute dtype's name (fp32, bf16, fp16) -> the torch dtype (torch imported here, on use)."""
    import torch

    try:
        return getattr(torch, TORCH_DTYPES[name])
    except KeyError:
        raise ConfigError(f"dtype {name!r}; allowed: {', '.join(TORCH_DTYPES)}") from None


def parse_budget(value: int | str | None) -> int | str | None:
    """An expert-tier budget: ``auto`` (resolved at deploy time, services/budgets.py), None
    (every expert fits) or a size as :func:`parse_bytes` reads it."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return parse_bytes(value)


Bytes = Annotated[int, BeforeValidator(parse_bytes), Field(ge=0)]
OptBytes = Annotated[int | None, BeforeValidator(parse_bytes)]
Budget = Annotated[int | Literal["auto"] | None, BeforeValidator(parse_budget)]


class DeployConfig(BaseModel):
    """How ``moestream serve`` lays the pipeline out on Ray."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    store: Path = Field(description="Expert store directory made by `moestream convert`.")
    namespace: str = Field(NAMESPACE, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                           description="Ray namespace holding the named, detached actors.")
    address: str | None = Field(
        None, description="Ray cluster to join: 'auto' (a running `ray start` head on this "
        "machine), 'HOST:6379', or None to start a local cluster in this process.")
    loaders: int = Field(2, ge=1, le=64, description="Number of expert-loader actors; each owns "
                         "a shard of the store (rendezvous hash of (layer, expert)).")
    device_budget: Budget = Field(
        "auto", description="Bytes of device memory for expert slots (the device cache); 'auto' = "
        "the free device memory less the dense weights, the KV budget and a workspace, resolved "
        "by the decode actor (on a CPU: host memory shared with the RAM tier); None = every "
        "expert fits.")
    ram_budget: Budget = Field(
        "auto", description="Bytes of host RAM for the loaders' shared-memory tier, split evenly "
        "between the loaders; 'auto' = the decode node's available RAM less a 4 GiB headroom, "
        "resolved by the deployer; None = every expert fits.")
    kv_budget: Bytes = Field("256MiB", description="Bytes for the paged KV cache.")
    ple_budget: Bytes = Field("256MiB", description="Bytes of host RAM for the PLE row cache of a "
                              "qwen4_exp store (its n-gram tables are read from row files on demand, "
                              "never loaded whole; docs/ple-tier.md).")
    kv_block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    prefix_cache: bool = Field(
        True, description="Prefix caching: full KV blocks are reused across requests that share "
        "a prefix (the next turn of a conversation computes only its new tokens); on hybrid "
        "models recurrent-state snapshots take up to a quarter of kv_budget. False: every "
        "request prefills its whole prompt.")
    policy: Literal["sweep", "lru", "lfu", "lfu-pure"] = Field(
        "sweep", description="Eviction policy of the device expert cache.")
    admission: bool = Field(False, description="Admission control in the device cache: a miss the "
                            "policy expects to reuse later than its victim runs from a staging slot "
                            "instead of evicting (sweep only; slots out of device_budget).")
    ram_policy: Literal["lru", "lfu", "lfu-pure"] = Field(
        "lru", description="Eviction policy of each loader's RAM tier.")
    dense_format: Literal["auto", "fp32", "bf16", "int8"] = Field(
        "auto", description="Format of the dense (non-expert) linears on the decode actor: bf16 "
        "halves and int8 quarters the bytes each decoded token reads (fp32 keeps them as stored); "
        "auto: int8 where the CPU kernels take int16 activations (AVX512-VNNI), else bf16 "
        "(docs/quantization.md#the-default-dense-format).")
    head_format: Literal["fp32", "bf16", "int8", "int4"] | None = Field(
        None, description="Format of the LM head alone (unset: as dense_format); int4 reads 45% "
        "fewer head bytes per token than int8.")
    prefetch_depth: int | None = Field(None, ge=0, le=8, description="Sparse layers ahead whose "
                                       "experts are predicted and prefetched; 0 turns prefetch off; "
                                       "unset: 1 on a GPU, 0 when the device tier is CPU memory.")
    io_threads: int = Field(2, ge=1, le=32, description="Decode-side threads copying experts "
                            "into device slots.")
    compute_threads: int | None = Field(
        None, ge=1, le=1024, description="Intra-op CPU threads of the decode actor (prefill and "
        "CPU compute; decode steps use MOESTREAM_DECODE_THREADS). Unset: every core of its node "
        "(Ray itself would start the actor with one).")
    direct_reads: bool = Field(
        True, description="Let the decode process copy RAM-tier hits straight out of the "
        "loaders' shared memory (validated by a per-slot sequence number) without an actor "
        "call; False sends every device miss through the owning loader.")
    queue_size: int = Field(64, ge=1, le=100_000, description="Requests the router admits at "
                            "once (queued + running); beyond it requests get BUSY.")
    max_waiting: int | None = Field(None, ge=0, le=100_000, description="Requests that may "
                                    "wait beyond the max_num_seqs running ones; one more gets "
                                    "BUSY (HTTP 429 with Retry-After). Unset: only queue_size.")
    speculative: str | None = Field(
        None, pattern=r"^(ngram|self|draft:.+)$",
        description="Speculative decoding on the decode actor: ngram (prompt lookup), self (the "
        "target on its device-resident experts) or draft:PATH (a smaller model sharing the "
        "tokenizer, a path on the decode node); unset: off. Requests speculate by default when "
        "set and may opt out (speculative=false); greedy output is identical either way.")
    tool_call_parser: Literal["hermes", "qwen3_coder", "deepseek_v3", "harmony"] | None = Field(
        None, description="The model's tool-call syntax (engine.agent.syntax); unset: read from "
        "the chat template (a template that shows none gets the Hermes <tool_call> JSON form).")
    max_draft: int = Field(8, ge=1, le=16, description="Most draft tokens one step verifies "
                           "per request (the adaptive controller picks up to this many).")
    max_num_seqs: int = Field(16, ge=1, le=4096, description="Sequences the decode engine runs "
                              "in one batch.")
    max_batched_tokens: int = Field(512, ge=1, le=1 << 20, description="Tokens per engine step.")
    request_timeout_s: float = Field(300.0, gt=0, le=86400, description="Seconds a request may "
                                     "take end to end before it is aborted with TIMEOUT.")
    fetch_timeout_s: float = Field(5.0, gt=0, le=600, description="Seconds the decode side waits "
                                   "for one expert fetch from a loader before retrying.")
    fetch_attempts: int = Field(6, ge=1, le=100, description="Attempts per expert fetch (owner "
                                "re-resolved each time) before ExpertLoadError.")
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Compute dtype of the "
                                                    "dense weights and the KV cache.")
    host: str = Field("127.0.0.1", description="Address every listening socket binds to "
                      "(Ray node IP, dashboard). Keep loopback unless the cluster spans machines.")
    include_dashboard: bool = Field(False, description="Start the dashboard/Jobs server "
                                    "(needed for `ray job submit`) when starting a local cluster.")
    num_cpus: int | None = Field(None, ge=1, le=4096, description="Logical CPUs of a locally "
                                 "started cluster (None = os.cpu_count()).")
    object_store_memory: OptBytes = Field(
        "512MiB", description="Object store size of a locally started cluster; set explicitly, "
        "Ray's default varies with free RAM.")
    num_gpus: int | None = Field(None, ge=0, le=64, description="GPUs for the decode actor: None "
                                 "= 1 when the cluster has a GPU, else 0 (decode runs on CPU).")

    @field_validator("store")
    @classmethod
    def _store_exists(cls, v: Path) -> Path:
        if not (v / "manifest.json").is_file():
            raise ValueError(f"store {str(v)!r} has no manifest.json; make one with "
                             f"`moestream convert <model> --out {v}`")
        return v.resolve()

    @model_validator(mode="after")
    def _admission_needs_a_declining_policy(self) -> "DeployConfig":
        from engine.experts.cache import check_admission

        try:
            check_admission(self.policy, self.admission)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return self

    @property
    def torch_dtype(self):
        """``dtype`` as a torch dtype."""
        return torch_dtype(self.dtype)

    def loader_ram_budget(self, slot_bytes: int, num_experts: int) -> int:
        """Each loader's share of the RAM tier (at least 4 slots, so a direct read racing an
        eviction cannot starve)."""
        if self.ram_budget == "auto":
            raise ConfigError("ram_budget 'auto' is resolved by the deployer (services.budgets) "
                              "before loaders start")
        total = self.ram_budget if self.ram_budget is not None else num_experts * slot_bytes
        return max(total // self.loaders, 4 * slot_bytes)
