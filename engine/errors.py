"""The engine's error taxonomy.

Every error a user can cause or meet derives from :class:`MoestreamError`, names the bad value
(file, tensor, layer/expert, field) and says what is allowed. Services map these classes onto
wire error codes (protocol.errors); nothing here imports torch or ray.
"""

from __future__ import annotations


class MoestreamError(Exception):
    """Base class of every error moestream raises on purpose."""


class ModelFormatError(MoestreamError, ValueError):
    """A model file (safetensors, GGUF, config.json, store manifest) is malformed.

    Raised before any large allocation: the message names the file and the problem.
    """

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnsupportedArchitectureError(MoestreamError, ValueError):
    """The checkpoint's architecture is not one moestream implements."""

    def __init__(self, arch: object, supported: list[str] | tuple[str, ...]) -> None:
        self.arch = arch
        self.supported = tuple(sorted(supported))
        super().__init__(
            f"unsupported architecture {arch!r}; supported: {', '.join(self.supported)}"
        )


class TokenizerNotFoundError(MoestreamError, FileNotFoundError):
    """No tokenizer could be found next to the model."""


class ConfigError(MoestreamError, ValueError):
    """A configuration value is out of range; the message names the field and the allowed range."""


class RequestValidationError(MoestreamError, ValueError):
    """A generation request is invalid (empty prompt, bad sampling parameter, too long, ...)."""


class ChecksumError(MoestreamError):
    """An expert blob's digest does not match the store manifest."""

    def __init__(self, layer: int, expert: int, path: object, expected: str, actual: str,
                 kind: str = "sha256") -> None:
        self.layer, self.expert = layer, expert
        super().__init__(
            f"checksum mismatch for layer {layer} expert {expert} in {path}: "
            f"manifest says {kind} {expected[:16]}{'...' if len(expected) > 16 else ''}, "
            f"data has {actual[:16]}{'...' if len(actual) > 16 else ''}"
        )


class ExpertLoadError(MoestreamError):
    """An expert could not be read from the store (I/O error, truncated file, loader gone)."""


class CacheCapacityError(MoestreamError):
    """A cache budget cannot hold what a single step needs (e.g. fewer slots than top-k)."""


class DeviceBudgetError(CacheCapacityError):
    """An allocation on the device would exceed the device memory budget (``--vram-budget``);
    the message names the allocation, its size, what is already allocated and the budget."""


class HostMemoryError(DeviceBudgetError):
    """The memory this process may use (its cgroup's limit, else the RAM) cannot hold what a run
    keeps resident (dense weights, KV cache, the margin); the message names the minimum."""


class CapacityError(MoestreamError):
    """A request can never fit (KV cache too small for prompt + max_tokens)."""


def quote(value: object, limit: int = 48) -> str:
    """A bounded ``repr`` of a name or value read from a file, for error messages.

    Messages identify the bad entry (a tensor name, a key) but never carry more than ``limit``
    characters of what a file holds: a 100 MB key or the bytes of some unrelated file must not
    end up in a log line."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"
